"""The tiny MLP of issue 11, counted in CPU instructions instead of timed: what each loop does
per step, free of the machine's noise.

    python benches/bench_mlp_instructions.py               # ~9 min (torch's import under valgrind)
    python benches/bench_mlp_instructions.py --cache-sim   # with simulated cache misses, ~15 min
    python benches/bench_mlp_instructions.py --branch-sim  # with simulated branch mispredictions
    python benches/bench_mlp_instructions.py --loops hand,stack,seeds   # some loops, ~1-2 min each

Each loop (the hand-written loops and hookloop's trainer with no hooks, the default stack, the
stack on the native schedule, the seeds' stack (the default stack and cvpods' and xmodaler's
every-step writers: ``PeriodicWriter([JSONWriter, TensorboardXWriter], 1)`` with
``window_size=1``), the default stack at period 1 with all three writers and with each alone;
``--loops`` picks some) runs twice, for ``--short`` and ``--long`` steps, under
valgrind's callgrind, which counts only inside those runs; the difference of the two counts over
the difference of their steps is the loop's instructions per step, with the fixed costs
(building the trainer, before_train, the last write) cancelled out. Only the training thread
is counted (callgrind's collection state is per thread): the writers' threads, which format
and write the files, are not. The garbage collector is off inside the counted runs (a
collection of the whole heap would land in one run and not the other) and the string-hash
seed is fixed. The same loop's count
repeats to within a few instructions per step from run to run, where time ratios on a shared
2-core machine carry intervals of ±2-3% (``bench_mlp_paired.py``): a change of a few hundred
instructions per step, invisible there, shows here.

Instructions are not time: code that runs between torch's calls finds cold caches, so its
instructions cost more than the step's average (``--cache-sim`` counts the simulated misses).
The table also lists, for each of hookloop's loops, its own native functions that take most
instructions per step. Those counts repeat to within a few instructions from run to run; a
whole loop's count moves by up to ~4k instructions per step from one process to the next even
so (where torch's allocations land), ~0.25% of a step: read small differences between loops
from the functions, not from the totals.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

LOOPS = {
    "hand": "hand-written loop (model calls only)",
    "book": "hand loop with its own bookkeeping",
    "none": "SimpleTrainer, no hooks",
    "stack": "default stack (MultiStepLR)",
    "native": "default stack, native schedule",
    "seeds": "the seeds' stack: default stack + every-step JSON and TensorBoard (window 1)",
    "stack1": "default stack at period 1 (MultiStepLR)",
    "printer1": "… at period 1, CommonMetricPrinter only",
    "json1": "… at period 1, JSONWriter only",
    "tb1": "… at period 1, TensorboardXWriter only",
}

# The trainers' loops: tiny_mlp.make_trainer's hooks, the writers' period, which writers
# (None: make_trainer's default, all three). The other loops are the hand-written ones.
TRAINERS: Dict[str, Tuple[str, int, Optional[Tuple[str, ...]]]] = {
    "none": ("none", 20, None),
    "stack": ("stack", 20, None),
    "native": ("native", 20, None),
    "seeds": ("seeds", 20, None),
    "stack1": ("stack", 1, None),
    "printer1": ("stack", 1, ("printer",)),
    "json1": ("stack", 1, ("json",)),
    "tb1": ("stack", 1, ("tb",)),
}


def trainer_args(loop: str) -> Tuple[str, Dict[str, Any]]:
    """``tiny_mlp.make_trainer``'s ``hooks`` and keyword arguments for one of the TRAINERS."""
    hooks, period, writers = TRAINERS[loop]
    kw: Dict[str, Any] = dict(period=period)
    if writers is not None:
        kw["writers"] = writers
    return hooks, kw


def chosen_loops(p: argparse.ArgumentParser, text: str) -> List[str]:
    """The comma-separated ``--loops`` of a tiny-MLP bench, or ``p.error`` naming the unknown
    ones."""
    loops = text.split(",")
    bad = [x for x in loops if x not in LOOPS]
    if bad:
        p.error(f"unknown loop(s) {bad}: choose from {', '.join(LOOPS)}")
    return loops


# callgrind counts inside calls of this C function only: each loop runs under operator.call
TOGGLE = "_operator_call"


def counted_call(f: Callable[..., object], *args: object) -> None:
    """``f(*args)`` inside ``operator.call`` (what callgrind counts), with Python's garbage
    collector off: a collection of the whole heap, which falls into one run and not another,
    would add thousands of instructions per step to one count."""
    gc.collect()
    gc.disable()
    try:
        operator.call(f, *args)
    finally:
        gc.enable()


def child(loops: Sequence[str], lengths: Sequence[int]) -> None:
    """Runs each loop for each length inside :func:`counted_call` (after 5 uncounted warm-up steps
    of the same loop on a model of their own), in order: the hand loops as
    ``tiny_mlp.time_hand`` runs them, the trainers' ``train()``. Building the model counts in
    both runs of a loop, and so cancels out."""
    import torch
    from lab import overhead, tiny_mlp

    torch.set_num_threads(1)
    dev = torch.device("cpu")
    batches = tiny_mlp.make_batches(dev)
    tmp = tempfile.mkdtemp(prefix="hookloop-instr-")
    try:
        with overhead.printer_logging():
            for loop in loops:
                for n in lengths:
                    if loop not in TRAINERS:
                        book = loop == "book"
                        tiny_mlp.time_hand(dev, batches, 5, False, book)
                        counted_call(tiny_mlp.time_hand, dev, batches, n, False, book)
                    else:
                        hooks, kw = trainer_args(loop)
                        warm = tiny_mlp.make_trainer("hl", dev, batches, 5, tmp, hooks, **kw)
                        warm.train(0, 5)
                        t = tiny_mlp.make_trainer("hl", dev, batches, n, tmp, hooks, **kw)
                        counted_call(t.train, 0, n)
                    print(f"{loop} {n} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_counts(path: str) -> Dict[str, int]:
    """The event totals of one callgrind output file: ``{"Ir": ..., "I1mr": ..., ...}``."""
    events: List[str] = []
    totals: Optional[List[int]] = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith(("summary:", "totals:")):
                totals = [int(x) for x in line.split()[1:]]
    if not events or totals is None:
        raise ValueError(f"{path} is not a callgrind output file (no events or totals)")
    return dict(zip(events, totals + [0] * (len(events) - len(totals))))


def callgrind_or_exit(p: argparse.ArgumentParser) -> str:
    """valgrind's path, or ``p.error`` naming what is missing to count instructions (Python
    3.11's ``operator.call``, which marks what callgrind counts, and valgrind itself)."""
    if not hasattr(operator, "call"):
        p.error("needs Python 3.11 or later (operator.call marks what callgrind counts)")
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        p.error("needs valgrind (Debian: apt-get install valgrind)")
    return valgrind


def run_counted(
    valgrind: str,
    out_dir: str,
    script_args: Sequence[str],
    valgrind_args: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
) -> Tuple[List[str], str]:
    """Runs ``python script_args...`` under callgrind, counting only inside ``operator.call``
    with a dump into ``out_dir`` after each call; returns the dumps' paths in call order and
    the child's stderr. Exits naming the failure when the child fails. The string-hash seed is
    fixed: dict and set probing would otherwise differ from run to run."""
    cmd = [
        valgrind, "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={TOGGLE}",
        f"--dump-after={TOGGLE}", f"--callgrind-out-file={os.path.join(out_dir, 'cg.out')}",
        *valgrind_args, sys.executable, *script_args,
    ]  # fmt: skip
    done = subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**(os.environ if env is None else env), "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"the counted run failed (exit {done.returncode})")
    dumps = sorted(
        (f for f in os.listdir(out_dir) if re.fullmatch(r"cg\.out\.\d+", f)),
        key=lambda f: int(f.rsplit(".", 1)[1]),
    )
    return [os.path.join(out_dir, f) for f in dumps], done.stderr


def per_step(
    counts: Sequence[Dict[str, int]], loops: Sequence[str], lengths: Tuple[int, int]
) -> Dict[str, Dict[str, float]]:
    """Per loop, each event per step: the long run's count less the short run's, over the
    steps between them. ``counts`` are the dumps in run order (loop by loop, short then
    long)."""
    if len(counts) != 2 * len(loops):
        raise ValueError(f"{len(counts)} callgrind dumps for {len(loops)} loops (2 each)")
    short, long = lengths
    out = {}
    for k, loop in enumerate(loops):
        a, b = counts[2 * k], counts[2 * k + 1]
        out[loop] = {e: (b[e] - a[e]) / (long - short) for e in b}
    return out


_FN = re.compile(r"^\s*([\d,]+)\s+\([^)]*\)\s+\?\?\?:(.+?) \[(.+)\]\s*$")


def own_functions(path: str, steps: int, top: int = 12) -> List[Tuple[str, float]]:
    """hookloop's native functions in one dump with the most instructions (inclusive) per
    step (the run's count over its steps), from ``callgrind_annotate``; PyO3's trampolines
    and the loop itself left out."""
    annotate = shutil.which("callgrind_annotate")
    if annotate is None:
        return []
    text = subprocess.run(
        [annotate, "--inclusive=yes", "--threshold=100", path],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = []
    for line in text.splitlines():
        m = _FN.match(line)
        if not m or "hookloop" not in m.group(3) or "_core" not in m.group(3):
            continue
        name = m.group(2)
        if "trampoline" in name or "run_loop" in name:
            continue
        rows.append((name, int(m.group(1).replace(",", "")) / steps))
    return sorted(rows, key=lambda r: -r[1])[:top]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--loops", default=",".join(LOOPS), help="comma-separated, of " + ",".join(LOOPS)
    )
    p.add_argument("--short", type=int, default=100)
    p.add_argument("--long", type=int, default=600)
    p.add_argument("--cache-sim", action="store_true", help="also count simulated cache misses")
    p.add_argument(
        "--branch-sim", action="store_true", help="also count simulated branch mispredictions"
    )
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    loops = chosen_loops(p, args.loops)
    if not 0 < args.short < args.long:
        p.error("--short and --long must be positive, --short below --long")
    if args.child:
        # "Starting training" and the timer's summary stay quiet; the printers' lines and the
        # bookkeeping loop's are still built and handed to their handlers (their loggers are
        # set to INFO themselves), as in the timed benches: they are part of what is counted.
        logging.getLogger("hookloop").setLevel(logging.WARNING)
        child(loops, (args.short, args.long))
        return 0
    valgrind = callgrind_or_exit(p)
    out_dir = tempfile.mkdtemp(prefix="hookloop-callgrind-")
    print("running under callgrind (torch's import alone takes minutes) ...", file=sys.stderr)
    child_args = [os.path.abspath(__file__), "--child", "--loops", ",".join(loops),
                  "--short", str(args.short), "--long", str(args.long)]  # fmt: skip
    sims = ["--cache-sim=yes"] * args.cache_sim + ["--branch-sim=yes"] * args.branch_sim
    dumps, _ = run_counted(valgrind, out_dir, child_args, sims)
    counts = [parse_counts(f) for f in dumps]
    steps = per_step(counts, loops, (args.short, args.long))
    events = list(next(iter(steps.values())))
    floor = steps.get("hand")
    head = " | ".join(f"{e}/step" for e in events)
    lines = [f"| loop | {head} | Ir over hand/step |", "|---" * (len(events) + 2) + "|"]
    for loop, row in steps.items():
        cells = " | ".join(f"{row[e]:,.0f}" for e in events)
        over = f"{row['Ir'] - floor['Ir']:+,.0f}" if floor else "—"
        lines.append(f"| {LOOPS[loop]} | {cells} | {over} |")
    print("\n".join(lines))
    own: Dict[str, List[Tuple[str, float]]] = {}
    for k, loop in enumerate(loops):
        if loop not in TRAINERS:
            continue
        own[loop] = own_functions(dumps[2 * k + 1], args.long)
        if own[loop]:
            print(f"\nhookloop's native functions in the run of {LOOPS[loop]!r}, Ir per step:")
            for name, ir in own[loop]:
                print(f"  {ir:>9,.0f}  {name}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"per_step": steps, "own_functions": own,
                       "lengths": [args.short, args.long]}, f, indent=1)  # fmt: skip
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
