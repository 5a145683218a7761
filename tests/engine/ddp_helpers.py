"""Worker functions for test_ddp.py, run in each of two gloo ranks spawned by ``launch``
(importable by the spawned workers: they are pickled by reference). Each rank writes what it
saw to ``RESULTS/rank{r}.json``; RESULTS is not the training's output directory, whose files
the test checks."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from hookloop.bench import TinyMLP
from hookloop.checkpoint import Checkpointer
from hookloop.data import TrainingSampler
from hookloop.engine import HookBase, SimpleTrainer, hooks
from hookloop.engine.defaults import create_ddp_model
from hookloop.utils import comm
from hookloop.utils.events import JSONWriter, TensorboardXWriter, get_event_storage

# Wall-clock metrics differ between any two runs; everything else must be identical.
TIMING = {"time", "data_time", "rank_data_time", "eta_seconds"}


class _Counter:
    """Wraps ``torch.distributed.<name>`` and counts its calls in this process."""

    def __init__(self, name: str) -> None:
        self.calls = 0
        real = getattr(dist, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        setattr(dist, name, counting)


def _watch_writes(out_dir: str) -> List[str]:
    """The paths under ``out_dir`` this process opens for writing, renames or removes, from
    Python's audit events (what the checkpointer does; the writers are on rank 0 only)."""
    root = os.path.realpath(out_dir)
    seen: List[str] = []
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def under(path: Any) -> bool:
        if isinstance(path, bytes):
            path = path.decode()
        if not isinstance(path, str):
            return False
        return os.path.realpath(path).startswith(root + os.sep)

    def audit(event: str, args: Any) -> None:
        if event == "open":
            path, mode, flags = args
            wants = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and flags & writing
            )
            if wants and under(path):
                seen.append(f"open {os.path.basename(str(path))}")
        elif event == "os.rename" and under(args[1]):
            seen.append(f"rename {os.path.basename(str(args[1]))}")
        elif event in ("os.remove", "os.unlink") and under(args[0]):
            seen.append(f"remove {os.path.basename(str(args[0]))}")

    sys.addaudithook(audit)
    return seen


class RecordingMLP(TinyMLP):
    """The tiny MLP, recording this rank's own losses at each iteration."""

    def __init__(self) -> None:
        super().__init__()
        self.record: Dict[str, Dict[str, float]] = {}

    def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
        out = super().forward(batch)
        if self.training:
            self.record[str(get_event_storage().iter)] = {k: float(v) for k, v in out.items()}
        return out


class Interrupt(HookBase):
    """On rank ``rank`` at the end of iteration ``at``: ``request_stop()`` or SIGTERM to this
    process (what a scheduler sends)."""

    def __init__(self, how: str, rank: int, at: int) -> None:
        self.how, self.rank, self.at = how, rank, at

    def after_step(self) -> None:
        if comm.get_rank() != self.rank or self.trainer.iter != self.at:
            return
        if self.how == "stop":
            self.trainer.request_stop()
        else:
            os.kill(os.getpid(), signal.SIGTERM)


def _dataset(n: int = 96) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32, 1, generator=g)
    x = torch.randn(n, 32, generator=g)
    return torch.utils.data.TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def train(out_dir: str, results_dir: str, opts: Dict[str, Any]) -> None:
    """A two-rank DDP run of the tiny MLP with detectron2's hooks, resuming from ``out_dir``
    when it holds a checkpoint. ``opts``: ``max_iter``, ``period`` (gather_metric_period),
    and optionally ``interrupt`` = [how, rank, iteration] (see :class:`Interrupt`) and
    ``async`` (``async_write_metrics``).

    The checkpointer saves to disk on every rank (``Checkpointer``'s default): the
    checkpointing hooks, registered on every rank, save once. The writers are on the main
    process only, as detectron2 registers them."""
    torch.set_num_threads(1)
    rank = comm.get_rank()
    written = _watch_writes(out_dir)
    gathers, barriers = _Counter("all_gather"), _Counter("barrier")

    torch.manual_seed(0)
    model = RecordingMLP()
    ddp = create_ddp_model(model)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = _dataset()
    held_out = (data.tensors[0][:16], data.tensors[1][:16])
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, sampler=TrainingSampler(len(data), seed=3), num_workers=0
    )
    trainer = SimpleTrainer(
        ddp,
        loader,
        opt,
        gather_metric_period=opts["period"],
        async_write_metrics=opts.get("async", False),
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=6, gamma=0.5)
    ckpt = Checkpointer(ddp, out_dir, trainer=trainer)
    evals: List[int] = []

    def evaluate() -> Dict[str, Any]:
        evals.append(trainer.iter)
        model.eval()
        with torch.no_grad():
            mse = float(model(held_out)["loss_mse"])
        model.train()
        return {"val": {"mse": mse}}

    interrupt = opts.get("interrupt")
    trainer.register_hooks(
        [
            hooks.IterationTimer(),
            hooks.LRScheduler(scheduler=sched),
            hooks.PeriodicCheckpointer(ckpt, period=5),
            hooks.EvalHook(4, evaluate),
            hooks.BestCheckpointer(4, ckpt, "val/mse", mode="min"),
            Interrupt(*interrupt) if interrupt else None,
            hooks.PreemptionHandler(),
            hooks.PeriodicWriter(
                [
                    JSONWriter(os.path.join(out_dir, "metrics.json"), window_size=1),
                    TensorboardXWriter(out_dir, window_size=1),
                ],
                period=1,
            )
            if comm.is_main_process()
            else None,
        ]
    )
    ckpt.resume_or_load("", resume=True)  # on every rank
    start = trainer.iter + 1 if ckpt.has_checkpoint() else 0
    result: Dict[str, Any] = {"rank": rank, "start": start, "preempted": None}
    preempted = None
    try:
        trainer.train(start, opts["max_iter"])
    except hooks.Preempted as e:
        result["preempted"] = e.code
        preempted = e
    result.update(
        iter=trainer.iter,
        stopped_early=trainer.stopped_early,
        weights=[p.detach().reshape(-1).tolist() for p in model.parameters()],
        losses=model.record,
        written=written,
        gathers=gathers.calls,
        barriers=barriers.calls,
        evals=evals,
        storage=sorted(trainer.storage.latest()),
    )
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    comm.synchronize()
    if preempted is not None:
        raise preempted  # as a training script would: launch() raises it too


class BNModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((self.head(torch.relu(self.bn(self.fc(x)))) - y) ** 2).mean()


def accumulate(out_dir: str, results_dir: str, steps: int, max_iter: int) -> None:
    """OptimizationHook(accumulate_grad_steps=steps) and PreciseBN under DDP: records the
    iterations in which DDP all-reduced gradients (its comm hook's calls) and each rank's
    precise BN statistics with what its own data gives."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.set_num_threads(1)
    rank = comm.get_rank()
    torch.manual_seed(0)
    model = BNModel()
    ddp = create_ddp_model(model)
    reduced_at: List[int] = []

    # Unannotated: DDP checks a hook's annotations, which are strings in this module.
    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
        reduced_at.append(get_event_storage().iter)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data

    def batch() -> Any:
        x = torch.randn(8, 4, generator=g) + rank
        return x, x.sum(1, keepdim=True)

    train_data = [batch() for _ in range(max_iter)]
    bn_data = [batch() for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = SimpleTrainer(ddp, train_data, opt)
    trainer.register_hooks(
        [
            hooks.OptimizationHook(accumulate_grad_steps=steps),
            hooks.PreciseBN(0, ddp, bn_data, num_iter=len(bn_data)),
        ]
    )
    trainer.train(0, max_iter)
    with torch.no_grad():
        expected = torch.stack([model.fc(x).mean(0) for x, _ in bn_data]).mean(0)
    result = {
        "rank": rank,
        "reduced_at": sorted(set(reduced_at)),
        "weights": [p.detach().reshape(-1).tolist() for p in model.parameters()],
        "bn_mean": model.bn.running_mean.tolist(),
        "bn_expected": expected.tolist(),
    }
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    comm.synchronize()
