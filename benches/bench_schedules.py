#!/usr/bin/env python
"""Per-iteration cost of an LR scheduler step: hookloop's native LRMultiplier against torch and
fvcore-style Python schedules.

    python benches/bench_schedules.py [--quick] [--repeats 9] [--iters 20000] [--groups 1,16]

Measures, side by side in this one process, the cost of one scheduler step per iteration:

- ``loop floor``: the timing loop calling a no-op (subtracted from nothing; shown for scale);
- ``torch MultiStepLR.step()``: torch's own scheduler, what the issue compares against;
- ``LRMultiplier(Warmup(MultiStep)).step()``: hookloop, native schedule (one call into Rust);
- ``LRMultiplier(Python schedule).step()``: hookloop's LRMultiplier over the same schedule as
  a Python ``ParamScheduler`` subclass (the fallback: torch's step, ``get_lr``, Python schedule);
- ``detectron2 LRMultiplier+fvcore .step()``: the baseline, detectron2's ``LRMultiplier`` over
  fvcore's ``WarmupParamScheduler(MultiStepParamScheduler(...))`` as modelled in
  ``tests/compat/reference_engine.py`` (the tests' model of detectron2, ``compat.d2``);
- ``LRScheduler hook, native`` / ``LRScheduler hook, fvcore``: the whole per-iteration work of
  hookloop's ``LRScheduler`` hook (``after_step``: put ``lr`` into the storage, step the
  scheduler) over the native ``LRMultiplier``, and over detectron2's ``LRMultiplier`` with
  fvcore's schedules (what a detectron2 codebase brings).

Each repeat runs every variant once, in a rotating order, so all see the same machine noise;
the table gives the median and minimum over repeats (ns per iteration) and the ratio of torch's
median to each. The garbage collector is off inside timed regions. A debug build is refused.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple, cast

import hookloop
import lab  # noqa: F401  (puts tests/ on sys.path: the baseline, compat.d2)
import torch
from compat import d2
from hookloop.engine.hooks import LRScheduler
from hookloop.solver import LRMultiplier, WarmupParamScheduler
from hookloop.solver.param_scheduler import MultiStepParamScheduler, ParamScheduler
from hookloop.utils.events import EventStorage

perf_ns = time.perf_counter_ns


class PythonSchedule(ParamScheduler):
    """A Python ParamScheduler subclass (hookloop evaluates it at Python cost)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, where: float) -> float:
        return self.inner(where)


def make_optimizer(groups: int) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1} for _ in range(groups)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return opt


class _Trainer:
    """What the LRScheduler hook reads of a trainer."""

    def __init__(self, optimizer: torch.optim.Optimizer, iters: int) -> None:
        self.optimizer = optimizer
        self.storage = EventStorage()
        self.max_iter = iters
        self.iter = 0


def hook_step(optimizer: torch.optim.Optimizer, scheduler: Any, iters: int) -> Callable[[], None]:
    """The LRScheduler hook's after_step over ``scheduler``, set up as a trainer would."""
    hook = LRScheduler(optimizer, scheduler)
    hook.trainer = cast(Any, _Trainer(optimizer, iters))
    hook.before_train()
    optimizer.step()
    scheduler.step()
    return hook.after_step


def schedule_args(iters: int) -> Tuple[List[float], List[int], int, float, float]:
    # detectron2's defaults scaled to `iters`: drops at 60% and 80%, warmup over 1%.
    warmup_iters = max(1, min(100, iters // 100))
    milestones = [int(iters * 0.6), int(iters * 0.8)]
    return [1.0, 0.1, 0.01], milestones, iters, 0.001, warmup_iters / iters


def build(variant: str, groups: int, iters: int) -> Callable[[], None]:
    """A fresh scheduler for `iters` steps; returns the per-iteration call."""
    opt = make_optimizer(groups)
    values, milestones, n, factor, length = schedule_args(iters)
    if variant == "loop floor":
        return lambda: None
    if variant == "torch MultiStepLR.step()":
        sched: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.MultiStepLR(
            opt, milestones=milestones, gamma=0.1
        )
        opt.step()  # torch warns once if the scheduler steps before the optimizer ever did
        sched.step()
        return sched.step
    if variant.startswith("detectron2") or variant == "LRScheduler hook, fvcore":
        d2_multiplier = d2.WarmupParamScheduler(
            d2.MultiStepParamScheduler(values, milestones=milestones, num_updates=n), factor, length
        )
        sched = d2.LRMultiplier(opt, d2_multiplier, n)
        if variant == "LRScheduler hook, fvcore":
            return hook_step(opt, sched, n)
        opt.step()
        sched.step()
        return sched.step
    if variant.startswith("LRMultiplier(Python"):
        d2_multiplier = d2.WarmupParamScheduler(
            d2.MultiStepParamScheduler(values, milestones=milestones, num_updates=n), factor, length
        )
        sched = LRMultiplier(opt, PythonSchedule(d2_multiplier), n)
        opt.step()
        sched.step()
        return sched.step
    native = WarmupParamScheduler(
        MultiStepParamScheduler(values, milestones=milestones, num_updates=n), factor, length
    )
    lrm = LRMultiplier(opt, native, n)
    assert lrm._fast, "the native path should apply"
    if variant == "LRScheduler hook, native":
        return hook_step(opt, lrm, n)
    opt.step()
    lrm.step()
    return lrm.step


VARIANTS = [
    "loop floor",
    "torch MultiStepLR.step()",
    "LRMultiplier(Warmup(MultiStep)).step()",
    "LRMultiplier(Python schedule).step()",
    "detectron2 LRMultiplier+fvcore .step()",
    "LRScheduler hook, native",
    "LRScheduler hook, fvcore",
]


def time_variant(variant: str, groups: int, iters: int) -> float:
    """ns per iteration over `iters` steps of a fresh scheduler."""
    step = build(variant, groups, iters + 2)
    gc.disable()
    try:
        t0 = perf_ns()
        for _ in range(iters):
            step()
        t1 = perf_ns()
    finally:
        gc.enable()
    return (t1 - t0) / iters


def run(
    repeats: int, iters: int, groups_list: List[int], collect: bool = True
) -> Dict[Tuple[int, str], List[float]]:
    results: Dict[Tuple[int, str], List[float]] = {}
    for groups in groups_list:
        for r in range(repeats):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            if collect:  # once per repeat: a full collection costs 0.1-1 s with torch loaded
                gc.collect()
            for variant in order:
                results.setdefault((groups, variant), []).append(
                    time_variant(variant, groups, iters)
                )
    return results


def table(results: Dict[Tuple[int, str], List[float]], groups_list: List[int]) -> str:
    head = ("param groups", "variant", "median ns/it", "min ns/it", "torch/this")
    lines = ["{:>12}  {:<40} {:>12} {:>10} {:>10}".format(*head)]
    for groups in groups_list:
        torch_median = statistics.median(results[(groups, "torch MultiStepLR.step()")])
        for variant in VARIANTS:
            samples = results[(groups, variant)]
            median = statistics.median(samples)
            ratio = f"{torch_median / median:.1f}x" if variant != "loop floor" else ""
            lines.append(
                f"{groups:>12}  {variant:<40} {median:>12.0f} {min(samples):>10.0f} {ratio:>10}"
            )
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20000, help="steps per timed run")
    parser.add_argument("--groups", default="1,16", help="comma-separated param group counts")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args(argv)
    if hookloop.BUILD_PROFILE != "release":
        print(
            f"refusing to benchmark a {hookloop.BUILD_PROFILE} build of hookloop", file=sys.stderr
        )
        return 2
    repeats, iters = (3, 200) if args.quick else (args.repeats, args.iters)
    groups_list = [int(g) for g in args.groups.split(",")]
    if repeats < 1 or iters < 1 or any(g < 1 for g in groups_list):
        parser.error("--repeats, --iters and --groups must be positive")
    results = run(repeats, iters, groups_list)
    print(
        f"LR scheduler step per iteration: median/min over {repeats} repeats of {iters} steps "
        f"(torch {torch.__version__}, Python {sys.version.split()[0]}, hookloop "
        f"{hookloop.__version__} {hookloop.BUILD_PROFILE})"
    )
    print(table(results, groups_list))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
