"""What the tiny MLP's loops cost beyond their instructions: the garbage collector, the
kernel, and the scheduler, per step (Linux).

    python benches/bench_mlp_runtime.py [--steps 3000] [--rounds 3] [--loops hand,stack,...]
    python benches/bench_mlp_runtime.py --busy    # with a busy-looping process on every other CPU
    python benches/bench_mlp_runtime.py --json-fsync always   # JSONWriter's fsync per pickup

Each loop runs in a fresh process per round (rounds interleaved), ``--steps`` steps after a
warm-up, and reports per step: the training thread's user and system CPU time
(``getrusage(RUSAGE_THREAD)``), the CPU time of the process's other threads (the writers'
threads: the process's CPU clock less the training thread's), the training thread's voluntary
and involuntary context switches (``/proc/thread-self/status``), minor page faults, and the
garbage collector's collections and the time spent in them (``gc.callbacks``).
``bench_mlp_instructions.py`` counts instructions and simulated cache misses and branch
mispredictions, but only inside the training thread's user-space code: this is the rest. Wall
time per step is printed for reference; it is as noisy here as anywhere on a shared machine
(``bench_mlp_paired.py`` measures ratios properly).

``--busy`` starts a process that spins on each CPU but one before the rounds (as data-loader
workers or a neighbour's job would keep them busy), so that the writers' threads, which poll
while a writer is active, must share a CPU with the training thread to run.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

# The tiny MLP's loops, one table for its benches (the instruction bench's; no torch there).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mlp_instructions import LOOPS, TRAINERS, chosen_loops, trainer_args  # noqa: E402

DEFAULT_LOOPS = ("hand", "book", "none", "stack", "native", "seeds", "stack1")
WARMUP = 200


def _switches() -> Dict[str, int]:
    out = {}
    with open("/proc/thread-self/status", encoding="ascii") as f:
        for line in f:
            if "ctxt_switches" in line:
                key, value = line.split(":")
                out[key.strip()] = int(value)
    return out


def child(loop: str, steps: int, json_fsync: Optional[str] = None) -> Dict[str, float]:
    """One loop's figures per step, in this process."""
    import itertools
    import logging
    import resource

    import torch

    torch.set_num_threads(1)
    from lab import tiny_mlp

    logging.getLogger("hookloop").setLevel(logging.WARNING)  # "Starting training" and the summary
    batches = tiny_mlp.make_batches()
    tmp = tempfile.mkdtemp(prefix="hookloop-runtime-")
    gc_time = [0.0]
    gc_count = [0]
    started = [0.0]

    def on_gc(phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - started[0]
            gc_count[0] += 1

    marks: List[Any] = []

    def mark() -> None:  # the start, then the end, of the measured steps
        if not marks:
            gc.collect()
            gc.callbacks.append(on_gc)
        else:
            gc.callbacks.remove(on_gc)
        # CPU clocks (exact runtimes, where rusage's user/system split is scaled from ticks).
        # The other threads' time is the process's clock less this thread's, read in turn:
        # this thread's clock before and after the process's brackets it, so the midpoint is
        # within half the bracket of the true value (which a loaded machine widens).
        before = time.clock_gettime_ns(time.CLOCK_THREAD_CPUTIME_ID)
        process = time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID)
        after = time.clock_gettime_ns(time.CLOCK_THREAD_CPUTIME_ID)
        others = (process - (before + after) / 2, (after - before) / 2)
        marks.append((resource.getrusage(resource.RUSAGE_THREAD), others, _switches(),
                      time.perf_counter()))  # fmt: skip

    if loop in TRAINERS:
        from hookloop.engine import HookBase

        class Marks(HookBase):  # registered last: the measured span holds every hook's work
            def before_step(self) -> None:
                if self.trainer.iter == WARMUP:
                    mark()

            def after_step(self) -> None:
                if self.trainer.iter == WARMUP + steps - 1:
                    mark()

        hooks, kw = trainer_args(loop)
        trainer = tiny_mlp.make_trainer(
            "hl", torch.device("cpu"), batches, WARMUP + steps, tmp, hooks=hooks,
            extra=[Marks], json_fsync=json_fsync, **kw,
        )  # fmt: skip
        trainer.train(0, WARMUP + steps)
    else:
        model, opt, sched = tiny_mlp.build()
        data = itertools.cycle(batches)

        def run(n: int) -> None:
            if loop == "hand":
                tiny_mlp.hand_loop(model, opt, data, n)
            else:
                tiny_mlp.hand_loop_bookkeeping(model, opt, sched, data, n)

        run(WARMUP)
        mark()
        run(steps)
        mark()
    (r0, (p0, e0), s0, t0), (r1, (p1, e1), s1, t1) = marks
    wall = t1 - t0
    per = 1.0 / steps
    return {
        "wall_us": wall * 1e6 * per,
        "user_us": (r1.ru_utime - r0.ru_utime) * 1e6 * per,
        "sys_us": (r1.ru_stime - r0.ru_stime) * 1e6 * per,
        # the process's other threads (the writers'), user and system: their work runs on
        # another CPU, if there is one free
        "other_threads_us": (p1 - p0) / 1e3 * per,
        # how far other_threads_us may be from the truth (the two brackets' halves): it is
        # at least -other_threads_err_us, the other threads' time being never negative
        "other_threads_err_us": (e0 + e1) / 1e3 * per,
        "minor_faults": (r1.ru_minflt - r0.ru_minflt) * per,
        "voluntary_switches": (s1["voluntary_ctxt_switches"] - s0["voluntary_ctxt_switches"]) * per,
        "involuntary_switches": (
            s1["nonvoluntary_ctxt_switches"] - s0["nonvoluntary_ctxt_switches"]
        )
        * per,
        "gc_collections": gc_count[0] * per,
        "gc_us": gc_time[0] * 1e6 * per,
    }


def _spin() -> None:  # pragma: no cover - runs in a process that is killed
    while True:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--loops", default=",".join(DEFAULT_LOOPS), help="comma-separated, of " + ",".join(LOOPS)
    )
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", action="store_true", help="keep every other CPU busy")
    p.add_argument(
        "--json-fsync", metavar="POLICY", help="the trainers' JSONWriter fsync (default: its own)"
    )
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--child", metavar="LOOP", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.json_fsync)))
        return 0
    loops = chosen_loops(p, args.loops)
    if args.steps <= 0 or args.rounds <= 0:
        p.error("--steps and --rounds must be positive")
    spinners: List[Any] = []
    if args.busy:
        for _ in range(max((os.cpu_count() or 1) - 1, 1)):
            proc = mp.get_context("spawn").Process(target=_spin, daemon=True)
            proc.start()
            spinners.append(proc)
    rows: Dict[str, List[Dict[str, float]]] = {loop: [] for loop in loops}
    try:
        for r in range(args.rounds):
            for loop in loops:
                fsync = ["--json-fsync", args.json_fsync] if args.json_fsync else []
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--child", loop,
                     "--steps", str(args.steps), *fsync],
                    capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                rows[loop].append(json.loads(out.strip().splitlines()[-1]))
                print(f"round {r + 1}/{args.rounds}: {loop} done", file=sys.stderr)
    finally:
        for proc in spinners:
            proc.kill()
    keys = list(next(iter(rows.values()))[0])
    print(f"median of {args.rounds} rounds, {args.steps} steps each, per step"
          + (" (other CPUs busy)" if args.busy else ""))  # fmt: skip
    print("| loop | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    medians = {}
    for loop, runs in rows.items():
        medians[loop] = {k: statistics.median(run[k] for run in runs) for k in keys}
        cells = " | ".join(f"{medians[loop][k]:.3g}" for k in keys)
        print(f"| {LOOPS[loop]} | {cells} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"runs": rows, "medians": medians, "busy": args.busy}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
