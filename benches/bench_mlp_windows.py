"""The tiny MLP of issue 11, timed per window of iterations instead of per run.

Each variant trains ``--steps`` steps in one run; a clock is read every ``--window`` steps (by
the hand loops inline, by a hook the dispatcher calls only at those iterations); the figure is
a low quantile (``--quantile``, default the 25th percentile) of the windows' time per step,
pooled over ``--rounds`` interleaved rounds. Every window holds one periodic write, so the
writers' cost is in it; a low quantile drops the windows that a burst of interference on a
shared machine slowed down, which the per-run medians of ``hookloop bench --only mlp`` cannot.

    python benches/bench_mlp_windows.py                  # 2,000 steps × 8 rounds, ~1 minute
    python benches/bench_mlp_windows.py --steps 200 --rounds 1   # a quick look

Variants: the hand-written loop (model calls only), the hand loop with its own bookkeeping
(``tiny_mlp.hand_loop_bookkeeping``'s calls), ``SimpleTrainer`` with no hooks, the default
stack (IterationTimer, LRScheduler(MultiStepLR), PeriodicWriter(printer, JSON, TensorBoard;
20)) and the same with hookloop's native schedule.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch
from hookloop.bench import tiny_mlp
from hookloop.engine import HookBase

clock = time.perf_counter


def _hand(batches: Any, n: int, window: int, bookkeeping: bool) -> List[float]:
    """The hand loops of :mod:`hookloop.bench.tiny_mlp`, run one window at a time (a window
    ends where the bookkeeping loop logs), with a clock read between windows."""
    model, opt, sched = tiny_mlp.build("cpu")
    data = itertools.cycle(batches)
    stamps = [clock()]
    for _ in range(n // window):
        if bookkeeping:
            tiny_mlp.hand_loop_bookkeeping(model, opt, sched, data, window, period=window)
        else:
            tiny_mlp.hand_loop(model, opt, data, window)
        stamps.append(clock())
    return stamps


class _Stamp(HookBase):
    """Reads the clock at the end of every ``window``-th iteration, after the other hooks."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.stamps: List[float] = []

    def before_train(self) -> None:
        self.stamps.append(clock())

    def _dispatch_period(self, stage: str) -> Any:
        return self.window if stage == "after_step" else None

    def _dispatch_order(self, stage: str) -> int:
        return 10

    def after_step(self) -> None:
        if (self.trainer.iter + 1) % self.window == 0:
            self.stamps.append(clock())


def _trainer(batches: Any, n: int, window: int, hooks: str, tmpdir: str) -> List[float]:
    stamp = _Stamp(window)
    t = tiny_mlp.make_trainer(
        "hl",
        torch.device("cpu"),
        batches,
        n,
        tmpdir,
        hooks=hooks,
        period=window,
        extra=[lambda: stamp],
    )
    t.train(0, n)
    return stamp.stamps


def run(steps: int, rounds: int, window: int, quantile: float) -> Dict[str, Any]:
    torch.set_num_threads(1)
    batches = tiny_mlp.make_batches("cpu")
    tmpdir = tempfile.mkdtemp(prefix="hookloop-windows-")
    variants: Dict[str, Callable[[], List[float]]] = {
        "hand": lambda: _hand(batches, steps, window, False),
        "hand_bookkeeping": lambda: _hand(batches, steps, window, True),
        "no_hooks": lambda: _trainer(batches, steps, window, "none", tmpdir),
        "stack": lambda: _trainer(batches, steps, window, "stack", tmpdir),
        "stack_native_schedule": lambda: _trainer(batches, steps, window, "native", tmpdir),
    }
    windows: Dict[str, List[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, f in variants.items():
            stamps = f()
            # The first window is warm-up (the first iteration builds iterators and tables).
            windows[name] += [(b - a) / window for a, b in zip(stamps[1:-1], stamps[2:])]
    per_step = {}
    for name, ws in windows.items():
        ws = sorted(ws)
        per_step[name] = ws[min(len(ws) - 1, int(quantile * len(ws)))] if ws else float("nan")
    hand, book = per_step["hand"], per_step["hand_bookkeeping"]
    return {
        "steps": steps,
        "rounds": rounds,
        "window": window,
        "quantile": quantile,
        "windows_per_variant": {k: len(v) for k, v in windows.items()},
        "us_per_step": {k: v * 1e6 for k, v in per_step.items()},
        "x_hand": {k: hand / v for k, v in per_step.items()},
        "x_hand_bookkeeping": {k: book / v for k, v in per_step.items()},
        "median_x_hand": {
            k: statistics.median(windows["hand"]) / statistics.median(v)
            for k, v in windows.items()
            if v and windows["hand"]
        },
    }


def main(argv: Any = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--quantile", type=float, default=0.25)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    if a.steps < 3 * a.window:
        p.error(f"--steps must be at least three windows ({3 * a.window})")
    res = run(a.steps, a.rounds, a.window, a.quantile)
    print(
        f"{res['steps']} steps × {res['rounds']} rounds, windows of {res['window']}, "
        f"quantile {res['quantile']}"
    )
    print("| variant | µs/step | × hand | × hand with bookkeeping | median-window × hand |")
    print("|---|---|---|---|---|")
    for k in res["us_per_step"]:
        median = res["median_x_hand"].get(k, float("nan"))
        print(
            f"| {k} | {res['us_per_step'][k]:.1f} | {res['x_hand'][k]:.3f} | "
            f"{res['x_hand_bookkeeping'][k]:.3f} | {median:.3f} |"
        )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
