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
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from hookloop import _core
from hookloop.checkpoint.rng import get_rng_state, set_rng_state
from hookloop.utils import comm
from hookloop.utils.events import _CURRENT_STORAGE_STACK, EventStorage, get_event_storage

__all__ = ["HookBase", "TrainerBase", "SimpleTrainer", "AMPTrainer"]

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
            orders.append(int(order_of(stage)) if order_of is not None else 0)
            if isinstance(method, types.MethodType) and method.__self__ is hook:
                entries.append((index, stage_index, method.__func__, hook, period))
            else:
                entries.append((index, stage_index, method, None, period))
    # Stable: equal orders keep registration order.
    ranked = sorted(range(len(entries)), key=orders.__getitem__)
    return [entries[k] for k in ranked]


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

        with EventStorage(start_iter) as self.storage:
            if self._resume_storage is not None:
                # The recent history of a resumed checkpoint: smoothing and the ETA continue.
                self.storage._load_state(dict(self._resume_storage))
                self.storage.iter = start_iter
                self._resume_storage = None
            # The hook list is re-read (it may have been rebound) and the table rebuilt.
            self._dispatcher.begin(self._hooks, self.storage, max_iter)
            try:
                self.before_train()
                self._dispatcher.run_loop(
                    self,
                    start_iter,
                    max_iter,
                    self.run_step,
                    self._overridden("before_step"),
                    self._overridden("after_step"),
                )
                # self.iter == max_iter can be used by `after_train` to tell whether the
                # training successfully finished or failed due to exceptions.
                self.iter = max_iter
            except BaseException as exc:
                if isinstance(exc, Exception):
                    logger.exception("Exception during training:")
                # The training error is what propagates: an error of after_train (a writer
                # whose close() meets a full disk) is logged and attached to it as a note,
                # where a plain `finally` would replace it.
                try:
                    self.after_train()
                except Exception as after:
                    _report_secondary(exc, after, "after_train")
                raise
            self.after_train()

    def _overridden(self, stage: str) -> Any:
        """The bound stage method if this trainer replaces TrainerBase's, else None: then the
        loop calls the dispatcher's stage directly (the same code TrainerBase's method calls,
        without its Python frame)."""
        if getattr(type(self), stage) is getattr(TrainerBase, stage) and stage not in vars(self):
            return None
        return getattr(self, stage)

    def before_train(self) -> None:
        self._dispatcher.before_train()

    def after_train(self) -> None:
        # Sets storage.iter = self.iter, then calls the hooks.
        self._dispatcher.after_train(self.iter)

    def before_step(self) -> None:
        # Maintain the invariant that storage.iter == trainer.iter for the entire execution
        # of each step (the dispatcher sets it, then calls the hooks).
        self._dispatcher.before_step(self.iter)

    def after_backward(self) -> None:
        self._dispatcher.after_backward()

    def after_step(self) -> None:
        self._dispatcher.after_step(self.iter)

    def hook_stats(self) -> List[Tuple[Any, str, int, float, float]]:
        """Per hook and stage: ``(hook, stage, calls, total_s, max_s)`` since ``train()``
        started, when ``self._dispatcher.timing`` is on (counts are zero otherwise)."""
        return list(self._dispatcher.hook_stats())

    def run_step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """The iteration, every stateful hook's state, the RNG states (Python, numpy, torch,
        CUDA), and during training the storage's recent scalar history (what smoothing and the
        ETA need), so that a resumed run continues as if it was never stopped.

        Two stateful hooks of one class are both saved: the first under the class's name (as
        detectron2 keys it), the next ones under ``Name.1``, ``Name.2``, ..."""
        ret: Dict[str, Any] = {"iteration": self.iter}
        hooks_state = {}
        for key, h in _hook_keys(self._hooks):
            sd = h.state_dict()
            if sd:
                hooks_state[key] = sd
        if hooks_state:
            ret["hooks"] = hooks_state
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
        for key, value in state_dict.get("hooks", {}).items():
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


# Entries kept per scalar in a checkpoint: the printer's ETA takes the median of the last 1000
# `time` values, and writers smooth over windows of 20 by default.
_RESUME_HISTORY = 1000


def _hook_keys(hooks: Iterable[Any]) -> List[Tuple[str, Any]]:
    """(key, hook) for the hooks' state in a checkpoint: the class's qualified name, then
    ``Name.1``, ``Name.2`` for later hooks of the same class."""
    seen: Dict[str, int] = {}
    out = []
    for h in hooks:
        name = type(h).__qualname__
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
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data_loader: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        gather_metric_period: int = 1,
        zero_grad_before_forward: bool = False,
        async_write_metrics: bool = False,
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
        # One worker, so metric writes run in submission order.
        self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._pending_writes: Deque[concurrent.futures.Future] = deque()

    def run_step(self) -> None:
        """Implement the standard training logic described above."""
        if not self.model.training:
            raise RuntimeError("[SimpleTrainer] model was changed to eval mode!")
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start

        if self.zero_grad_before_forward:
            self.optimizer.zero_grad()

        loss_dict, losses = _losses(self.model(data), "SimpleTrainer")
        if not self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        losses.backward()

        self.after_backward()

        if self.async_write_metrics:
            self._submit_metrics(loss_dict, data_time)
        else:
            self._write_metrics(loss_dict, data_time)

        self.optimizer.step()

    def _submit_metrics(self, loss_dict: Mapping[str, torch.Tensor], data_time: float) -> None:
        """Writes metrics on the executor thread, after re-raising any earlier write's error."""
        self._raise_async_errors()
        self._pending_writes.append(
            self.concurrent_executor.submit(
                self._write_metrics, loss_dict, data_time, iter=self.iter
            )
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

    _data_start: Optional[Dict[str, Any]] = None
    _data_start_iter = 0
    _resumed_rng = False

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
            try:
                SimpleTrainer.write_metrics(loss_dict, data_time, iter, prefix)
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
            return
        metrics_dict: Dict[str, Any] = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        metrics_dict["data_time"] = data_time
        # Gather metrics among all workers for logging. This assumes DDP-style training.
        all_metrics_dict = comm.gather(metrics_dict)
        if not comm.is_main_process():
            storage._write_metrics(None, data_time, None, cur_iter, prefix)
            return
        # data_time among workers can have high variance. The actual latency caused by
        # data_time is the maximum among workers.
        max_data_time = max(x.pop("data_time") for x in all_metrics_dict)
        reduced = {k: _mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0]}
        storage._write_metrics(reduced, data_time, max_data_time, cur_iter, prefix)

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["optimizer"] = self.optimizer.state_dict()
        data = self._data_state()
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
        try:
            super().after_train()
        finally:
            self.concurrent_executor.shutdown(wait=True)
            self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        errors = [e for e in (f.exception() for f in self._pending_writes) if e is not None]
        self._pending_writes.clear()
        # A write that failed after the last step stops a run that otherwise succeeded; when
        # training already failed (maybe on an earlier such error), later ones are its echo.
        if errors and self.iter == self.max_iter:
            raise errors[0]
        for e in errors:
            logger.error("Asynchronous metric write failed after training stopped: %r", e)


def _losses(out: Any, who: str) -> Tuple[Mapping[str, torch.Tensor], torch.Tensor]:
    """The model's output as (loss dict, summed loss): a loss tensor (named ``total_loss``)
    or a non-empty dict of str -> loss tensor. Anything else is a TypeError/ValueError saying
    what run_step expected and what it got."""
    if isinstance(out, torch.Tensor):
        return {"total_loss": out}, out
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
    return out, sum(out.values())  # type: ignore[return-value]


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
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start

        if self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        with torch.autocast(device_type=self._device_type, dtype=self.precision):
            loss_dict, losses = _losses(self.model(data), "AMPTrainer")

        if not self.zero_grad_before_forward:
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

        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["grad_scaler"] = self.grad_scaler.state_dict()
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
