"""The end-to-end tiny model, for the scripts of ``benches/``: ``hookloop bench``'s.

:class:`TinyMLP` (Linear 32→64, ReLU, Linear 64→1 on batches of 16, SGD with momentum, four
losses: a step cheap enough, a few hundred µs on one CPU thread, that the training loop's
bookkeeping shows), its batches and :func:`build` are those of :mod:`hookloop.bench`. The same
model calls are made by a hand-written loop (:func:`hand_loop`, the floor: data, forward, sum,
zero_grad, backward, step), by a hand-written loop that also does a user's own bookkeeping
(:func:`hand_loop_bookkeeping`), and by each engine's ``SimpleTrainer`` or ``AMPTrainer``
(:func:`make_trainer`); each is timed to the end of its last iteration (:func:`time_hand`,
:func:`time_trainer`), after waiting for the device.
"""

from __future__ import annotations

import functools
import itertools
import logging
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from hookloop import bench
from hookloop.bench import TinyMLP, build, make_batches
from torch import nn

from lab import overhead

__all__ = [
    "TinyMLP",
    "make_batches",
    "build",
    "hand_loop",
    "hand_loop_bookkeeping",
    "native_scheduler",
    "native_available",
    "make_trainer",
    "time_hand",
    "time_trainer",
    "amp_settings",
]

Batch = Tuple[torch.Tensor, torch.Tensor]


def amp_settings(device: torch.device) -> Tuple[str, torch.dtype, bool]:
    """What AMPTrainer uses: float16 with a GradScaler on CUDA, bfloat16 without on the CPU."""
    if device.type == "cuda":
        return "cuda", torch.float16, True
    return "cpu", torch.bfloat16, False


def hand_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: Iterator[Batch],
    n: int,
    amp: bool = False,
    scaler: Optional[Any] = None,
) -> None:
    """The same model calls as ``SimpleTrainer.run_step`` (``AMPTrainer.run_step`` with
    ``amp``), with no bookkeeping: no timing, no metrics, no hooks. Without ``amp``, it is
    ``hookloop bench``'s floor."""
    if not amp:
        bench.hand_loop(model, opt, data, n)
        return
    model.train()
    device_type, dtype, _ = amp_settings(next(model.parameters()).device)
    assert scaler is not None
    for _ in range(n):
        with torch.autocast(device_type=device_type, dtype=dtype):
            loss_dict = model(next(data))
            losses = sum(loss_dict.values())
        opt.zero_grad()
        scaler.scale(losses).backward()
        scaler.step(opt)
        scaler.update()


# The bookkeeping loop's log period (PeriodicWriter's in the default stack).
LOG_PERIOD = 20


@functools.cache
def hand_logger() -> logging.Logger:
    """The bookkeeping loop's logger: enabled at INFO, not propagated, with one NullHandler.
    Each line is built (as the printer builds its own) and becomes a LogRecord that reaches
    the handler, which drops it: no Formatter runs and nothing is written, as for the
    printers' lines under ``overhead.printer_logging``."""
    lg = logging.getLogger("lab.tiny_mlp.hand_loop")
    lg.setLevel(logging.INFO)
    lg.propagate = False
    if not lg.handlers:
        lg.addHandler(logging.NullHandler())
    return lg


def _log_line(log: logging.Logger, it: int, kept: List[torch.Tensor], opt: Any) -> None:
    loss = torch.stack(kept).mean().item()
    kept.clear()
    log.info(f"iter: {it}  total_loss: {loss:.4g}  lr: {opt.param_groups[0]['lr']:.5g}")


def hand_loop_bookkeeping(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    data: Iterator[Batch],
    n: int,
    amp: bool = False,
    scaler: Optional[Any] = None,
    period: int = LOG_PERIOD,
) -> None:
    """:func:`hand_loop` plus the bookkeeping of a user who logs by hand: ``sched.step()``
    after every step; the total loss kept, detached, every step; and every ``period`` steps
    one read of the kept losses (their mean: one ``.item()``) and one log line (iteration,
    that mean, the LR) to :func:`hand_logger`."""
    log = hand_logger()
    kept: List[torch.Tensor] = []
    model.train()
    if not amp:
        for i in range(n):
            loss_dict = model(next(data))
            losses = sum(loss_dict.values())
            opt.zero_grad()
            losses.backward()  # type: ignore[union-attr]
            opt.step()
            sched.step()
            kept.append(losses.detach())  # type: ignore[union-attr]
            if (i + 1) % period == 0:
                _log_line(log, i, kept, opt)
        return
    device_type, dtype, _ = amp_settings(next(model.parameters()).device)
    assert scaler is not None
    for i in range(n):
        with torch.autocast(device_type=device_type, dtype=dtype):
            loss_dict = model(next(data))
            losses = sum(loss_dict.values())
        opt.zero_grad()
        scaler.scale(losses).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        kept.append(losses.detach())  # type: ignore[union-attr]
        if (i + 1) % period == 0:
            _log_line(log, i, kept, opt)


def _schedule_classes(impl: str) -> Tuple[Any, Any, Any]:
    """LRMultiplier, WarmupParamScheduler, MultiStepParamScheduler of engine ``impl``: hookloop's
    (evaluated in Rust), the reference's (detectron2's and fvcore's code, in Python), or
    detectron2's and fvcore's themselves."""
    if impl == "hl":
        from hookloop import solver
        from hookloop.solver import param_scheduler as ps

        return solver.LRMultiplier, solver.WarmupParamScheduler, ps.MultiStepParamScheduler
    if impl == "ref":
        from compat import reference_engine as ref

        return ref.LRMultiplier, ref.WarmupParamScheduler, ref.MultiStepParamScheduler
    if impl == "d2":
        from detectron2 import solver as d2_solver
        from fvcore.common import param_scheduler as fv

        return d2_solver.LRMultiplier, d2_solver.WarmupParamScheduler, fv.MultiStepParamScheduler
    raise ValueError(f"unknown engine {impl!r}")


@functools.cache
def native_available(impl: str) -> bool:
    """Whether engine ``impl``'s schedules import here (detectron2's need detectron2.solver and
    fvcore)."""
    try:
        _schedule_classes(impl)
    except ImportError:
        return False
    return True


def native_scheduler(impl: str, opt: torch.optim.Optimizer, n: int) -> Any:
    """detectron2's way to schedule, with engine ``impl``'s classes:
    ``LRMultiplier(opt, WarmupParamScheduler(MultiStepParamScheduler(...)), n)``, giving on
    every trained iteration the LR of :func:`build`'s MultiStepLR (a warmup of factor 1 over
    0.1% of the run; the one milestone is reached only by the step after the last
    iteration)."""
    multiplier_cls, warmup_cls, multi_step_cls = _schedule_classes(impl)
    multi_step = multi_step_cls([1.0, 0.1], num_updates=n + 1, milestones=[n])
    return multiplier_cls(opt, warmup_cls(multi_step, 1.0, 0.001), n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_hand(
    device: torch.device,
    batches: Sequence[Batch],
    n: int,
    amp: bool = False,
    bookkeeping: bool = False,
    data: Optional[Iterator[Batch]] = None,
) -> float:
    """Seconds for ``n`` steps of :func:`hand_loop` (:func:`hand_loop_bookkeeping` with
    ``bookkeeping``) on a fresh model, over ``batches`` cycled (or ``data`` when given)."""
    model, opt, sched = build(device)
    data = itertools.cycle(batches) if data is None else data
    scaler = torch.amp.GradScaler(device.type, enabled=amp_settings(device)[2]) if amp else None
    _sync(device)
    t0 = time.perf_counter()
    if bookkeeping:
        hand_loop_bookkeeping(model, opt, sched, data, n, amp, scaler)
    else:
        hand_loop(model, opt, data, n, amp, scaler)
    _sync(device)
    return time.perf_counter() - t0


def _ref_amp_trainer() -> Any:
    """detectron2's AMPTrainer.run_step over the reference SimpleTrainer (the reference has
    no AMPTrainer of its own)."""
    from compat import reference_engine as ref

    class RefAMPTrainer(ref.SimpleTrainer):  # type: ignore[misc]
        def __init__(self, model: nn.Module, data_loader: Any, optimizer: Any) -> None:
            super().__init__(model, data_loader, optimizer)
            device = next(model.parameters()).device
            self._device_type, self.precision, enabled = amp_settings(device)
            self.grad_scaler = torch.amp.GradScaler(self._device_type, enabled=enabled)

        def run_step(self) -> None:
            assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            with torch.autocast(device_type=self._device_type, dtype=self.precision):
                loss_dict = self.model(data)
                losses = sum(loss_dict.values())
            self.optimizer.zero_grad()
            self.grad_scaler.scale(losses).backward()
            self.after_backward()
            self._write_metrics(loss_dict, data_time)
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()

    return RefAMPTrainer


_TIMED: Dict[Tuple[str, bool], Any] = {}


def _trainer_cls(impl: str, amp: bool) -> Any:
    """The engine's SimpleTrainer or AMPTrainer, subclassed to record when the last iteration
    ended (after waiting for the device), before after_train's final write and close."""
    key = (impl, amp)
    if key not in _TIMED:
        if not amp:
            base: Any = overhead.engine(impl).SimpleTrainer
        elif impl == "hl":
            from hookloop.engine import AMPTrainer

            base = AMPTrainer
        elif impl == "ref":
            base = _ref_amp_trainer()
        else:
            from detectron2.engine import AMPTrainer as D2AMPTrainer

            base = D2AMPTrainer

        class Timed(base):  # type: ignore[misc, valid-type]
            loop_end: float = 0.0

            def after_train(self) -> None:
                try:
                    _sync(next(self.model.parameters()).device)
                    self.loop_end = time.perf_counter()
                finally:  # the hooks' after_train (writers close) also when that raised
                    super().after_train()

        _TIMED[key] = Timed
    return _TIMED[key]


def make_trainer(
    impl: str,
    device: torch.device,
    batches: Sequence[Batch],
    n: int,
    tmpdir: str,
    hooks: str = "stack",
    amp: bool = False,
    period: int = 20,
    extra: Sequence[Callable[[], Any]] = (),
    writers: Sequence[str] = overhead.ALL_WRITERS,
    data: Optional[Iterable[Batch]] = None,
    json_fsync: Optional[str] = None,
) -> Any:
    """Engine ``impl``'s trainer on a fresh tiny model, its data ``batches`` cycled (or
    ``data`` when given). ``hooks``: ``"stack"`` for
    IterationTimer + LRScheduler(MultiStepLR) + PeriodicWriter([printer, JSON, TensorBoard],
    ``period``) in detectron2's order (``writers`` picks a subset), ``"native"`` for the same
    with :func:`native_scheduler` in place of MultiStepLR, ``"seeds"`` for the stack plus
    cvpods' and xmodaler's every-step writers, ``PeriodicWriter([JSON, TensorBoard], 1)``
    with ``window_size=1`` in files of their own (``overhead.stack_hooks``' ``everystep``),
    ``"none"`` for none; ``extra`` makes more hooks (registered after those); ``json_fsync``:
    hookloop's JSONWriter option (None: its default), for every JSONWriter."""
    if hooks not in ("none", "stack", "native", "seeds"):
        raise ValueError(f"hooks must be 'none', 'stack', 'native' or 'seeds', got {hooks!r}")
    model, opt, sched = build(device)
    if hooks == "native":
        sched = native_scheduler(impl, opt, n)
    loader = itertools.cycle(batches) if data is None else data
    t = _trainer_cls(impl, amp)(model, loader, opt)
    hs: List[Any] = []
    if hooks != "none":
        e = overhead.engine(impl)
        d = tempfile.mkdtemp(prefix=f"mlp-{impl}-", dir=tmpdir)
        everystep = overhead.EVERYSTEP_WRITERS if hooks == "seeds" else ()
        hs = overhead.stack_hooks(e, opt, sched, period, n, d, writers, json_fsync, everystep)
    hs += [make() for make in extra]
    t.register_hooks(hs)
    return t


def time_trainer(trainer: Any, n: int) -> float:
    """Seconds from the start of ``train(0, n)`` to the end of its last iteration."""
    _sync(next(trainer.model.parameters()).device)
    t0 = time.perf_counter()
    trainer.train(0, n)
    return float(trainer.loop_end - t0)
