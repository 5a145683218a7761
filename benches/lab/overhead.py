"""Training-loop overhead: hookloop against a pure-Python detectron2-style baseline.

The measurements behind ``benches/bench_overhead.py`` (a thin wrapper that calls :func:`main`),
and helpers the other scripts of ``benches/`` share. Everything is measured side by side in one
process: each repeat runs every variant once, in a rotating order, so both sides see the same
machine noise; the table gives the median and the minimum over repeats and the ratio
reference / hookloop of the medians. The baseline is ``compat.reference_engine``
(``tests/compat/reference_engine.py``: detectron2's semantics, our own code; the tests' oracle
too, as ``compat.d2``). The garbage collector is off inside timed regions (as ``timeit``
does). A debug build of hookloop is refused. See ``benches/README.md`` for what each section
measures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import itertools
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import hookloop
import numpy as np
import torch
from compat import reference_engine as ref
from hookloop.engine import hooks as hl_hooks
from hookloop.engine import train_loop as hl_loop
from hookloop.utils import events as hl_events

perf_ns = time.perf_counter_ns
thread_ns = time.thread_time_ns

# ---------------------------------------------------------------------------------------------
# configuration


@dataclass
class Config:
    """Sizes of every measurement. ``full()`` is what RESULTS.md quotes."""

    repeats: int = 9
    # 1. put_scalar
    put_fills: Tuple[int, ...] = (0, 100_000, 1_000_000, 2_000_000)
    put_max_length: int = 1_000_000  # fvcore's default: evicts once full
    put_big_max_length: int = 4_000_000  # large enough never to evict
    put_n: int = 30_000  # calls per repeat
    put_n_ref_evict: int = 1_000  # reference calls per repeat while evicting (O(len) each)
    # 2. memory
    mem_iters: int = 1_000_000
    mem_iters_ref: int = 1_000_000
    # 3. loop
    loop_n: int = 200_000
    # 4. write_metrics
    wm_n: int = 5_000
    # 5. writers
    writer_n: int = 200
    writer_prefill: int = 1_000
    # 6. default stack
    # many short runs: a burst of load from a neighbour spoils one repeat, not the median
    stack_n: Dict[int, int] = field(default_factory=lambda: {20: 1_000, 1: 300})
    stack_repeats: int = 25

    @classmethod
    def full(cls) -> Config:
        return cls()

    @classmethod
    def quick(cls) -> Config:
        return cls(
            repeats=3,
            put_n=10_000,
            put_n_ref_evict=200,
            mem_iters=200_000,
            mem_iters_ref=100_000,
            loop_n=50_000,
            wm_n=1_000,
            writer_n=50,
            writer_prefill=1_000,
            stack_n={20: 200, 1: 100},
            stack_repeats=5,
        )

    @classmethod
    def tiny(cls) -> Config:
        """For the smoke test: every code path, no meaningful numbers."""
        return cls(
            repeats=1,
            put_fills=(0, 1_000, 5_000, 10_000),
            put_max_length=5_000,
            put_big_max_length=20_000,
            put_n=500,
            put_n_ref_evict=50,
            mem_iters=2_000,
            mem_iters_ref=1_000,
            loop_n=500,
            wm_n=50,
            writer_n=5,
            writer_prefill=30,
            stack_n={20: 45, 1: 12},
            stack_repeats=1,
        )


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class Stat:
    median: float
    min: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        return cls(statistics.median(values), min(values))

    @classmethod
    def over(cls, runs: Sequence[float], floor: Sequence[float]) -> Stat:
        """A cost over a floor measured in the same repeats: the median of the per-repeat
        differences, and the best run minus the best floor."""
        return cls(statistics.median([a - b for a, b in zip(runs, floor)]), min(runs) - min(floor))


@dataclass
class Row:
    section: str
    what: str
    unit: str
    hookloop: Optional[Stat]
    reference: Optional[Stat]
    n: str
    target: str = ""
    target_value: Optional[float] = None  # hookloop's median must be <= this
    note: str = ""

    @property
    def ratio(self) -> Optional[float]:
        # under one unit (ns, µs, MiB) hookloop's figure is noise, and so would the ratio be
        if self.hookloop is None or self.reference is None or self.hookloop.median < 1.0:
            return None
        return self.reference.median / self.hookloop.median

    @property
    def met(self) -> Optional[bool]:
        if self.target_value is None or self.hookloop is None:
            return None
        return self.hookloop.median <= self.target_value

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["met"] = self.met
        return d


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _fmt_stat(s: Optional[Stat]) -> str:
    return "—" if s is None else f"{_fmt(s.median)} ({_fmt(s.min)})"


def format_table(rows: Sequence[Row]) -> str:
    out = [
        "| # | measurement | unit | hookloop median (min) | reference median (min) "
        "| ref/hookloop | n × repeats | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "—" if r.ratio is None else f"{r.ratio:,.1f}×"
        met = {None: "", True: "yes", False: "**no**"}[r.met]
        what = r.what + (f" — {r.note}" if r.note else "")
        out.append(
            f"| {r.section} | {what} | {r.unit} | {_fmt_stat(r.hookloop)} "
            f"| {_fmt_stat(r.reference)} | {ratio} | {r.n} | {r.target} | {met} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# helpers


def _timed(fn: Callable[[], float]) -> float:
    """Runs one measurement with the collector off (as timeit does; run_all collects once
    before each section)."""
    gc.disable()
    try:
        return fn()
    finally:
        gc.enable()


# Called after every timed run of ``_interleaved`` (a script may point it at a progress bar); a
# no-op otherwise.
progress: Callable[[], None] = lambda: None  # noqa: E731


def _interleaved(variants: Dict[str, Callable[[], float]], repeats: int) -> Dict[str, List[float]]:
    """Each repeat runs every variant once, starting at a different one each time."""
    names = list(variants)
    out: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(_timed(variants[name]))
            progress()
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _human(n: int) -> str:
    return f"{n / 1e6:g}e6" if n >= 1_000_000 and n % 100_000 == 0 else f"{n:,}"


@contextlib.contextmanager
def printer_logging() -> Iterator[None]:
    """CommonMetricPrinter's loggers, on every side: enabled at INFO so every line is formatted
    and handed to a handler, which drops it (a NullHandler). Restored on exit."""
    saved = []
    # detectron2's own printer logs to "detectron2.utils.events"
    for name in dict.fromkeys(
        (hl_events.logger.name, ref.EVENTS_LOGGER, "detectron2.utils.events")
    ):
        lg = logging.getLogger(name)
        handler = logging.NullHandler()
        saved.append((lg, lg.level, lg.propagate, handler))
        lg.setLevel(logging.INFO)
        lg.propagate = False
        lg.addHandler(handler)
    try:
        yield
    finally:
        for lg, level, propagate, handler in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


# ---------------------------------------------------------------------------------------------
# 1. put_scalar


def _fill_hookloop(storage: Any, name: str, fill: int) -> None:
    put = storage.put_scalar
    for i in range(fill):
        put(name, 0.5 + (i % 97) * 1e-3, cur_iter=i)
    storage.iter = fill


def _fill_reference(storage: ref.EventStorage, name: str, fill: int, max_length: int) -> None:
    """The state ``fill`` puts would leave, built directly (a Python loop with eviction would
    take minutes). Every entry is the same tuple: ``list.pop(0)`` moves 8-byte pointers
    whatever they point to, so timing is unchanged and the list costs 8 bytes per entry."""
    storage.put_scalar(name, 0.5, cur_iter=0)
    if fill > 1:
        hb = storage.history(name)
        hb._data = [hb._data[0]] * min(fill, max_length)
        hb._count = fill
    storage.iter = fill


def _put_loop(get_storage: Callable[[], Any], vals: List[float]) -> float:
    put = get_storage().put_scalar
    t0 = perf_ns()
    for v in vals:
        put("loss", v)
    return (perf_ns() - t0) / len(vals)


def bench_put_scalar(cfg: Config) -> List[Row]:
    rows = []
    vals = [0.5 + (i % 101) * 1e-3 for i in range(max(cfg.put_n, cfg.put_n_ref_evict))]
    cases = []
    for fill in cfg.put_fills:
        cases.append((fill, cfg.put_max_length))
        if fill >= cfg.put_max_length:
            cases.append((fill, cfg.put_big_max_length))
    for fill, max_length in cases:
        evicts = fill >= max_length
        n_hl = cfg.put_n
        n_ref = cfg.put_n_ref_evict if evicts else cfg.put_n

        if fill == 0:
            # "from empty": a new storage each repeat
            s_hl: Any = lambda ml=max_length: hl_events.EventStorage(max_length=ml)  # noqa: E731
            s_ref: Any = lambda ml=max_length: ref.EventStorage(max_length=ml)  # noqa: E731
        else:
            hl_storage = hl_events.EventStorage(max_length=max_length)
            _fill_hookloop(hl_storage, "loss", fill)
            ref_storage = ref.EventStorage(max_length=max_length)
            _fill_reference(ref_storage, "loss", fill, max_length)
            s_hl = lambda s=hl_storage: s  # noqa: E731
            s_ref = lambda s=ref_storage: s  # noqa: E731

        res = _interleaved(
            {
                "hl": functools.partial(_put_loop, s_hl, vals[:n_hl]),
                "ref": functools.partial(_put_loop, s_ref, vals[:n_ref]),
            },
            cfg.repeats,
        )
        label = "default" if max_length == cfg.put_max_length else "large"
        held = min(fill, max_length)
        state = "evicting" if evicts else "no eviction"
        rows.append(
            Row(
                "1",
                f"put_scalar, fill {_human(fill)}, max_length {_human(max_length)} ({label}; "
                f"holds {_human(held)}, {state})",
                "ns/call",
                Stat.of(res["hl"]),
                Stat.of(res["ref"]),
                f"{n_hl:,} / {n_ref:,} × {cfg.repeats}",
                "≤ 150 ns flat",
                150.0,
            )
        )
    rows[0].note = "ns include the Python for-loop; n: hookloop / reference calls per repeat"
    return rows


# ---------------------------------------------------------------------------------------------
# 2. memory

_MEM_NAMES = ("loss_cls", "loss_box_reg", "loss_mask", "loss_rpn_cls", "loss_rpn_loc")


def _fill_memory(storage: Any, iters: int) -> None:
    put = storage.put_scalars
    for i in range(iters):
        storage.iter = i
        x = (i % 1009) * 1e-4  # five distinct floats per iteration, like five .item() results
        put(loss_cls=x + 1.0, loss_box_reg=x + 2.0, loss_mask=x + 3.0, loss_rpn_cls=x + 4.0,
            loss_rpn_loc=x + 5.0)  # fmt: skip


def _memory_growth(make: Callable[[], Any], iters: int) -> Tuple[int, float, Any]:
    gc.collect()
    before = _rss_bytes()
    storage = make()
    t0 = time.perf_counter()
    _fill_memory(storage, iters)
    seconds = time.perf_counter() - t0
    gc.collect()
    return _rss_bytes() - before, seconds, storage


def bench_memory(cfg: Config) -> List[Row]:
    mib = 1024.0 * 1024.0
    grown_hl, sec_hl, s = _memory_growth(hl_events.EventStorage, cfg.mem_iters)
    heap = s._heap_bytes()
    del s
    grown_ref, sec_ref, s = _memory_growth(ref.EventStorage, cfg.mem_iters_ref)
    del s
    gc.collect()
    rows = []
    note = f"hookloop's own count of its heap: {heap / mib:.1f} MiB; fill took {sec_hl:.2f} s"
    if cfg.mem_iters_ref == cfg.mem_iters:
        rows.append(
            Row(
                "2",
                f"RSS growth, {_human(cfg.mem_iters)} iterations × 5 scalars, one storage",
                "MiB",
                Stat(grown_hl / mib, grown_hl / mib),
                Stat(grown_ref / mib, grown_ref / mib),
                f"{_human(cfg.mem_iters)} × 5 × 1",
                "≤ 80 MiB",
                80.0,
                note + f" (reference {sec_ref:.2f} s)",
            )
        )
    else:
        rows.append(
            Row(
                "2",
                f"RSS growth, {_human(cfg.mem_iters)} iterations × 5 scalars, one storage",
                "MiB",
                Stat(grown_hl / mib, grown_hl / mib),
                None,
                f"{_human(cfg.mem_iters)} × 5 × 1",
                "≤ 80 MiB",
                80.0,
                note,
            )
        )
        rows.append(
            Row(
                "2",
                f"RSS growth, reference at a smaller N: {_human(cfg.mem_iters_ref)} iterations "
                "× 5 scalars (hookloop column: its figure scaled to this N)",
                "MiB",
                Stat(*(2 * [grown_hl / mib * cfg.mem_iters_ref / cfg.mem_iters])),
                Stat(grown_ref / mib, grown_ref / mib),
                f"{_human(cfg.mem_iters_ref)} × 5 × 1",
                "",
                None,
                f"reference fill took {sec_ref:.2f} s",
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------
# 3. loop overhead


class _HLNoOp(hl_loop.TrainerBase):
    def run_step(self) -> None:
        pass


class _RefNoOp(ref.TrainerBase):
    def run_step(self) -> None:
        pass


class _HLStepHook(hl_loop.HookBase):
    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass


class _RefStepHook(ref.HookBase):
    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass


def _checkpoint_hooks(tmpdir: str, period: int) -> List[Any]:
    """PeriodicCheckpointer, EvalHook and BestCheckpointer, as every detectron2 hook list has
    them, with periods no run of the benchmark reaches (their cost between periods). The
    checkpointer does not write (save_to_disk=False): the final save at the last iteration
    stays out of the figure."""
    from hookloop.checkpoint import Checkpointer

    ckpt = Checkpointer(torch.nn.Linear(1, 1), tmpdir, save_to_disk=False)
    return [
        hl_hooks.PeriodicCheckpointer(ckpt, period),
        hl_hooks.EvalHook(period, lambda: {"acc": 1.0}, eval_after_train=False),
        hl_hooks.BestCheckpointer(period, ckpt, "acc"),
    ]


def bench_loop(cfg: Config, tmpdir: str) -> List[Row]:
    n = cfg.loop_n
    hl0, hl16 = _HLNoOp(), _HLNoOp()
    hl16.register_hooks([hl_loop.HookBase() for _ in range(16)])
    rf0, rf16 = _RefNoOp(), _RefNoOp()
    rf16.register_hooks([ref.HookBase() for _ in range(16)])
    hl16s, rf16s = _HLNoOp(), _RefNoOp()
    hl16s.register_hooks([_HLStepHook() for _ in range(16)])
    rf16s.register_hooks([_RefStepHook() for _ in range(16)])
    hlck = _HLNoOp()
    # A period past the run's end (and so past its last iteration): the hooks stay idle.
    hlck.register_hooks(_checkpoint_hooks(tmpdir, 10 * n))

    def bare() -> float:
        run_step = hl0.run_step
        t0 = perf_ns()
        for _ in range(n):
            run_step()
        return (perf_ns() - t0) / n

    def train(t: Any) -> Callable[[], float]:
        def f() -> float:
            t0 = perf_ns()
            t.train(0, n)
            return (perf_ns() - t0) / n

        return f

    res = _interleaved(
        {"bare": bare, "hl0": train(hl0), "hl16": train(hl16), "rf0": train(rf0),
         "rf16": train(rf16), "hl16s": train(hl16s), "rf16s": train(rf16s),
         "hlck": train(hlck)},
        cfg.repeats,
    )  # fmt: skip

    def diff(a: str, b: str) -> Stat:
        return Stat.over(res[a], res[b])

    nn = f"{n:,} × {cfg.repeats}"
    return [
        Row("3", "bare `for i in range(n): run_step()` (floor, absolute)", "ns/iter",
            Stat.of(res["bare"]), None, nn),
        Row("3", "TrainerBase.train, no hooks, over bare", "ns/iter",
            diff("hl0", "bare"), diff("rf0", "bare"), nn, "≤ 100 ns", 100.0),
        Row("3", "TrainerBase.train, 16 no-op HookBase(), over bare", "ns/iter",
            diff("hl16", "bare"), diff("rf16", "bare"), nn),
        Row("3", "16 no-op hooks, extra over no hooks", "ns/iter",
            diff("hl16", "hl0"), diff("rf16", "rf0"), nn, "≤ 60 ns", 60.0),
        Row("3", "16 hooks overriding before_step and after_step (empty), extra over no hooks",
            "ns/iter", diff("hl16s", "hl0"), diff("rf16s", "rf0"), nn, "≤ 800 ns", 800.0),
        Row("3", "PeriodicCheckpointer + EvalHook + BestCheckpointer between periods, extra "
            "over no hooks (includes their last-iteration call)", "ns/iter",
            diff("hlck", "hl0"), None, nn, "≤ 300 ns", 300.0),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 3b. hooks that do nothing on most iterations: their cost per iteration there


class _FreeLoss:
    """A loss whose division and backward() cost nothing: what OptimizationHook adds to a
    forward-only trainer's iteration, without the backward itself."""

    def __truediv__(self, other: Any) -> _FreeLoss:
        return self

    def backward(self) -> None:
        pass


class _HLForwardOnly(hl_loop.TrainerBase):
    """A runner-style trainer: run_step leaves the loss in step_outputs (here: once)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.step_outputs = {"loss_for_backward": _FreeLoss()}

    def run_step(self) -> None:
        pass


def bench_idle_hooks(cfg: Config) -> List[Row]:
    """Hooks whose work is rare, on the iterations without it: OptimizationHook on iterations
    that do not step, PreemptionHandler without a signal, ProgressBar between redraws."""
    import io

    from hookloop.utils.progress import ProgressBar

    n = cfg.loop_n
    # Steps once, at the last iteration (the core's period rule): its one step is included.
    never = 10 * n

    def simple() -> hl_loop.SimpleTrainer:
        # A plain SimpleTrainer (OptimizationHook leaves it the backward and is skipped on the
        # iterations that do not step), whose step does nothing: replaced on the instance,
        # which the hook does not look at (a subclass's run_step would make it look).
        model = torch.nn.Linear(1, 1)
        t = hl_loop.SimpleTrainer(model, [None], torch.optim.SGD(model.parameters(), lr=0.1))
        t.run_step = lambda: None  # type: ignore[method-assign]
        return t

    sim0, sim_opt = simple(), simple()
    sim_opt.register_hooks([hl_hooks.OptimizationHook(accumulate_grad_steps=never)])
    param = torch.nn.Parameter(torch.zeros(1))
    fwd0 = _HLForwardOnly(torch.optim.SGD([param], lr=0.1))
    fwd_opt = _HLForwardOnly(torch.optim.SGD([param], lr=0.1))
    fwd_opt.register_hooks([hl_hooks.OptimizationHook(accumulate_grad_steps=never)])
    hl0, pre, bar_t = _HLNoOp(), _HLNoOp(), _HLNoOp()
    pre.register_hooks([hl_hooks.PreemptionHandler()])
    # A bar on a "terminal" that redraws at most once an hour: drawn once here, before the
    # timed runs, so that every timed write() is one between redraws.
    bar = ProgressBar(n, file=io.StringIO(), terminal=True, refresh_interval=3600.0)
    with hl_events.EventStorage(0):
        bar.write()
    bar_t.register_hooks([hl_hooks.PeriodicWriter([bar], period=1)])
    has_bar = bar._enabled

    def train(t: Any) -> Callable[[], float]:
        def f() -> float:
            t0 = perf_ns()
            t.train(0, n)
            return (perf_ns() - t0) / n

        return f

    def bar_writes() -> float:
        write = bar.write
        with hl_events.EventStorage(0):
            t0 = perf_ns()
            for _ in range(n):
                write()
            return (perf_ns() - t0) / n

    def floor() -> float:
        f = _HLNoOp().run_step
        t0 = perf_ns()
        for _ in range(n):
            f()
        return (perf_ns() - t0) / n

    variants = {
        "sim0": train(sim0), "sim_opt": train(sim_opt), "fwd0": train(fwd0),
        "fwd_opt": train(fwd_opt), "hl0": train(hl0), "pre": train(pre),
        "bar": train(bar_t), "bar_writes": bar_writes, "floor": floor,
    }  # fmt: skip
    res = _interleaved(variants, cfg.repeats)

    def diff(a: str, b: str) -> Stat:
        return Stat.over(res[a], res[b])

    nn = f"{n:,} × {cfg.repeats}"
    no_bar = "" if has_bar else " (tqdm not installed: the bar is off)"
    return [
        Row("3b", "OptimizationHook, SimpleTrainer (runs the backward), iterations that do not "
            "step, extra over no hooks (includes its one step, at the last iteration)",
            "ns/iter", diff("sim_opt", "sim0"), None, nn, "≤ 500 ns", 500.0),
        Row("3b", "OptimizationHook, forward-only trainer (step_outputs['loss_for_backward'], "
            "a loss whose backward() is free), iterations that do not step, extra over no "
            "hooks", "ns/iter", diff("fwd_opt", "fwd0"), None, nn, "≤ 500 ns", 500.0),
        Row("3b", "PreemptionHandler, no signal, extra over no hooks", "ns/iter",
            diff("pre", "hl0"), None, nn, "≤ 500 ns", 500.0),
        Row("3b", "ProgressBar between redraws, in PeriodicWriter(period=1), extra over no "
            "hooks" + no_bar, "ns/iter", diff("bar", "hl0"), None, nn, "≤ 500 ns", 500.0),
        Row("3b", "ProgressBar.write() between redraws, per call (a Python loop of calls, "
            "over the same loop of no-op calls)" + no_bar, "ns/call",
            diff("bar_writes", "floor"), None, nn),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 4. SimpleTrainer.write_metrics


def _four_losses() -> Dict[str, torch.Tensor]:
    w = torch.nn.Parameter(torch.tensor(1.0))
    return {
        "loss_cls": w * 0.5,
        "loss_box_reg": w * 0.25,
        "loss_rpn_cls": w * 0.125,
        "loss_rpn_loc": w * 0.0625,
    }


def bench_write_metrics(cfg: Config) -> List[Row]:
    n = cfg.wm_n
    loss_dict = _four_losses()

    def run(storage_cls: Any, write_metrics: Callable[..., None]) -> Callable[[], float]:
        def f() -> float:
            with storage_cls():
                t0 = perf_ns()
                for i in range(n):
                    write_metrics(loss_dict, 0.0012, i)
                return (perf_ns() - t0) / n / 1e3

        return f

    res = _interleaved(
        {
            "hl": run(hl_events.EventStorage, hl_loop.SimpleTrainer.write_metrics),
            "ref": run(ref.EventStorage, ref.SimpleTrainer.write_metrics),
        },
        cfg.repeats,
    )
    return [
        Row("4", "SimpleTrainer.write_metrics, 4 losses (CPU 0-d tensors), one process",
            "µs/call", Stat.of(res["hl"]), Stat.of(res["ref"]), f"{n:,} × {cfg.repeats}",
            "≤ 5 µs", 5.0),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 5. writers

# Twenty scalars a Mask R-CNN run has in storage (lr without smoothing, as LRScheduler puts it).
_WRITER_SCALARS = (
    "total_loss", "loss_cls", "loss_box_reg", "loss_mask", "loss_rpn_cls", "loss_rpn_loc",
    "time", "data_time", "rank_data_time", "fast_rcnn/cls_accuracy",
    "fast_rcnn/fg_cls_accuracy", "fast_rcnn/false_negative", "mask_rcnn/accuracy",
    "mask_rcnn/false_positive", "mask_rcnn/false_negative", "roi_head/num_fg_samples",
    "roi_head/num_bg_samples", "rpn/num_pos_anchors", "rpn/num_neg_anchors",
)  # fmt: skip


def _put_iteration(storage: Any, it: int) -> None:
    storage.iter = it
    for k, name in enumerate(_WRITER_SCALARS):
        storage.put_scalar(name, 0.1 * (k + 1) + (it % 13) * 1e-3)
    storage.put_scalar("lr", 0.02, smoothing_hint=False)


_MAX_ITER = 10_000_000


def _make_writer(impl: str, kind: str, d: str) -> Any:
    if impl == "hl":
        if kind == "json":
            return hl_events.JSONWriter(os.path.join(d, "metrics.json"))
        if kind == "tb":
            return hl_events.TensorboardXWriter(d)
        return hl_events.CommonMetricPrinter(_MAX_ITER)
    if kind == "json":
        return ref.JSONWriter(os.path.join(d, "metrics.json"))
    if kind == "tb":
        return ref.TensorboardXWriter(d)
    return ref.CommonMetricPrinter(_MAX_ITER)


def _flush(writer: Any) -> None:
    """Waits until what ``write()`` started is done: hookloop's writer thread, torch's."""
    if hasattr(writer, "flush"):  # hookloop JSONWriter / TensorboardXWriter
        writer.flush()
    elif hasattr(writer, "_writer"):  # reference TensorboardXWriter: SummaryWriter's thread
        writer._writer.flush()
    # reference JSONWriter: flushed and fsynced inside write(); printers: synchronous


_WRITER_TITLES = {
    "json": "JSONWriter.write()",
    "tb": "TensorboardXWriter.write()",
    "printer": "CommonMetricPrinter.write() (NullHandler at INFO)",
}


def _writer_case(cfg: Config, kind: str, tmpdir: str) -> List[Row]:
    n = cfg.writer_n
    with contextlib.ExitStack() as stack:
        storages = {
            "hl": stack.enter_context(hl_events.EventStorage()),
            "ref": stack.enter_context(ref.EventStorage()),
        }
        writers = {}
        for impl, s in storages.items():
            for it in range(cfg.writer_prefill):
                _put_iteration(s, it)
            d = tempfile.mkdtemp(prefix=f"{impl}-{kind}-", dir=tmpdir)
            writers[impl] = _make_writer(impl, kind, d)
        next_iter = {impl: cfg.writer_prefill for impl in storages}
        end_to_end: Dict[str, List[float]] = {"hl": [], "ref": []}
        per_call: Dict[str, List[int]] = {"hl": [], "ref": []}

        def measure(impl: str) -> Callable[[], float]:
            s, w = storages[impl], writers[impl]

            def f() -> float:
                spent = total = 0
                for _ in range(n):
                    # a new iteration's values, then the write; only write() is timed
                    _put_iteration(s, next_iter[impl])
                    next_iter[impl] += 1
                    t0 = perf_ns()
                    w.write()
                    t1 = perf_ns()
                    _flush(w)
                    spent += t1 - t0
                    total += perf_ns() - t0
                    per_call[impl].append(t1 - t0)
                end_to_end[impl].append(total / n / 1e3)
                return spent / n / 1e3

            return f

        res = _interleaved({"hl": measure("hl"), "ref": measure("ref")}, cfg.repeats)
        t_close = {}
        for impl, w in writers.items():
            t0 = perf_ns()
            w.close()
            t_close[impl] = (perf_ns() - t0) / 1e3
    nn = f"{n:,} × {cfg.repeats}"
    rows = [
        Row("5", f"{_WRITER_TITLES[kind]}, 20 scalars, training thread", "µs/call",
            Stat.of(res["hl"]), Stat.of(res["ref"]), nn, "≤ 20 µs", 20.0,
            f"median of single calls: hookloop {statistics.median(per_call['hl']) / 1e3:.1f} µs, "
            f"reference {statistics.median(per_call['ref']) / 1e3:.1f} µs")
    ]  # fmt: skip
    if kind != "printer":
        rows.append(
            Row("5", f"{_WRITER_TITLES[kind]} + flush(), end to end (waits for the writer "
                "thread / fsync)", "µs/call", Stat.of(end_to_end["hl"]),
                Stat.of(end_to_end["ref"]), nn, note=f"close(): hookloop "
                f"{t_close['hl']:.0f} µs, reference {t_close['ref']:.0f} µs")
        )  # fmt: skip
    return rows


def bench_writers(cfg: Config, tmpdir: str) -> List[Row]:
    return [r for kind in ("json", "tb", "printer") for r in _writer_case(cfg, kind, tmpdir)]


# ---------------------------------------------------------------------------------------------
# 6. the default stack


class _OneParam(torch.nn.Module):
    """Four losses from one parameter: the cheapest model with a real backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, data: Any) -> Dict[str, torch.Tensor]:
        w = self.w
        return {
            "loss_cls": w * 0.5,
            "loss_box_reg": w * 0.25,
            "loss_rpn_cls": w * 0.125,
            "loss_rpn_loc": w * 0.0625,
        }


def _model_opt_sched() -> Tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = _OneParam()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10_000, gamma=0.5)
    return model, opt, sched


def detectron2_available() -> bool:
    """Whether ``import detectron2.engine`` works here (the "detectron2" columns), in this
    process and in the fresh ones the paired benches start: an installed package, not a
    module object registered in ``sys.modules`` (tests/compat registers one)."""
    import importlib.machinery

    if importlib.machinery.PathFinder.find_spec("detectron2") is None:
        return False
    try:
        import detectron2.engine  # noqa: F401
        import detectron2.utils.events  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def engine(impl: str) -> Any:
    """The classes of one engine, by the names detectron2 gives them: ``"hl"`` hookloop,
    ``"ref"`` the pure-Python reference, ``"d2"`` detectron2 itself (imported here, not
    before: ``detectron2_available()`` says whether it can be)."""
    if impl == "hl":
        mods: Tuple[Any, ...] = (hl_loop, hl_hooks, hl_events)
    elif impl == "ref":
        mods = (ref,)
    elif impl == "d2":
        from detectron2.engine import hooks as d2_hooks
        from detectron2.engine import train_loop as d2_loop
        from detectron2.utils import events as d2_events

        mods = (d2_loop, d2_hooks, d2_events)
    else:
        raise ValueError(f"unknown engine {impl!r}")
    names = (
        "HookBase", "TrainerBase", "SimpleTrainer", "IterationTimer", "LRScheduler",
        "PeriodicWriter", "EventStorage", "CommonMetricPrinter", "JSONWriter",
        "TensorboardXWriter",
    )  # fmt: skip
    found = {}
    for name in names:
        found[name] = next(getattr(m, name) for m in mods if hasattr(m, name))

    base: Any = found["SimpleTrainer"]

    class StackTrainer(base):  # type: ignore[misc, valid-type]
        """Records when the last iteration ended (before after_train's last write)."""

        loop_end: Tuple[int, int] = (0, 0)

        def after_train(self) -> None:
            self.loop_end = (perf_ns(), thread_ns())
            super().after_train()

    return argparse.Namespace(name=impl, StackTrainer=StackTrainer, **found)


ALL_WRITERS = ("printer", "json", "tb")

#: The every-step writers of the seeds (cvpods' and xmodaler's ``build_everystep_writers``):
#: JSON and TensorBoard with ``window_size=1``, in a second PeriodicWriter at period 1.
EVERYSTEP_WRITERS = ("json", "tb")

#: Where the every-step writers write, inside the stack's directory: a metrics file and an
#: event directory of their own (two writers never share a file).
EVERYSTEP_JSON, EVERYSTEP_TB_DIR = "metrics_everystep.json", "everystep"


def stack_hooks(
    e: Any,
    opt: torch.optim.Optimizer,
    sched: Any,
    period: int,
    n: int,
    d: str,
    writers: Sequence[str] = ALL_WRITERS,
    json_fsync: Optional[str] = None,
    everystep: Sequence[str] = (),
) -> List[Any]:
    """IterationTimer, LRScheduler, PeriodicWriter([printer, JSON, TB], period) of engine ``e``
    (see :func:`engine`), as detectron2's DefaultTrainer orders them, writing into ``d``.
    ``writers`` picks a subset (none: no PeriodicWriter); ``json_fsync`` is hookloop's
    JSONWriter option (None: its default, what a user gets). ``everystep`` (a subset of
    :data:`EVERYSTEP_WRITERS`) adds ``PeriodicWriter([JSON, TB], 1)`` with ``window_size=1``
    after it, writing :data:`EVERYSTEP_JSON` and into :data:`EVERYSTEP_TB_DIR` of ``d``: the
    seeds' configuration."""
    bad = set(everystep) - set(EVERYSTEP_WRITERS)
    if bad:
        raise ValueError(f"every-step writers are {EVERYSTEP_WRITERS}, got {sorted(bad)}")

    def json_writer(path: str, window_size: int) -> Any:
        if e.name == "hl" and json_fsync is not None:
            return e.JSONWriter(path, window_size, fsync=json_fsync)
        return e.JSONWriter(path, window_size)

    make: Dict[str, Callable[[], Any]] = {
        "printer": lambda: e.CommonMetricPrinter(n),
        "json": lambda: json_writer(os.path.join(d, "metrics.json"), 20),
        "tb": lambda: e.TensorboardXWriter(d),
    }
    make_everystep: Dict[str, Callable[[], Any]] = {
        "json": lambda: json_writer(os.path.join(d, EVERYSTEP_JSON), 1),
        "tb": lambda: e.TensorboardXWriter(os.path.join(d, EVERYSTEP_TB_DIR), window_size=1),
    }
    hooks: List[Any] = [e.IterationTimer(), e.LRScheduler(opt, sched)]
    if writers:
        hooks.append(e.PeriodicWriter([make[w]() for w in writers], period))
    if everystep:
        hooks.append(e.PeriodicWriter([make_everystep[w]() for w in everystep], 1))
    return hooks


def make_stack_trainer(
    impl: str,
    period: int,
    n: int,
    d: str,
    writers: Sequence[str] = ALL_WRITERS,
    json_fsync: Optional[str] = None,
) -> Any:
    """SimpleTrainer on the one-parameter model with :func:`stack_hooks`, for engine ``impl``
    (see :func:`engine`)."""
    model, opt, sched = _model_opt_sched()
    e = engine(impl)
    t = e.StackTrainer(model, itertools.repeat(None), opt)
    t.register_hooks(stack_hooks(e, opt, sched, period, n, d, writers, json_fsync))
    return t


@dataclass
class StackRun:
    """µs per iteration of one run: wall time to the end of the last iteration, the same
    including after_train, and the training thread's CPU time to the end of the last
    iteration (not counting waits, other threads, or time the thread was preempted)."""

    wall: float
    wall_total: float
    cpu: float


def _bare_stack(n: int) -> StackRun:
    """The same model step with no bookkeeping: SimpleTrainer.run_step without
    after_backward/write_metrics, plus the scheduler step LRScheduler makes."""
    model, opt, sched = _model_opt_sched()
    data_iter = iter(itertools.repeat(None))
    model.train()
    perf = time.perf_counter
    t0, c0 = perf_ns(), thread_ns()
    for _ in range(n):
        if not model.training:
            raise RuntimeError
        start = perf()
        data = next(data_iter)
        _data_time = perf() - start
        loss_dict = model(data)
        losses = sum(loss_dict.values())
        opt.zero_grad()
        losses.backward()
        opt.step()
        sched.step()
    wall = (perf_ns() - t0) / n / 1e3
    return StackRun(wall, wall, (thread_ns() - c0) / n / 1e3)


def _run_stack(impl: str, period: int, n: int, tmpdir: str, *args: Any) -> StackRun:
    if impl == "bare":
        return _bare_stack(n)
    d = tempfile.mkdtemp(prefix=f"stack-{impl}-{period}-", dir=tmpdir)
    t = make_stack_trainer(impl, period, n, d, *args)
    t0, c0 = perf_ns(), thread_ns()
    t.train(0, n)
    t1 = perf_ns()
    end, end_cpu = t.loop_end
    return StackRun((end - t0) / n / 1e3, (t1 - t0) / n / 1e3, (end_cpu - c0) / n / 1e3)


def _stack_variants(
    cfg: Config, n: int, variants: Dict[str, Tuple[Any, ...]], tmpdir: str
) -> Dict[str, List[StackRun]]:
    """Interleaved runs of ``_run_stack(*variants[k])``, each repeat in a rotating order."""
    runs: Dict[str, List[StackRun]] = {k: [] for k in variants}

    def run(k: str) -> Callable[[], float]:
        def f() -> float:
            impl, period, *args = variants[k]
            runs[k].append(_run_stack(impl, period, n, tmpdir, *args))
            return 0.0

        return f

    _interleaved({k: run(k) for k in variants}, cfg.stack_repeats)
    return runs


def _over(runs: Dict[str, List[StackRun]], k: str, attr: str) -> Stat:
    return Stat.over([getattr(r, attr) for r in runs[k]], [getattr(r, attr) for r in runs["bare"]])


def _stack_case(cfg: Config, period: int, n: int, tmpdir: str) -> List[Row]:
    runs = _stack_variants(
        cfg, n, {"bare": ("bare", period), "hl": ("hl", period), "ref": ("ref", period)}, tmpdir
    )
    target = 10.0 if period == 20 else 25.0
    nn = f"{n:,} × {cfg.stack_repeats}"
    return [
        Row("6", f"period {period}: bare model step (floor, absolute; incl. StepLR.step)",
            "µs/iter", Stat.of([r.wall for r in runs["bare"]]), None, nn),
        Row("6", f"period {period}: default stack over bare, wall time to the end of the "
            "last iteration", "µs/iter", _over(runs, "hl", "wall"), _over(runs, "ref", "wall"),
            nn, f"≤ {target:g} µs", target),
        Row("6", f"period {period}: same, training-thread CPU time (no waits, no preemption)",
            "µs/iter", _over(runs, "hl", "cpu"), _over(runs, "ref", "cpu"), nn),
        Row("6", f"period {period}: same, wall time including after_train (last write, "
            "close: waits for writer threads)", "µs/iter", _over(runs, "hl", "wall_total"),
            _over(runs, "ref", "wall_total"), nn),
    ]  # fmt: skip


_BREAKDOWN = (
    ("IterationTimer + LRScheduler + write_metrics, no writer", (), None),
    ("… + PeriodicWriter([CommonMetricPrinter])", ("printer",), None),
    ("… + PeriodicWriter([JSONWriter]) (fsync='periodic', the default)", ("json",), None),
    ("… + PeriodicWriter([JSONWriter(fsync='always')])", ("json",), "always"),
    ("… + PeriodicWriter([JSONWriter(fsync='never')])", ("json",), "never"),
    ("… + PeriodicWriter([TensorboardXWriter])", ("tb",), None),
)


def bench_breakdown(cfg: Config, tmpdir: str) -> List[Row]:
    """Where hookloop's period-1 stack spends its time: one writer at a time."""
    n = cfg.stack_n[1]
    variants: Dict[str, Tuple[Any, ...]] = {"bare": ("bare", 1)}
    for k, (_, writers, fsync) in enumerate(_BREAKDOWN):
        variants[str(k)] = ("hl", 1, writers, fsync)
    runs = _stack_variants(cfg, n, variants, tmpdir)
    nn = f"{n:,} × {cfg.stack_repeats}"
    return [
        Row("6b", f"hookloop, period 1: {what}, over bare, training-thread CPU time",
            "µs/iter", _over(runs, str(k), "cpu"), None, nn,
            note=f"wall: {_fmt(_over(runs, str(k), 'wall').median)} µs")
        for k, (what, _, _) in enumerate(_BREAKDOWN)
    ]  # fmt: skip


def bench_stack(cfg: Config, tmpdir: str) -> List[Row]:
    rows = []
    for period, n in sorted(cfg.stack_n.items(), reverse=True):
        rows += _stack_case(cfg, period, n, tmpdir)
    return rows


# ---------------------------------------------------------------------------------------------
# parity check used by the smoke test


def json_parity_run(tmpdir: str, n_iter: int = 45, period: int = 7) -> Tuple[str, str]:
    """A deterministic run through both engines (write_metrics, an unsmoothed scalar, a sparse
    one, a late one put for the previous iteration) with PeriodicWriter([JSONWriter]); returns
    (hookloop's metrics.json, the reference's metrics.json)."""
    values = [torch.tensor(v) for v in (0.75, 0.5, 0.125, 3.0, 1.5, 0.3)]

    def step(trainer: Any, write_metrics: Callable[..., None], storage: Any) -> None:
        i = trainer.iter
        loss_dict = {
            "loss_a": values[i % 6] * (1 + i % 5),
            "loss_b": values[(i + 2) % 6] / (1 + i % 3),
            "loss_c": values[(i + 4) % 6] + 0.01 * i,
            "loss_d": values[(i + 1) % 6] - 0.001 * i,
        }
        write_metrics(loss_dict, 0.001 * (i % 7 + 1), i)
        storage.put_scalar("lr", 0.02 * 0.9 ** (i // 10), smoothing_hint=False)
        if i % 3 == 0:
            storage.put_scalar("sparse", i * 0.25)
        if i % 5 == 4:
            storage.put_scalar("late", 1.0 / (i + 1), cur_iter=i - 1)

    class HL(hl_loop.TrainerBase):
        def run_step(self) -> None:
            step(self, hl_loop.SimpleTrainer.write_metrics, self.storage)

    class Ref(ref.TrainerBase):
        def run_step(self) -> None:
            step(self, ref.SimpleTrainer.write_metrics, self.storage)

    paths = []
    impls: Tuple[Tuple[str, Any, Any, Any], ...] = (
        ("hl", HL, hl_events.JSONWriter, hl_hooks.PeriodicWriter),
        ("ref", Ref, ref.JSONWriter, ref.PeriodicWriter),
    )
    for impl, cls, writer_cls, pw in impls:
        path = os.path.join(tmpdir, f"{impl}-metrics.json")
        t = cls()
        t.register_hooks([pw([writer_cls(path, window_size=4)], period)])
        t.train(0, n_iter)
        paths.append(path)
    texts = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            texts.append(f.read())
    return texts[0], texts[1]


# ---------------------------------------------------------------------------------------------
# driver


def machine_info(argv: Sequence[str]) -> Dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
    except OSError:
        load = "?"
    return {
        "command": "python " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_at_start": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "hookloop": hookloop.__version__,
        "build_profile": hookloop.BUILD_PROFILE,
    }


SECTIONS = (
    "put_scalar",
    "memory",
    "loop",
    "idle_hooks",
    "write_metrics",
    "writers",
    "stack",
    "breakdown",
)


def run_all(
    cfg: Config,
    tmpdir: str,
    log: Callable[[str], None] = lambda s: None,
    only: Optional[Sequence[str]] = None,
) -> List[Row]:
    """Runs every section (or those in ``only``); memory first, while the heap is fresh.
    Returns rows in table order."""
    found: Dict[str, List[Row]] = {}
    steps: List[Tuple[str, Callable[[], List[Row]]]] = [
        ("memory", lambda: bench_memory(cfg)),
        ("put_scalar", lambda: bench_put_scalar(cfg)),
        ("loop", lambda: bench_loop(cfg, tmpdir)),
        ("idle_hooks", lambda: bench_idle_hooks(cfg)),
        ("write_metrics", lambda: bench_write_metrics(cfg)),
        ("writers", lambda: bench_writers(cfg, tmpdir)),
        ("stack", lambda: bench_stack(cfg, tmpdir)),
        ("breakdown", lambda: bench_breakdown(cfg, tmpdir)),
    ]
    if only is not None:
        unknown = [x for x in only if x not in SECTIONS]
        if unknown:
            raise ValueError(f"unknown sections {unknown}; the sections are {list(SECTIONS)}")
        steps = [(name, fn) for name, fn in steps if name in only]
    with printer_logging():
        for name, fn in steps:
            gc.collect()
            t0 = time.perf_counter()
            found[name] = fn()
            log(f"  {name}: {time.perf_counter() - t0:.1f} s")
    return [r for name in SECTIONS if name in found for r in found[name]]


def main(argv: Optional[Sequence[str]] = None, command: str = "benches/bench_overhead.py") -> int:
    """``benches/bench_overhead.py``: every section, one markdown table (what RESULTS.md quotes).
    ``command`` is the script's path as the machine info records it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller n (about 30 s)")
    p.add_argument("--json", metavar="OUT", help="also write the rows and machine as JSON")
    p.add_argument(
        "--only",
        metavar="SECTIONS",
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)",
    )
    args = p.parse_args(argv)
    only = None
    if args.only is not None:
        only = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [x for x in only if x not in SECTIONS]
        if unknown or not only:
            p.error(f"--only {args.only!r}: the sections are {', '.join(SECTIONS)}")

    if hookloop.BUILD_PROFILE != "release":
        print(
            f"refusing to benchmark: hookloop._core is a {hookloop.BUILD_PROFILE!r} build; "
            "rebuild with `maturin develop --release`",
            file=sys.stderr,
        )
        return 2

    torch.set_num_threads(1)  # scalar ops never use the intra-op pool; one thread is less noise
    info = machine_info([command] + argv)
    cfg = Config.quick() if args.quick else Config.full()
    for k, v in info.items():
        print(f"{k}: {v}")
    print(flush=True)

    tmpdir = tempfile.mkdtemp(prefix="hookloop-bench-")
    t0 = time.perf_counter()
    try:
        rows = run_all(cfg, tmpdir, log=lambda s: print(s, file=sys.stderr, flush=True), only=only)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    with open("/proc/loadavg") as f:
        info["loadavg_at_end"] = " ".join(f.read().split()[:3])

    print(format_table(rows))
    print()
    print(f"total: {info['seconds']} s; loadavg at end: {info['loadavg_at_end']}")
    missed = [r for r in rows if r.met is False]
    print(f"targets: {sum(r.met is True for r in rows)} met, {len(missed)} missed")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"machine": info, "config": asdict(cfg), "rows": [r.as_dict() for r in rows]},
                f,
                indent=1,
                default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o),
            )
    return 0
