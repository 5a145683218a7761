"""Hooks, mirroring ``detectron2.engine.hooks``.

Each hook overrides only the stages it needs, so the Rust dispatcher calls it only there.
"""

from __future__ import annotations

import datetime
import logging
from collections import Counter
from typing import Any, Callable, Dict, Iterable, Mapping, Optional

import torch

from hookloop import _core
from hookloop.engine.train_loop import HookBase
from hookloop.utils.events import EventWriter

__all__ = [
    "CallbackHook",
    "IterationTimer",
    "PeriodicWriter",
    "LRScheduler",
]

logger = logging.getLogger(__name__)


class CallbackHook(HookBase):
    """Create a hook using callback functions provided by the user."""

    def __init__(
        self,
        *,
        before_train: Optional[Callable[[Any], None]] = None,
        after_train: Optional[Callable[[Any], None]] = None,
        before_step: Optional[Callable[[Any], None]] = None,
        after_step: Optional[Callable[[Any], None]] = None,
    ) -> None:
        """Each argument is a function that takes one argument: the trainer."""
        self._before_train = before_train
        self._before_step = before_step
        self._after_step = after_step
        self._after_train = after_train

    def before_train(self) -> None:
        if self._before_train:
            self._before_train(self.trainer)

    def after_train(self) -> None:
        if self._after_train:
            self._after_train(self.trainer)
        # The functions may be closures that hold reference to the trainer. Therefore, delete
        # them to avoid circular reference.
        del self._before_train, self._after_train
        del self._before_step, self._after_step

    def before_step(self) -> None:
        if self._before_step:
            self._before_step(self.trainer)

    def after_step(self) -> None:
        if self._after_step:
            self._after_step(self.trainer)


class IterationTimer(_core._IterationTimerBase, HookBase):
    """Track the time spent for each iteration (each run_step call in the trainer). Print a
    summary in the end of training.

    This hook uses the time between the call to its :meth:`before_step` and
    :meth:`after_step` methods. Under the convention that :meth:`before_step` of all hooks
    should only take negligible amount of time, the :class:`IterationTimer` hook should be
    placed at the beginning of the list of hooks to obtain accurate timing.

    ``before_step``/``after_step`` run in Rust (``hookloop._core._IterationTimerBase``); the
    ``time`` scalar and the summary lines are detectron2's.
    """

    def __init__(self, warmup_iter: int = 3) -> None:
        """
        Args:
            warmup_iter (int): the number of iterations at the beginning to exclude from
                timing.
        """
        if isinstance(warmup_iter, bool) or not isinstance(warmup_iter, int):
            raise TypeError(f"warmup_iter must be an int, got {type(warmup_iter).__name__}")
        self._configure(warmup_iter)

    def before_train(self) -> None:
        self._start(self.trainer.storage, self.trainer.start_iter)

    def __getstate__(self) -> Dict[str, Any]:
        return {**HookBase.__getstate__(self), "_warmup_iter": self._warmup_iter}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        self._configure(state.pop("_warmup_iter"))
        HookBase.__setstate__(self, state)

    def after_train(self) -> None:
        total_time, total_time_minus_hooks = self._elapsed()
        hook_time = total_time - total_time_minus_hooks

        num_iter = self.trainer.storage.iter + 1 - self.trainer.start_iter - self._warmup_iter

        if num_iter > 0 and total_time_minus_hooks > 0:
            # Speed is meaningful only after warmup
            # NOTE this format is parsed by grep in some scripts
            logger.info(
                "Overall training speed: {} iterations in {} ({:.4f} s / it)".format(
                    num_iter,
                    str(datetime.timedelta(seconds=int(total_time_minus_hooks))),
                    total_time_minus_hooks / num_iter,
                )
            )

        logger.info(
            "Total training time: {} ({} on hooks)".format(
                str(datetime.timedelta(seconds=int(total_time))),
                str(datetime.timedelta(seconds=int(hook_time))),
            )
        )


class PeriodicWriter(HookBase):
    """Write events to EventStorage (by calling ``writer.write()``) periodically.

    It is executed every ``period`` iterations and after the last iteration. Note that
    ``period`` does not affect how data is smoothed by each writer. Between periods the
    dispatcher does not call it at all (its period filter, the core's one period rule).
    """

    def __init__(self, writers: Iterable[EventWriter], period: int = 20) -> None:
        """
        Args:
            writers (list[EventWriter]): a list of EventWriter objects
            period (int): the period to write
        """
        writers = list(writers)
        for w in writers:
            if not isinstance(w, EventWriter):
                raise TypeError(f"PeriodicWriter got {type(w).__name__!r}, not an EventWriter")
        if isinstance(period, bool) or not isinstance(period, int):
            raise TypeError(f"PeriodicWriter period must be an int, got {type(period).__name__}")
        if period <= 0:
            raise ValueError(f"PeriodicWriter period must be a positive int, got {period}")
        self._writers = writers
        self._period = period

    def _dispatch_period(self, stage: str) -> Optional[int]:
        # Only this class's own after_step follows the period; a subclass's may not.
        if stage == "after_step" and type(self).after_step is PeriodicWriter.after_step:
            return self._period
        return None

    def after_step(self) -> None:
        trainer = self.trainer
        if _core.periodic_due(trainer.iter, self._period, trainer.max_iter):
            for writer in self._writers:
                writer.write()

    def after_train(self) -> None:
        for writer in self._writers:
            # If any new data is found (e.g. produced by other after_train), write them
            # before closing
            writer.write()
            writer.close()


class LRScheduler(_core._LRSchedulerBase, HookBase):
    """A hook which executes a torch builtin LR scheduler and summarizes the LR. It is
    executed after every iteration.

    ``after_step`` (put ``lr``, step the scheduler) runs in Rust
    (``hookloop._core._LRSchedulerBase``). ``_optimizer``, ``_scheduler`` and
    ``_best_param_group_id`` are that base's state: setting one takes effect at the next step.
    """

    def __init__(self, optimizer: Optional[torch.optim.Optimizer] = None, scheduler: Any = None):
        """
        Args:
            optimizer (torch.optim.Optimizer): defaults to ``trainer.optimizer``.
            scheduler (torch.optim.lr_scheduler.LRScheduler): defaults to
                ``trainer.scheduler``.
        """
        self._optimizer = optimizer
        self._scheduler = scheduler

    def before_train(self) -> None:
        trainer: Any = self.trainer
        self._optimizer = self._optimizer or trainer.optimizer
        if self._scheduler is None:
            self._scheduler = trainer.scheduler
        self._best_param_group_id = LRScheduler.get_best_param_group_id(self._optimizer)
        self._start(trainer.storage)

    def __getstate__(self) -> Dict[str, Any]:
        return {
            **HookBase.__getstate__(self),
            "_optimizer": self._optimizer,
            "_scheduler": self._scheduler,
            "_best_param_group_id": self._best_param_group_id,
        }

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        self._optimizer = state.pop("_optimizer")
        self._scheduler = state.pop("_scheduler")
        self._best_param_group_id = state.pop("_best_param_group_id")
        HookBase.__setstate__(self, state)

    @staticmethod
    def get_best_param_group_id(optimizer: torch.optim.Optimizer) -> int:
        # NOTE: some heuristics on what LR to summarize
        # summarize the param group with most parameters
        largest_group = max(len(g["params"]) for g in optimizer.param_groups)

        if largest_group == 1:
            # If all groups have one parameter, then find the most common initial LR, and
            # use it for summary
            lr_count = Counter([g["lr"] for g in optimizer.param_groups])
            lr = lr_count.most_common()[0][0]
            for i, g in enumerate(optimizer.param_groups):
                if g["lr"] == lr:
                    return i
        else:
            for i, g in enumerate(optimizer.param_groups):
                if len(g["params"]) == largest_group:
                    return i
        return 0

    @property
    def scheduler(self) -> Any:
        if self._scheduler is not None:
            return self._scheduler
        trainer: Any = self.trainer
        return trainer.scheduler

    def state_dict(self) -> Dict[str, Any]:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LRScheduler):
            return self.scheduler.state_dict()
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LRScheduler):
            logger.info("Loading scheduler from state_dict ...")
            self.scheduler.load_state_dict(dict(state_dict))
