"""The training loop, mirroring ``detectron2.engine.train_loop``.

``HookBase``, ``TrainerBase``, ``SimpleTrainer`` and ``AMPTrainer`` keep detectron2's API and
call order. The per-iteration loop and the hook dispatch run in Rust (``hookloop._core``):
``TrainerBase.train`` makes one call into Rust for the whole loop, and each stage calls only
the hooks that override it. Everything that touches torch stays here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import time
import types
import weakref
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from hookloop import _core
from hookloop.checkpoint.rng import get_rng_state, set_rng_state
from hookloop.data.cursor import DataCursor, iters_per_epoch
from hookloop.engine.metrics import LossMetrics, write_metrics_across
from hookloop.engine.stop import StopController, StopTraining
from hookloop.utils import comm
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


class _StopBeforeNextStep(HookBase):
    """The hook a stop appends to the loop's hook list (:mod:`hookloop.engine.stop`): the
    list edit rebuilds the dispatcher's table at its next stage, and this hook's
    ``before_step`` runs first in the next iteration, before any other hook's. Until then the
    loop has no stop check at all."""

    priority = -(2**62)  # before every other hook, whatever its priority

    def before_step(self) -> None:
        raise StopTraining


def _overrides(hook: Any, stage: str) -> bool:
    return stage in getattr(hook, "__dict__", {}) or getattr(type(hook), stage, None) is not (
        getattr(HookBase, stage)
    )


class _Parts:
    """hookloop's own state of one trainer, in its one slot ``_hookloop`` (detectron2's
    trainers have none of it; a subclass's attributes cannot collide with it):

    - ``dispatcher``: the Rust hook dispatcher over the trainer's ``_hooks``;
    - ``stop``: the :class:`~hookloop.engine.stop.StopController` (a ``DefaultTrainer`` shares
      its own with the trainer it wraps);
    - ``data`` and ``metrics``: ``SimpleTrainer``'s collaborators, the
      :class:`~hookloop.data.cursor.DataCursor` and the
      :class:`~hookloop.engine.metrics.LossMetrics` (None on other trainers);
    - the state of the current ``train()``: whether it stopped early, its wall-clock span, the
      storage history of a resumed checkpoint, AMP's device type.
    """

    def __init__(self, hooks: List[Any]) -> None:
        self.dispatcher = _core.Dispatcher(hooks, _dispatch_entries)
        self.stop = StopController(_StopBeforeNextStep)
        self.data: Optional[DataCursor] = None
        self.metrics: Optional[LossMetrics] = None
        self.stopped_early = False
        self.train_time: List[Any] = [0.0, None]
        self.resume_storage: Optional[Mapping[str, Any]] = None
        self.device_type = "cpu"


def _simple_parts(trainer: Any) -> _Parts:
    """The trainer's parts with ``SimpleTrainer``'s collaborators, made here for a subclass
    that skipped ``SimpleTrainer.__init__``."""
    parts: _Parts = trainer._hookloop
    if parts.metrics is None:
        parts.data = DataCursor()
        parts.metrics = LossMetrics()
        parts.stop.collective = True
    return parts


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
        self.iter: int = 0
        self.start_iter: int = 0
        self._hookloop = _Parts(self._hooks)
        if type(self).after_backward is TrainerBase.after_backward:
            # run_step calls self.after_backward() every iteration: bind it straight to the
            # dispatcher, which saves a Python frame. A subclass's own after_backward is kept.
            self.after_backward = self._hookloop.dispatcher.after_backward  # type: ignore[method-assign]

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
        parts = self._hookloop
        parts.stopped_early = False
        parts.train_time = [time.perf_counter(), None]

        with EventStorage(start_iter) as self.storage:
            if parts.resume_storage is not None:
                # The recent history of a resumed checkpoint: smoothing and the ETA continue.
                self.storage._load_state(dict(parts.resume_storage))
                self.storage.iter = start_iter
                parts.resume_storage = None
            # The hook list is re-read (it may have been rebound) and the table rebuilt.
            hooks = self._hooks
            parts.stop.begin(hooks)
            parts.dispatcher.begin(hooks, self.storage, max_iter)
            try:
                self.before_train()
                try:
                    parts.dispatcher.run_loop(
                        self,
                        start_iter,
                        max_iter,
                        self.run_step,
                        _overridden(self, "before_step"),
                        _overridden(self, "after_step"),
                    )
                except StopTraining:
                    # Raised before any hook of the iteration after the stop: the last one
                    # that completed (every after_step of it ran) is the one before.
                    self.iter -= 1
                    parts.stopped_early = True
                    logger.info(f"Training stopped on request after iteration {self.iter}")
                else:
                    # self.iter == max_iter can be used by `after_train` to tell whether the
                    # training successfully finished or failed due to exceptions.
                    self.iter = max_iter
            except BaseException as exc:
                if isinstance(exc, Exception):
                    logger.exception("Exception during training:")
                _on_exception(self._hooks, exc)
                parts.stop.end()
                # The training error is what propagates: an error of after_train (a writer
                # whose close() meets a full disk) is logged and attached to it as a note,
                # where a plain `finally` would replace it.
                try:
                    self.after_train()
                except Exception as after:
                    _report_secondary(exc, after, "after_train")
                finally:
                    parts.train_time[1] = time.perf_counter()
                raise
            parts.stop.end()
            try:
                self.after_train()
            finally:
                parts.train_time[1] = time.perf_counter()
        after_stop = parts.stop.take_raise_after_train()
        if parts.stopped_early and parts.stop.rides_collective():
            # Every rank stopped after the same iteration: none leaves before the main
            # process's checkpoint of it is on disk (when one process exits, launch() and
            # torchrun stop the others).
            comm.synchronize()
        if after_stop is not None and parts.stopped_early:
            raise after_stop

    # stop_requested and stopped_early are not detectron2's names: a subclass may assign its
    # own, which reads then give (the loop never reads them).

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` was called during the current (or last) ``train()``."""
        return self.__dict__.get("stop_requested", self._hookloop.stop.requested)  # type: ignore[no-any-return]

    @stop_requested.setter
    def stop_requested(self, value: Any) -> None:
        self.__dict__["stop_requested"] = value

    @property
    def stopped_early(self) -> bool:
        """Whether the current (or last) ``train()`` ended through :meth:`request_stop` before
        ``max_iter``."""
        return self.__dict__.get("stopped_early", self._hookloop.stopped_early)  # type: ignore[no-any-return]

    @stopped_early.setter
    def stopped_early(self, value: Any) -> None:
        self.__dict__["stopped_early"] = value

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
        (:class:`~hookloop.engine.stop.Preempted`) makes every rank raise it. With
        ``async_write_metrics`` the agreement of one period's collective is applied at the
        next period boundary. Other trainers stop alone.

        Args:
            raise_after_train: an exception that ``train()`` raises after ``after_train``
                when the run stopped early (not when the stop came in the last iteration:
                training then finished normally; ``PreemptionHandler`` passes
                :class:`~hookloop.engine.stop.Preempted` for the process's exit status).
        """
        self._hookloop.stop.request(raise_after_train)

    def before_train(self) -> None:
        parts = self._hookloop
        if not parts.stop.running:
            # A loop of the subclass's own (``for self.iter in range(...)`` calling the stages):
            # the dispatcher learns this run's storage and max_iter here, as train() tells it.
            storage = getattr(self, "storage", None)
            if isinstance(storage, EventStorage):
                max_iter = getattr(self, "max_iter", None)
                parts.dispatcher.begin(
                    self._hooks, storage, max_iter if isinstance(max_iter, int) else _NO_MAX_ITER
                )
        parts.dispatcher.before_train()

    def after_train(self) -> None:
        self.storage.iter = self.iter
        self._hookloop.dispatcher.after_train(self.iter)

    def before_step(self) -> None:
        # Maintain the invariant that storage.iter == trainer.iter for the entire execution
        # of each step
        self.storage.iter = self.iter
        self._hookloop.dispatcher.before_step(self.iter)

    def after_backward(self) -> None:
        self._hookloop.dispatcher.after_backward()

    def after_step(self) -> None:
        self._hookloop.dispatcher.after_step(self.iter)

    def hooks_table(self) -> Dict[str, List[Any]]:
        """The hooks each stage calls, in call order (registration order, unless hooks declare
        a ``priority``): what the dispatcher runs, for checking where a hook lands."""
        dispatcher = self._hookloop.dispatcher
        return {stage: list(dispatcher.hooks_for(stage)) for stage in _STAGES}

    def hook_stats(self) -> List[HookStat]:
        """Per hook and stage, the time spent in it since ``train()`` started: a
        :class:`HookStat` ``(hook, stage, calls, total_s, max_s, share)`` per entry of the
        dispatch table, in call order. Every hook call is timed (one clock read per call, a
        few nanoseconds; ``trainer._hookloop.dispatcher.timing = False`` turns it off, and the
        counts then stay zero). ``share`` is ``total_s`` over the training time so far."""
        parts = self._hookloop
        # The dispatcher's counts carry over edits of the hook list (a stop adds and removes
        # one hook of its own, left out here).
        rows = [
            r for r in parts.dispatcher.hook_stats() if not isinstance(r[0], _StopBeforeNextStep)
        ]
        start, end = parts.train_time
        elapsed = (time.perf_counter() if end is None else end) - start
        return [
            HookStat(h, stage, calls, total, longest, total / elapsed if elapsed > 0 else 0.0)
            for h, stage, calls, total, longest in rows
        ]

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
        self._hookloop.resume_storage = state_dict.get("storage")


def _overridden(trainer: TrainerBase, stage: str) -> Any:
    """The bound stage method if ``trainer`` replaces TrainerBase's, else None: then the loop
    calls the dispatcher's stage directly (the same code TrainerBase's method calls, without
    its Python frame)."""
    if getattr(type(trainer), stage) is getattr(TrainerBase, stage) and stage not in vars(trainer):
        return None
    return getattr(trainer, stage)


def _on_exception(hooks: List[Any], exc: BaseException) -> None:
    """Each hook's ``on_exception`` that overrides HookBase's, in registration order; their
    own errors are logged so that ``exc`` propagates unchanged."""
    for h in list(hooks):
        if not _overrides(h, "on_exception"):
            continue
        try:
            h.on_exception(exc)
        except Exception:
            logger.exception(f"{type(h).__name__}.on_exception raised; re-raising the original")


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

    Two collaborators do hookloop's extra work: a :class:`~hookloop.data.cursor.DataCursor`
    (epochs of a finite loader, the data position for resume) and a
    :class:`~hookloop.engine.metrics.LossMetrics` (losses read in batches, asynchronous
    writes, the packed collective across ranks).

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
        epoch (int): the epoch of a finite data loader (0 for the first pass; infinite
            loaders stay at 0).
        iters_per_epoch: ``len(data_loader)`` when the loader has a length, else None.
    """

    #: At most this many recorded iterations of losses wait, as tensors, for one batched read.
    METRICS_READ_EVERY = 20
    #: At most this many batches of CUDA losses are copied to the host without being waited
    #: for (until something reads the storage); then they are read.
    MAX_IN_FLIGHT = 50

    step_optimizer = True
    #: Read in before_train; a subclass that skips SimpleTrainer.__init__ gets the deferred
    #: reads unless it sets it.
    check_finite_every_step = False

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
        _simple_parts(self)

    def before_train(self) -> None:
        _simple_parts(self).metrics.configure(self)  # type: ignore[union-attr]
        super().before_train()

    def run_step(self) -> None:
        """Implement the standard training logic described above."""
        if not self.model.training:
            raise RuntimeError("[SimpleTrainer] model was changed to eval mode!")
        start = time.perf_counter()
        try:
            data = next(self._data_loader_iter)
        except StopIteration:  # a finite loader: the next epoch (free while not raised)
            data = _simple_parts(self).data.next_epoch(self)  # type: ignore[union-attr]
        data_time = time.perf_counter() - start

        if self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()

        loss_dict, losses = _losses(self.model(data), "SimpleTrainer")
        if not self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()
        losses.backward()

        self.after_backward()

        if self.async_write_metrics:
            _simple_parts(self).metrics.submit(self, loss_dict, data_time)  # type: ignore[union-attr]
        else:
            self._write_metrics(loss_dict, data_time)

        if self.step_optimizer:
            self.optimizer.step()

    @property
    def _data_loader_iter(self) -> Any:
        # only create the data loader iterator when it is used
        if self._data_loader_iter_obj is None:
            cursor = _simple_parts(self).data
            self._data_loader_iter_obj = cursor.new_iterator(self)  # type: ignore[union-attr]
        return self._data_loader_iter_obj

    # epoch and iters_per_epoch are not detectron2's names: a subclass may assign its own
    # (xmodaler-style trainers do), which is then what reads give; the cursor keeps its own.

    @property
    def epoch(self) -> int:
        """The epoch of a finite data loader (0 for the first pass)."""
        if "epoch" in self.__dict__:
            return self.__dict__["epoch"]  # type: ignore[no-any-return]
        return _simple_parts(self).data.epoch  # type: ignore[union-attr]

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.__dict__["epoch"] = value

    @property
    def iters_per_epoch(self) -> Optional[int]:
        """``len(data_loader)`` when the loader has a length, else None."""
        if "iters_per_epoch" in self.__dict__:
            return self.__dict__["iters_per_epoch"]  # type: ignore[no-any-return]
        return iters_per_epoch(self.data_loader)

    @iters_per_epoch.setter
    def iters_per_epoch(self, value: Optional[int]) -> None:
        self.__dict__["iters_per_epoch"] = value

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
        metrics = self._hookloop.metrics or _simple_parts(self).metrics
        metrics.write(self, loss_dict, data_time, prefix, self.iter if iter is None else iter)  # type: ignore[union-attr]

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
        write_metrics_across(loss_dict, data_time, cur_iter, prefix, 0)

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["optimizer"] = self.optimizer.state_dict()
        data = _simple_parts(self).data.state(self)  # type: ignore[union-attr]
        if data:
            ret["data"] = data
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        cursor = _simple_parts(self).data
        cursor.load_state(self, state_dict.get("data"), "rng" in state_dict)  # type: ignore[union-attr]

    def after_train(self) -> None:
        metrics = _simple_parts(self).metrics
        settle_error = metrics.settle_last(self.storage)  # type: ignore[union-attr]
        try:
            super().after_train()
        finally:
            self.concurrent_executor.shutdown(wait=True)
            self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        errors = metrics.take_errors(settle_error)  # type: ignore[union-attr]
        # A write that failed after the last step stops a run that otherwise succeeded; when
        # training already failed (maybe on an earlier such error), later ones are its echo.
        if errors and (self.iter == self.max_iter or self.stopped_early):
            raise errors[0]
        for e in errors:
            logger.error("Asynchronous metric write failed after training stopped: %r", e)


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

        self._hookloop.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if self._hookloop.device_type == "cpu" and precision == torch.float16:
            logger.info("AMPTrainer: no CUDA device, using bfloat16 autocast on the CPU")
            precision = torch.bfloat16
        if grad_scaler is None:
            # Loss scaling guards float16 gradients; bfloat16 has float32's range.
            grad_scaler = torch.amp.GradScaler(
                self._hookloop.device_type, enabled=self._hookloop.device_type == "cuda"
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
            data = _simple_parts(self).data.next_epoch(self)  # type: ignore[union-attr]
        data_time = time.perf_counter() - start

        if self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()
        with torch.autocast(device_type=self._hookloop.device_type, dtype=self.precision):
            loss_dict, losses = _losses(self.model(data), "AMPTrainer")

        if not self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()

        self.grad_scaler.scale(losses).backward()

        if self.log_grad_scaler:
            storage = get_event_storage()
            storage.put_scalar("[metric]grad_scaler", self.grad_scaler.get_scale())

        self.after_backward()

        if self.async_write_metrics:
            _simple_parts(self).metrics.submit(self, loss_dict, data_time)  # type: ignore[union-attr]
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
