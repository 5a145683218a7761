#!/usr/bin/env python
"""Two gloo ranks on 127.0.0.1, spawned by ``hookloop.engine.launch``: what hookloop costs
over a hand-written DDP loop, and what its metric reduction costs against detectron2's.

1. **steps/s** of the tiny MLP of ``lab.tiny_mlp`` (Linear 32→64, ReLU, Linear 64→1,
   batches of 16, SGD with momentum) wrapped in ``DistributedDataParallel``, each rank on its
   own data: ``lab.tiny_mlp.hand_loop`` (the same torch calls as
   ``SimpleTrainer.run_step``: data, forward, sum, zero_grad, backward, step; no metrics),
   the same loop plus the one all_gather of the packed metrics every step (what hookloop
   makes at ``gather_metric_period=1``), and hookloop's ``SimpleTrainer`` (no hooks) at
   ``gather_metric_period`` 20 and 1.
2. **metric reduction**, µs per metric write with the tiny MLP's 4 losses: hookloop's
   ``SimpleTrainer.write_metrics`` (one all_gather of one float64 tensor) and detectron2's
   ``write_metrics`` (``.item()`` per loss, ``comm.gather`` of a dict, a pickled
   ``gather_object``, then ``np.max``/``np.mean`` on the main process), both into hookloop's
   ``EventStorage``, with the torch.distributed collectives each makes per write.

Variants alternate within each repeat (each repeat starts at a different one), both ranks in
step; rank 0's medians over the repeats are reported, ratios are formed within a repeat.

```
python benches/bench_ddp.py            # about a minute on 2 cores
python benches/bench_ddp.py --quick
```
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List

import numpy as np
import torch
import torch.distributed as dist
from hookloop.engine import SimpleTrainer, launch
from hookloop.utils import comm
from hookloop.utils.events import EventStorage, get_event_storage
from lab import overhead, tiny_mlp
from torch.nn.parallel import DistributedDataParallel


def _ddp() -> Any:
    model, opt, _ = tiny_mlp.build("cpu")
    return DistributedDataParallel(model), opt


def _steps(sizes: Dict[str, int], rank: int) -> Dict[str, List[float]]:
    n = sizes["steps"]
    batches = tiny_mlp.make_batches("cpu", seed=rank)  # each rank its own data
    trainer_cls = tiny_mlp._trainer_cls("hl", False)  # records the end of the last iteration

    def hand(gather: bool) -> Callable[[], float]:
        def run() -> float:
            model, opt = _ddp()
            data = itertools.cycle(batches)
            comm.synchronize()
            t0 = time.perf_counter()
            if gather:
                for _ in range(n):
                    loss_dict = model(next(data))
                    losses = sum(loss_dict.values())
                    opt.zero_grad()
                    losses.backward()
                    # The packed metrics of one write: 4 losses, data time, stop code.
                    with torch.no_grad():
                        read = torch.stack(list(loss_dict.values())).to(torch.float64).tolist()
                    mine = torch.tensor(read + [0.0, 0.0], dtype=torch.float64)
                    chunks = [torch.empty_like(mine) for _ in range(2)]
                    dist.all_gather(chunks, mine)
                    torch.stack(chunks).tolist()
                    opt.step()
            else:
                tiny_mlp.hand_loop(model, opt, data, n)
            return n / (time.perf_counter() - t0)

        return run

    def hookloop(period: int) -> Callable[[], float]:
        def run() -> float:
            model, opt = _ddp()
            t = trainer_cls(model, itertools.cycle(batches), opt, gather_metric_period=period)
            comm.synchronize()
            return n / tiny_mlp.time_trainer(t, n)

        return run

    variants = {
        "hand": hand(False),
        "hand_gather1": hand(True),
        "hl20": hookloop(20),
        "hl1": hookloop(1),
    }
    for run in variants.values():  # warm-up
        run()
    return overhead._interleaved(variants, sizes["repeats"])


def _d2_write_metrics(loss_dict: Dict[str, torch.Tensor], data_time: float, it: int) -> None:
    """detectron2's SimpleTrainer.write_metrics (v0.6), over hookloop's comm and storage."""
    metrics_dict = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
    metrics_dict["data_time"] = data_time
    storage = get_event_storage()
    storage.put_scalar("rank_data_time", data_time, cur_iter=it)
    all_metrics_dict = comm.gather(metrics_dict)
    if comm.is_main_process():
        data_time = np.max([x.pop("data_time") for x in all_metrics_dict])
        storage.put_scalar("data_time", data_time, cur_iter=it)
        metrics_dict = {k: np.mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0]}
        total_losses_reduced = sum(metrics_dict.values())
        if not np.isfinite(total_losses_reduced):
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={it}!")
        storage.put_scalar("total_loss", total_losses_reduced, cur_iter=it)
        if len(metrics_dict) > 1:
            storage.put_scalars(cur_iter=it, **metrics_dict)


_COLLECTIVES = ("all_gather", "gather", "all_gather_into_tensor", "broadcast", "all_reduce")


def _count_collectives(write: Callable[[], None]) -> int:
    """torch.distributed collectives one call of ``write`` makes (gather_object's included:
    it calls the module's all_gather and gather)."""
    c10d = dist.distributed_c10d
    calls = [0]
    saved = {name: getattr(c10d, name) for name in _COLLECTIVES}

    def counting(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return real(*args, **kwargs)

        return call

    try:
        for name, real in saved.items():
            setattr(c10d, name, counting(real))
            setattr(dist, name, getattr(c10d, name))
        write()
    finally:
        for name, real in saved.items():
            setattr(c10d, name, real)
            setattr(dist, name, real)
    return calls[0]


def _reduction(sizes: Dict[str, int], rank: int) -> Dict[str, Any]:
    n = sizes["writes"]
    model, _, _ = tiny_mlp.build("cpu")
    losses = {
        k: v.detach() for k, v in model(tiny_mlp.make_batches("cpu", 1, seed=rank)[0]).items()
    }

    def writes(write: Callable[[Dict[str, torch.Tensor], float, int], None]) -> Callable[[], float]:
        def run() -> float:
            with EventStorage():
                comm.synchronize()
                t0 = time.perf_counter()
                for i in range(n):
                    write(losses, 0.001, i)
                return (time.perf_counter() - t0) / n * 1e6

        return run

    variants = {"hl": writes(SimpleTrainer.write_metrics), "d2": writes(_d2_write_metrics)}
    for run in variants.values():
        run()
    with EventStorage():
        counts = {
            "hl": _count_collectives(lambda: SimpleTrainer.write_metrics(losses, 0.001, 0)),
            "d2": _count_collectives(lambda: _d2_write_metrics(losses, 0.001, 0)),
        }
    return {"times": overhead._interleaved(variants, sizes["repeats"]), "collectives": counts}


def _worker(sizes: Dict[str, int], out: str) -> None:
    torch.set_num_threads(1)
    rank = comm.get_rank()
    result = {"steps": _steps(sizes, rank), "reduction": _reduction(sizes, rank)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    comm.synchronize()


def _median_min(xs: List[float]) -> str:
    return f"{statistics.median(xs):,.1f} ({min(xs):,.1f})"


def _ratio(a: List[float], b: List[float]) -> float:
    return statistics.median([x / y for x, y in zip(a, b)])


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    p.add_argument("--json", help="also write the raw figures there")
    args = p.parse_args(argv)
    sizes = (
        {"steps": 50, "writes": 100, "repeats": 3}
        if args.quick
        else {"steps": 400, "writes": 2000, "repeats": 9}
    )
    info = overhead.machine_info(sys.argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU, also on a machine with GPUs
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        launch(_worker, 2, dist_url="auto", args=(sizes, out), timeout=timedelta(minutes=5))
        with open(out) as f:
            result = json.load(f)
    steps, red = result["steps"], result["reduction"]
    print(
        f"{info['date']} · {info['cpu']} · {info['nproc']} CPUs · load {info['loadavg_at_start']}"
        f" · torch {info['torch']} · hookloop {info['hookloop']} ({info['build_profile']})"
    )
    print(f"\n2 gloo ranks, tiny MLP, {sizes['steps']} steps × {sizes['repeats']} repeats")
    print("| loop | steps/s median (min) | ratio to hand loop | ratio to hand + gather/step |")
    print("|---|---|---|---|")
    labels = {
        "hand": "hand-written DDP loop (tiny_mlp.hand_loop)",
        "hand_gather1": "hand loop + one packed all_gather per step",
        "hl20": "hookloop SimpleTrainer, gather_metric_period=20",
        "hl1": "hookloop SimpleTrainer, gather_metric_period=1",
    }
    for k, label in labels.items():
        to_hand = _ratio(steps[k], steps["hand"])
        to_gather = _ratio(steps[k], steps["hand_gather1"])
        print(f"| {label} | {_median_min(steps[k])} | {to_hand:.3f} | {to_gather:.3f} |")
    t = red["times"]
    c = red["collectives"]
    print(f"\nmetric reduction, 4 losses, {sizes['writes']} writes × {sizes['repeats']} repeats")
    print("| write_metrics | µs/write median (min) | collectives/write | d2/hookloop |")
    print("|---|---|---|---|")
    print(f"| hookloop (one packed all_gather) | {_median_min(t['hl'])} | {c['hl']} | |")
    print(
        f"| detectron2 (comm.gather of a dict) | {_median_min(t['d2'])} | {c['d2']} | "
        f"{_ratio(t['d2'], t['hl']):.2f}× |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "sizes": sizes, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
