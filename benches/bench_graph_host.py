"""The host's time per CUDAGraphTrainer step outside the replay: what the host spends between
replays (the loader's next batch, the copy into the static batch, the LR check, the handover
of the ring slot to the storage, the hooks) when the replay itself costs nothing.

A replayed graph runs on the device while the host goes on; the host only limits the step
rate when this time exceeds the replay's device time (~70 us for the tiny MLP on an H200).
Runs anywhere: the capture seam's eager implementation, with every replay after the capture
made a no-op, on ``hookloop bench``'s tiny MLP (batch 16, 4 losses; fused SGD with momentum).

    python benches/bench_graph_host.py [--n 3000] [--repeats 5] [--resident]

Prints the median time between two ``after_step`` calls (microseconds) per round, and the
median over rounds, with no hooks and with the default stack (IterationTimer, LRScheduler
with MultiStepLR, PeriodicWriter([printer, JSON, TensorBoard], 20)), the two interleaved.
``--resident``: the data is a DeviceResidentLoader (the same 1,024 samples in batches of 16,
drop_last: an epoch boundary every 64 steps), fed through ``next()`` and a copy into the
static batch, or made by the graph itself (its graph source), the two interleaved.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch
from hookloop.bench import TinyMLP, make_batches
from hookloop.data import DeviceResidentLoader
from hookloop.engine import CUDAGraphTrainer, hooks
from hookloop.engine.graph import EagerStepGraph
from hookloop.engine.graph import seam as graph_seam
from hookloop.utils.events import CommonMetricPrinter, JSONWriter, TensorboardXWriter


class FreeReplays(EagerStepGraph):
    """The eager seam whose replays after the capture's first one do nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._ran = False

    def replay(self) -> None:
        if not self._ran:
            self._ran = True
            super().replay()


class Stamps(hooks.HookBase):
    def __init__(self) -> None:
        self.at: List[float] = []

    def after_step(self) -> None:
        self.at.append(time.perf_counter())


def resident(source: bool) -> DeviceResidentLoader:
    batches = make_batches(count=64)
    xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    loader = DeviceResidentLoader((xs, ys), 16, seed=0, drop_last=True)
    if not source:
        loader.graph_source = lambda device: None  # type: ignore[method-assign]
    return loader


def one_round(stack: bool, n: int, data: str = "cycle") -> float:
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=True)
    loader: Any = itertools.cycle(make_batches(count=8))
    if data != "cycle":
        loader = resident(data == "source")
    trainer = CUDAGraphTrainer(model, loader, opt, graph="eager")
    out = tempfile.mkdtemp()
    hs: List[Any] = []
    if stack:
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [n // 2], 0.1)
        writers = [
            CommonMetricPrinter(n),
            JSONWriter(f"{out}/metrics.json"),
            TensorboardXWriter(out),
        ]
        hs = [
            hooks.IterationTimer(),
            hooks.LRScheduler(opt, sched),
            hooks.PeriodicWriter(writers, 20),
        ]
    stamps = Stamps()
    trainer.register_hooks(hs + [stamps])
    trainer.train(0, n)
    skip = 100  # the warm-up steps and the capture
    gaps = [b - a for a, b in zip(stamps.at[skip:], stamps.at[skip + 1 :])]
    return statistics.median(gaps) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="steps per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds")
    parser.add_argument(
        "--resident",
        action="store_true",
        help="a DeviceResidentLoader: next() + copy into the static batch vs its graph source",
    )
    args = parser.parse_args()
    logging.getLogger("hookloop").setLevel(logging.WARNING)
    graph_seam.EagerStepGraph = FreeReplays  # type: ignore[misc]
    kinds = [("no hooks", False, "cycle"), ("default stack", True, "cycle")]
    if args.resident:
        kinds = [
            (f"{name}, {how}", stack, data)
            for name, stack in (("no hooks", False), ("default stack", True))
            for how, data in (("next()+place", "place"), ("graph source", "source"))
        ]
    rounds: Dict[str, List[float]] = {name: [] for name, _, _ in kinds}
    for _ in range(args.repeats):
        for name, stack, data in kinds:
            rounds[name].append(one_round(stack, args.n, data))
    print(f"host time per step outside the replay, us (median of {args.n} steps per round)")
    for name, values in rounds.items():
        per = ", ".join(f"{v:.1f}" for v in values)
        print(f"{name:>28}: median {statistics.median(values):.1f}  (rounds: {per})")


if __name__ == "__main__":
    main()
