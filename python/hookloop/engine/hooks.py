"""Hooks, mirroring ``detectron2.engine.hooks``.

Each hook overrides only the stages it needs, so the Rust dispatcher calls it only there.
"""

from __future__ import annotations

import datetime
import logging
import math
import operator
from collections import Counter
from typing import Any, Callable, Dict, Iterable, Mapping, Optional

import torch

from hookloop import _core
from hookloop.checkpoint import PeriodicCheckpointer as _PeriodicCheckpointer
from hookloop.checkpoint.checkpointer import _save_with
from hookloop.engine.train_loop import HookBase
from hookloop.utils import comm
from hookloop.utils.events import EventWriter

__all__ = [
    "CallbackHook",
    "IterationTimer",
    "PeriodicWriter",
    "LRScheduler",
    "PeriodicCheckpointer",
    "BestCheckpointer",
    "EvalHook",
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
        self._start()

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


class PeriodicWriter(_core._PeriodicWriterBase, HookBase):
    """Write events to EventStorage (by calling ``writer.write()``) periodically.

    It is executed every ``period`` iterations and after the last iteration. Note that
    ``period`` does not affect how data is smoothed by each writer. The per-step check runs
    in Rust (``hookloop._core._PeriodicWriterBase``).
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
        self._configure(writers, period)

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
    (``hookloop._core._LRSchedulerBase``); it reads ``_optimizer``, ``_scheduler`` (else
    ``trainer.scheduler``) and ``_best_param_group_id`` at each step.
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
        self._best_param_group_id = LRScheduler.get_best_param_group_id(self._optimizer)

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
        trainer: Any = self.trainer
        return self._scheduler or trainer.scheduler

    def state_dict(self) -> Dict[str, Any]:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LRScheduler):
            return self.scheduler.state_dict()
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LRScheduler):
            logger.info("Loading scheduler from state_dict ...")
            self.scheduler.load_state_dict(dict(state_dict))


# ----------------------------------------------------------------------------------------------
# Checkpointing and evaluation


def _int_arg(what: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _training_finished(trainer: Any) -> bool:
    """Whether the loop ran to ``max_iter`` (``train()`` sets ``iter = max_iter`` only then)."""
    return trainer.iter >= trainer.max_iter


class PeriodicCheckpointer(_PeriodicCheckpointer, HookBase):
    """Same as :class:`hookloop.checkpoint.PeriodicCheckpointer`, but as a hook.

    Note that when used as a hook, it is unable to save additional data other than what's
    defined by the given ``checkpointer``.

    It is executed every ``period`` iterations and after the last iteration: as in
    detectron2, ``<file_prefix>_final`` is saved in the ``after_step`` of iteration
    ``max_iter - 1``, so only when the last step completed (never after an exception), and
    the trainer state in it has that iteration, from which a resume starts at ``max_iter``.
    ``after_train`` waits for an ``async_save`` checkpointer's save in flight.
    """

    def before_train(self) -> None:
        self.max_iter = self.trainer.max_iter

    def after_step(self) -> None:
        # step(self.trainer.iter), inlined: this runs every iteration. No way to use **kwargs.
        iteration = self.trainer.iter
        if (iteration + 1) % self.period == 0:
            self._save_periodic(iteration, {"iteration": iteration})
        if self.max_iter is not None and iteration >= self.max_iter - 1:
            self.checkpointer.save(f"{self.file_prefix}_final", iteration=iteration)

    def after_train(self) -> None:
        _wait_for_saves(self.checkpointer, _training_finished(self.trainer))


def _wait_for_saves(checkpointer: Any, finished: bool) -> None:
    """Waits for a background save; its error stops a run that succeeded, and is logged when
    training already failed (raising it would hide the original error)."""
    wait = getattr(checkpointer, "wait", None)
    if wait is None:
        return
    if finished:
        wait()
        return
    try:
        wait()
    except Exception as e:
        logger.error(f"Background checkpoint save failed after training stopped: {e!r}")


class BestCheckpointer(HookBase):
    """Checkpoints best weights based off given metric.

    This hook should be used in conjunction to and executed after the hook that produces the
    metric, e.g. :class:`EvalHook`. It saves ``<file_prefix>.pth`` on the first finite value
    of ``val_metric`` and then on each strict improvement; NaN and infinity never count as
    the best. Unlike detectron2's, saving the best model does not move ``last_checkpoint``:
    a resume continues from the newest periodic checkpoint. The best value and iteration are
    in :meth:`state_dict`, so a resumed run does not replace a better model with a worse one.
    """

    def __init__(
        self,
        eval_period: int,
        checkpointer: Any,
        val_metric: str,
        mode: str = "max",
        file_prefix: str = "model_best",
    ) -> None:
        """
        Args:
            eval_period (int): the period ``EvalHook`` is set to run (0: only after training).
            checkpointer: the checkpointer object used to save checkpoints.
            val_metric (str): chosen validation metric to track for best checkpoint, e.g.
                "bbox/AP50"
            mode (str): one of {'max', 'min'}. controls whether the chosen val metric should
                be maximized or minimized, e.g. for "bbox/AP50" it should be "max"
            file_prefix (str): the prefix of checkpoint's filename, defaults to "model_best"
        """
        self._period = _int_arg("BestCheckpointer eval_period", eval_period, 0)
        if not callable(getattr(checkpointer, "save", None)):
            raise TypeError(
                f"BestCheckpointer needs a checkpointer with save(), "
                f"got {type(checkpointer).__name__}"
            )
        if not isinstance(val_metric, str) or not val_metric:
            raise TypeError(f"BestCheckpointer val_metric must be a non-empty str: {val_metric!r}")
        if mode not in ("max", "min"):
            raise ValueError(
                f'Mode "{mode}" to `BestCheckpointer` is unknown. It should be one of '
                '{"max", "min"}.'
            )
        if not isinstance(file_prefix, str) or not file_prefix:
            raise ValueError(
                f"BestCheckpointer file_prefix must be a non-empty str: {file_prefix!r}"
            )
        self._logger = logging.getLogger(__name__)
        self._val_metric = val_metric
        self._mode = mode
        self._compare = operator.gt if mode == "max" else operator.lt
        self._checkpointer = checkpointer
        self._file_prefix = file_prefix
        self.best_metric: Optional[float] = None
        self.best_iter: Optional[int] = None
        # Iteration of the last value looked at: a value not newer than it is stale.
        self._checked_iter: Optional[int] = None

    def _best_checking(self) -> None:
        metric_tuple = self.trainer.storage.latest().get(self._val_metric)
        if metric_tuple is None:
            self._logger.warning(
                f"Given val metric {self._val_metric} does not seem to be computed/stored. "
                "Will not be checkpointing based on it."
            )
            return
        latest_metric, metric_iter = metric_tuple
        metric_iter = int(metric_iter)
        newest_seen = max(
            (i for i in (self._checked_iter, self.best_iter) if i is not None), default=None
        )
        if newest_seen is not None and metric_iter <= newest_seen:
            self._logger.warning(
                f"The latest value of {self._val_metric} is from iteration {metric_iter}, "
                f"already checked: no new evaluation, not checkpointing"
            )
            return
        self._checked_iter = metric_iter
        latest_metric = float(latest_metric)
        if not math.isfinite(latest_metric):
            self._logger.warning(
                f"Not saving as latest eval score for {self._val_metric} is {latest_metric} "
                f"@ iteration {metric_iter}, which is never the best"
            )
            return
        if self.best_metric is None or self._compare(latest_metric, self.best_metric):
            previous = self.best_metric, self.best_iter
            _save_with(
                self._checkpointer, self._file_prefix, {"iteration": metric_iter}, tag_last=False
            )
            self.best_metric, self.best_iter = latest_metric, metric_iter
            if previous[0] is None:
                self._logger.info(
                    f"Saved first model at {latest_metric:0.5f} @ {metric_iter} steps"
                )
            else:
                self._logger.info(
                    f"Saved best model as latest eval score for {self._val_metric} is "
                    f"{latest_metric:0.5f}, better than last best score {previous[0]:0.5f} "
                    f"@ iteration {previous[1]}."
                )
        else:
            self._logger.info(
                f"Not saving as latest eval score for {self._val_metric} is "
                f"{latest_metric:0.5f}, not better than best score {self.best_metric:0.5f} "
                f"@ iteration {self.best_iter}."
            )

    def after_step(self) -> None:
        # same conditions as `EvalHook`
        next_iter = self.trainer.iter + 1
        if (
            self._period > 0
            and next_iter % self._period == 0
            and next_iter != self.trainer.max_iter
        ):
            self._best_checking()

    def after_train(self) -> None:
        # same conditions as `EvalHook`
        finished = _training_finished(self.trainer)
        try:
            if finished:
                self._best_checking()
        finally:
            _wait_for_saves(self._checkpointer, finished)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "best_metric": self.best_metric,
            "best_iter": self.best_iter,
            "checked_iter": self._checked_iter,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or not {"best_metric", "best_iter"} <= set(
            state_dict
        ):
            raise ValueError(
                "BestCheckpointer.load_state_dict() needs a dict with best_metric and best_iter"
            )
        best, best_iter = state_dict["best_metric"], state_dict["best_iter"]
        checked = state_dict.get("checked_iter", best_iter)
        self.best_metric = None if best is None else float(best)
        self.best_iter = None if best_iter is None else int(best_iter)
        self._checked_iter = None if checked is None else int(checked)


def _flatten_results_dict(results: Mapping[Any, Any], prefix: str = "") -> Dict[str, Any]:
    """Expand a hierarchical dict of scalars into a flat dict of scalars. If results[k1][k2]
    = 1, the returned dict will have the entry {"k1/k2": 1}."""
    out: Dict[str, Any] = {}
    for k, v in results.items():
        if not isinstance(k, str):
            raise TypeError(
                f"[EvalHook] eval_function returned a key that is not a str: {k!r}"
                + (f" under '{prefix[:-1]}'" if prefix else "")
            )
        if isinstance(v, Mapping):
            out.update(_flatten_results_dict(v, prefix + k + "/"))
        else:
            out[prefix + k] = v
    return out


class EvalHook(HookBase):
    """Run an evaluation function periodically, and at the end of training.

    It is executed every ``eval_period`` iterations (not at the last one) and after the last
    iteration. The results are put into the storage unsmoothed, under "a/b" keys for a
    nested dict.
    """

    def __init__(
        self, eval_period: int, eval_function: Callable[[], Any], eval_after_train: bool = True
    ) -> None:
        """
        Args:
            eval_period (int): the period to run ``eval_function``. Set to 0 to not evaluate
                periodically (but still evaluate after the last iteration if
                ``eval_after_train`` is True).
            eval_function (callable): a function which takes no arguments, and returns a
                nested dict of evaluation metrics.
            eval_after_train (bool): whether to evaluate after the last iteration

        Note:
            This hook must be enabled in all or none workers. If you would like only certain
            workers to perform evaluation, give other workers a no-op function
            (``eval_function=lambda: None``).
        """
        self._period = _int_arg("EvalHook eval_period", eval_period, 0)
        if not callable(eval_function):
            raise TypeError(
                f"EvalHook eval_function must be callable, got {type(eval_function).__name__}"
            )
        self._func: Callable[[], Any] = eval_function
        self._eval_after_train = bool(eval_after_train)

    def _do_eval(self) -> None:
        results = self._func()

        if results:
            if not isinstance(results, Mapping):
                raise TypeError("Eval function must return a dict. Got {} instead.".format(results))
            flattened_results = _flatten_results_dict(results)
            values = {}
            for k, v in flattened_results.items():
                try:
                    values[k] = float(v)
                except Exception as e:
                    raise ValueError(
                        "[EvalHook] eval_function should return a nested dict of float. "
                        "Got '{}: {}' instead.".format(k, v)
                    ) from e
            self.trainer.storage.put_scalars(**values, smoothing_hint=False)

        # Evaluation may take different time among workers. A barrier make them start the
        # next iteration together.
        comm.synchronize()

    def after_step(self) -> None:
        next_iter = self.trainer.iter + 1
        if self._period > 0 and next_iter % self._period == 0:
            # do the last eval in after_train
            if next_iter != self.trainer.max_iter:
                self._do_eval()

    def after_train(self) -> None:
        try:
            # Not after a failed training.
            if self._eval_after_train and _training_finished(self.trainer):
                self._do_eval()
        finally:
            # func is likely a closure that holds reference to the trainer, therefore we
            # clean it to avoid circular reference in the end
            self.__dict__.pop("_func", None)
