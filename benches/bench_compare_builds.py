"""The tiny MLP's default stack against the hand loop, in instructions per step, for this
checkout and for other builds of hookloop: what a change did, across any number of commits.

    python benches/bench_compare_builds.py --period 1 --against /tmp/old/python   # ~5 min per build

``--against`` names the ``python/`` directory of another checkout with its ``_core`` built in
release (``git worktree add /tmp/old REV``, ``cargo build --release -p hookloop-py`` there, and
``target/release/lib_core.so`` copied into ``/tmp/old/python/hookloop/`` under the extension's
name). Each build runs in a process of its own under valgrind's callgrind, as
``bench_mlp_instructions.py`` runs its loops: the hand-written loop and ``SimpleTrainer`` with
IterationTimer + LRScheduler(MultiStepLR) + PeriodicWriter([printer, JSON, TensorBoard],
``--period``), each for ``--short`` and ``--long`` steps inside ``operator.call``, the garbage
collector off. The child uses only hookloop's public API and builds the tiny MLP itself, so
that it runs against builds that lack ``hookloop.bench``.

    python benches/bench_compare_builds.py --timed --period 1 --against /tmp/old/python  # ~4 min

``--timed`` times the same loops instead: the hand loop and each build's stack in paired
turns (``lab.paired``; every process a fresh interpreter that imports its build and
checks that it did), and per build the stack's µs per step over the hand loop and its ratio to
this build's, with 95% intervals that resample the processes and the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

# The callgrind plumbing of the tiny MLP's instruction bench, beside this script (no torch).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mlp_instructions import (
    callgrind_or_exit,
    counted_call,
    parse_counts,
    per_step,
    run_counted,
)  # noqa: E402

LOOPS = ("hand", "stack")


def tiny_mlp() -> Tuple[Any, List[Any]]:
    """``hookloop.bench``'s model class and its batches (the same seeds, layers and
    losses; a test checks that both give the same losses), rebuilt here for old builds."""
    import torch
    from torch import nn

    class TinyMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, batch: Any) -> Dict[str, Any]:
            x, y = batch
            pred = self.net(x)
            err = pred - y
            return {
                "loss_mse": (err * err).mean(),
                "loss_l1": err.abs().mean(),
                "loss_huber": nn.functional.smooth_l1_loss(pred, y),
                "loss_reg": 1e-4 * (pred * pred).mean(),
            }

    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 1, generator=g)
    batches = []
    for _ in range(64):
        x = torch.randn(16, 32, generator=g)
        batches.append((x, x @ w))
    return TinyMLP, batches


def make_loops(
    period: int, tmp: str, data: Optional[Callable[[List[Any]], Iterator[Any]]] = None
) -> Dict[str, Callable[[int], Callable[[], None]]]:
    """The two loops, each as ``make(n)``: a fresh model and a function that trains it ``n``
    steps (the hand-written loop, and ``SimpleTrainer`` with the default stack at ``period``
    writing under ``tmp``), taking its batches from ``data(batches)`` (default: cycled).
    Only hookloop's public API: it runs against builds that lack ``hookloop.bench``."""
    import torch
    from hookloop.engine import SimpleTrainer, hooks
    from hookloop.utils import events

    model_cls, batches = tiny_mlp()
    feed = data if data is not None else itertools.cycle

    def build() -> Tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = model_cls()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10**9], gamma=0.1)
        return model, opt, sched

    def hand(n: int) -> Callable[[], None]:
        model, opt, _ = build()
        it = feed(batches)

        def loop() -> None:
            model.train()
            for _ in range(n):
                loss_dict = model(next(it))
                losses = sum(loss_dict.values())
                opt.zero_grad()
                losses.backward()
                opt.step()

        return loop

    def stack(n: int) -> Callable[[], None]:
        model, opt, sched = build()
        trainer = SimpleTrainer(model, feed(batches), opt)
        d = tempfile.mkdtemp(dir=tmp)
        writers = [
            events.CommonMetricPrinter(n),
            events.JSONWriter(os.path.join(d, "metrics.json")),
            events.TensorboardXWriter(d),
        ]
        stack = [hooks.IterationTimer(), hooks.LRScheduler(opt, sched)]
        trainer.register_hooks([*stack, hooks.PeriodicWriter(writers, period)])
        return lambda: trainer.train(0, n)

    return {"hand": hand, "stack": stack}


def child(period: int, lengths: Sequence[int]) -> None:
    """Each loop for each length inside ``operator.call``, after 5 uncounted steps of its own."""
    import hookloop
    import torch

    print(f"hookloop from {os.path.dirname(hookloop.__file__)}", file=sys.stderr, flush=True)
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="hookloop-builds-")
    try:
        makes = make_loops(period, tmp)
        with _printer_logging():
            for loop in LOOPS:
                for n in lengths:
                    makes[loop](5)()
                    counted_call(makes[loop](n))
                    print(f"{loop} {n} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def timed_child(
    conn: Any, python_path: Optional[str], loop: str, period: int, window: int, steps: int,
    tmp: str,
) -> None:  # fmt: skip
    """One process of ``--timed`` (a fresh interpreter): ``loop`` of the hookloop found first
    on ``python_path`` (the parent's when None) trains, taking its turns through
    ``paired._turns``, until the parent stops it."""
    import traceback

    if python_path is not None:
        sys.path.insert(0, python_path)
    try:
        import hookloop
        import torch

        where = os.path.dirname(os.path.abspath(hookloop.__file__))
        if python_path is not None and os.path.realpath(where) != os.path.realpath(
            os.path.join(python_path, "hookloop")
        ):
            raise RuntimeError(f"imported hookloop from {where}, not from {python_path}")
        from lab import paired as turns  # this checkout's; it imports no hookloop

        torch.set_num_threads(1)
        device = torch.device("cpu")
        makes = make_loops(period, tmp, lambda batches: turns._turns(conn, batches, window, device))
        with _printer_logging():
            makes[loop](steps)()
        conn.send(("error", f"{loop} ({where}) ended after {steps} steps, before it was stopped"))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    conn.close()
    os._exit(0)


@contextlib.contextmanager
def _printer_logging() -> Iterator[None]:
    """The printer's lines built and handed to a handler that drops them, as
    ``overhead.printer_logging`` sets it up (which old builds lack); the rest of hookloop's
    logging quiet. Restored on exit."""
    log, root = logging.getLogger("hookloop.utils.events"), logging.getLogger("hookloop")
    saved = (log.level, log.propagate, root.level)
    handler = logging.NullHandler()
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = saved[1]
        log.setLevel(saved[0])  # setLevel also clears the loggers' cached levels
        root.setLevel(saved[2])


def count(
    python_path: Optional[str], args: argparse.Namespace, valgrind: str
) -> Tuple[str, Dict[str, float]]:
    """Where the child found hookloop, and the instructions per step of each loop, for the
    hookloop found on ``python_path`` (this checkout's when None)."""

    env = dict(os.environ)
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([python_path, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    child_args = [os.path.abspath(__file__), "--child", "--period", str(args.period),
                  "--short", str(args.short), "--long", str(args.long)]  # fmt: skip
    out_dir = tempfile.mkdtemp(prefix="hookloop-callgrind-")
    try:
        dumps, stderr = run_counted(valgrind, out_dir, child_args, env=env)
        counts = [parse_counts(f) for f in dumps]
        steps = per_step(counts, list(LOOPS), (args.short, args.long))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    found = re.search(r"hookloop from (.+)", stderr)
    where = found.group(1).strip() if found else "?"
    return where, {loop: row["Ir"] for loop, row in steps.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--against", action="append", default=[], metavar="PYTHON_DIR",
                   help="another build's python/ directory (repeatable)")  # fmt: skip
    p.add_argument("--period", type=int, default=20)
    p.add_argument("--short", type=int, default=100)
    p.add_argument("--long", type=int, default=600)
    p.add_argument("--timed", action="store_true",
                   help="time the loops in paired turns, not count instructions")  # fmt: skip
    p.add_argument("--rounds", type=int, default=200, help="--timed: rounds of turns")
    p.add_argument("--window", type=int, default=20, help="--timed: steps per turn")
    p.add_argument("--warmup", type=int, default=5, help="--timed: untimed first rounds")
    p.add_argument("--replicas", type=int, default=4, help="--timed: processes per loop")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.period < 1:
        p.error("--period must be positive")
    if not 0 < args.short < args.long:
        p.error("--short and --long must be positive, --short below --long")
    if args.rounds < 1 or args.window < 1 or args.replicas < 1 or args.warmup < 0:
        p.error("--rounds, --window and --replicas must be positive, --warmup not negative")
    if args.child:
        child(args.period, (args.short, args.long))
        return 0
    for path in args.against:
        if not os.path.isdir(os.path.join(path, "hookloop")):
            p.error(f"--against {path}: no hookloop package there")
    if args.timed:
        return timed(args)
    valgrind = callgrind_or_exit(p)
    rows = []
    for path in [None, *args.against]:
        where, ir = count(path, args, valgrind)
        rows.append((where, ir["hand"], ir["stack"] - ir["hand"]))
        print(f"{where} done", file=sys.stderr, flush=True)
    print(f"| hookloop | hand loop Ir/step | default stack (period {args.period}) over it |")
    print("|---|---|---|")
    for name, hand, over in rows:
        print(f"| {name} | {hand:,.0f} | {over:+,.0f} |")
    return 0


def timed(args: argparse.Namespace) -> int:
    """``--timed``: the hand loop and each build's stack in paired turns
    (``lab.paired``, every process a fresh interpreter), and per build the stack's
    µs per step over the hand loop, with 95% intervals that resample the processes and the
    rounds, and its ratio to the first build's."""
    import numpy as np
    from lab import paired

    builds: List[Optional[str]] = [None, *args.against]
    hand = paired.Variant("hand")
    stacks = [paired.Variant(f"build {i}", "stack") for i in range(len(builds))]
    path_of = dict(zip(stacks, builds))

    def spawn(v: Any, conn: Any, steps: int, tmp: str) -> Tuple[Callable[..., None], Tuple]:
        loop = "hand" if v == hand else "stack"
        return timed_child, (conn, path_of.get(v), loop, args.period, args.window, steps, tmp)

    print(f"{len(builds) + 1} loops x {args.replicas} processes, {args.rounds} rounds "
          "(each process imports torch first) ...", file=sys.stderr, flush=True)  # fmt: skip
    times = paired.run(
        [hand, *stacks], window=args.window, rounds=args.rounds, warmup=args.warmup,
        replicas=args.replicas, spawn=spawn,
    )  # fmt: skip
    us = 1e6 / args.window  # seconds per window -> µs per step

    def over(h: Any, v: Any) -> float:
        return float(np.median(v - h)) * us

    def relative(h: Any, v: Any, first: Any) -> float:
        return float(np.median(v - h) / np.median(first - h))

    print(f"\n| hookloop | hand loop µs/step | default stack (period {args.period}) µs/step over "
          "it (95% interval) | over-hand time ÷ the first build's (95% interval) |")  # fmt: skip
    print("|---|---|---|---|")
    hand_us = statistics.median(paired.windows(times, hand)) * us
    for v, path in zip(stacks, builds):
        o = over(np.asarray(paired.windows(times, hand)), np.asarray(paired.windows(times, v)))
        lo, hi = paired.bootstrap_ci(times, [hand, v], over)
        cell = "1"
        if v != stacks[0]:
            r = relative(*(np.asarray(paired.windows(times, x)) for x in (hand, v, stacks[0])))
            rlo, rhi = paired.bootstrap_ci(times, [hand, v, stacks[0]], relative)
            cell = f"{r:.3f} ({rlo:.3f}–{rhi:.3f})"
        name = path if path is not None else "this build"
        print(f"| {name} | {hand_us:,.1f} | {o:+,.1f} ({lo:+,.1f} to {hi:+,.1f}) | {cell} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
