"""The tiny MLP of issue 11 in paired turns (:mod:`hookloop.bench.paired`), with each ratio's
95% confidence interval: the figures RESULTS.md quotes for the tiny-MLP goals.

    python benches/bench_mlp_paired.py                 # 600 rounds of 20 steps, ~70 s
    python benches/bench_mlp_paired.py --rounds 50     # a quick look

Every loop trains in a process of its own and the processes take turns of ``--window`` steps,
rotating their order each round; each ratio of steps/s is formed within a round, and the
table gives the median over the rounds with a bootstrap interval of that median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from hookloop.bench import paired

VARIANTS = {
    "hand-written loop (model calls only)": paired.HAND,
    "hand loop with its own bookkeeping": paired.HAND_BOOKKEEPING,
    "SimpleTrainer, no hooks": paired.Variant("hl", "none"),
    "default stack (MultiStepLR)": paired.Variant("hl", "stack"),
    "default stack, native schedule": paired.Variant("hl", "native"),
}


def run(rounds: int, window: int, warmup: int) -> Dict[str, Any]:
    """The figures as a dict: µs per step (median window), and per floor the median ratio
    with its 95% interval and, where issue 11 sets one, the goal."""
    t0 = time.perf_counter()
    res = paired.run(list(VARIANTS.values()), window=window, rounds=rounds, warmup=warmup)
    out: Dict[str, Any] = {"rounds": rounds, "window": window, "variants": {}}
    for name, v in VARIANTS.items():
        row: Dict[str, Any] = {"us_per_step": statistics.median(res[v]) / window * 1e6}
        for floor, key in ((paired.HAND, "x_hand"), (paired.HAND_BOOKKEEPING, "x_bookkeeping")):
            r = paired.ratios(res, floor, v)
            goal = paired.GOALS.get((v.hooks, floor)) if v.impl == "hl" else None
            row[key] = {"median": statistics.median(r), "ci95": paired.median_ci(r),
                        "goal": goal}  # fmt: skip
        out["variants"][name] = row
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
    p.add_argument("--rounds", type=int, default=600)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.window < 1 or args.warmup < 0:
        p.error("--rounds and --window must be positive, --warmup not negative")
    out = run(args.rounds, args.window, args.warmup)
    lines: List[str] = [
        "| loop | µs/step | × hand (95% interval) | × hand with bookkeeping (95% interval) |",
        "|---|---|---|---|",
    ]
    for name, row in out["variants"].items():
        lines.append(f"| {name} | {row['us_per_step']:.1f} | {_cell(row['x_hand'])} | "
                     f"{_cell(row['x_bookkeeping'])} |")  # fmt: skip
    print("\n".join(lines))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{args.rounds} rounds of {args.window} steps, {out['seconds']} s; "
          f"load average at the end: {load}")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
