"""The training loop, mirroring ``detectron2.engine.train_loop``.

``HookBase``, ``TrainerBase``, ``SimpleTrainer`` and ``AMPTrainer`` keep detectron2's API and
call order. The per-iteration loop and the hook dispatch run in Rust (``hookloop._core``):
``TrainerBase.train`` makes one call into Rust for the whole loop, and each stage calls only
the hooks that override it. Everything that touches torch stays here.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import operator
import threading
import time
import types
import weakref
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from hookloop import _core
from hookloop.checkpoint.rng import get_rng_state, set_rng_state
from hookloop.utils import comm
from hookloop.utils._tensors import read_scalars, stack_scalars
from hookloop.utils.events import _CURRENT_STORAGE_STACK, EventStorage, get_event_storage

__all__ = ["HookBase", "TrainerBase", "SimpleTrainer", "AMPTrainer", "HookStat"]

logger = logging.getLogger(__name__)


def _report_secondary(primary: BaseException, secondary: BaseException, where: str) -> None:
    """An error raised while `primary` propagates: logged at ERROR, and attached to `primary`
    as a note (Python 3.11+), so the first error stays the one raised."""
    logger.error(
        "%s failed while handling %s: %s: %s",
        where,
        type(primary).__name__,
        type(secondary).__name__,
        secondary,
        exc_info=secondary,
    )
    add_note = getattr(primary, "add_note", None)
    if add_note is not None:
        add_note(f"{where} then failed with {type(secondary).__name__}: {secondary}")


class HookBase:
    """Base class for hooks that can be registered with :class:`TrainerBase`.

    Each hook can implement 5 methods, called in this order::

        hook.before_train()
        for iter in range(start_iter, max_iter):
            hook.before_step()
            trainer.run_step()        # calls hook.after_backward() in SimpleTrainer
            hook.after_step()
        iter += 1
        hook.after_train()

    When ``before_train`` or a step raises, :meth:`on_exception` runs first (only in hooks
    that override it), then ``after_train``; the exception then propagates unchanged.

    Notes:
        1. In the hook method, users can access ``self.trainer`` to access more properties
           about the context (e.g., model, current iteration, or config if using
           ``DefaultTrainer``).
        2. A hook that does something in :meth:`before_step` can often be implemented
           equivalently in :meth:`after_step`. If the hook takes non-trivial time, it is
           strongly recommended to implement the hook in :meth:`after_step` instead of
           :meth:`before_step`. The convention is that :meth:`before_step` should only take
           negligible time.
        3. A stage method left as ``HookBase``'s own is never called: the dispatcher skips it.

    Attributes:
        trainer (TrainerBase): A weak reference to the trainer object. Set by the trainer
            when the hook is registered.
    """

    trainer: "TrainerBase" = None  # type: ignore[assignment]

    def before_train(self) -> None:
        """Called before the first iteration."""

    def after_train(self) -> None:
        """Called after the last iteration."""

    def before_step(self) -> None:
        """Called before each iteration."""

    def after_backward(self) -> None:
        """Called after the backward pass of each iteration."""

    def after_step(self) -> None:
        """Called after each iteration."""

    def on_exception(self, exc: BaseException) -> None:
        """Called once, before :meth:`after_train`, when ``before_train`` or a step raised
        ``exc`` (any exception, ``KeyboardInterrupt`` included), for example to save a crash
        checkpoint or log. Only hooks that override it are called, from Python and never per
        iteration. ``exc`` propagates unchanged after it; an error raised here is logged and
        does not replace it."""

    def state_dict(self) -> Dict[str, Any]:
        """Hooks are stateless by default, but can be made checkpointable by implementing
        ``state_dict`` and ``load_state_dict``."""
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned; stateless hooks ignore it."""

    def _dispatch_period(self, stage: str) -> Optional[int]:
        """The period of this hook's ``stage`` method, for the dispatcher's period filter:
        ``None`` (called every time, the default) or N, called only when ``iter + 1`` is a
        multiple of N and at the last iteration. A hook returning N must keep its own check
        for callers that invoke the method directly."""
        return None

    def _dispatch_order(self, stage: str) -> int:
        """Where this hook's ``stage`` method runs among the stage's hooks: by this number
        (0 by default), then in registration order. ``PeriodicCheckpointer`` uses 1 for
        ``after_step`` so that its checkpoint holds the state of every other hook's
        ``after_step`` of that iteration (evaluation results, the best-model record)."""
        return 0

    def __getstate__(self) -> Dict[str, Any]:
        # The trainer is a weak proxy (not picklable); it is set again at registration.
        state = dict(self.__dict__)
        if isinstance(state.get("trainer"), (weakref.ProxyType, weakref.CallableProxyType)):
            del state["trainer"]
        return state

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(state)


class HookStat(NamedTuple):
    """The time one hook spent in one stage, from :meth:`TrainerBase.hook_stats`."""

    hook: Any
    #: ``"before_train"``, ``"before_step"``, ``"after_backward"``, ``"after_step"`` or
    #: ``"after_train"``.
    stage: str
    calls: int
    total_s: float
    max_s: float
    #: ``total_s`` as a fraction of the training time so far (``train()``'s wall time).
    share: float


_STAGES = ("before_train", "after_train", "before_step", "after_step", "after_backward")


def _dispatch_entries(hooks: List[Any]) -> List[Tuple[int, int, Any, Any, int]]:
    """The dispatcher's table for ``hooks``: ``(hook_index, stage_index, function, self,
    period)`` for each stage a hook overrides (a stage left as ``HookBase``'s own is never
    called) or sets on the instance. Methods are resolved here, once per rebuild; a Python
    method is passed as its function and the hook, which the dispatcher calls as
    ``function(hook)`` (one vectorcall, no bound-method object)."""
    entries = []
    orders = []
    for index, hook in enumerate(hooks):
        cls = type(hook)
        own = getattr(hook, "__dict__", {})
        for stage_index, stage in enumerate(_STAGES):
            if stage not in own and getattr(cls, stage, None) is getattr(HookBase, stage):
                continue
            method = getattr(hook, stage, None)
            if method is None:
                # Not a hook at all: fail at the call, as detectron2's loop would.
                method = _missing_stage(hook, stage)
            period_of = getattr(hook, "_dispatch_period", None)
            period = int((period_of(stage) if period_of is not None else None) or 0)
            order_of = getattr(hook, "_dispatch_order", None)
            order = int(order_of(stage)) if order_of is not None else 0
            orders.append((_priority(hook), order))
            if isinstance(method, types.MethodType) and method.__self__ is hook:
                entries.append((index, stage_index, method.__func__, hook, period))
            else:
                entries.append((index, stage_index, method, None, period))
    # By priority, then the hook's order within a stage; stable: registration order otherwise.
    ranked = sorted(range(len(entries)), key=orders.__getitem__)
    return [entries[k] for k in ranked]


#: mmengine's priority names; a hook's ``priority`` may be one of them or an int (lower first).
PRIORITIES = {
    "HIGHEST": 0,
    "VERY_HIGH": 10,
    "HIGH": 30,
    "ABOVE_NORMAL": 40,
    "NORMAL": 50,
    "BELOW_NORMAL": 60,
    "LOW": 70,
    "VERY_LOW": 90,
    "LOWEST": 100,
}


def _priority(hook: Any) -> int:
    """A hook's ``priority`` attribute as an int: NORMAL (50) when it has none, so that
    without priorities hooks run in registration order, as detectron2's do. detectron2 has
    no such notion: a ``priority`` that is neither an int nor one of :data:`PRIORITIES`'
    names (a float, another string, an object) is the hook's own data, and counts as
    NORMAL."""
    p = getattr(hook, "priority", None)
    if isinstance(p, str):
        return PRIORITIES.get(p.upper(), PRIORITIES["NORMAL"])
    if isinstance(p, int) and not isinstance(p, bool):
        return p
    return PRIORITIES["NORMAL"]


def _missing_stage(hook: Any, stage: str) -> Any:
    def call() -> None:
        getattr(hook, stage)()

    return call


def _check_iters(start_iter: Any, max_iter: Any) -> Tuple[int, int]:
    """Both as ints (numpy ints accepted, as range() accepts them), or a clear error."""
    out = []
    for name, value in (("start_iter", start_iter), ("max_iter", max_iter)):
        if isinstance(value, bool):
            raise TypeError(f"train() {name} must be an int, got bool")
        try:
            out.append(operator.index(value))
        except TypeError:
            raise TypeError(f"train() {name} must be an int, got {type(value).__name__}") from None
    start_iter, max_iter = out
    if max_iter < start_iter:
        raise ValueError(f"train() max_iter ({max_iter}) must be >= start_iter ({start_iter})")
    return start_iter, max_iter


class _StopTraining(BaseException):
    """Control flow of :meth:`TrainerBase.request_stop`, caught in ``train()``. A
    ``BaseException``, so that a hook's ``except Exception`` does not swallow it."""


class _StopBeforeNextStep(HookBase):
    """Added to the hook list by :meth:`TrainerBase.request_stop`: the list edit rebuilds the
    dispatcher's table at its next stage, and this hook's ``before_step`` runs first in the
    next iteration, before any other hook's. Until then the loop has no stop check at all."""

    priority = -(2**62)  # before every other hook, whatever its priority

    def before_step(self) -> None:
        raise _StopTraining


def _overrides(hook: Any, stage: str) -> bool:
    return stage in getattr(hook, "__dict__", {}) or getattr(type(hook), stage, None) is not (
        getattr(HookBase, stage)
    )


class TrainerBase:
    """Base class for iterative trainer with hooks.

    The only assumption we made here is: the training runs in a loop. A subclass can
    implement what the loop is. We made no assumptions about the existence of dataloader,
    optimizer, model, etc.

    Attributes:
        iter (int): the current iteration.
        start_iter (int): The iteration to start with. By convention the minimum possible
            value is 0.
        max_iter (int): The iteration to end training.
        storage (EventStorage): An EventStorage that's opened during the course of training.
        stop_requested (bool): whether :meth:`request_stop` was called in this ``train()``.
        stopped_early (bool): whether this ``train()`` ended through :meth:`request_stop`
            before ``max_iter`` (then ``iter`` is the last iteration that completed).
    """

    max_iter: int
    storage: EventStorage

    def __init__(self) -> None:
        self._hooks: List[HookBase] = []
        self._dispatcher = _core.Dispatcher(self._hooks, _dispatch_entries)
        self.iter: int = 0
        self.start_iter: int = 0
        if type(self).after_backward is TrainerBase.after_backward:
            # run_step calls self.after_backward() every iteration: bind it straight to the
            # dispatcher, which saves a Python frame. A subclass's own after_backward is kept.
            self.after_backward = self._dispatcher.after_backward  # type: ignore[method-assign]

    def register_hooks(self, hooks: Iterable[Optional[HookBase]]) -> None:
        """Register hooks to the trainer. The hooks are executed in the order they are
        registered.

        Args:
            hooks (list[Optional[HookBase]]): list of hooks; ``None`` entries are dropped.
        """
        if isinstance(hooks, HookBase) or not isinstance(hooks, Iterable):
            raise TypeError(f"register_hooks() takes a list of hooks, got {type(hooks).__name__}")
        registered = [h for h in hooks if h is not None]
        for h in registered:
            if not isinstance(h, HookBase):
                raise TypeError(
                    f"register_hooks() got {type(h).__name__!r}, which is not a HookBase"
                )
        for h in registered:
            # To avoid circular reference, hooks and trainer cannot own each other. This
            # normally does not matter, but will cause memory leak if the involved objects
            # contain __del__.
            h.trainer = weakref.proxy(self)
        self._hooks.extend(registered)

    def train(self, start_iter: int, max_iter: int) -> None:
        """
        Args:
            start_iter, max_iter (int): See docs above
        """
        start_iter, max_iter = _check_iters(start_iter, max_iter)
        logger.info("Starting training from iteration {}".format(start_iter))

        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        self._stop_requested = False
        self._stop_applied = False
        self.stopped_early = False
        self._raise_after_train = None
        self._train_time = [time.perf_counter(), None]

        with EventStorage(start_iter) as self.storage:
            if self._resume_storage is not None:
                # The recent history of a resumed checkpoint: smoothing and the ETA continue.
                self.storage._load_state(dict(self._resume_storage))
                self.storage.iter = start_iter
                self._resume_storage = None
            # The hook list is re-read (it may have been rebound) and the table rebuilt.
            self._loop_hooks = hooks = self._hooks
            self._dispatcher.begin(hooks, self.storage, max_iter)
            try:
                self.before_train()
                try:
                    self._dispatcher.run_loop(
                        self,
                        start_iter,
                        max_iter,
                        self.run_step,
                        self._overridden("before_step"),
                        self._overridden("after_step"),
                    )
                except _StopTraining:
                    # Raised before any hook of the iteration after the stop: the last one
                    # that completed (every after_step of it ran) is the one before.
                    self.iter -= 1
                    self.stopped_early = True
                    logger.info(f"Training stopped on request after iteration {self.iter}")
                else:
                    # self.iter == max_iter can be used by `after_train` to tell whether the
                    # training successfully finished or failed due to exceptions.
                    self.iter = max_iter
            except BaseException as exc:
                if isinstance(exc, Exception):
                    logger.exception("Exception during training:")
                self._on_exception(exc)
                self._end_loop(hooks)
                # The training error is what propagates: an error of after_train (a writer
                # whose close() meets a full disk) is logged and attached to it as a note,
                # where a plain `finally` would replace it.
                try:
                    self.after_train()
                except Exception as after:
                    _report_secondary(exc, after, "after_train")
                finally:
                    self._train_time[1] = time.perf_counter()
                raise
            self._end_loop(hooks)
            try:
                self.after_train()
            finally:
                self._train_time[1] = time.perf_counter()
        after_stop, self._raise_after_train = self._raise_after_train, None
        if self.stopped_early and self._stop_rides_collective():
            # Every rank stopped after the same iteration: none leaves before the main
            # process's checkpoint of it is on disk (when one process exits, launch() and
            # torchrun stop the others).
            comm.synchronize()
        if after_stop is not None and self.stopped_early:
            raise after_stop

    def _end_loop(self, hooks: List[Any]) -> None:
        """Leaves the loop: no stop can be requested any more, and a stop's hook is removed."""
        self._loop_hooks = None
        if self._stop_applied:
            hooks[:] = [h for h in hooks if not isinstance(h, _StopBeforeNextStep)]

    _loop_hooks: Optional[List[Any]] = None
    _stop_requested = False
    _stop_applied = False
    _raise_after_train: Optional[BaseException] = None
    stopped_early = False

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` was called during the current (or last) ``train()``;
        once a subclass assigns its own ``stop_requested`` (detectron2 has no such name), its
        value, which the loop never reads."""
        return self.__dict__.get("stop_requested", self._stop_requested)  # type: ignore[no-any-return]

    @stop_requested.setter
    def stop_requested(self, value: Any) -> None:
        self.__dict__["stop_requested"] = value

    def request_stop(self, raise_after_train: Optional[BaseException] = None) -> None:
        """Ends training cleanly after the current step: every hook's ``after_step`` of the
        iteration in progress runs, then ``after_train``, with ``iter`` at that iteration
        and :attr:`stopped_early` set (``PeriodicCheckpointer`` then saves a checkpoint of
        it, from which a resume continues at the next iteration). Called before the first
        step (in ``before_train``), no step runs. Costs nothing per iteration until called:
        the stop is a hook added to the list, which the dispatcher sees at its next stage.

        Across processes (``SimpleTrainer``/``AMPTrainer``, also inside ``DefaultTrainer``, with
        more than one rank) the stop is not taken alone: the request rides on the next packed
        metric collective (the one every ``gather_metric_period`` iterations), and every rank
        stops after that iteration, the same one. A stop requested on one rank therefore
        takes effect at the next period boundary (at once when requested in ``run_step``
        before that iteration's collective), and not at all when no collective remains before
        ``max_iter`` (training then finishes). A preemption on one rank
        (:class:`~hookloop.engine.hooks.Preempted`) makes every rank raise it. With
        ``async_write_metrics`` the agreement of one period's collective is applied at the
        next period boundary. Other trainers stop alone.

        Args:
            raise_after_train: an exception that ``train()`` raises after ``after_train``
                when the run stopped early (not when the stop came in the last iteration:
                training then finished normally; ``PreemptionHandler`` passes
                :class:`~hookloop.engine.hooks.Preempted` for the process's exit status).
        """
        hooks = self._loop_hooks
        if hooks is None:
            raise RuntimeError(
                "request_stop() stops a running train() (call it from a hook or run_step); "
                "no training is running"
            )
        if raise_after_train is not None and not isinstance(raise_after_train, BaseException):
            raise TypeError(
                "request_stop() raise_after_train must be an exception, got "
                f"{type(raise_after_train).__name__}"
            )
        if raise_after_train is not None and self._raise_after_train is None:
            self._raise_after_train = raise_after_train
        if self._stop_requested:
            return
        self._stop_requested = True
        if not self._stop_rides_collective():
            self._apply_stop()
        # Else the next packed collective carries it (_outgoing_stop), and _stop_agreed
        # applies it on every rank at the same iteration.

    def _stop_rides_collective(self) -> bool:
        """Whether a stop request waits for the next packed metric collective (a trainer that
        makes one, with more than one rank) instead of being taken at once."""
        return False

    def _apply_stop(self) -> None:
        """Stops before the next step: the stop hook goes into the list, which the dispatcher
        sees at its next stage."""
        hooks = self._loop_hooks
        if self._stop_applied or hooks is None:
            return
        self._stop_applied = True
        hooks.append(_StopBeforeNextStep())

    def _outgoing_stop(self) -> int:
        """What this rank puts in the next collective's stop slot: 0 (no stop pending), 1 (a
        stop), or ``1 + signum`` for a preemption by that signal."""
        if not self._stop_requested or self._stop_applied:
            return 0
        signum = getattr(self._raise_after_train, "signum", None)
        if isinstance(self._raise_after_train, SystemExit) and isinstance(signum, int):
            return 1 + signum
        return 1

    def _stop_agreed(self, code: int) -> None:
        """The largest stop code any rank sent in this iteration's collective: every rank
        stops after this iteration; a preemption anywhere is raised everywhere."""
        if self._loop_hooks is None:
            return
        self._stop_requested = True
        if code > 1 and self._raise_after_train is None:
            from hookloop.engine.hooks import Preempted

            self._raise_after_train = Preempted(code - 1)
        self._apply_stop()

    def _on_exception(self, exc: BaseException) -> None:
        """Each hook's ``on_exception`` that overrides HookBase's, in registration order; their
        own errors are logged so that ``exc`` propagates unchanged."""
        for h in list(self._hooks):
            if not _overrides(h, "on_exception"):
                continue
            try:
                h.on_exception(exc)
            except Exception:
                logger.exception(f"{type(h).__name__}.on_exception raised; re-raising the original")

    def _overridden(self, stage: str) -> Any:
        """The bound stage method if this trainer replaces TrainerBase's, else None: then the
        loop calls the dispatcher's stage directly (the same code TrainerBase's method calls,
        without its Python frame)."""
        if getattr(type(self), stage) is getattr(TrainerBase, stage) and stage not in vars(self):
            return None
        return getattr(self, stage)

    def before_train(self) -> None:
        if self._loop_hooks is None:
            # A loop of the subclass's own (``for self.iter in range(...)`` calling the stages):
            # the dispatcher learns this run's storage and max_iter here, as train() tells it.
            self._begin_own_loop()
        self._dispatcher.before_train()

    def _begin_own_loop(self) -> None:
        storage = getattr(self, "storage", None)
        if isinstance(storage, EventStorage):
            max_iter = getattr(self, "max_iter", None)
            self._dispatcher.begin(
                self._hooks, storage, max_iter if isinstance(max_iter, int) else _NO_MAX_ITER
            )

    def after_train(self) -> None:
        self.storage.iter = self.iter
        self._dispatcher.after_train(self.iter)

    def before_step(self) -> None:
        # Maintain the invariant that storage.iter == trainer.iter for the entire execution
        # of each step
        self.storage.iter = self.iter
        self._dispatcher.before_step(self.iter)

    def after_backward(self) -> None:
        self._dispatcher.after_backward()

    def after_step(self) -> None:
        self._dispatcher.after_step(self.iter)

    def hooks_table(self) -> Dict[str, List[Any]]:
        """The hooks each stage calls, in call order (registration order, unless hooks declare
        a ``priority``): what the dispatcher runs, for checking where a hook lands."""
        return {stage: list(self._dispatcher.hooks_for(stage)) for stage in _STAGES}

    def hook_stats(self) -> List[HookStat]:
        """Per hook and stage, the time spent in it since ``train()`` started: a
        :class:`HookStat` ``(hook, stage, calls, total_s, max_s, share)`` per entry of the
        dispatch table, in call order. Every hook call is timed (one clock read per call, a
        few nanoseconds; ``trainer._dispatcher.timing = False`` turns it off, and the counts
        then stay zero). ``share`` is ``total_s`` over the training time so far."""
        # The dispatcher's counts carry over edits of the hook list (a stop adds and removes
        # one hook of its own, left out here).
        rows = [
            r for r in self._dispatcher.hook_stats() if not isinstance(r[0], _StopBeforeNextStep)
        ]
        start, end = self._train_time
        elapsed = (time.perf_counter() if end is None else end) - start
        return [
            HookStat(h, stage, calls, total, longest, total / elapsed if elapsed > 0 else 0.0)
            for h, stage, calls, total, longest in rows
        ]

    _train_time: List[Any] = [0.0, None]

    def run_step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """The iteration, every stateful hook's state, the RNG states (Python, numpy, torch,
        CUDA), and during training the storage's recent scalar history (what smoothing and the
        ETA need), so that a resumed run continues as if it was never stopped.

        Two stateful hooks of one class are both saved: the first under the class's name (as
        detectron2 keys it), the next ones under ``Name.1``, ``Name.2``, ..."""
        ret: Dict[str, Any] = {"iteration": self.iter}
        hooks_state: Dict[str, Any] = {}
        own_state: Dict[str, Any] = {}
        for key, h in _hook_keys(self._hooks):
            sd = h.state_dict()
            if sd:
                # State of a hook that detectron2 has but keeps stateless (it would call a
                # load_state_dict that its hook lacks) goes where detectron2 does not look.
                beyond = getattr(type(h), "_STATE_BEYOND_DETECTRON2", False)
                (own_state if beyond else hooks_state)[key] = sd
        if hooks_state:
            ret["hooks"] = hooks_state
        if own_state:
            ret[_OWN_HOOK_STATE] = own_state
        ret["rng"] = get_rng_state()
        storage = getattr(self, "storage", None)
        if storage is not None and storage in _CURRENT_STORAGE_STACK:
            ret["storage"] = storage._state(keep=_RESUME_HISTORY)
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or "iteration" not in state_dict:
            raise ValueError("load_state_dict() needs a dict with an 'iteration' key")
        self.iter = state_dict["iteration"]
        hooks = dict(_hook_keys(self._hooks))
        saved = {**state_dict.get("hooks", {}), **state_dict.get(_OWN_HOOK_STATE, {})}
        for key, value in saved.items():
            h = hooks.get(key)
            if h is None:
                logger.warning(f"Cannot find the hook '{key}', its state_dict is ignored.")
                continue
            h.load_state_dict(value)
        if "rng" in state_dict:
            set_rng_state(state_dict["rng"])
        # Applied to the storage that the next train() opens.
        self._resume_storage = state_dict.get("storage")

    _resume_storage: Optional[Mapping[str, Any]] = None


# The trainer state's key for hooks whose state detectron2 does not keep (BestCheckpointer's
# best value): detectron2 reads only "hooks", so it resumes from a hookloop checkpoint.
_OWN_HOOK_STATE = "hookloop_hooks"

# max_iter for a loop that never set one: no iteration is the last.
_NO_MAX_ITER = 2**53

# Entries kept per scalar in a checkpoint: the printer's ETA takes the median of the last 1000
# `time` values, and writers smooth over windows of 20 by default.
_RESUME_HISTORY = 1000


def _hook_keys(hooks: Iterable[Any], qualified: bool = True) -> List[Tuple[str, Any]]:
    """(key, hook) for the hooks' state in a checkpoint: the class's qualified name (its plain
    name unless ``qualified``), then ``Name.1``, ``Name.2`` for later hooks of the same class."""
    seen: Dict[str, int] = {}
    out = []
    for h in hooks:
        name = type(h).__qualname__ if qualified else type(h).__name__
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append((name if n == 0 else f"{name}.{n}", h))
    return out


class SimpleTrainer(TrainerBase):
    """A simple trainer for the most common type of task: single-cost single-optimizer
    single-data-source iterative optimization, optionally using data-parallelism.

    It assumes that every step, you:

    1. Compute the loss with a data from the data_loader.
    2. Compute the gradients with the above loss.
    3. Update the model with the optimizer.

    All other tasks during training (checkpointing, logging, evaluation, LR schedule) are
    maintained by hooks, which can be registered by :meth:`TrainerBase.register_hooks`.

    Args:
        model: a torch Module. Takes a data from data_loader and returns a dict of losses
            (or a single loss tensor).
        data_loader: an iterable. Contains data to be used to call model.
        optimizer: a torch optimizer.
        gather_metric_period: an int. Every gather_metric_period iterations the metrics are
            gathered from all the ranks to rank 0 and logged.
        zero_grad_before_forward: whether to zero the gradients before the forward.
        async_write_metrics: bool. If True, then write metrics asynchronously to improve
            training speed. A ``FloatingPointError`` found there stops training on the
            training thread at the next step (detectron2 only logs it).
        check_finite_every_step: bool. By default (False) the losses are kept as tensors and
            read in one batch, without a device synchronization per step: before anything
            reads the storage (a writer, a hook's ``latest()``) and at least every
            ``METRICS_READ_EVERY`` recorded iterations. The values and iterations stored are
            the same; a non-finite loss raises ``FloatingPointError`` naming the iteration
            where it appeared, up to that many iterations later. True reads them at every
            step, as detectron2 does.

    Attributes:
        step_optimizer (bool): whether :meth:`run_step` zeroes the gradients and steps the
            optimizer (``AMPTrainer``: and its grad scaler). True by default;
            :class:`~hookloop.engine.hooks.OptimizationHook` sets it to False in its
            ``before_train`` and does both itself (every N iterations with accumulation).
    """

    #: At most this many recorded iterations of losses wait, as tensors, for one batched read.
    METRICS_READ_EVERY = 20

    step_optimizer = True

    def __init__(
        self,
        model: torch.nn.Module,
        data_loader: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        gather_metric_period: int = 1,
        zero_grad_before_forward: bool = False,
        async_write_metrics: bool = False,
        *,
        check_finite_every_step: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(gather_metric_period, bool) or not isinstance(gather_metric_period, int):
            raise TypeError(
                f"gather_metric_period must be an int, got {type(gather_metric_period).__name__}"
            )
        if gather_metric_period <= 0:
            raise ValueError(f"gather_metric_period must be positive, got {gather_metric_period}")
        model.train()
        self.model = model
        self.data_loader = data_loader
        # to access the data loader iterator, call `self._data_loader_iter`
        self._data_loader_iter_obj: Optional[Any] = None
        self.optimizer = optimizer
        self.gather_metric_period = gather_metric_period
        self.zero_grad_before_forward = zero_grad_before_forward
        self.async_write_metrics = async_write_metrics
        self.check_finite_every_step = check_finite_every_step
        # One worker, so metric writes run in submission order.
        self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._init_metric_state()

    #: Read in before_train; a subclass that skips SimpleTrainer.__init__ gets detectron2's
    #: per-step reads unless it sets it.
    check_finite_every_step = False
    _deferring = False
    # None until _init_metric_state ran: a subclass that skips SimpleTrainer.__init__ (calls
    # TrainerBase.__init__ and sets detectron2's attributes itself) gets the state in
    # before_train or after_train, whichever runs first.
    _settle_lock: Any = None

    def _init_metric_state(self) -> None:
        """hookloop's own state for writing metrics (none of it is detectron2's): pending
        asynchronous writes, losses recorded but not read yet, and their lock."""
        self._pending_writes: Deque[concurrent.futures.Future] = deque()
        # Losses recorded but not read yet: (iteration, data_time, loss_dict, prefix). The
        # training thread appends to this one list without a lock (an append is atomic); a
        # settle, which any thread reading the storage may run, removes what it takes, under
        # _settle_lock. The list is never replaced: an append made while a settle runs lands
        # either in what it takes or in a list it left empty (and that append sets the
        # storage's flag again).
        self._pending_metrics: List[Tuple[int, float, Mapping[str, Any], str]] = []
        self._settle_lock = threading.RLock()
        # Losses of earlier iterations on their way to the host (a CUDA copy not waited for).
        self._in_flight: List[Tuple[List[Tuple[int, float, Mapping[str, Any], str]], Any]] = []
        this = weakref.ref(self)  # the storage holds this function: no trainer <-> storage cycle

        def settle() -> None:
            trainer = this()
            if trainer is not None:
                trainer._settle_metrics()

        self._settler = settle

    def before_train(self) -> None:
        if self._settle_lock is None:
            self._init_metric_state()
        # Deferred reads in one process; the per-step path when asked for, for asynchronous
        # writes, and across processes (whose reduction is per write).
        self._deferring = not (
            self.check_finite_every_step
            or self.async_write_metrics
            or (comm._initialized() and comm.get_world_size() > 1)
        )
        super().before_train()

    def run_step(self) -> None:
        """Implement the standard training logic described above."""
        if not self.model.training:
            raise RuntimeError("[SimpleTrainer] model was changed to eval mode!")
        start = time.perf_counter()
        try:
            data = next(self._data_loader_iter)
        except StopIteration:  # a finite loader: the next epoch (free while not raised)
            data = self._next_epoch()
        data_time = time.perf_counter() - start

        if self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()

        loss_dict, losses = _losses(self.model(data), "SimpleTrainer")
        if not self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()
        losses.backward()

        self.after_backward()

        if self.async_write_metrics:
            self._submit_metrics(loss_dict, data_time)
        else:
            self._write_metrics(loss_dict, data_time)

        if self.step_optimizer:
            self.optimizer.step()

    def _submit_metrics(self, loss_dict: Mapping[str, torch.Tensor], data_time: float) -> None:
        """Writes metrics on the executor thread, after re-raising any earlier write's error.
        The executor gets a copy of the loss dict: the model may refill its dict at the next
        step before the executor reads it (detectron2 hands over the model's own)."""
        self._raise_async_errors()
        it = self.iter
        loss_dict = dict(loss_dict)
        if (it + 1) % self.gather_metric_period == 0 and self._stop_rides_collective():
            # Across ranks: the stop agreed in the previous period's collective is taken
            # here, at the same iteration on every rank (the wait is for a write a period
            # old); this period's collective carries the stop code read now.
            self._wait_for_metric_writes()
            owner = self._stop_owner()
            agreed, self._async_stop = self._async_stop, 0
            if agreed:
                owner._stop_agreed(agreed)
            # Its own group: on the default one, this thread's collective could meet DDP's
            # all-reduces in a different order on each rank (made here, on the training
            # thread, where every rank reaches the first one at the same point).
            group = comm._get_off_thread_group()
            stop = owner._outgoing_stop()
            self._pending_writes.append(
                self.concurrent_executor.submit(
                    self._write_metrics_async, loss_dict, data_time, it, stop, group
                )
            )
            return
        self._pending_writes.append(
            self.concurrent_executor.submit(self._write_metrics, loss_dict, data_time, iter=it)
        )

    def _wait_for_metric_writes(self) -> None:
        """Waits for the asynchronous metric writes queued so far, re-raising the first error.
        A periodic writer calls this when it is due, so its lines carry every loss of the
        iterations they cover, as in the synchronous mode."""
        pending = self._pending_writes
        while pending:
            pending.popleft().result()

    def _raise_async_errors(self) -> None:
        """Re-raises, on the training thread, an exception from a finished asynchronous metric
        write (the oldest first)."""
        pending = self._pending_writes
        while pending and pending[0].done():
            pending.popleft().result()

    @property
    def _data_loader_iter(self) -> Any:
        # only create the data loader iterator when it is used
        if self._data_loader_iter_obj is None:
            # Where the sampler starts, before a prefetching loader moves it on: a checkpoint
            # records the position of the batches actually consumed from here.
            self._data_start = _sampler_state(self.data_loader)
            self._data_start_iter = self.iter
            if self._resumed_rng:
                # A DataLoader draws its base seed from torch's RNG when its iterator is made.
                # An uninterrupted run made it at the first iteration; a resumed run must not
                # shift the RNG stream it restored, so that draw is undone.
                rng = torch.random.get_rng_state()
                self._data_loader_iter_obj = iter(self.data_loader)
                torch.random.set_rng_state(rng)
                self._resumed_rng = False
            else:
                self._data_loader_iter_obj = iter(self.data_loader)
        return self._data_loader_iter_obj

    #: The epoch of a finite data loader (0 for the first pass; infinite loaders stay at 0).
    epoch = 0
    # Batches taken in the current epoch before this train() (from a resumed checkpoint).
    _epoch_batches_before = 0
    _epoch_start_iter = 0

    @property
    def iters_per_epoch(self) -> Optional[int]:
        """``len(data_loader)`` when the loader has a length, else None; once a subclass
        assigns its own (as xmodaler-style trainers do), that value."""
        if "iters_per_epoch" in self.__dict__:
            return self.__dict__["iters_per_epoch"]  # type: ignore[no-any-return]
        loader = self.data_loader
        if type(loader) in _NO_LEN:
            return None  # asked at every write: no TypeError raised and caught each time
        try:
            return len(loader)  # type: ignore[arg-type]
        except TypeError:
            return None

    @iters_per_epoch.setter
    def iters_per_epoch(self, value: Optional[int]) -> None:
        self.__dict__["iters_per_epoch"] = value

    def _next_epoch(self) -> Any:
        """The first batch of the next pass over a finite loader: ``epoch`` advances and the
        sampler's ``set_epoch(epoch)`` is called when it has one (detectron2-style runners).
        A one-shot iterator (a generator) has no next epoch: its ``StopIteration`` ends
        training, as in detectron2."""
        if iter(self.data_loader) is self.data_loader:
            raise StopIteration
        self.epoch += 1
        self._epoch_start_iter = self.iter
        self._epoch_batches_before = 0
        set_epoch = getattr(_sampler(self.data_loader), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        self._data_loader_iter_obj = None
        try:
            return next(self._data_loader_iter)
        except StopIteration:
            raise ValueError(
                f"the data loader ({type(self.data_loader).__name__}) yields no batches"
            ) from None

    _data_start: Optional[Dict[str, Any]] = None
    _data_start_iter = 0
    _resumed_rng = False

    def _resume_epoch(self, epoch: int, batches: int) -> None:
        """Continues a finite loader at ``batches`` into ``epoch``: the sampler gets
        ``set_epoch(epoch)`` (so a seeded sampler repeats that epoch's order) and the batches
        already used are drawn and dropped (a finite loader has no position to seek to)."""
        self.epoch = epoch
        set_epoch = getattr(_sampler(self.data_loader), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self._data_loader_iter_obj = None
        rng = get_rng_state()  # drawing batches must not move the restored random streams
        it = self._data_loader_iter
        for _ in range(batches):
            if next(it, _END) is _END:
                break
        set_rng_state(rng)
        self._resumed_rng = False
        self._epoch_batches_before = batches
        self._epoch_start_iter = self.iter + 1  # the first iteration of the resumed run

    def _data_state(self) -> Dict[str, Any]:
        """The data position for a checkpoint saved at the end of iteration ``self.iter``:
        the loader's own ``state_dict()`` when it has one, else its sampler's state moved on
        by the batches consumed since the iterator was created (one per iteration)."""
        loader = self.data_loader
        own = getattr(loader, "state_dict", None)
        if callable(own):
            return {"loader": own()}
        if self._data_loader_iter_obj is None or self._data_start is None:
            return {}
        batches = self.iter + 1 - self._data_start_iter
        batch_size = _batch_size(loader)
        if batch_size is None or "position" not in self._data_start:
            return {}
        state = dict(self._data_start)
        state["position"] = state["position"] + batches * batch_size * comm.get_world_size()
        return {"sampler": state}

    def _load_data_state(self, data: Mapping[str, Any]) -> None:
        if "epoch" in data:
            self._resume_epoch(int(data["epoch"]), int(data["epoch_batches"]))
            return
        loader = self.data_loader
        own = getattr(loader, "load_state_dict", None)
        sampler = _sampler(loader)
        if "loader" in data and callable(own):
            own(data["loader"])
        elif "sampler" in data and sampler is not None and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(data["sampler"])
        else:
            logger.warning(
                f"The data loader ({type(loader).__name__}) cannot be resumed: it has no "
                "state_dict() and no resumable sampler (hookloop.data.TrainingSampler); "
                "training continues with its data from its current position."
            )
            return
        self._data_loader_iter_obj = None

    def reset_data_loader(self, data_loader_builder: Any) -> None:
        """Delete and replace the current data loader with a new one, which will be created
        by calling ``data_loader_builder`` (without argument)."""
        del self.data_loader
        data_loader = data_loader_builder()
        self.data_loader = data_loader
        self._data_loader_iter_obj = None

    def _write_metrics(
        self,
        loss_dict: Mapping[str, torch.Tensor],
        data_time: float,
        prefix: str = "",
        iter: Optional[int] = None,
    ) -> None:
        iter = self.iter if iter is None else iter
        if (iter + 1) % self.gather_metric_period == 0:
            if self._deferring:
                # Kept as tensors: no device synchronization, no torch call, this step. The
                # dict is copied: a model may return the same dict every step, refilled.
                pending = self._pending_metrics
                pending.append((iter, data_time, dict(loss_dict), prefix))
                if len(pending) == 1:
                    self.storage._defer(self._settler)
                elif len(pending) >= self.METRICS_READ_EVERY:
                    self._read_pending()
                return
            owner = self._stop_owner()
            try:
                agreed = _write_metrics_across(
                    loss_dict, data_time, iter, prefix, owner._outgoing_stop()
                )
            except Exception:
                logger.exception("Exception in writing metrics: ")
                raise
            if agreed:
                owner._stop_agreed(agreed)

    def _stop_owner(self) -> TrainerBase:
        """The trainer whose loop a stop ends: this one, or the ``DefaultTrainer``-style
        wrapper that runs this one's steps (``_stop_owner_ref``)."""
        ref = self._stop_owner_ref
        owner = ref() if ref is not None else None
        return self if owner is None else owner

    _stop_owner_ref: Optional["weakref.ReferenceType[TrainerBase]"] = None

    def _stop_rides_collective(self) -> bool:
        return comm._initialized() and comm.get_world_size() > 1

    def _write_metrics_async(
        self,
        loss_dict: Mapping[str, torch.Tensor],
        data_time: float,
        iter: int,
        stop: int,
        group: Any,
    ) -> None:
        """``_write_metrics`` on the executor thread, with the stop code the training thread
        read at this step; the agreed code waits for the training thread (_submit_metrics)."""
        if (iter + 1) % self.gather_metric_period != 0:
            return
        try:
            agreed = _write_metrics_across(loss_dict, data_time, iter, "", stop, group)
        except Exception:
            logger.exception("Exception in writing metrics: ")
            raise
        if agreed:
            self._async_stop = agreed

    _async_stop = 0

    #: At most this many batches of CUDA losses are copied to the host without being waited for
    #: (until something reads the storage); then they are read.
    MAX_IN_FLIGHT = 50

    def _read_pending(self) -> None:
        """The pending losses are METRICS_READ_EVERY iterations long. CUDA losses start their
        copy to the host (one stack, one non-blocking copy into pinned memory, an event after
        it) without waiting for it, so no iteration synchronizes until something reads the
        storage; other losses are put now."""
        with self._settle_lock:
            pending = self._pending_metrics
            tensors = (
                _losses_if(pending, _is_cuda) if len(self._in_flight) < self.MAX_IN_FLIGHT else None
            )
            flat = stack_scalars(tensors) if tensors else None
            if flat is not None:
                self._in_flight.append((self._take_pending(), _HostCopy(flat)))
                return  # the storage's deferred flag stays set: a read completes the copy
        self.storage._settle()

    def _take_pending(self) -> List[Tuple[int, float, Mapping[str, Any], str]]:
        """The pending entries, removed from the list in place (under ``_settle_lock``): what
        the training thread appends meanwhile stays for the next settle."""
        pending = self._pending_metrics
        taken = pending[:]
        del pending[: len(taken)]
        return taken

    def _settle_metrics(self) -> None:
        """Puts the pending losses of every recorded iteration with the one write_metrics
        rule, in one call into the core per batch. Losses on a device are read in one batch
        (one stack, one copy to the host: one synchronization, or a wait for a copy started
        earlier); on the CPU the core reads each with ``item()``, which costs less than
        stacking many small tensors."""
        with self._settle_lock:
            in_flight, self._in_flight = self._in_flight, []
            pending = self._take_pending()
            batches: List[Tuple[List[Any], Optional[List[float]]]] = [
                (entries, copy.values()) for entries, copy in in_flight
            ]
            if pending:
                # The first loss on the CPU (every settle of a CPU run): _losses_if stops
                # there and the core reads them all (a stray device tensor is still read, with
                # item()).
                tensors = _losses_if(pending, _off_cpu)
                batches.append((pending, read_scalars(tensors) if tensors else None))
            try:
                for entries, values in batches:
                    self.storage._write_metrics_batch(entries, values)
            except Exception:
                logger.exception("Exception in writing metrics: ")
                raise

    @staticmethod
    def write_metrics(
        loss_dict: Mapping[str, torch.Tensor],
        data_time: float,
        cur_iter: int,
        prefix: str = "",
    ) -> None:
        """
        Args:
            loss_dict (dict): dict of scalar losses
            data_time (float): time taken by the dataloader iteration
            cur_iter (int): the iteration the metrics belong to
            prefix (str): prefix for logging keys

        What is put is one rule in the core (``metrics::write_metrics``): ``rank_data_time``
        on every rank; on the main process ``data_time`` (the max over ranks),
        ``{prefix}total_loss`` and, with several losses, each loss (the mean over ranks).
        """
        _write_metrics_across(loss_dict, data_time, cur_iter, prefix, 0)

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["optimizer"] = self.optimizer.state_dict()
        data = self._data_state()
        if self.iters_per_epoch is not None:
            # A finite loader: the epoch and the batches taken in it (one per iteration).
            data["epoch"] = self.epoch
            data["epoch_batches"] = (
                self._epoch_batches_before + self.iter + 1 - max(self._epoch_start_iter, 0)
            )
        if data:
            ret["data"] = data
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if "data" in state_dict:
            self._load_data_state(state_dict["data"])
        self._resumed_rng = "rng" in state_dict

    def after_train(self) -> None:
        if self._settle_lock is None:
            self._init_metric_state()
        settle_error: Optional[BaseException] = None
        try:
            self.storage._settle()  # the last deferred losses, before the hooks read them
        except Exception as error:
            settle_error = error
        try:
            super().after_train()
        finally:
            self.concurrent_executor.shutdown(wait=True)
            self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        errors = [e for e in (f.exception() for f in self._pending_writes) if e is not None]
        if settle_error is not None:
            errors.insert(0, settle_error)
        self._pending_writes.clear()
        # A write that failed after the last step stops a run that otherwise succeeded; when
        # training already failed (maybe on an earlier such error), later ones are its echo.
        if errors and (self.iter == self.max_iter or self.stopped_early):
            raise errors[0]
        for e in errors:
            logger.error("Asynchronous metric write failed after training stopped: %r", e)


def _write_metrics_across(
    loss_dict: Mapping[str, torch.Tensor],
    data_time: float,
    cur_iter: int,
    prefix: str,
    stop: int,
    group: Optional[Any] = None,
) -> int:
    """``SimpleTrainer.write_metrics``, which also carries this rank's stop code (see
    ``TrainerBase._outgoing_stop``) in the packed collective (on ``group``, by default the
    default group): returns the largest any rank sent (0 in one process, where a stop never
    waits for a collective)."""
    # get_event_storage(), inlined: this runs every step.
    storage = _CURRENT_STORAGE_STACK[-1] if _CURRENT_STORAGE_STACK else get_event_storage()
    if type(loss_dict) is not dict:
        if not isinstance(loss_dict, Mapping):
            raise TypeError(
                f"write_metrics() needs a dict of losses, got {type(loss_dict).__name__}"
            )
        loss_dict = dict(loss_dict)
    if not comm._initialized() or comm.get_world_size() == 1:
        # One process: the reduced values are its own; the core reads each loss with
        # item() (what detectron2's v.detach().cpu().item() computes, without the copies).
        storage._write_metrics(loss_dict, data_time, data_time, cur_iter, prefix)
        return 0
    names = list(loss_dict)
    # One packed collective: every rank's losses, data time and stop code in one float64
    # tensor, all-gathered once (detectron2 pickles a dict per rank through gather_object).
    # Every rank gets every value, so a non-finite total fails on all ranks at this
    # iteration, not on the main process alone while the others wait in their next
    # collective, and a stop asked for on one rank stops every rank after this iteration.
    packed = read_scalars([v for v in loss_dict.values()]) + [float(data_time), float(stop)]
    gathered = _all_gather_floats(packed, len(names), cur_iter, group)
    # data_time among workers can have high variance. The actual latency caused by
    # data_time is the maximum among workers.
    max_data_time = max(row[-2] for row in gathered)
    agreed = int(max(row[-1] for row in gathered))
    reduced = {k: _mean([row[i] for row in gathered]) for i, k in enumerate(names)}
    if comm.is_main_process():
        storage._write_metrics(reduced, data_time, max_data_time, cur_iter, prefix)
        return agreed
    storage._write_metrics(None, data_time, None, cur_iter, prefix)
    total = sum(reduced.values())
    if not math.isfinite(total):
        import numpy as np

        # The main process's message (the core's): the dict of numpy means, as detectron2's.
        means = {k: np.float64(v) for k, v in reduced.items()}
        raise FloatingPointError(
            f"Loss became infinite or NaN at iteration={cur_iter}!\nloss_dict = {means}"
        )
    return agreed


def _all_gather_floats(
    values: List[float], n_losses: int, cur_iter: int, group: Optional[Any] = None
) -> List[List[float]]:
    """Every rank's ``values`` (losses, data time, stop code), with one all_gather of one
    tensor on ``group`` (the default group when None)."""
    import torch.distributed as dist

    world = comm.get_world_size()
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    chunks = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(chunks, mine, group=group)
    rows = torch.stack(chunks).cpu().tolist()
    if any(len(r) != n_losses + 2 for r in rows):  # pragma: no cover - shapes are fixed
        raise ValueError(f"ranks reported different numbers of losses at iteration {cur_iter}")
    return rows


def _losses_if(
    pending: List[Tuple[int, float, Mapping[str, Any], str]], accept: Any
) -> Optional[List[Any]]:
    """Every loss of the ``pending`` iterations, when ``accept`` takes each of them (tried on
    the first one before the list is built), else None."""
    if not accept(next(iter(pending[0][2].values()), None)):
        return None
    values = [v for _, _, losses, _ in pending for v in losses.values()]
    return values if all(map(accept, values)) else None


def _off_cpu(value: Any) -> bool:
    # is_cpu, not .device.type: a device object per call costs seven times as much
    return isinstance(value, torch.Tensor) and not value.is_cpu


_END = object()

# Iterables that never have a length (the infinite loaders detectron2-style code passes).
_NO_LEN = frozenset({itertools.cycle, itertools.count, itertools.repeat, types.GeneratorType})


def _is_cuda(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cuda


class _HostCopy:
    """Losses stacked on a CUDA device (``stack_scalars``) on their way to the host, copied
    without blocking into pinned memory, with an event recorded after the copy.
    :meth:`values` waits for that event only (not for the whole device)."""

    def __init__(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            self._host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            # On the stream of the losses' device (the copy's), not the current device's.
            self._event = torch.cuda.current_stream(flat.device).record_event()

    def values(self) -> List[float]:
        self._event.synchronize()
        return self._host.reshape(-1).tolist()


def _losses(out: Any, who: str) -> Tuple[Mapping[str, torch.Tensor], torch.Tensor]:
    """The model's output as (loss dict, summed loss): a loss tensor (named ``total_loss``)
    or a non-empty dict of str -> loss tensor. Anything else is a TypeError/ValueError saying
    what run_step expected and what it got."""
    if isinstance(out, torch.Tensor):
        return {"total_loss": out}, out
    if type(out) is dict and out:
        # The per-step path: the keys' type and one sum; the checks below only when it fails.
        try:
            total = _sum(out.values())
        except TypeError:  # values that do not add up: the checks below say which
            total = None
        if isinstance(total, torch.Tensor) and _ONLY_STR.issuperset(map(type, out)):
            return out, total
    expected = "a loss tensor or a dict of str -> loss tensor"
    if not isinstance(out, Mapping):
        raise TypeError(f"[{who}] the model must return {expected}, got {type(out).__name__}")
    if not out:
        raise ValueError(f"[{who}] the model must return {expected}, got an empty dict")
    for name, value in out.items():
        if not isinstance(name, str):
            raise TypeError(
                f"[{who}] the model's loss dict must have str keys, got {type(name).__name__} "
                f"key {name!r}"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"[{who}] the model's loss '{name}' must be a tensor, got {type(value).__name__}"
            )
    return out, _sum(out.values())


_ONLY_STR = frozenset({str})


def _sum(values: Iterable[Any]) -> Any:
    """``sum(values)`` started from the first value instead of 0: ``0 + tensor`` goes through
    ``Tensor.__radd__`` and costs about as much as two tensor additions (the values are the
    same; the graph has one add fewer)."""
    it = iter(values)
    total = next(it)
    for v in it:
        total = total + v
    return total


def _sampler(loader: Any) -> Any:
    """The sampler that orders a loader's data: a DataLoader's ``batch_sampler.sampler`` or
    ``sampler``, or the loader itself when it is a sampler."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if sampler is None:
        sampler = getattr(loader, "sampler", None)
    return sampler


def _sampler_state(loader: Any) -> Optional[Dict[str, Any]]:
    sampler = _sampler(loader)
    state_dict = getattr(sampler, "state_dict", None)
    return dict(state_dict()) if callable(state_dict) else None


def _batch_size(loader: Any) -> Optional[int]:
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _mean(values: List[float]) -> float:
    """numpy.mean of the values gathered from the ranks."""
    import numpy as np

    return float(np.mean(values))


class AMPTrainer(SimpleTrainer):
    """Like :class:`SimpleTrainer`, but uses automatic mixed precision in the training loop.

    Without CUDA it runs on the CPU with bfloat16 autocast (detectron2 asserts instead); a
    float16 ``precision`` then becomes bfloat16, which CPU autocast supports.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data_loader: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        gather_metric_period: int = 1,
        zero_grad_before_forward: bool = False,
        grad_scaler: Optional[Any] = None,
        precision: torch.dtype = torch.float16,
        log_grad_scaler: bool = False,
        async_write_metrics: bool = False,
        *,
        check_finite_every_step: bool = False,
    ) -> None:
        unsupported = "AMPTrainer does not support single-process multi-device training!"
        if isinstance(model, DistributedDataParallel):
            if model.device_ids and len(model.device_ids) > 1:
                raise ValueError(unsupported)
        if isinstance(model, DataParallel):
            raise ValueError(unsupported)
        if not isinstance(precision, torch.dtype):
            raise TypeError(f"precision must be a torch.dtype, got {type(precision).__name__}")

        super().__init__(
            model,
            data_loader,
            optimizer,
            gather_metric_period,
            zero_grad_before_forward,
            async_write_metrics=async_write_metrics,
            check_finite_every_step=check_finite_every_step,
        )

        self._device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if self._device_type == "cpu" and precision == torch.float16:
            logger.info("AMPTrainer: no CUDA device, using bfloat16 autocast on the CPU")
            precision = torch.bfloat16
        if grad_scaler is None:
            # Loss scaling guards float16 gradients; bfloat16 has float32's range.
            grad_scaler = torch.amp.GradScaler(
                self._device_type, enabled=self._device_type == "cuda"
            )
        self.grad_scaler = grad_scaler
        self.precision = precision
        self.log_grad_scaler = log_grad_scaler

    def run_step(self) -> None:
        """Implement the AMP training logic."""
        if not self.model.training:
            raise RuntimeError("[AMPTrainer] model was changed to eval mode!")

        start = time.perf_counter()
        try:
            data = next(self._data_loader_iter)
        except StopIteration:  # a finite loader: the next epoch (free while not raised)
            data = self._next_epoch()
        data_time = time.perf_counter() - start

        if self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()
        with torch.autocast(device_type=self._device_type, dtype=self.precision):
            loss_dict, losses = _losses(self.model(data), "AMPTrainer")

        if not self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()

        self.grad_scaler.scale(losses).backward()

        if self.log_grad_scaler:
            storage = get_event_storage()
            storage.put_scalar("[metric]grad_scaler", self.grad_scaler.get_scale())

        self.after_backward()

        if self.async_write_metrics:
            self._submit_metrics(loss_dict, data_time)
        else:
            self._write_metrics(loss_dict, data_time)

        if self.step_optimizer:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["grad_scaler"] = self.grad_scaler.state_dict()
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
