"""``hookloop bench``: what the training loop's bookkeeping costs on this machine.

Side by side in one process run, each measurement runs a bare loop (the floor), hookloop, the
pure-Python detectron2-semantics reference (``hookloop._d2_reference``) and detectron2 itself
when it is importable, in repetitions that rotate their order; the table gives medians over
the repetitions, and every cost or ratio is formed within one repetition before the median is
taken. The sections:

- ``dispatch``: ``TrainerBase.train`` with a no-op ``run_step``, with no hooks, ``K`` hooks
  that override nothing, and ``K`` hooks that override ``before_step``/``after_step``;
  ns per iteration over a bare ``for`` loop calling ``run_step``.
- ``stack``: ``SimpleTrainer`` on a one-parameter model with IterationTimer + LRScheduler +
  PeriodicWriter([printer, JSON, TensorBoard]) at period 20 and 1; µs per iteration over the
  same model step without bookkeeping.
- ``mlp``: the tiny MLP of :mod:`hookloop.bench.tiny_mlp` on ``--device``, trained by each
  engine's ``SimpleTrainer``: with no hooks, with the default stack at period 20 (torch's
  MultiStepLR), and with that stack on the engine's own ``LRMultiplier`` schedule; steps/s
  as a fraction of a hand-written loop's that makes the same model calls, and the default
  stack's also as a fraction of a hand-written loop that does its own bookkeeping
  (``scheduler.step()`` every step, the losses read and one line logged every 20 steps).
  Timed in paired turns (:mod:`hookloop.bench.paired`): every loop in a process of its own,
  the processes taking turns of 20 steps, the ratios formed within each round. Wall time,
  which is what a user waits for: the training thread's CPU time would leave out hookloop's
  writer threads, the work hookloop moves off that thread.
- ``storage``: ``put_scalar`` into a history of 1 million entries (evicting, and not), and a
  storage filled for 1 million iterations × 5 scalars (RSS growth).
- ``hook`` (with ``--hook module:Class``): that hook's cost per iteration, on the tiny MLP's
  ``SimpleTrainer``, over the same trainer without it and over the hand-written loop.

The measuring code is :mod:`hookloop.bench.overhead`'s, which ``benches/bench_overhead.py``
runs in full. A debug build is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["add_arguments", "run"]

SECTIONS = ("dispatch", "stack", "mlp", "storage", "hook")
ENGINES = ("hl", "ref", "d2")
COLUMNS = {"hl": "hookloop", "ref": "reference", "d2": "detectron2"}


@dataclass
class Sizes:
    """Iterations per timed run and repetitions, per section."""

    hooks: int = 16
    dispatch_n: int = 200_000
    repeats: int = 9
    stack_n: Dict[int, int] = field(default_factory=lambda: {20: 1_000, 1: 300})
    stack_repeats: int = 15
    # paired turns (hookloop.bench.paired): windows of 20 steps (one write of the stack at
    # period 20 each), every process of every loop once per round; ratios are formed within
    # a round, over the mean of each loop's processes (their own speeds differ by up to 3%)
    mlp_window: int = 20
    mlp_rounds: int = 300
    mlp_warmup: int = 5
    mlp_replicas: int = 3
    put_fills: Tuple[int, ...] = (0, 1_000_000)
    put_n: int = 30_000
    put_n_ref_evict: int = 1_000
    mem_iters: int = 1_000_000
    mem_iters_ref: int = 1_000_000
    hook_n: int = 2_000
    hook_repeats: int = 9
    # the default stack's writers; without the tensorboard package (the reference's and
    # detectron2's TensorBoard writer need it) every engine runs without TensorBoard
    writers: Tuple[str, ...] = ("printer", "json", "tb")

    @classmethod
    def full(cls, hooks: int) -> Sizes:
        return cls(hooks=hooks)

    @classmethod
    def quick(cls, hooks: int) -> Sizes:
        """About 30 s on a laptop core."""
        return cls(
            hooks=hooks,
            dispatch_n=50_000,
            repeats=5,
            stack_n={20: 300, 1: 100},
            stack_repeats=5,
            mlp_rounds=30,
            mlp_warmup=3,
            mlp_replicas=2,
            put_n=10_000,
            put_n_ref_evict=200,
            mem_iters_ref=100_000,
            hook_n=500,
            hook_repeats=5,
        )

    @classmethod
    def smoke(cls, hooks: int) -> Sizes:
        """For the tests: every code path in a few seconds, no meaningful numbers."""
        return cls(
            hooks=hooks,
            dispatch_n=200,
            repeats=1,
            stack_n={20: 25, 1: 5},
            stack_repeats=1,
            mlp_window=5,
            mlp_rounds=2,
            mlp_warmup=1,
            mlp_replicas=1,
            put_fills=(0, 2_000),
            put_n=100,
            put_n_ref_evict=20,
            mem_iters=2_000,
            mem_iters_ref=1_000,
            hook_n=25,
            hook_repeats=1,
        )

    def overhead_config(self) -> Any:
        """The storage section's sizes, as :class:`hookloop.bench.overhead.Config`."""
        from hookloop.bench import overhead

        return overhead.Config(
            repeats=self.repeats,
            put_fills=self.put_fills,
            put_max_length=max(self.put_fills),
            put_big_max_length=4 * max(self.put_fills),
            put_n=self.put_n,
            put_n_ref_evict=self.put_n_ref_evict,
            mem_iters=self.mem_iters,
            mem_iters_ref=self.mem_iters_ref,
        )


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class Figure:
    """The median over repetitions and the best repetition (the lowest cost, or the highest
    throughput); for the paired tiny-MLP ratios also a 95% interval of the median (over the
    processes and the rounds: ``paired.ratio_ci``)."""

    median: float
    best: float
    ci95: Optional[Tuple[float, float]] = None

    @classmethod
    def cost(cls, values: Sequence[float]) -> Figure:
        return cls(statistics.median(values), min(values))

    @classmethod
    def throughput(
        cls, values: Sequence[float], ci95: Optional[Tuple[float, float]] = None
    ) -> Figure:
        return cls(statistics.median(values), max(values), ci95)


@dataclass
class Row:
    section: str
    what: str
    unit: str
    n: str
    bare: Optional[Figure] = None
    figures: Dict[str, Figure] = field(default_factory=dict)  # by engine: hl, ref, d2
    higher_is_better: bool = False
    note: str = ""
    target: str = ""  # the goal, as the table shows it
    target_value: Optional[float] = None  # hookloop's median must reach it

    @property
    def met(self) -> Optional[bool]:
        """Whether hookloop's median reaches ``target_value`` (at least it when higher is
        better, at most it otherwise)."""
        hl = self.figures.get("hl")
        if self.target_value is None or hl is None:
            return None
        if self.higher_is_better:
            return hl.median >= self.target_value
        return hl.median <= self.target_value

    @property
    def settled(self) -> Optional[bool]:
        """Whether hookloop's 95% interval lies wholly on one side of ``target_value`` (None
        without an interval or a target)."""
        hl = self.figures.get("hl")
        if self.target_value is None or hl is None or hl.ci95 is None:
            return None
        lo, hi = hl.ci95
        return not lo < self.target_value < hi

    @property
    def ratio(self) -> Optional[float]:
        """reference / hookloop, for costs of at least one unit (under one, hookloop's figure
        is noise and so would the ratio be)."""
        hl, rf = self.figures.get("hl"), self.figures.get("ref")
        if self.higher_is_better or hl is None or rf is None or hl.median < 1.0:
            return None
        return rf.median / hl.median

    def as_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {
            "section": self.section,
            "what": self.what,
            "unit": self.unit,
            "n": self.n,
            "higher_is_better": self.higher_is_better,
            "bare": None if self.bare is None else asdict(self.bare),
        }
        for impl, column in COLUMNS.items():
            fig = self.figures.get(impl)
            d[column] = None if fig is None else asdict(fig)
        d["reference_over_hookloop"] = self.ratio
        d["note"] = self.note
        d["target"] = self.target
        d["target_value"] = self.target_value
        d["met"] = self.met
        d["settled"] = self.settled
        return d


def _fmt(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return str(x) if x else "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.3f}"


def _cell(fig: Optional[Figure]) -> str:
    if fig is None:
        return "—"
    if fig.ci95 is not None:
        lo, hi = fig.ci95
        return f"{fig.median:.3f} ({lo:.3f}–{hi:.3f})"
    return f"{_fmt(fig.median)} ({_fmt(fig.best)})"


def _met(row: Row) -> str:
    verdict = {None: "", True: "yes", False: "**no**"}[row.met]
    return verdict + (", interval spans it" if row.settled is False else "")


def format_table(rows: Sequence[Row], engines: Sequence[str]) -> str:
    """A markdown table: median (best) per column, or median (95% interval) for the paired
    ratios."""
    heads = ["section", "measurement", "unit", "bare loop"] + [COLUMNS[e] for e in engines]
    heads += ["ref/hookloop", "n × repeats", "target", "met"]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        cells = [r.section, r.what + (f" — {r.note}" if r.note else ""), r.unit, _cell(r.bare)]
        cells += [_cell(r.figures.get(e)) for e in engines]
        cells += ["—" if r.ratio is None else f"{r.ratio:,.1f}×", r.n, r.target]
        cells.append(_met(r))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# sections


def _measure(variants: Dict[str, Callable[[], float]], repeats: int) -> Dict[str, List[float]]:
    """One untimed run of each variant (first calls allocate, compile, fill caches), then
    ``repeats`` interleaved timed ones."""
    from hookloop.bench import overhead

    for f in variants.values():
        f()
    return overhead._interleaved(variants, repeats)


def _writer_names(s: Sizes) -> str:
    names = {"printer": "printer", "json": "JSON", "tb": "TensorBoard"}
    return ", ".join(names[w] for w in s.writers) or "no writers"


def _diffs(a: Sequence[float], b: Sequence[float]) -> Figure:
    """A cost over a floor measured in the same repetitions."""
    return Figure.cost([x - y for x, y in zip(a, b)])


def _dispatch(s: Sizes, engines: Sequence[str]) -> List[Row]:
    from hookloop.bench import overhead

    n, k = s.dispatch_n, s.hooks
    variants: Dict[str, Callable[[], float]] = {}
    first: Any = None
    for impl in engines:
        e = overhead.engine(impl)

        class NoOp(e.TrainerBase):  # type: ignore[misc, name-defined]
            def run_step(self) -> None:
                pass

        class StepHook(e.HookBase):  # type: ignore[misc, name-defined]
            def before_step(self) -> None:
                pass

            def after_step(self) -> None:
                pass

        t0, tk, ts = NoOp(), NoOp(), NoOp()
        tk.register_hooks([e.HookBase() for _ in range(k)])
        ts.register_hooks([StepHook() for _ in range(k)])
        first = first or t0
        for name, t in (("0", t0), ("k", tk), ("s", ts)):
            variants[impl + name] = _train_n(t, n)

    def bare() -> float:
        run_step = first.run_step
        t0 = overhead.perf_ns()
        for _ in range(n):
            run_step()
        return (overhead.perf_ns() - t0) / n

    res = _measure({"bare": bare, **variants}, s.repeats)
    nn = f"{n:,} × {s.repeats}"
    rows = [
        Row("dispatch", "TrainerBase.train, no hooks, over a bare `for` loop", "ns/iter", nn,
            Figure.cost(res["bare"]), {e: _diffs(res[e + "0"], res["bare"]) for e in engines},
            note="bare loop column: the floor itself"),
        Row("dispatch", f"{k} HookBase() that override nothing, over no hooks", "ns/iter", nn,
            figures={e: _diffs(res[e + "k"], res[e + "0"]) for e in engines}),
        Row("dispatch", f"{k} hooks overriding before_step and after_step (empty), over no "
            "hooks", "ns/iter", nn, figures={e: _diffs(res[e + "s"], res[e + "0"])
                                             for e in engines}),
    ]  # fmt: skip
    return rows


def _train_n(t: Any, n: int) -> Callable[[], float]:
    from hookloop.bench import overhead

    def f() -> float:
        t0 = overhead.perf_ns()
        t.train(0, n)
        return (overhead.perf_ns() - t0) / n

    return f


def _stack(s: Sizes, engines: Sequence[str], tmpdir: str) -> List[Row]:
    from hookloop.bench import overhead

    rows = []
    for period, n in sorted(s.stack_n.items(), reverse=True):
        variants: Dict[str, Tuple[Any, ...]] = {"bare": ("bare", period)}
        variants.update({e: (e, period, s.writers) for e in engines})
        cfg = overhead.Config(stack_repeats=s.stack_repeats)
        runs = overhead._stack_variants(cfg, n, variants, tmpdir)
        bare = [r.wall for r in runs["bare"]]
        rows.append(
            Row(
                "stack",
                f"IterationTimer + LRScheduler + PeriodicWriter({_writer_names(s)}; "
                f"period {period}) + SimpleTrainer metrics, over the bare model step",
                "µs/iter",
                f"{n:,} × {s.stack_repeats}",
                Figure.cost(bare),
                {e: _diffs([r.wall for r in runs[e]], bare) for e in engines},
                note="bare loop column: the one-parameter model's step itself",
            )
        )
    return rows


def _mlp_variants(engines: Sequence[str]) -> List[Any]:
    """The loops of the mlp section (:class:`hookloop.bench.paired.Variant`): the two
    hand-written loops, then per engine its trainer with no hooks, with the default stack, and
    with the stack on the engine's own schedule where that imports (detectron2's needs
    fvcore)."""
    from hookloop.bench import paired, tiny_mlp

    return [paired.HAND, paired.HAND_BOOKKEEPING] + [
        paired.Variant(impl, hooks)
        for impl in engines
        for hooks in ("none", "stack", "native")
        if hooks != "native" or tiny_mlp.native_available(impl)
    ]


def _mlp(s: Sizes, engines: Sequence[str], device: Any) -> List[Row]:
    from hookloop.bench import overhead, paired

    variants = _mlp_variants(engines)
    res = paired.run(
        variants, device=device, window=s.mlp_window, rounds=s.mlp_rounds,
        warmup=s.mlp_warmup, replicas=s.mlp_replicas, writers=s.writers,
        tick=lambda: overhead.progress(),
    )  # fmt: skip

    def ratios(floor: Any, hooks: str) -> Dict[str, Figure]:
        """steps/s of each engine's loop over the floor's, formed per round."""
        out = {}
        for e in engines:
            v = paired.Variant(e, hooks)
            if v in res:
                ci = paired.ratio_ci(res, floor, v)
                out[e] = Figure.throughput(paired.ratios(res, floor, v), ci)
        return out

    def steps_per_s(floor: Any) -> Figure:
        return Figure.throughput([s.mlp_window / t for t in paired.windows(res, floor)])

    nn = f"{s.mlp_window} steps × {s.mlp_rounds} turns × {s.mlp_replicas} processes"
    what = "tiny MLP (32→64→1, batch 16, SGD momentum, 4 losses) on " + str(device)
    writers = _writer_names(s)

    def stack(sched: str) -> str:
        return (
            f"SimpleTrainer + IterationTimer + LRScheduler({sched}) + "
            f"PeriodicWriter({writers}; period 20)"
        )

    hand, bk = "× hand loop's steps/s", "× bookkeeping hand loop's steps/s"
    h, hb = paired.HAND, paired.HAND_BOOKKEEPING

    def goal(hooks: str, floor: Any) -> Dict[str, Any]:
        value = paired.GOALS[(hooks, floor)]
        return {"target": f"≥ {value:g}", "target_value": value}

    return [
        Row("mlp", f"{what}: SimpleTrainer, no hooks", hand, nn, steps_per_s(h),
            ratios(h, "none"), True, "bare loop column: the hand-written loop's steps/s",
            **goal("none", h)),
        Row("mlp", f"{what}: " + stack("MultiStepLR"), hand, nn, None,
            ratios(h, "stack"), True, **goal("stack", h)),
        Row("mlp", f"{what}: the same, over a hand-written loop with the user's own "
            "bookkeeping: MultiStepLR.step() every step; the total loss kept every step, their "
            "mean read with .item() and logged (one line to a NullHandler) every 20 steps", bk,
            nn, steps_per_s(hb), ratios(hb, "stack"), True,
            "bare loop column: the bookkeeping loop's steps/s", **goal("stack", hb)),
        Row("mlp", f"{what}: " + stack("LRMultiplier(WarmupParamScheduler("
            "MultiStepParamScheduler))"), hand, nn, None, ratios(h, "native"), True,
            "MultiStepLR's LRs, from each engine's own schedule classes (the reference's are "
            "detectron2's and fvcore's, in Python)", **goal("native", h)),
    ]  # fmt: skip


def _storage(s: Sizes) -> List[Row]:
    from hookloop.bench import overhead

    cfg = s.overhead_config()
    out = []
    gc.collect()
    mem = overhead.bench_memory(cfg)  # first, while the heap is fresh
    overhead.progress()
    gc.collect()
    for r in mem + overhead.bench_put_scalar(cfg):
        figs = {}
        for impl, stat in (("hl", r.hookloop), ("ref", r.reference)):
            if stat is not None:
                figs[impl] = Figure(stat.median, stat.min)
        out.append(Row("storage", r.what, r.unit, r.n, None, figs, note=r.note))
    return out


def _hook(
    s: Sizes, make_hook: Callable[[], Any], label: str, device: Any, tmpdir: str
) -> List[Row]:
    from hookloop.bench import tiny_mlp

    n = s.hook_n
    batches = tiny_mlp.make_batches(device)

    def trainer(extra: Sequence[Callable[[], Any]]) -> Callable[[], float]:
        def f() -> float:
            t = tiny_mlp.make_trainer("hl", device, batches, n, tmpdir, "none", extra=extra)
            return tiny_mlp.time_trainer(t, n)

        return f

    res = _measure(
        {
            "hand": lambda: tiny_mlp.time_hand(device, batches, n),
            "base": trainer(()),
            "with": trainer((make_hook,)),
        },
        s.hook_repeats,
    )
    us = {k: [t / n * 1e6 for t in v] for k, v in res.items()}
    nn = f"{n:,} × {s.hook_repeats}"
    return [
        Row("hook", f"{label}: its cost, SimpleTrainer + it over SimpleTrainer alone "
            f"(tiny MLP on {device})", "µs/iter", nn, None,
            {"hl": _diffs(us["with"], us["base"])}),
        Row("hook", f"SimpleTrainer + {label} over the hand-written loop", "µs/iter", nn,
            Figure.cost(us["hand"]), {"hl": _diffs(us["with"], us["hand"])},
            note="bare loop column: the hand-written loop's µs per step"),
    ]  # fmt: skip


def _ticks(section: str, s: Sizes, engines: Sequence[str]) -> int:
    """How many timed runs a section makes (the progress bar's total)."""
    if section == "dispatch":
        return (1 + 3 * len(engines)) * s.repeats
    if section == "stack":
        return len(s.stack_n) * (1 + len(engines)) * s.stack_repeats
    if section == "mlp":
        return s.mlp_rounds
    if section == "storage":
        cases = len(s.put_fills) + sum(f >= max(s.put_fills) for f in s.put_fills)
        return 1 + 2 * cases * s.repeats
    return 3 * s.hook_repeats


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Points ``overhead.progress`` at a tqdm bar on stderr (a plain line when tqdm is not
    importable); yields a function that names the running section. When stderr is not a
    terminal (a log file, CI), a line per section and per tenth done instead, each ended:
    no carriage returns in the log."""
    from hookloop.bench import overhead

    saved = overhead.progress
    if not enabled:
        yield lambda name: None
        return
    tty = sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and tty:
        bar = tqdm(total=total, unit="run", file=sys.stderr, leave=False, dynamic_ncols=True)
        overhead.progress = lambda: bar.update(1)
        try:
            yield lambda name: bar.set_description(name)
        finally:
            overhead.progress = saved
            bar.close()
        return
    state: Dict[str, Any] = {"done": 0, "name": "", "shown": None}

    def show() -> None:
        pct = 100 * state["done"] // max(total, 1)
        if tty:
            print(f"\rhookloop bench: {state['name']:<8} {pct:3d}%", end="", file=sys.stderr,
                  flush=True)  # fmt: skip
        elif state["shown"] != (state["name"], pct // 10):
            state["shown"] = (state["name"], pct // 10)
            print(f"hookloop bench: {state['name']:<8} {pct:3d}%", file=sys.stderr, flush=True)

    def tick() -> None:
        state["done"] += 1
        show()

    def name(section: str) -> None:
        state["name"] = section
        show()

    overhead.progress = tick
    try:
        yield name
    finally:
        overhead.progress = saved
        if tty:
            print(file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``hookloop bench``."""
    p.add_argument("--quick", action="store_true", help="smaller runs (about 30 s)")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the machine as JSON")
    p.add_argument(
        "--device", default="cpu", help="device of the tiny-MLP and --hook runs: cpu or cuda"
    )
    p.add_argument(
        "--hook", metavar="MODULE:CLASS", help="also measure this hook's cost per iteration"
    )
    p.add_argument(
        "--hook-args", metavar="JSON", help="the hook's arguments: a JSON object or array"
    )
    p.add_argument(
        "--only",
        metavar="SECTIONS",
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)",
    )
    p.add_argument("--hooks", type=int, default=16, help="K, the hook count of `dispatch`")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # tiny sizes for the tests: every code path in seconds
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)


def _hook_factory(p: argparse.ArgumentParser, spec: str, raw: Optional[str]) -> Callable[[], Any]:
    """``module:Class`` and its JSON arguments as a function that makes a new hook, checked
    once here so that a mistake is a usage error, not a traceback mid-run."""
    from hookloop.engine.train_loop import HookBase

    mod_name, sep, cls_name = spec.partition(":")
    if not sep or not mod_name or not cls_name:
        p.error(f"--hook {spec!r}: expected MODULE:CLASS, e.g. mypkg.hooks:GradNorm")
    args: List[Any] = []
    kwargs: Dict[str, Any] = {}
    if raw is not None:
        try:
            value = json.loads(raw)
        except ValueError as e:
            p.error(f"--hook-args is not valid JSON: {e}")
        if isinstance(value, dict):
            kwargs = value
        elif isinstance(value, list):
            args = value
        else:
            p.error("--hook-args must be a JSON object (keyword arguments) or array (positional)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would, for the user's own modules
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        p.error(f"--hook {spec!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}")
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type) or not issubclass(cls, HookBase):
        what = "not found" if cls is None else f"a {type(cls).__name__}, not a HookBase subclass"
        p.error(f"--hook {spec!r}: {cls_name!r} in {mod_name!r} is {what}")

    def make() -> Any:
        return cls(*args, **kwargs)

    try:
        make()
    except Exception as e:
        p.error(f"--hook {spec!r}: {cls_name}({raw or ''}) failed: {type(e).__name__}: {e}")
    return make


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """``hookloop bench`` with parsed ``args``; ``p`` reports usage errors."""
    import torch

    import hookloop
    from hookloop.bench import overhead

    if args.only:
        sections = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [x for x in sections if x not in SECTIONS]
        if unknown or not sections:
            p.error(f"--only {args.only!r}: sections are {', '.join(SECTIONS)}")
    else:
        sections = list(SECTIONS)
    if args.hook is None:
        if args.hook_args is not None:
            p.error("--hook-args needs --hook")
        if args.only and "hook" in sections:
            p.error("--only hook needs --hook MODULE:CLASS")
        sections = [x for x in sections if x != "hook"]
    if not 1 <= args.hooks <= 10_000:
        p.error(f"--hooks must be between 1 and 10000, got {args.hooks}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as e:
        p.error(f"--device {args.device!r}: {e}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device!r}: must be cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device!r}: CUDA is not available here")
    make_hook = _hook_factory(p, args.hook, args.hook_args) if args.hook else None
    if hookloop.BUILD_PROFILE != "release":
        p.error(
            f"refusing to benchmark: hookloop._core is a {hookloop.BUILD_PROFILE!r} build; "
            "rebuild with `pip install -e .` or `maturin develop --release`"
        )

    engines = [e for e in ENGINES if e != "d2" or overhead.detectron2_available()]
    torch.set_num_threads(1)  # scalar ops never use the intra-op pool; one thread is less noise
    if args.smoke:
        sizes = Sizes.smoke(args.hooks)
    else:
        sizes = Sizes.quick(args.hooks) if args.quick else Sizes.full(args.hooks)
    if importlib.util.find_spec("tensorboard") is None:
        sizes.writers = ("printer", "json")
    info = overhead.machine_info(["-m", "hookloop", "bench"] + list(args.argv))
    info["command"] = "hookloop bench " + " ".join(args.argv)
    info["device"] = str(device)
    if device.type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(device)
    info["detectron2"] = _detectron2_version() if "d2" in engines else None
    for k, v in info.items():
        print(f"{k}: {v}")
    print(flush=True)

    tmpdir = tempfile.mkdtemp(prefix="hookloop-bench-")
    rows: List[Row] = []
    t_start = time.perf_counter()
    total = sum(_ticks(x, sizes, engines) for x in sections)
    try:
        with overhead.printer_logging(), _progress_bar(total, not args.no_progress) as name:
            for section in sections:
                name(section)
                gc.collect()
                if section == "dispatch":
                    rows += _dispatch(sizes, engines)
                elif section == "stack":
                    rows += _stack(sizes, engines, tmpdir)
                elif section == "mlp":
                    rows += _mlp(sizes, engines, device)
                elif section == "storage":
                    rows += _storage(sizes)
                else:
                    assert make_hook is not None
                    rows += _hook(sizes, make_hook, args.hook, device, tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    info["seconds"] = round(time.perf_counter() - t_start, 1)

    print(format_table(rows, engines))
    print()
    judged = [r.met for r in rows if r.met is not None]
    if judged:
        open_ = sum(r.settled is False for r in rows)
        spans = f"; {open_} of them with an interval that spans the target" if open_ else ""
        print(f"targets (hookloop's median): {sum(judged)} of {len(judged)} met{spans}")
    print(
        f"total: {info['seconds']} s. Medians over interleaved repetitions (best in "
        "parentheses; for the tiny MLP's ratios, the 95% interval over its processes and "
        "rounds); costs over a floor and steps/s ratios are formed within each "
        "repetition; ref/hookloop is the ratio of the two medians. Figures from a busy "
        "machine are noisy: rerun before quoting one."
    )
    if "d2" not in engines:
        print("detectron2 is not importable here: its column is left out.")
    if "tb" not in sizes.writers:
        print("tensorboard is not installed: the default stack runs without TensorBoard.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "machine": info,
                    "sizes": asdict(sizes),
                    "engines": [COLUMNS[e] for e in engines],
                    "rows": [r.as_dict() for r in rows],
                },
                f,
                indent=1,
                default=str,
            )
    return 0


def _detectron2_version() -> str:
    try:
        import detectron2

        return str(getattr(detectron2, "__version__", "unknown version"))
    except Exception:
        return "unknown version"
