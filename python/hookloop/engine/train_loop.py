"""The training loop, mirroring ``detectron2.engine.train_loop``.

detectron2's API, call order and loop (``TrainerBase.train``); each stage is one call into
the Rust dispatcher, which runs the hooks over a table :mod:`hookloop.engine.dispatch`
builds. hookloop's state of a trainer is one slot,
``_hookloop`` (:mod:`hookloop.engine.parts`), made on first use; its additions to the API are
in :mod:`hookloop.engine.additions`. Everything that touches torch stays here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, cast

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from hookloop.checkpoint.rng import get_rng_state, set_rng_state
from hookloop.engine import dispatch
from hookloop.engine.additions import EpochAdditions, HookStat, TrainerAdditions
from hookloop.engine.dispatch import base_stage
from hookloop.engine.losses import losses_of
from hookloop.engine.metrics import write_metrics_across
from hookloop.engine.parts import (
    NO_MAX_ITER,
    OWN_HOOK_STATE,
    RESUME_HISTORY,
    SimpleTrainerParts,
    TrainerParts,
    check_iters,
    hook_keys,
    report_secondary,
)
from hookloop.engine.stop import StopTraining
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

    trainer: "TrainerBase" = cast("TrainerBase", None)

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
        """The period of ``stage`` for the dispatcher: None (every time) or N (when ``iter + 1``
        is a multiple of N, and at the last iteration); the hook keeps its own check too."""
        return None

    def __getstate__(self) -> Dict[str, Any]:
        # The trainer is a weak proxy (not picklable); it is set again at registration.
        state = dict(self.__dict__)
        if isinstance(state.get("trainer"), (weakref.ProxyType, weakref.CallableProxyType)):
            del state["trainer"]
        return state

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(state)


class TrainerBase(TrainerAdditions):
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
    #: What ``__new__`` makes ``_hookloop``: hookloop's own state of the trainer.
    _parts_class = TrainerParts

    def __new__(cls, *args: Any, **kwargs: Any) -> "TrainerBase":
        # Here, not in __init__: a subclass may skip every __init__ (detectron2's trainers
        # need nothing of the kind) and still train.
        trainer = super().__new__(cls)
        trainer._hookloop = cls._parts_class()
        return trainer

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

        with EventStorage(start_iter) as self.storage:
            parts.start_run(self, self.storage, max_iter)
            try:
                self.before_train()
                try:
                    for self.iter in range(start_iter, max_iter):
                        self.before_step()
                        self.run_step()
                        self.after_step()
                except StopTraining:
                    # Raised by before_step before any hook of the iteration after the stop:
                    # the last one that completed (every after_step of it ran) is the one
                    # before.
                    self.iter -= 1
                    parts.stop.stopped_early = True
                    logger.info(f"Training stopped on request after iteration {self.iter}")
                else:
                    # self.iter == max_iter can be used by `after_train` to tell whether the
                    # training successfully finished or failed due to exceptions.
                    self.iter += 1
            except BaseException as exc:
                parts.failed = True
                if isinstance(exc, Exception):
                    logger.exception("Exception during training:")
                dispatch.run_on_exception(self._hooks, exc)
                parts.stop.end()
                # The training error propagates; one of after_train is logged, noted on it.
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
        parts.end_run()

    # The stages. Each is one call into the dispatcher, which runs the hooks that override it
    # (dispatch.overrides), in the table's order, on their periods. After an edit of the hook
    # list the dispatcher's stage runs nothing and returns False: dispatch.run_stage then sets
    # a table for the list as it is now and runs the stage (the path every stage takes; the
    # per-step ones try the dispatcher first, without run_stage's Python frame).

    def before_train(self) -> None:
        parts = self._hookloop
        if not parts.stop.running:
            # A subclass's own loop calling the stages: the dispatcher learns its run here.
            max_iter = getattr(self, "max_iter", None)
            parts.begin(self, max_iter if isinstance(max_iter, int) else NO_MAX_ITER)
        dispatch.run_stage(self, "before_train")

    def after_train(self) -> None:
        self.storage.iter = self.iter
        dispatch.run_stage(self, "after_train", self.iter)

    def before_step(self) -> None:
        if self._hookloop.stop.applied:
            raise StopTraining  # request_stop(): no hook of this iteration runs
        # Maintain the invariant that storage.iter == trainer.iter for the entire step
        self.storage.iter = self.iter
        if not self._hookloop.dispatcher.before_step(self._hooks, self.iter):
            dispatch.run_stage(self, "before_step", self.iter)

    def after_backward(self) -> None:
        if not self._hookloop.dispatcher.after_backward(self._hooks):
            dispatch.run_stage(self, "after_backward")

    def after_step(self) -> None:
        if not self._hookloop.dispatcher.after_step(self._hooks, self.iter):
            dispatch.run_stage(self, "after_step", self.iter)

    def run_step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """The iteration, every stateful hook's state, the RNG states (Python, numpy, torch,
        CUDA), and during training the storage's recent scalar history (what smoothing and the
        ETA need), so that a resumed run continues as if it was never stopped. A second stateful
        hook of one class is saved under ``Name.1`` (the first under detectron2's ``Name``)."""
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
        # Applied to the storage that the next train() opens, if that run resumes this state
        # (starts at the iteration after it); detectron2 restores the iteration and the hooks'
        # states whatever the run.
        self._hookloop.resume_storage = state_dict.get("storage")
        self._hookloop.resume_storage_iter = state_dict["iteration"]


class SimpleTrainer(EpochAdditions, TrainerBase):
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
            reads the storage (a writer, a hook's ``latest()``) and at least every 20
            recorded iterations (the storage's pending queue). The values and iterations
            stored are the same; a non-finite loss raises ``FloatingPointError`` naming the
            iteration where it appeared, up to that many iterations later. True reads them at
            every step, as detectron2 does.

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
    #: Read in before_train (a subclass may skip __init__): the deferred reads by default.
    check_finite_every_step = False
    _parts_class = SimpleTrainerParts  # with SimpleTrainer's collaborators

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
        if self._data_loader_iter_obj is None:
            self._data_loader_iter_obj = self._hookloop.data.new_iterator(self)
        return self._data_loader_iter_obj

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
