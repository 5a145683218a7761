"""The training loop, mirroring ``detectron2.engine.train_loop``.

``HookBase``, ``TrainerBase``, ``SimpleTrainer`` and ``AMPTrainer`` keep detectron2's API and
call order. The per-iteration loop and the hook dispatch run in Rust (``hookloop._core``):
``TrainerBase.train`` makes one call into Rust for the whole loop, and each stage calls only
the hooks that override it. Everything that touches torch stays here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import operator
import time
import weakref
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DataParallel, DistributedDataParallel

from hookloop import _core
from hookloop.utils import comm
from hookloop.utils.events import _CURRENT_STORAGE_STACK, EventStorage, get_event_storage

__all__ = ["HookBase", "TrainerBase", "SimpleTrainer", "AMPTrainer"]

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

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _STAGES:
            self._stages_changed()

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        if name in _STAGES:
            self._stages_changed()

    def _stages_changed(self) -> None:
        # A stage method set on the instance after registration: the trainer's dispatch table
        # was built without it, so rebuild it.
        trainer = self.__dict__.get("trainer")
        if trainer is not None:
            try:
                trainer._hooks._sync()
            except ReferenceError:  # the trainer is gone
                pass


_STAGES = frozenset(("before_train", "after_train", "before_step", "after_step", "after_backward"))


class _HookList(list):
    """The trainer's hook list. Any change rebuilds the Rust dispatch table, so code that edits
    ``trainer._hooks`` in place (as some detectron2-based repos do) keeps working."""

    __slots__ = ("_dispatcher",)

    def __init__(self, dispatcher: Any, hooks: Iterable[HookBase] = ()) -> None:
        super().__init__(hooks)
        self._dispatcher = dispatcher
        self._sync()

    def _sync(self) -> None:
        self._dispatcher.set_hooks(self, HookBase)


def _resyncing(name: str) -> Any:
    """``list.<name>``, followed by a rebuild of the dispatch table."""
    base = getattr(list, name)

    def method(self: _HookList, *args: Any, **kwargs: Any) -> Any:
        result = base(self, *args, **kwargs)
        self._sync()
        return self if name in ("__iadd__", "__imul__") else result

    method.__name__ = method.__qualname__ = name
    return method


for _name in (
    "append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse",
    "__setitem__", "__delitem__", "__iadd__", "__imul__",
):  # fmt: skip
    setattr(_HookList, _name, _resyncing(_name))
del _name


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
        self._dispatcher = _core.Dispatcher()
        self.__hooks = _HookList(self._dispatcher)
        self.iter: int = 0
        self.start_iter: int = 0
        if type(self).after_backward is TrainerBase.after_backward:
            # run_step calls self.after_backward() every iteration: bind it straight to the
            # dispatcher, which saves a Python frame. A subclass's own after_backward is kept.
            self.after_backward = self._dispatcher.after_backward  # type: ignore[method-assign]

    @property
    def _hooks(self) -> List[HookBase]:
        return self.__hooks

    @_hooks.setter
    def _hooks(self, hooks: Iterable[HookBase]) -> None:
        self.__hooks = _HookList(self._dispatcher, hooks)

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
            try:
                self.before_train()
                self._dispatcher.run_loop(
                    self,
                    self.storage,
                    start_iter,
                    max_iter,
                    self.run_step,
                    self._overridden("before_step"),
                    self._overridden("after_step"),
                )
                # self.iter == max_iter can be used by `after_train` to tell whether the
                # training successfully finished or failed due to exceptions.
                self.iter = max_iter
            except Exception:
                logger.exception("Exception during training:")
                raise
            finally:
                self.after_train()

    def _overridden(self, stage: str) -> Any:
        """The bound stage method if this trainer replaces TrainerBase's, else None (then the
        Rust loop does TrainerBase's work itself)."""
        if getattr(type(self), stage) is getattr(TrainerBase, stage) and stage not in vars(self):
            return None
        return getattr(self, stage)

    def before_train(self) -> None:
        self._dispatcher.before_train()

    def after_train(self) -> None:
        self.storage.iter = self.iter
        self._dispatcher.after_train()

    def before_step(self) -> None:
        # Maintain the invariant that storage.iter == trainer.iter for the entire execution
        # of each step.
        self.storage.iter = self.iter
        self._dispatcher.before_step()

    def after_backward(self) -> None:
        self._dispatcher.after_backward()

    def after_step(self) -> None:
        self._dispatcher.after_step()

    def run_step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        ret: Dict[str, Any] = {"iteration": self.iter}
        hooks_state = {}
        for h in self._hooks:
            sd = h.state_dict()
            if sd:
                name = type(h).__qualname__
                if name in hooks_state:
                    # detectron2 keeps the first of several stateful hooks of one type.
                    continue
                hooks_state[name] = sd
        if hooks_state:
            ret["hooks"] = hooks_state
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or "iteration" not in state_dict:
            raise ValueError("load_state_dict() needs a dict with an 'iteration' key")
        self.iter = state_dict["iteration"]
        for key, value in state_dict.get("hooks", {}).items():
            for h in self._hooks:
                try:
                    name = type(h).__qualname__
                except AttributeError:
                    continue
                if name == key:
                    h.load_state_dict(value)
                    break
            else:
                logger.warning(f"Cannot find the hook '{key}', its state_dict is ignored.")


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

        loss_dict = self.model(data)
        if isinstance(loss_dict, torch.Tensor):
            losses = loss_dict
            loss_dict = {"total_loss": loss_dict}
        else:
            losses = sum(loss_dict.values())
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
            self._data_loader_iter_obj = iter(self.data_loader)
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
        iter = self.iter if iter is None else iter
        if (iter + 1) % self.gather_metric_period == 0:
            try:
                # write_metrics's one-process path, inlined: this runs at every step, and the
                # call it saves costs about 1 µs inside a training loop (benches/RESULTS.md).
                if (
                    type(loss_dict) is dict
                    and _CURRENT_STORAGE_STACK
                    and not (comm._AVAILABLE and dist.is_initialized())
                ):
                    storage = _CURRENT_STORAGE_STACK[-1]
                    not_finite = storage._put_losses(loss_dict, data_time, iter, prefix)
                    if not_finite is not None:
                        raise _non_finite_loss(iter, not_finite)
                else:
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
        """
        # get_event_storage() and comm.get_world_size() == 1, inlined: this runs every step.
        storage = _CURRENT_STORAGE_STACK[-1] if _CURRENT_STORAGE_STACK else get_event_storage()
        if type(loss_dict) is dict and not (comm._AVAILABLE and dist.is_initialized()):
            # One process: the gathered list would be [metrics_dict], whose max and mean are
            # its own values. The whole write is one call into Rust, which reads each loss
            # with item() (what detectron2's v.detach().cpu().item() computes, without
            # building a detached tensor and a CPU copy).
            not_finite = storage._put_losses(loss_dict, data_time, cur_iter, prefix)
            if not_finite is not None:
                raise _non_finite_loss(cur_iter, not_finite)
            return

        metrics_dict: Dict[str, Any] = {k: v.item() for k, v in loss_dict.items()}
        if comm.get_world_size() == 1:
            storage.put_scalars(rank_data_time=data_time, data_time=data_time, cur_iter=cur_iter)
        else:
            # Keep track of data time per rank
            storage.put_scalar("rank_data_time", data_time, cur_iter=cur_iter)
            # Gather metrics among all workers for logging. This assumes DDP-style training.
            metrics_dict["data_time"] = data_time
            all_metrics_dict = comm.gather(metrics_dict)
            if not comm.is_main_process():
                return
            # data_time among workers can have high variance. The actual latency caused by
            # data_time is the maximum among workers.
            data_time = max(x.pop("data_time") for x in all_metrics_dict)
            storage.put_scalar("data_time", data_time, cur_iter=cur_iter)
            # average the rest metrics
            metrics_dict = {
                k: _mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0].keys()
            }

        total_losses_reduced = sum(metrics_dict.values())
        if not math.isfinite(total_losses_reduced):
            raise _non_finite_loss(cur_iter, metrics_dict)

        storage.put_scalar("{}total_loss".format(prefix), total_losses_reduced, cur_iter=cur_iter)
        if len(metrics_dict) > 1:
            storage.put_scalars(cur_iter=cur_iter, **metrics_dict)

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["optimizer"] = self.optimizer.state_dict()
        return ret

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])

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


def _non_finite_loss(cur_iter: int, losses: Mapping[str, float]) -> FloatingPointError:
    """detectron2's error for a NaN or infinite total loss."""
    return FloatingPointError(
        f"Loss became infinite or NaN at iteration={cur_iter}!\nloss_dict = {losses}"
    )


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
            loss_dict = self.model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())

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
