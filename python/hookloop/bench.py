"""``hookloop bench``: what the training loop's bookkeeping costs on this machine.

hookloop, and detectron2 when it is importable, over a floor, side by side in one process: each
repetition runs every variant once (the order rotates, the garbage collector is off), and the
table gives medians of costs and ratios formed within one repetition. The floors: a bare ``for``
loop calling a no-op ``run_step`` (for ``TrainerBase.train`` with no hooks, and with 16 that
override ``before_step`` and ``after_step``); a hand-written loop making the tiny MLP's model
calls (for ``SimpleTrainer`` with no hooks, the default stack, and the seeds' stack: it and
cvpods'/xmodaler's every-step JSON and TensorBoard, ``window_size=1``, period 1); ``SimpleTrainer``
alone (for it with ``--hook``). ``--cuda-graph`` (CUDA only) adds the tiny MLP's
``CUDAGraphTrainer`` (the whole step as one CUDA graph) with no hooks and with the default stack
over the hand-written eager loop on the GPU. A second table feeds the tiny MLP + default stack
from ``DataLoader(TensorDataset, shuffle=True)`` and from ``hookloop.data.DeviceResidentLoader``
over the same 50,000 samples (batch 16, on the CPU): the data time per batch and the time per
step, the resident loader's over the DataLoader's. The repository's ``benches/`` has the full
benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.machinery
import importlib.util
import itertools
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

import hookloop

__all__ = [
    "TinyMLP",
    "make_batches",
    "build",
    "hand_loop",
    "loader_data",
    "loader_data_time",
    "run",
]

Batch = Tuple[torch.Tensor, torch.Tensor]
Variants = Dict[str, Callable[[], float]]
ENGINES, RATIOS = ("hookloop", "detectron2"), ("hookloop_over_floor", "detectron2_over_hookloop")
STEPS = ("before_step", "after_step")
HOOKS, PERIOD = 16, 20  # the dispatch rows' hook count, the default stack's write period
GRAPH_WARMUP = 3  # CUDAGraphTrainer's warm-up steps before its capture (its default)
EVERYSTEP = ("json", "tb")  # the seeds' (cvpods', xmodaler's) every-step writers, window_size 1
# The loader rows: issue 44's dataset (50,000 samples of 32 features) in batches of 16.
LOADER_SIZE, LOADER_BATCH = 50_000, 16
LOADERS = ("DataLoader", "DeviceResidentLoader")
LOADER_FIGURES = ("data_us", "step_us", "steps_per_s", "data_of_dataloader",
                  "steps_per_s_over_dataloader")  # fmt: skip
LOADER_NAMES = {"DataLoader": "DataLoader(TensorDataset, shuffle=True)",
                "DeviceResidentLoader": "DeviceResidentLoader"}  # fmt: skip
CLASSES = ("HookBase", "TrainerBase", "SimpleTrainer", "IterationTimer", "LRScheduler",
           "PeriodicWriter", "CommonMetricPrinter", "JSONWriter", "TensorboardXWriter")  # fmt: skip


class TinyMLP(nn.Module):
    """Linear 32→64, ReLU, Linear 64→1; four losses from one prediction: a step cheap enough
    (a few hundred µs on one CPU thread) that the loop's bookkeeping shows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, batch: Batch) -> Dict[str, torch.Tensor]:
        pred = self.net(batch[0])
        err = pred - batch[1]
        return {"loss_mse": (err * err).mean(), "loss_l1": err.abs().mean(),
                "loss_huber": nn.functional.smooth_l1_loss(pred, batch[1]),
                "loss_reg": 1e-4 * (pred * pred).mean()}  # fmt: skip


def make_batches(device: Any = "cpu", count: int = 64, batch: int = 16, seed: int = 0) -> Any:
    """``count`` batches of generated regression data, on ``device``; loaders cycle them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 1, generator=g)
    xs = [torch.randn(batch, 32, generator=g) for _ in range(count)]
    return [(x.to(device), (x @ w).to(device)) for x in xs]


def build(device: Any = "cpu", seed: int = 0) -> Tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model, SGD with momentum, and torch's MultiStepLR (its milestone is never reached)."""
    torch.manual_seed(seed)
    model = TinyMLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.MultiStepLR(opt, [10**9], gamma=0.1)


def hand_loop(model: nn.Module, opt: torch.optim.Optimizer, data: Iterator[Batch], n: int) -> None:
    """The model calls of ``SimpleTrainer.run_step`` (data, forward, sum, zero_grad, backward,
    step) with no bookkeeping: no timing, no metrics, no hooks."""
    model.train()
    for _ in range(n):
        losses: Any = sum(model(next(data)).values())
        opt.zero_grad()
        losses.backward()
        opt.step()


def _measure(variants: Variants, repeats: int) -> Dict[str, List[float]]:
    """Per variant, what it returned in each of ``repeats`` repetitions that run every variant
    once, one variant later each time, the garbage collector off (as timeit does), after one
    untimed run of each (first calls allocate and fill caches)."""
    names = list(variants)
    out: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(-1, repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.disable()
            try:
                value = variants[name]()
            finally:
                gc.enable()
            if r >= 0:
                out[name].append(value)
    return out


def _engine(package: str) -> Any:
    """hookloop's or detectron2's classes, by detectron2's names."""
    mods = [importlib.import_module(f"{package}.{m}") for m in ("engine.train_loop",
            "engine.hooks", "utils.events")]  # fmt: skip
    return argparse.Namespace(**{c: next(getattr(m, c) for m in mods if hasattr(m, c))
                                 for c in CLASSES})  # fmt: skip


def _per_step(f: Callable[[], Any], n: int, unit: float) -> float:
    """Runs ``f`` (``n`` steps): the time per step, in units of ``unit`` seconds."""
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) / n / unit


def _dispatch(engines: Dict[str, Any], n: int, reps: int) -> List[Dict[str, Any]]:
    def timed(f: Callable[[], Any]) -> Callable[[], float]:
        return functools.partial(_per_step, f, n, 1e-9)

    variants: Variants = {}
    for name, e in engines.items():
        no_op = type("NoOp", (e.TrainerBase,), {"run_step": lambda self: None})
        step_hook = type("StepHook", (e.HookBase,), dict.fromkeys(STEPS, lambda self: None))
        plain, hooked = no_op(), no_op()
        hooked.register_hooks([step_hook() for _ in range(HOOKS)])
        variants[name] = timed(functools.partial(plain.train, 0, n))
        variants[name + "+hooks"] = timed(functools.partial(hooked.train, 0, n))

    def bare(run_step: Callable[[], None] = plain.run_step) -> None:
        for _ in range(n):
            run_step()

    res = _measure({"floor": timed(bare), **variants}, reps)
    what, size = "TrainerBase.train, {}, over a bare `for` loop", f"{n:,} × {reps}"
    return [_row(what.format("no hooks"), "ns/iter", size, res, {e: e for e in engines}),
            _row(what.format(f"{HOOKS} hooks overriding before_step and after_step"), "ns/iter",
                 size, res, {e: e + "+hooks" for e in engines})]  # fmt: skip


def _stack(e: Any, opt: Any, sched: Any, writers: Sequence[str], n: int, d: str) -> List[Any]:
    """The default stack of engine ``e``: IterationTimer, LRScheduler, PeriodicWriter(``writers``,
    period 20), its files in ``d``."""
    make = {"printer": lambda: e.CommonMetricPrinter(n),
            "json": lambda: e.JSONWriter(os.path.join(d, "metrics.json")),
            "tb": lambda: e.TensorboardXWriter(d)}  # fmt: skip
    return [e.IterationTimer(), e.LRScheduler(opt, sched),
            e.PeriodicWriter([make[w]() for w in writers], PERIOD)]  # fmt: skip


def _mlp(engines: Dict[str, Any], n: int, reps: int, writers: Sequence[str], tmpdir: str,
         hook: Optional[Tuple[str, Any]]) -> List[Dict[str, Any]]:  # fmt: skip
    batches = make_batches()

    def hand() -> float:
        model, opt, _ = build()
        return _per_step(lambda: hand_loop(model, opt, itertools.cycle(batches), n), n, 1e-6)

    everystep = [w for w in writers if w in EVERYSTEP]

    def trainer(e: Any, hooks: str = "none", extra: Sequence[Callable[[], Any]] = ()) -> Any:
        def timed() -> float:
            model, opt, sched = build()
            t = e.SimpleTrainer(model, itertools.cycle(batches), opt)
            d = tempfile.mkdtemp(dir=tmpdir)
            every = {
                "json": lambda: e.JSONWriter(os.path.join(d, "metrics_everystep.json"), 1),
                "tb": lambda: e.TensorboardXWriter(os.path.join(d, "everystep"), 1),
            }
            hs: List[Any] = []
            if hooks != "none":
                hs += _stack(e, opt, sched, writers, n, d)
            if hooks == "seeds":
                hs.append(e.PeriodicWriter([every[w]() for w in everystep], 1))
            t.register_hooks(hs + [m() for m in extra])
            return _per_step(functools.partial(t.train, 0, n), n, 1e-6)  # to the writers' close

        return timed

    variants: Variants = {"floor": hand}
    for name, e in engines.items():
        variants.update({name: trainer(e), name + "+stack": trainer(e, "stack"),
                         name + "+seeds": trainer(e, "seeds")})  # fmt: skip
    if hook is not None:
        variants["hook"] = trainer(engines["hookloop"], extra=[hook[1]])
    res = _measure(variants, reps)
    names = {"printer": "printer", "json": "JSON", "tb": "TensorBoard"}
    stack = (f" + IterationTimer + LRScheduler + PeriodicWriter("
             f"{', '.join(names[w] for w in writers)}; period {PERIOD})")  # fmt: skip
    seeds = f"PeriodicWriter({', '.join(names[w] for w in everystep)}; window_size 1, period 1)"
    what, size = "tiny MLP: SimpleTrainer{}, over the hand-written loop", f"{n:,} × {reps}"
    rows = [_row(what.format(", no hooks"), "µs/step", size, res, {e: e for e in engines}),
            _row(what.format(stack), "µs/step", size, res, {e: e + "+stack" for e in engines}),
            _row(what.format(f"{stack} + {seeds}"), "µs/step", size, res,
                 {e: e + "+seeds" for e in engines})]  # fmt: skip
    if hook is not None:
        what = f"tiny MLP: SimpleTrainer + {hook[0]}, over SimpleTrainer alone"
        rows.append(_row(what, "µs/step", size, res, {"hookloop": "hook"}, floor="hookloop"))
    return rows


def loader_data(size: int = LOADER_SIZE, seed: int = 0) -> Batch:
    """The loader rows' dataset: ``size`` samples of the tiny MLP's 32 features and their
    regression targets, on the CPU (issue 44's 50,000 × 32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 32, generator=g)
    return x, x @ torch.randn(32, 1, generator=g)


def loader_data_time(loader: Any, n: int) -> float:
    """Seconds per batch of ``n`` (at most ``len(loader)``) ``next()`` calls on a fresh iterator
    of ``loader``, made before the clock starts."""
    it, t0 = iter(loader), time.perf_counter()
    for _ in range(n):
        next(it)
    return (time.perf_counter() - t0) / n


def _loaders(n: int, reps: int, writers: Sequence[str], tmpdir: str) -> List[Dict[str, Any]]:
    """The tiny MLP + default stack on ``SimpleTrainer`` fed by ``DataLoader(TensorDataset,
    shuffle=True)`` and by ``DeviceResidentLoader`` over the same tensors (on the CPU): the data
    time per batch (``next()`` alone) and the time per step of the whole run, each loader
    once per repetition; the resident loader's figures over the DataLoader's, per repetition."""
    from torch.utils.data import DataLoader, TensorDataset

    from hookloop.data import DeviceResidentLoader

    e, (x, y) = _engine("hookloop"), loader_data()
    make = {"DataLoader": lambda: DataLoader(TensorDataset(x, y), LOADER_BATCH, shuffle=True),
            "DeviceResidentLoader": lambda: DeviceResidentLoader((x, y), LOADER_BATCH,
                                                                 seed=0)}  # fmt: skip

    def data(name: str) -> float:
        return loader_data_time(make[name](), n) * 1e6

    def train(name: str) -> float:
        model, opt, sched = build()
        t = e.SimpleTrainer(model, make[name](), opt)
        t.register_hooks(_stack(e, opt, sched, writers, n, tempfile.mkdtemp(dir=tmpdir)))
        return _per_step(functools.partial(t.train, 0, n), n, 1e-6)

    res = _measure({f"{k}:{f.__name__}": functools.partial(f, k) for k in LOADERS
                    for f in (data, train)}, reps)  # fmt: skip
    med, rows, what = statistics.median, [], "tiny MLP: SimpleTrainer + default stack, fed by "
    for name in LOADERS:
        data_us, step_us = res[f"{name}:data"], res[f"{name}:train"]
        base_data, base_step = res["DataLoader:data"], res["DataLoader:train"]
        rows.append({"what": what + LOADER_NAMES[name], "loader": name, "n": f"{n:,} × {reps}",
                     "data_us": med(data_us), "step_us": med(step_us),
                     "steps_per_s": med(1e6 / s for s in step_us),
                     "data_of_dataloader": med(d / b for d, b in zip(data_us, base_data)),
                     "steps_per_s_over_dataloader": med(b / s for s, b in zip(step_us, base_step)),
                     "runs": {"data_us": data_us, "step_us": step_us}})  # fmt: skip
    return rows


def format_loader_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The loader rows as a markdown table of medians."""
    size = f"batch {LOADER_BATCH} of {LOADER_SIZE:,} × 32"
    out = [f"| loader ({size}) | data µs/batch | µs/step | steps/s | data ÷ DataLoader's "
           "| steps/s ÷ DataLoader's | n × repeats |", "|---" * 7 + "|"]  # fmt: skip
    for r in rows:
        cells = [_fmt(r[k], "×" if "_dataloader" in k else "") for k in LOADER_FIGURES]
        out.append(f"| {r['what']} | {' | '.join(cells)} | {r['n']} |")
    return "\n".join(out)


def steady_clock(
    device: Any, warmup_iters: int, clock: Callable[[], float] = time.perf_counter
) -> Any:
    """A hook (register it last) that times a ``CUDAGraphTrainer``'s steady state: from the end
    of its capture iteration (``start_iter + warmup_iters``: its ``before_train``, the warm-up
    steps and the capture are one-time costs, ``setup``) to the end of its last iteration, each
    end after a device synchronization. ``per_step()``: seconds per step of that stretch."""
    from hookloop.engine.train_loop import HookBase

    def sync() -> float:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return clock()

    class SteadyClock(HookBase):
        def before_train(self) -> None:
            self.start = sync()
            self.capture_iter = self.trainer.start_iter + warmup_iters
            self.capture_end = self.end = 0.0

        def after_step(self) -> None:
            it, last = self.trainer.iter, self.trainer.max_iter - 1
            if it == self.capture_iter:
                self.capture_end = sync()
            if it == last:
                self.end = sync()

        def setup(self) -> float:
            return self.capture_end - self.start

        def per_step(self) -> float:
            steps = self.trainer.max_iter - 1 - self.capture_iter
            if steps < 1:
                raise ValueError(f"no steady steps: {self.trainer.max_iter} iterations")
            return (self.end - self.capture_end) / steps

    return SteadyClock()


def _cuda_graph(n: int, reps: int, writers: Sequence[str], tmpdir: str) -> List[Dict[str, Any]]:
    """The tiny MLP on CUDA: CUDAGraphTrainer (fused SGD) with no hooks and with the default
    stack over the hand-written eager loop. The hand loop is timed between two synchronizations;
    the trainer over its steps after the capture (``steady_clock``: the before_train, warm-up
    and capture are a one-time cost, left out of a rate)."""
    from hookloop.engine import CUDAGraphTrainer

    e, dev = _engine("hookloop"), torch.device("cuda")
    batches = make_batches(dev)

    def hand() -> float:
        model, opt, _ = build(dev)
        torch.cuda.synchronize(dev)

        def run() -> None:
            hand_loop(model, opt, itertools.cycle(batches), n)
            torch.cuda.synchronize(dev)

        return _per_step(run, n, 1e-6)

    def graphed(stack: bool) -> float:
        model, _, _ = build(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=True)
        t = CUDAGraphTrainer(model, itertools.cycle(batches), opt, warmup_iters=GRAPH_WARMUP)
        d = tempfile.mkdtemp(dir=tmpdir)
        make = {"printer": lambda: e.CommonMetricPrinter(n), "tb": lambda: e.TensorboardXWriter(d),
                "json": lambda: e.JSONWriter(os.path.join(d, "metrics.json"))}  # fmt: skip
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [10**9], gamma=0.1)
        clock = steady_clock(dev, GRAPH_WARMUP)
        t.register_hooks([e.IterationTimer(), e.LRScheduler(opt, sched), e.PeriodicWriter(
            [make[w]() for w in writers], PERIOD)] if stack else [])  # fmt: skip
        t.register_hooks([clock])
        t.train(0, n)
        return float(clock.per_step()) * 1e6

    res = _measure({"floor": hand, "graph": functools.partial(graphed, False),
                    "stack": functools.partial(graphed, True)}, reps)  # fmt: skip
    what = "tiny MLP on CUDA: CUDAGraphTrainer{}, over the hand-written eager loop"
    return [_row(what.format(w), "µs/step", f"{n:,} × {reps}", res, {"hookloop": k})
            for w, k in ((", no hooks", "graph"), (" + default stack", "stack"))]  # fmt: skip


def _row(what: str, unit: str, n: str, res: Any, keys: Dict[str, str], floor: str = "floor") -> Any:
    """One row's medians: costs of ``res[keys[engine]]`` over ``res[floor]`` and ratios, each
    formed within a repetition (a ratio over a cost at or under zero would be noise: none)."""
    floor_runs, runs = res[floor], {e: res[k] for e, k in keys.items()}
    cost = {e: [x - f for x, f in zip(v, floor_runs)] for e, v in runs.items()}
    hl, d2 = cost["hookloop"], cost.get("detectron2")
    ratio = [d / h for d, h in zip(d2, hl)] if d2 and min(hl) > 0 else None
    over_floor = [x / f for x, f in zip(runs["hookloop"], floor_runs)]
    return {"what": what, "unit": unit, "n": n, "floor": statistics.median(floor_runs),
            **{e: statistics.median(cost[e]) if e in cost else None for e in ENGINES},
            "hookloop_over_floor": statistics.median(over_floor),
            "detectron2_over_hookloop": statistics.median(ratio) if ratio else None,
            "runs": {"floor": floor_runs, **runs}}  # fmt: skip


def _fmt(x: Optional[float], unit: str = "") -> str:
    digits = 0 if x is None or abs(x) >= 100 else 1 if abs(x) >= 10 else 2
    return "—" if x is None else f"{x:,.{digits}f}{unit}"


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The rows as a markdown table of medians."""
    out = ["| measurement | unit | floor | hookloop | detectron2 | hookloop ÷ floor "
           "| detectron2 ÷ hookloop | n × repeats |", "|---" * 8 + "|"]  # fmt: skip
    for r in rows:
        cells = [*(_fmt(r[k]) for k in ("floor", *ENGINES)), *(_fmt(r[k], "×") for k in RATIOS)]
        out.append(f"| {r['what']} | {r['unit']} | {' | '.join(cells)} | {r['n']} |")
    return "\n".join(out)


def _hook_class(p: argparse.ArgumentParser, spec: str) -> Any:
    """``MODULE:CLASS``, imported and made once now: a mistake is a usage error, not a traceback."""
    from hookloop.engine.train_loop import HookBase

    mod_name, sep, cls_name = spec.partition(":")
    if not sep or not mod_name or not cls_name:
        p.error(f"--hook {spec!r}: expected MODULE:CLASS, e.g. mypkg.hooks:GradNorm")
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
    try:
        cls()
    except Exception as e:
        p.error(f"--hook {spec!r}: {cls_name}() failed: {type(e).__name__}: {e} (the hook is "
                "made with no arguments: a subclass can supply them)")  # fmt: skip
    return cls


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """``hookloop bench`` with parsed ``args`` (``quick``, ``json``, ``hook``, and ``argv``:
    the command's own arguments, as given); ``p`` reports usage errors."""
    hook = (args.hook, _hook_class(p, args.hook)) if args.hook else None
    cuda_graph = getattr(args, "cuda_graph", False)
    if cuda_graph and not torch.cuda.is_available():
        p.error("--cuda-graph needs a CUDA device, and torch finds none here")
    if hookloop.BUILD_PROFILE != "release":
        p.error(f"refusing to benchmark: hookloop._core is a {hookloop.BUILD_PROFILE!r} build; "
                "rebuild with `pip install -e .` or `maturin develop --release`")  # fmt: skip
    torch.set_num_threads(1)  # the model is too small for the intra-op pool; one is less noise
    engines = {"hookloop": _engine("hookloop")}
    # an installed detectron2 on sys.path, not a module a program put in sys.modules
    if importlib.machinery.PathFinder.find_spec("detectron2") is not None:
        with contextlib.suppress(Exception):
            engines["detectron2"] = _engine("detectron2")
    writers = ("printer", "json") + (("tb",) if importlib.util.find_spec("tensorboard") else ())
    n, m, reps = (20_000, 200, 5) if args.quick else (200_000, 2_000, 9)
    d2 = sys.modules["detectron2"] if "detectron2" in engines else None
    cpus = []
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        cpus = [x.split(":", 1)[1].strip() for x in f if x.startswith("model name")]
    info = {"command": " ".join(["hookloop bench", *args.argv]), "cpu": (cpus or ["?"])[0],
            "nproc": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "hookloop": hookloop.__version__,
            "build_profile": hookloop.BUILD_PROFILE,
            "detectron2": getattr(d2, "__version__", "unknown") if d2 else None}  # fmt: skip
    print("\n".join(f"{k}: {v}" for k, v in info.items()) + "\n", flush=True)
    # The printers' loggers at INFO with one handler that drops each record, as the run's
    # logging would be set up: every line is formatted and handled, and nothing is printed.
    loggers = [logging.getLogger(f"{e}.utils.events") for e in ENGINES]
    saved = [(lg.level, lg.propagate, lg.handlers) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
        lg.propagate, lg.handlers = False, [logging.NullHandler()]
    tmpdir, t0 = tempfile.mkdtemp(prefix="hookloop-bench-"), time.perf_counter()
    try:
        rows = _dispatch(engines, n, reps) + _mlp(engines, m, reps, writers, tmpdir, hook)
        loader_rows = _loaders(m, reps, writers, tmpdir)
        if cuda_graph:
            rows += _cuda_graph(m, reps, writers, tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        for lg, (level, propagate, handlers) in zip(loggers, saved):
            lg.setLevel(level)  # also clears the loggers' cached levels
            lg.propagate, lg.handlers = propagate, handlers
    info["seconds"] = round(time.perf_counter() - t0, 1)
    print(format_table(rows) + "\n")
    print(format_loader_table(loader_rows) + "\n")
    print(f"total: {info['seconds']} s. Medians over {reps} interleaved repetitions; each cost "
          "over the floor and each ratio is formed within one repetition. A busy machine makes "
          "them noisy: rerun before quoting one.")  # fmt: skip
    for missing, say in ((d2 is None, "detectron2 is not importable here: its column is left out."),
                         ("tb" not in writers, "tensorboard is not installed: the stacks run "
                          "without TensorBoard.")):  # fmt: skip
        if missing:
            print(say)
    if args.json:
        sizes = {"dispatch_n": n, "mlp_n": m, "loader_n": m, "repeats": reps,
                 "loader_dataset": [LOADER_SIZE, 32], "loader_batch": LOADER_BATCH,
                 "writers": list(writers),
                 "everystep_writers": [w for w in writers if w in EVERYSTEP]}  # fmt: skip
        out = {"machine": info, "sizes": sizes, "engines": list(engines), "rows": rows,
               "loader_rows": loader_rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0
