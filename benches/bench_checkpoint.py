"""What checkpointing costs the training thread.

1. **save**: seconds the calling thread spends in one ``Checkpointer.save`` of a small model
   (about the demo's size) and of a ~100 MB model, with and without ``async_save``; for
   ``async_save`` also the time until the file is on disk (``wait()``).
2. **hook save**: seconds per iteration of a loop whose ``PeriodicCheckpointer(period=1)``
   saves the model, its optimizer and the trainer at every iteration, with a hook after it
   (the checkpointer then takes the model's state at its place and writes the file after the
   iteration's last hook: this row shows what that costs; run the script with another
   build's ``python/`` first on ``PYTHONPATH`` to compare).
3. **hooks**: µs per iteration that ``PeriodicCheckpointer``, ``BestCheckpointer`` and
   ``EvalHook`` add between their periods, over a bare ``TrainerBase`` loop.
4. **settle before save**: ms per checkpoint of ``PeriodicCheckpointer(period=10)`` in a
   ``SimpleTrainer`` whose 3 losses (CPU tensors) of the last 10 iterations wait in the
   storage's batched read at each save, which reads them first since issue 42 (run with
   another build's ``python/`` first on ``PYTHONPATH`` to compare); and the read itself
   (``_settle`` of 10 such iterations, the same code in every build). With a period that is a
   multiple of 20 (detectron2's 5000), nothing waits at a save: the queue read them at the
   save iteration's own step.

```
python benches/bench_checkpoint.py           # about 30 s
python benches/bench_checkpoint.py --quick   # a few seconds
```
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable, List

import torch
from hookloop.checkpoint import Checkpointer
from hookloop.engine import (
    BestCheckpointer,
    EvalHook,
    HookBase,
    PeriodicCheckpointer,
    TrainerBase,
)
from torch import nn


def _model(n_bytes: int) -> nn.Module:
    side = int((n_bytes / 4 / 2) ** 0.5)
    return nn.Sequential(nn.Linear(side, side), nn.Linear(side, side))


def _size(model: nn.Module) -> str:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return f"{n / 2**20:.0f} MB" if n >= 2**20 else f"{n / 2**10:.0f} KB"


def bench_save(n_bytes: int, repeats: int) -> List[str]:
    model = _model(n_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for async_save in (False, True):
            ckpt = Checkpointer(model, d, async_save=async_save, optimizer=opt)
            calling, total = [], []
            for i in range(repeats):
                start = time.perf_counter()
                ckpt.save(f"m{i % 2}")
                calling.append(time.perf_counter() - start)
                ckpt.wait()
                total.append(time.perf_counter() - start)
            rows.append(
                f"| {_size(model)} (+ SGD momentum) | {'async' if async_save else 'sync'} | "
                f"{statistics.median(calling) * 1e3:.1f} ms | "
                f"{statistics.median(total) * 1e3:.1f} ms |"
            )
    return rows


class _Noop(TrainerBase):
    def run_step(self) -> None:
        pass


class _After(HookBase):
    def after_step(self) -> None:
        pass


def bench_hook_save(n_bytes: int, repeats: int) -> str:
    model = _model(n_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with tempfile.TemporaryDirectory() as d:
        t = _Noop()
        ckpt = Checkpointer(model, d, optimizer=opt, trainer=t)
        t.register_hooks([PeriodicCheckpointer(ckpt, 1, max_to_keep=2), _After()])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            t.train(0, 3)
            times.append((time.perf_counter() - start) / 3)
    return f"| {_size(model)} (+ SGD momentum) | {statistics.median(times) * 1e3:.1f} ms |"


def _per_iter(make_hooks: Callable[[], list], n: int) -> float:
    t = _Noop()
    t.register_hooks(make_hooks())
    start = time.perf_counter()
    t.train(0, n)
    return (time.perf_counter() - start) / n * 1e6


def bench_hooks(n: int, repeats: int) -> str:
    ckpt = Checkpointer(nn.Linear(1, 1), "")
    never = 10**9

    def three() -> list:
        return [
            PeriodicCheckpointer(ckpt, never),
            EvalHook(never, lambda: {}, eval_after_train=False),
            BestCheckpointer(never, ckpt, "metric"),
        ]

    bare, hooked = [], []
    for _ in range(repeats):  # interleaved, so drift affects both
        bare.append(_per_iter(list, n))
        hooked.append(_per_iter(three, n))
    b, h = statistics.median(bare), statistics.median(hooked)
    return f"| bare loop | {b:.3f} µs |\n| + the 3 hooks | {h:.3f} µs (+{h - b:.3f} µs) |"


class _ThreeLosses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.linear(x)
        return {"loss_a": y.pow(2).mean(), "loss_b": y.abs().mean(), "loss_c": y.mean() ** 2}


class _TimedCheckpointer(PeriodicCheckpointer):
    """Times its saves: ``after_step`` at its period and the write after the stage."""

    times: List[float] = []

    def after_step(self) -> None:
        due = (self.trainer.iter + 1) % self.period == 0
        start = time.perf_counter()
        super().after_step()
        if due:
            self.times.append(time.perf_counter() - start)

    def _finish_step(self) -> None:
        # The file's write after the stage's last hook (a build before 99bbc5c writes it in
        # after_step and has no such step).
        start = time.perf_counter()
        getattr(super(), "_finish_step", lambda: None)()
        if self.times:
            self.times[-1] += time.perf_counter() - start


def bench_settle_before_save(n_checkpoints: int, repeats: int) -> str:
    from hookloop.engine import SimpleTrainer
    from hookloop.utils.events import EventStorage

    per_save, settle = [], []
    x = torch.randn(8, 4)
    for _ in range(repeats):
        model = _ThreeLosses()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with tempfile.TemporaryDirectory() as d:
            trainer = SimpleTrainer(model, iter(lambda: x, None), opt)
            hook = _TimedCheckpointer(Checkpointer(model, d, optimizer=opt), 10, max_to_keep=2)
            hook.times = []
            trainer.register_hooks([hook])
            trainer.train(0, 10 * n_checkpoints)
            per_save.append(statistics.median(hook.times[1:]))
        losses = model(x)
        with EventStorage(0) as storage:
            for i in range(n_checkpoints):
                for it in range(10):
                    storage._record_losses(10 * i + it, 0.0, dict(losses))
                start = time.perf_counter()
                storage._settle()
                settle.append(time.perf_counter() - start)
    return (
        "| Linear(4, 1), 3 losses × 10 iterations waiting | "
        f"{statistics.median(per_save) * 1e3:.3f} ms | {statistics.median(settle) * 1e3:.3f} ms |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import logging

    logging.disable(logging.WARNING)  # BestCheckpointer warns that "metric" is absent
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {platform.machine()}")
    print(f"command: python benches/bench_checkpoint.py{' --quick' if args.quick else ''}\n")
    print("| model | save | training thread | until on disk |")
    print("|---|---|---|---|")
    for n_bytes in (4 * 2**10 * 10, 100 * 2**20):
        for row in bench_save(n_bytes, 3 if args.quick else 7):
            print(row)
    print("\n| model | PeriodicCheckpointer(period=1), per iteration |\n|---|---|")
    for n_bytes in (4 * 2**10 * 10, 100 * 2**20):
        print(bench_hook_save(n_bytes, 3 if args.quick else 7))
    print("\n| per iteration | |\n|---|---|")
    print(bench_hooks(50_000 if args.quick else 300_000, 3 if args.quick else 7))
    print(
        "\n| PeriodicCheckpointer(period=10) in a SimpleTrainer | per checkpoint "
        "| of which reading the waiting losses |\n|---|---|---|"
    )
    print(bench_settle_before_save(20 if args.quick else 100, 3 if args.quick else 7))


if __name__ == "__main__":
    main()
