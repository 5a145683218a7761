"""The tiny MLP of issue 11 in paired turns (:mod:`lab.paired`), with each ratio's
95% confidence interval: the tiny-MLP figures of docs/performance.md.

    python benches/bench_mlp_paired.py                 # 400 rounds, 4 processes a loop: ~4 min
    python benches/bench_mlp_paired.py --rounds 50     # a quick look
    python benches/bench_mlp_paired.py --period-1      # the period-1 stack, each writer alone

Every loop trains in ``--replicas`` processes of its own and the processes take turns of
``--window`` steps, in a new random order each round; each ratio of steps/s is formed within a
round (a loop's time there is the mean over its processes), and the table gives the median
over the rounds with a bootstrap interval that resamples the processes and the rounds. The
default loops end with the seeds' stack (the default stack and cvpods' and xmodaler's
every-step writers), whose ratio to the default stack is printed below the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from lab import paired

VARIANTS = {
    "hand-written loop (model calls only)": paired.HAND,
    "hand loop with its own bookkeeping": paired.HAND_BOOKKEEPING,
    "SimpleTrainer, no hooks": paired.Variant("hl", "none"),
    "default stack (MultiStepLR)": paired.Variant("hl", "stack"),
    "default stack, native schedule": paired.Variant("hl", "native"),
    # cvpods' and xmodaler's hooks: the default stack and PeriodicWriter([JSON, TB], 1) with
    # window_size=1 (tiny_mlp.make_trainer's "seeds")
    "the seeds' stack: default stack + every-step JSON and TensorBoard (window 1)": (
        paired.Variant("hl", "seeds")
    ),
}

#: What every-step writing costs in time: the seeds' stack over the default stack, formed
#: within each round like the ratios over the hand loops.
STACK, SEEDS = paired.Variant("hl", "stack"), paired.Variant("hl", "seeds")

#: ``--period-1``: the default stack writing every iteration, and each writer alone, in time
#: (what bench_mlp_instructions.py counts in instructions).
PERIOD_1 = {
    "hand-written loop (model calls only)": paired.HAND,
    "hand loop with its own bookkeeping": paired.HAND_BOOKKEEPING,
    "default stack at period 1": paired.Variant("hl", "stack", 1),
    "… at period 1, CommonMetricPrinter only": paired.Variant("hl", "stack", 1, ("printer",)),
    "… at period 1, JSONWriter only": paired.Variant("hl", "stack", 1, ("json",)),
    "… at period 1, TensorboardXWriter only": paired.Variant("hl", "stack", 1, ("tb",)),
}


def run(
    rounds: int, window: int, warmup: int, replicas: int, variants: Dict[str, Any] = VARIANTS
) -> Dict[str, Any]:
    """The figures as a dict: µs per step (median window), and per floor the median ratio
    with its 95% interval and, where issue 11 sets one, the goal."""
    t0 = time.perf_counter()
    res = paired.run(
        list(variants.values()), window=window, rounds=rounds, warmup=warmup, replicas=replicas
    )
    out: Dict[str, Any] = {
        "rounds": rounds, "window": window, "replicas": replicas, "variants": {},
    }  # fmt: skip
    for name, v in variants.items():
        row: Dict[str, Any] = {
            "us_per_step": statistics.median(paired.windows(res, v)) / window * 1e6,
            # each process's own median: how far apart the processes of one loop are
            "us_per_step_by_process": [statistics.median(w) / window * 1e6 for w in res[v]],
        }
        for floor, key in ((paired.HAND, "x_hand"), (paired.HAND_BOOKKEEPING, "x_bookkeeping")):
            r = paired.ratios(res, floor, v)
            # the goals are set for the default period and writers
            default = v.impl == "hl" and v == paired.Variant(v.impl, v.hooks)
            goal = paired.GOALS.get((v.hooks, floor)) if default else None
            row[key] = {"median": statistics.median(r), "ci95": paired.ratio_ci(res, floor, v),
                        "goal": goal}  # fmt: skip
        out["variants"][name] = row
    if STACK in res and SEEDS in res:
        out["seeds_x_stack"] = {"median": statistics.median(paired.ratios(res, STACK, SEEDS)),
                                "ci95": paired.ratio_ci(res, STACK, SEEDS)}  # fmt: skip
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _cell(fig: Dict[str, Any]) -> str:
    lo, hi = fig["ci95"]
    cell = f"{fig['median']:.3f} ({lo:.3f}–{hi:.3f})"
    if fig["goal"] is not None:
        met = "met" if fig["median"] >= fig["goal"] else "**missed**"
        sure = "" if (lo >= fig["goal"] or hi < fig["goal"]) else ", interval spans it"
        cell += f" ≥ {fig['goal']:g}: {met}{sure}"
    return cell


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--replicas", type=int, default=4, help="processes per loop")
    p.add_argument("--json", metavar="OUT")
    p.add_argument(
        "--period-1", action="store_true", help="the stack at period 1 and each writer alone"
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.window < 1 or args.replicas < 1 or args.warmup < 0:
        p.error("--rounds, --window and --replicas must be positive, --warmup not negative")
    variants = PERIOD_1 if args.period_1 else VARIANTS
    out = run(args.rounds, args.window, args.warmup, args.replicas, variants)
    lines: List[str] = [
        "| loop | µs/step (each process) | × hand (95% interval) | "
        "× hand with bookkeeping (95% interval) |",
        "|---|---|---|---|",
    ]
    for name, row in out["variants"].items():
        each = ", ".join(f"{u:.0f}" for u in row["us_per_step_by_process"])
        lines.append(f"| {name} | {row['us_per_step']:.1f} ({each}) | {_cell(row['x_hand'])} | "
                     f"{_cell(row['x_bookkeeping'])} |")  # fmt: skip
    print("\n".join(lines))
    if "seeds_x_stack" in out:
        fig = out["seeds_x_stack"]
        lo, hi = fig["ci95"]
        print(f"\nthe seeds' stack × the default stack's steps/s: {fig['median']:.3f} "
              f"({lo:.3f}–{hi:.3f})")  # fmt: skip
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{args.rounds} rounds of {args.window} steps, {args.replicas} processes per loop, "
          f"{out['seconds']} s; "
          f"load average at the end: {load}")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
