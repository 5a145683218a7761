"""Worker functions for test_launch.py, importable by spawned workers (they are pickled by
reference) and runnable as a script under torchrun:

    python -m torch.distributed.run ... tests/utils/launch_helpers.py OUT_DIR TAG
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from hookloop.engine import launch
from hookloop.utils import comm


def report(out_dir: str, tag: str) -> None:
    """Every helper's value on this rank, written to OUT_DIR/TAG-rankN.json."""
    torch.set_num_threads(1)
    rank = comm.get_rank()
    world_size = comm.get_world_size()
    np.random.seed(1000 + rank)  # a different seed per rank: the shared one must be rank 0's
    result = {
        "pid": os.getpid(),
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "world_size": world_size,
        "rank": rank,
        "local_rank": comm.get_local_rank(),
        "local_size": comm.get_local_size(),
        "is_main": comm.is_main_process(),
        "all_gather": comm.all_gather({"rank": rank, "sq": rank * rank}),
        "gather": comm.gather(("r", rank)),
        "seed": comm.shared_random_seed(),
        "rank0_seed": int(np.random.RandomState(1000).randint(2**31)),
    }
    if world_size > 1:
        result["gather_dst1"] = comm.gather(rank + 10, dst=1)
        result["local_all_gather"] = comm.all_gather(rank, group=comm.get_local_process_group())
    reduced = comm.reduce_dict({"a": torch.tensor(float(rank + 1)), "b": torch.tensor(4.0)})
    result["reduced"] = {k: v.item() for k, v in reduced.items()} if rank == 0 else None
    comm.synchronize()
    with open(os.path.join(out_dir, f"{tag}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def fail_on_rank1(out_dir: str) -> None:
    """Rank 1 raises after a collective; rank 0 ignores SIGTERM (as a preemption handler
    would) and waits forever, so only SIGKILL ends it."""
    rank = comm.get_rank()
    with open(os.path.join(out_dir, f"pid-rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    comm.all_gather(rank)
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    # Under torchrun the arguments of launch() other than main_func and args are unused.
    launch(report, 1, args=(sys.argv[1], sys.argv[2]))
