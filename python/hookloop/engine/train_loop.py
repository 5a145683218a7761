"""The training loop, mirroring ``detectron2.engine.train_loop``.

``HookBase``, ``TrainerBase``, ``SimpleTrainer`` and ``AMPTrainer`` keep detectron2's API and
call order. The per-iteration loop and the hook dispatch run in Rust (``hookloop._core``):
``TrainerBase.train`` makes one call into Rust for the whole loop, and each stage calls only
the hooks that override it (:mod:`hookloop.engine.dispatch` builds that table). hookloop's own
state of a trainer lives in one slot, ``_hookloop`` (:mod:`hookloop.engine.parts`), made on
first use. Everything that touches torch stays here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from hookloop.checkpoint.rng import get_rng_state, set_rng_state
from hookloop.data.cursor import iters_per_epoch
from hookloop.engine import dispatch
from hookloop.engine.dispatch import base_stage
from hookloop.engine.losses import losses_of
from hookloop.engine.metrics import write_metrics_across
from hookloop.engine.parts import (
    NO_MAX_ITER,
    OWN_HOOK_STATE,
    RESUME_HISTORY,
    PartsSlot,
    SimpleTrainerParts,
    TrainerParts,
    check_iters,
    elapsed,
    hook_keys,
    report_secondary,
)
from hookloop.engine.stop import StopTraining
from hookloop.utils import comm
from hookloop.utils.events import _CURRENT_STORAGE_STACK, EventStorage, get_event_storage

__all__ = ["HookBase", "TrainerBase", "SimpleTrainer", "AMPTrainer", "HookStat"]

logger = logging.getLogger(__name__)


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

    @base_stage
    def before_train(self) -> None:
        """Called before the first iteration."""

    @base_stage
    def after_train(self) -> None:
        """Called after the last iteration."""

    @base_stage
    def before_step(self) -> None:
        """Called before each iteration."""

    @base_stage
    def after_backward(self) -> None:
        """Called after the backward pass of each iteration."""

    @base_stage
    def after_step(self) -> None:
        """Called after each iteration."""

    @base_stage
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
    #: hookloop's own state (:class:`~hookloop.engine.parts.TrainerParts`), made on first use.
    _hookloop = PartsSlot(TrainerParts)

    def __init__(self) -> None:
        self._hooks: List[HookBase] = []
        self.iter: int = 0
        self.start_iter: int = 0

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
        start_iter, max_iter = check_iters(start_iter, max_iter)
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
            parts.begin(self, self.storage, max_iter)
            parts.stop.begin()
            try:
                self.before_train()
                try:
                    dispatch.run_loop(self, start_iter, max_iter)
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
                dispatch.run_on_exception(self._hooks, exc)
                parts.stop.end()
                # The training error is what propagates: an error of after_train (a writer
                # whose close() meets a full disk) is logged and attached to it as a note,
                # where a plain `finally` would replace it.
                try:
                    self.after_train()
                except Exception as after:
                    report_secondary(exc, after, "after_train")
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
        step (in ``before_train``), no step runs. The stop is a flag the loop reads between
        iterations; the trainer's hook list is not touched.

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
                parts.begin(self, storage, max_iter if isinstance(max_iter, int) else NO_MAX_ITER)
        dispatch.run_stage(self, "before_train")

    def after_train(self) -> None:
        self.storage.iter = self.iter
        dispatch.run_stage(self, "after_train", self.iter)

    @base_stage  # the loop runs it in Rust (see dispatch.run_loop)
    def before_step(self) -> None:
        # Maintain the invariant that storage.iter == trainer.iter for the entire execution
        # of each step
        self.storage.iter = self.iter
        dispatch.run_stage(self, "before_step", self.iter)

    def after_backward(self) -> None:
        # run_stage, inlined: run_step calls this at every iteration.
        if not self._hookloop.dispatcher.after_backward():
            dispatch.run_stage(self, "after_backward")

    @base_stage  # the loop runs it in Rust
    def after_step(self) -> None:
        dispatch.run_stage(self, "after_step", self.iter)

    def hooks_table(self) -> Dict[str, List[Any]]:
        """The hooks each stage calls, in call order (registration order, unless hooks declare
        a ``priority``): what the dispatcher runs, for checking where a hook lands."""
        dispatch.set_table(self)  # for the list as it is now
        dispatcher = self._hookloop.dispatcher
        return {stage: list(dispatcher.hooks_for(stage)) for stage in dispatch.STAGES}

    def hook_stats(self) -> List[HookStat]:
        """Per hook and stage, the time spent in it since ``train()`` started: a
        :class:`HookStat` ``(hook, stage, calls, total_s, max_s, share)`` per entry of the
        dispatch table, in call order. Every hook call is timed (one clock read per call, a
        few nanoseconds; ``trainer._hookloop.dispatcher.timing = False`` turns it off, and the
        counts then stay zero). ``share`` is ``total_s`` over the training time so far."""
        total = elapsed(self._hookloop)
        return [
            HookStat(h, stage, calls, t, longest, t / total if total > 0 else 0.0)
            for h, stage, calls, t, longest in self._hookloop.dispatcher.hook_stats()
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
        for key, h in hook_keys(self._hooks):
            sd = h.state_dict()
            if sd:
                # State of a hook that detectron2 has but keeps stateless (it would call a
                # load_state_dict that its hook lacks) goes where detectron2 does not look.
                beyond = getattr(type(h), "_STATE_BEYOND_DETECTRON2", False)
                (own_state if beyond else hooks_state)[key] = sd
        if hooks_state:
            ret["hooks"] = hooks_state
        if own_state:
            ret[OWN_HOOK_STATE] = own_state
        ret["rng"] = get_rng_state()
        storage = getattr(self, "storage", None)
        if storage is not None and storage in _CURRENT_STORAGE_STACK:
            ret["storage"] = storage._state(keep=RESUME_HISTORY)
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or "iteration" not in state_dict:
            raise ValueError("load_state_dict() needs a dict with an 'iteration' key")
        self.iter = state_dict["iteration"]
        hooks = dict(hook_keys(self._hooks))
        saved = {**state_dict.get("hooks", {}), **state_dict.get(OWN_HOOK_STATE, {})}
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
            ``LossMetrics.READ_EVERY`` (20) recorded iterations. The values and iterations stored are
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

    step_optimizer = True
    #: Read in before_train; a subclass that skips SimpleTrainer.__init__ gets the deferred
    #: reads unless it sets it.
    check_finite_every_step = False
    #: detectron2 sets it in __init__; read in before_train (a subclass may skip __init__).
    async_write_metrics = False
    #: hookloop's own state, with SimpleTrainer's collaborators, made on first use.
    _hookloop = PartsSlot(SimpleTrainerParts)

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

    def before_train(self) -> None:
        self._hookloop.metrics.configure(self)
        super().before_train()

    def run_step(self) -> None:
        """Implement the standard training logic described above."""
        if not self.model.training:
            raise RuntimeError("[SimpleTrainer] model was changed to eval mode!")
        start = time.perf_counter()
        try:
            data = next(self._data_loader_iter)
        except StopIteration:  # a finite loader: the next epoch (free while not raised)
            data = self._hookloop.data.next_epoch(self)
        data_time = time.perf_counter() - start

        if self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()

        loss_dict, losses = losses_of(self.model(data), "SimpleTrainer")
        if not self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()
        losses.backward()

        self.after_backward()

        if self.async_write_metrics:
            self._hookloop.metrics.submit(self, loss_dict, data_time)
        else:
            self._write_metrics(loss_dict, data_time)

        if self.step_optimizer:
            self.optimizer.step()

    @property
    def _data_loader_iter(self) -> Any:
        # only create the data loader iterator when it is used
        if self.__dict__.get("_data_loader_iter_obj") is None:
            self._data_loader_iter_obj = self._hookloop.data.new_iterator(self)
        return self._data_loader_iter_obj

    # epoch and iters_per_epoch are not detectron2's names: a subclass may assign its own
    # (xmodaler-style trainers do), which is then what reads give; the cursor keeps its own.

    @property
    def epoch(self) -> int:
        """The epoch of a finite data loader (0 for the first pass)."""
        if "epoch" in self.__dict__:
            return self.__dict__["epoch"]  # type: ignore[no-any-return]
        return self._hookloop.data.epoch  # type: ignore[no-any-return]

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
        it = self.iter if iter is None else iter
        self._hookloop.metrics.write(self, loss_dict, data_time, prefix, it)

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
        data = self._hookloop.data.state(self)
        if data:
            ret["data"] = data
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._hookloop.data.load_state(self, state_dict.get("data"), "rng" in state_dict)

    def after_train(self) -> None:
        metrics = self._hookloop.metrics
        settle_error = metrics.settle_last(self.storage)
        try:
            super().after_train()
        finally:
            self.concurrent_executor.shutdown(wait=True)
            self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        errors = metrics.take_errors(settle_error)
        # A write that failed after the last step stops a run that otherwise succeeded; when
        # training already failed (maybe on an earlier such error), later ones are its echo.
        if errors and (self.iter == self.max_iter or self.stopped_early):
            raise errors[0]
        for e in errors:
            logger.error("Asynchronous metric write failed after training stopped: %r", e)


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
            data = self._hookloop.data.next_epoch(self)
        data_time = time.perf_counter() - start

        if self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()
        with torch.autocast(device_type=self._hookloop.device_type, dtype=self.precision):
            loss_dict, losses = losses_of(self.model(data), "AMPTrainer")

        if not self.zero_grad_before_forward and self.step_optimizer:
            self.optimizer.zero_grad()

        self.grad_scaler.scale(losses).backward()

        if self.log_grad_scaler:
            storage = get_event_storage()
            storage.put_scalar("[metric]grad_scaler", self.grad_scaler.get_scale())

        self.after_backward()

        if self.async_write_metrics:
            self._hookloop.metrics.submit(self, loss_dict, data_time)
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
