"""hookloop's own hooks, beyond detectron2's (those are in :mod:`hookloop.engine.hooks`, which
re-exports these): stopping on a preemption signal, stopping early on a plateau, and the
optimizer step as a hook (gradient accumulation, clipping, AMP).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from typing import Any, Callable, Dict, Iterable, Mapping, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from hookloop import _core
from hookloop.engine._args import _callable_arg, _int_arg
from hookloop.engine.stop import Preempted
from hookloop.engine.train_loop import AMPTrainer, HookBase, SimpleTrainer

__all__ = ["EarlyStopping", "OptimizationHook", "Preempted", "PreemptionHandler"]

# The hooks' logger (filters match "hookloop.engine.hooks" for every hook).
logger = logging.getLogger("hookloop.engine.hooks")


class PreemptionHandler(HookBase):
    """Turns a signal (what clusters send before they kill a job) into a clean stop: the
    checkpoint of the last completed iteration is saved and the process exits with
    :class:`Preempted`'s status. Register it after the hooks whose ``after_step`` should still
    run in the iteration the signal arrives in.

    The signal handler only records the signal; at the next step boundary (this hook's
    ``after_step``) the hook calls ``trainer.request_stop()``, so every hook's ``after_step`` of
    that iteration runs, ``PeriodicCheckpointer`` saves the stop iteration in ``after_train``,
    and a resumed run continues from it exactly (unless a loss of the run was not finite: then
    nothing is saved and ``train()`` raises that ``FloatingPointError``). ``after_train``
    restores the handlers that were installed before; then ``train()`` raises
    ``Preempted(signum)``. A signal that
    arrives after the last step is ignored (training finished). Handlers are installed only
    from the main thread (Python's rule); elsewhere the hook logs a warning and does nothing.

    Across processes (``SimpleTrainer``/``AMPTrainer``/``DefaultTrainer`` with more than one
    rank) a signal on any rank stops every rank at the same iteration: the stop rides on the
    next packed metric collective (one every ``gather_metric_period`` iterations, no extra
    collective per step), so it takes effect at the next period boundary, every rank raises
    ``Preempted`` and the main process saves the checkpoint. No collective before
    ``max_iter``: training finishes. Give it a ``gather_metric_period`` short enough for the
    grace period the scheduler allows between SIGTERM and SIGKILL.

    Args:
        signals: the signals to handle (numbers or ``signal.Signals``).
    """

    def __init__(self, signals: Iterable[Any] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        if isinstance(signals, (str, bytes)) or not isinstance(signals, Iterable):
            raise TypeError(
                f"PreemptionHandler signals must be a sequence of signals, "
                f"got {type(signals).__name__}"
            )
        out = []
        for s in signals:
            if isinstance(s, bool) or not isinstance(s, int):
                raise TypeError(f"PreemptionHandler signals must be signal numbers, got {s!r}")
            try:
                sig = signal.Signals(s)
            except ValueError:
                raise ValueError(f"PreemptionHandler signals: {s} is not a signal") from None
            if sig in _UNCATCHABLE:
                raise ValueError(f"PreemptionHandler signals: {sig.name} cannot be caught")
            out.append(sig)
        if not out:
            raise ValueError("PreemptionHandler signals must name at least one signal")
        self._signals = tuple(dict.fromkeys(out))
        self._previous: Dict[signal.Signals, Any] = {}
        #: The signal received in this training run, or None.
        self.signum: Optional[int] = None
        self._stopping = False

    def _handle(self, signum: int, frame: Any) -> None:
        # Only a flag: the handler runs between any two bytecodes of the training thread,
        # where saving (or even logging) is not safe.
        if self.signum is None:
            self.signum = signum

    def before_train(self) -> None:
        self.signum = None
        self._stopping = False
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "PreemptionHandler: training runs outside the main thread, where signal "
                "handlers cannot be installed; signals are not handled"
            )
            return
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def after_step(self) -> None:
        if self.signum is None or self._stopping:
            return
        self._stopping = True
        trainer = self.trainer
        logger.warning(
            f"Received {signal.Signals(self.signum).name} during iteration {trainer.iter}: "
            f"stopping after it, saving a checkpoint, then exiting with status "
            f"{128 + self.signum}"
        )
        trainer.request_stop(Preempted(self.signum))

    def after_train(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            # None: the previous handler was not installed from Python; the default is.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


_UNCATCHABLE = {signal.Signals(s) for s in (signal.SIGKILL, signal.SIGSTOP)}


class EarlyStopping(HookBase):
    """Stops training through ``trainer.request_stop()`` when an evaluated metric has not
    improved for ``patience`` evaluations in a row.

    Register it after the hook that puts the metric (e.g. :class:`EvalHook`): its
    ``after_step`` looks at the metric's latest value when that value was put in the
    current iteration, so each evaluation counts once. A value improves when it is better
    than the best so far by more than ``min_delta``; NaN never improves. The best value and
    the count of evaluations without improvement are in :meth:`state_dict`, so that they
    survive a resume. With a ``PeriodicCheckpointer``, the stop iteration is checkpointed.

    Args:
        metric (str): the metric's name in the storage, e.g. "bbox/AP50".
        patience (int): evaluations without improvement that stop training (>= 1).
        mode (str): "max" or "min": whether larger or smaller is better.
        min_delta (float): the smallest change that counts as an improvement (>= 0).
    """

    def __init__(
        self, metric: str, patience: int, mode: str = "max", min_delta: float = 0.0
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise TypeError(f"EarlyStopping metric must be a non-empty str, got {metric!r}")
        self._patience = _int_arg("EarlyStopping", "patience", patience, 1)
        if mode not in ("max", "min"):
            raise ValueError(f'EarlyStopping mode must be "max" or "min", got {mode!r}')
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)):
            raise TypeError(
                f"EarlyStopping min_delta must be a number, got {type(min_delta).__name__}"
            )
        if not math.isfinite(min_delta) or min_delta < 0:
            raise ValueError(f"EarlyStopping min_delta must be finite and >= 0, got {min_delta}")
        self._metric = metric
        self._mode = mode
        self._min_delta = float(min_delta)
        #: The best value so far and the iteration it was put at.
        self.best: Optional[float] = None
        self.best_iter: Optional[int] = None
        #: Evaluations in a row without improvement.
        self.bad_evals = 0
        self._checked_iter: Optional[int] = None
        self._history: Any = None
        self._seen = -1

    def before_train(self) -> None:
        self._history = None  # a new storage
        self._seen = -1

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return not math.isnan(value)
        if self._mode == "max":
            return value > self.best + self._min_delta
        return value < self.best - self._min_delta

    def after_step(self) -> None:
        # Per iteration: one read of the history's count (a live handle, fetched once).
        history = self._history
        if history is None:
            try:
                history = self._history = self.trainer.storage.history(self._metric)
            except KeyError:
                return
        count = history._count
        if count == self._seen:
            return
        self._seen = count
        value, at = history.values()[-1]
        iteration = self.trainer.iter
        if int(at) != iteration or self._checked_iter == iteration:
            return
        self._checked_iter = iteration
        value = float(value)
        if self._improves(value):
            self.best, self.best_iter, self.bad_evals = value, iteration, 0
            return
        self.bad_evals += 1
        if self.bad_evals >= self._patience:
            logger.info(
                f"EarlyStopping: {self._metric} = {value:.5g} at iteration {iteration}, no "
                f"better than {self.best} (iteration {self.best_iter}) for {self.bad_evals} "
                f"evaluations: stopping"
            )
            self.trainer.request_stop()

    def state_dict(self) -> Dict[str, Any]:
        return {
            "best": self.best,
            "best_iter": self.best_iter,
            "bad_evals": self.bad_evals,
            "checked_iter": self._checked_iter,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or not {"best", "bad_evals"} <= set(state_dict):
            raise ValueError("EarlyStopping.load_state_dict() needs a dict with best and bad_evals")
        best, best_iter = state_dict["best"], state_dict.get("best_iter")
        checked = state_dict.get("checked_iter")
        self.best = None if best is None else float(best)
        self.best_iter = None if best_iter is None else int(best_iter)
        self.bad_evals = int(state_dict["bad_evals"])
        self._checked_iter = None if checked is None else int(checked)


# ----------------------------------------------------------------------------------------------
# Optimization: accumulation, clipping, (scaled) stepping


class OptimizationHook(HookBase):
    """Owns zeroing the gradients, clipping and the (scaled) optimizer step, as the
    runner-style codebases (cvpods, xmodaler) use it: the optimizer steps every
    ``accumulate_grad_steps`` iterations (those where ``iter + 1`` is a multiple of it, and
    the last iteration) and the gradients are zeroed after each step.

    Two kinds of trainer:

    * :class:`SimpleTrainer` / :class:`AMPTrainer` (also as a wrapper's ``trainer._trainer``,
      as in ``DefaultTrainer``), which run the backward themselves: the hook sets their
      ``step_optimizer = False`` in ``before_train`` (the trainer then neither zeroes nor
      steps) and, on a stepping iteration, unscales (AMP), divides the
      accumulated gradients by N, clips and steps (through the trainer's ``grad_scaler``
      under AMP). Its ``after_step`` is not called at all on the other iterations.
    * A trainer whose ``run_step`` runs only the forward and leaves the loss in
      ``trainer.step_outputs["loss_for_backward"]``: ``after_step`` also runs the backward
      of that loss divided by N (scaled by the hook's own ``GradScaler`` when
      ``mixed_precision``; the trainer runs its forward under ``torch.autocast``). A
      ``SimpleTrainer`` subclass that overrides ``run_step`` (cvpods' runners) is told
      apart at its first step: a loss left in ``step_outputs`` makes it this kind.

    Accumulating N steps of batch B gives the update of one step of batch N*B for losses that
    are means over the batch. Under DDP, iterations that do not step run inside
    ``model.no_sync()`` (entered at the end of the previous step's ``after_step``), so the
    gradients are all-reduced once per optimizer step. After a resume at an iteration that
    is not a multiple of N, the first window has fewer micro-batches (gradients are not
    checkpointed).

    Args:
        accumulate_grad_steps (int): N, the iterations whose gradients make one step.
        grad_clipper (callable): called as ``grad_clipper(params)`` before each step, with
            the optimizer's parameters that have a gradient, after unscaling (for example
            ``functools.partial(torch.nn.utils.clip_grad_norm_, max_norm=1.0)``).
        mixed_precision (bool): for a forward-only trainer, scale the loss with a
            ``GradScaler`` (enabled for CUDA parameters; bfloat16 on the CPU needs no
            scaling). With ``AMPTrainer`` its scaler is used either way; with a plain
            ``SimpleTrainer`` it is an error (its backward is not scaled).
    """

    def __init__(
        self,
        accumulate_grad_steps: int = 1,
        grad_clipper: Optional[Callable[..., Any]] = None,
        mixed_precision: bool = False,
    ) -> None:
        self.accumulate_grad_steps = _int_arg(
            "OptimizationHook", "accumulate_grad_steps", accumulate_grad_steps, 1
        )
        if grad_clipper is not None:
            _callable_arg("OptimizationHook", "grad_clipper", grad_clipper)
        if not isinstance(mixed_precision, bool):
            raise TypeError(
                f"OptimizationHook mixed_precision must be a bool, "
                f"got {type(mixed_precision).__name__}"
            )
        self.grad_clipper = grad_clipper
        self.mixed_precision = mixed_precision
        self.grad_scaler: Optional[Any] = None
        self._own_scaler: Optional[Any] = None
        self._no_sync: Optional[Any] = None
        self._ddp: Optional[DistributedDataParallel] = None
        self._restore_switch: Optional[bool] = None
        self._trainer_backward = False

    def _inner(self) -> Optional[SimpleTrainer]:
        """The SimpleTrainer that runs the backward: the trainer, or the one a
        DefaultTrainer-style wrapper keeps as ``_trainer``; None for a forward-only one."""
        trainer = self.trainer
        for t in (trainer, getattr(trainer, "_trainer", None)):
            if isinstance(t, SimpleTrainer):
                return t
        return None

    @staticmethod
    def _runs_own_step(trainer: SimpleTrainer) -> bool:
        """Whether ``trainer.run_step`` is SimpleTrainer's or AMPTrainer's own (which run the
        backward). A subclass's may run only the forward, as cvpods' runners do: the first
        ``after_step`` then looks for the loss in ``step_outputs``."""
        # __class__, not type(): the trainer is usually a weak proxy.
        return trainer.__class__.run_step in (SimpleTrainer.run_step, AMPTrainer.run_step)

    def _model_ddp(self) -> Optional[DistributedDataParallel]:
        model = getattr(self._inner() or self.trainer, "model", None)
        return model if isinstance(model, DistributedDataParallel) else None

    def _dispatch_period(self, stage: str) -> Optional[int]:
        # With a trainer that runs the backward and no DDP, only the stepping iterations need
        # this hook: the dispatcher skips the others (the same rule as _core.periodic_due).
        if (
            stage == "after_step"
            and type(self).after_step is OptimizationHook.after_step
            and self.trainer is not None
            and (inner := self._inner()) is not None
            and self._runs_own_step(inner)
            and self._model_ddp() is None
        ):
            return self.accumulate_grad_steps
        return None

    def before_train(self) -> None:
        trainer = self.trainer
        inner = self._inner()
        optimizer = getattr(inner or trainer, "optimizer", None)
        if optimizer is None or not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"OptimizationHook needs trainer.optimizer (a torch optimizer); "
                f"{type(trainer).__name__} has none"
            )
        self._optimizer = optimizer
        self._trainer_backward = inner is not None
        # A SimpleTrainer subclass with its own run_step: its first step tells which kind.
        self._undecided = inner is not None and not self._runs_own_step(inner)
        if inner is not None:
            if isinstance(inner, AMPTrainer):
                self.grad_scaler = inner.grad_scaler
            elif self._undecided:
                self.grad_scaler = None
            elif self.mixed_precision:
                raise ValueError(
                    "OptimizationHook(mixed_precision=True) with a SimpleTrainer: its backward "
                    "is not scaled; use AMPTrainer, whose grad_scaler the hook then uses"
                )
            else:
                self.grad_scaler = None
            self._restore_switch = inner.step_optimizer
            inner.step_optimizer = False
        elif self.mixed_precision:
            if self._own_scaler is None:
                device = _params_device(optimizer)
                self._own_scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
            self.grad_scaler = self._own_scaler
        else:
            self.grad_scaler = None
        self._ddp = self._model_ddp() if self.accumulate_grad_steps > 1 else None
        # Read once: a per-iteration read through the trainer's weak proxy costs more.
        self._max_iter = trainer.max_iter
        optimizer.zero_grad()
        self._enter_no_sync(trainer.start_iter)

    def _enter_no_sync(self, iteration: int) -> None:
        """Enters ``no_sync()`` for ``iteration`` if it does not step (under DDP)."""
        if self._ddp is None or self._due(iteration):
            return
        ctx = self._ddp.no_sync()
        ctx.__enter__()
        self._no_sync = ctx

    def _exit_no_sync(self) -> None:
        ctx, self._no_sync = self._no_sync, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    _max_iter: Optional[int] = None

    def _due(self, iteration: int) -> bool:
        max_iter = self._max_iter if self._max_iter is not None else self.trainer.max_iter
        return _core.periodic_due(iteration, self.accumulate_grad_steps, max_iter)

    def after_step(self) -> None:
        trainer = self.trainer
        iteration = trainer.iter
        n = self.accumulate_grad_steps
        if self._undecided:
            self._decide(trainer)
        if not self._trainer_backward:
            outputs: Any = getattr(trainer, "step_outputs", None)
            try:
                loss = outputs["loss_for_backward"]
            except (KeyError, TypeError):
                raise KeyError(
                    f"OptimizationHook: trainer.step_outputs has no 'loss_for_backward' at "
                    f"iter {iteration} (a run_step that runs only the forward leaves the loss "
                    f"there)"
                ) from None
            if n > 1:
                loss = loss / n
            if self.grad_scaler is not None:
                loss = self.grad_scaler.scale(loss)
            loss.backward()
        ddp = self._ddp
        if ddp is not None:
            self._exit_no_sync()
        max_iter = self._max_iter if self._max_iter is not None else trainer.max_iter
        if _core.periodic_due(iteration, n, max_iter):
            self._step()
        if ddp is not None:
            self._enter_no_sync(iteration + 1)

    _undecided = False

    def _decide(self, trainer: Any) -> None:
        """After the first step of a SimpleTrainer subclass with its own ``run_step``: a loss
        left in ``step_outputs["loss_for_backward"]`` means it ran only the forward, and this
        hook runs the backward; otherwise the trainer ran it, as SimpleTrainer's does."""
        self._undecided = False
        outputs = getattr(trainer, "step_outputs", None)
        if isinstance(outputs, Mapping) and "loss_for_backward" in outputs:
            self._trainer_backward = False
            if self.mixed_precision and self.grad_scaler is None:
                if self._own_scaler is None:
                    device = _params_device(self._optimizer)
                    self._own_scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
                self.grad_scaler = self._own_scaler
        elif self.mixed_precision and self.grad_scaler is None:
            raise ValueError(
                "OptimizationHook(mixed_precision=True) with a SimpleTrainer: its backward "
                "is not scaled; use AMPTrainer, whose grad_scaler the hook then uses"
            )

    def _step(self) -> None:
        optimizer = self._optimizer
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        if self.grad_clipper is not None or (
            self._trainer_backward and self.accumulate_grad_steps > 1
        ):
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if self._trainer_backward and self.accumulate_grad_steps > 1 and params:
                # The trainer's backward summed N losses; the step is that of their mean.
                torch._foreach_div_([p.grad for p in params], float(self.accumulate_grad_steps))
            if self.grad_clipper is not None:
                self.grad_clipper(params)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()

    def after_train(self) -> None:
        self._exit_no_sync()
        if self._restore_switch is not None:
            inner = self._inner()
            if inner is not None:
                inner.step_optimizer = self._restore_switch
            self._restore_switch = None

    def state_dict(self) -> Dict[str, Any]:
        if self._own_scaler is None:
            return {}
        return {"grad_scaler": self._own_scaler.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if "grad_scaler" not in state_dict:
            return
        if self._own_scaler is None:
            trainer: Any = self.trainer  # a trainer with an optimizer (SimpleTrainer's name)
            device = _params_device(trainer.optimizer)
            self._own_scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
        self._own_scaler.load_state_dict(state_dict["grad_scaler"])


def _params_device(optimizer: Any) -> str:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return str(p.device.type)
    return "cpu"
