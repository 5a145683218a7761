"""SimpleTrainer across two real gloo ranks on 127.0.0.1: one packed collective per metric
write, the main process records the mean losses and the max data time, and a non-finite loss
on one rank fails every rank at the same iteration."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, nan_at: int) -> None:
    import datetime

    from hookloop.engine import SimpleTrainer

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )
    calls = []
    real = dist.all_gather

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    dist.all_gather = counting

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            # Each rank sees different data: rank r's losses are (r + 1) * x.
            a = (self.w * 0 + x * (rank + 1)).sum()
            if nan_at >= 0 and rank == 1 and float(x) == nan_at:
                a = a * float("nan")
            return {"loss_a": a, "loss_b": (self.w * 0 + 1.0).sum()}

    model = Model()
    data = [torch.tensor(float(i)) for i in range(10)]
    trainer = SimpleTrainer(model, data, torch.optim.SGD(model.parameters(), lr=0.0),
                            gather_metric_period=2)  # fmt: skip
    result = {"rank": rank}
    try:
        trainer.train(0, 10)
    except FloatingPointError as e:
        result["error"] = str(e).splitlines()[0]
        result["iter"] = trainer.iter
    result["collectives"] = len(calls)
    st = trainer.storage
    result["names"] = sorted(st.latest())
    if rank == 0 and "total_loss" in st.latest():
        result["loss_a"] = st.history("loss_a").values()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Both ranks are done with collectives before either tears the group down; then leave
    # without the interpreter's teardown, where gloo's threads can abort the process after a
    # run that ended in an exception (the results are on disk already).
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _run(tmp_path, nan_at=-1):
    ctx = mp.start_processes(
        _worker, args=(2, _free_port(), str(tmp_path), nan_at), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    while not ctx.join(timeout=TIMEOUT):
        pass
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_ranks_record_means_with_one_collective_per_write(tmp_path):
    r0, r1 = _run(tmp_path)
    # Due iterations 1, 3, 5, 7, 9: one all_gather each.
    assert r0["collectives"] == r1["collectives"] == 5
    # rank 0: mean of x * 1 and x * 2 at the due iterations
    assert r0["loss_a"] == [[1.5 * x, x] for x in (1, 3, 5, 7, 9)]  # (value, iter) via JSON
    assert "total_loss" in r0["names"] and "data_time" in r0["names"]
    # Other ranks keep their own data time only.
    assert r1["names"] == ["rank_data_time"]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_nan_on_one_rank_fails_every_rank_at_the_same_iteration(tmp_path):
    r0, r1 = _run(tmp_path, nan_at=5)
    for r in (r0, r1):
        assert r["error"] == "Loss became infinite or NaN at iteration=5!"
        assert r["iter"] == 5


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
