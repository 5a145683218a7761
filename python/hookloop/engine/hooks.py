"""Hooks, mirroring ``detectron2.engine.hooks``.

Each hook overrides only the stages it needs, so the Rust dispatcher calls it only there.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import math
import operator
import os
import warnings
from collections import Counter
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Union

import torch

from hookloop import _core
from hookloop.checkpoint import PeriodicCheckpointer as _PeriodicCheckpointer
from hookloop.checkpoint.checkpointer import DeferredSaves, _save_with, deferring
from hookloop.data.cursor import ReplayIterator, run_epochs
from hookloop.engine._args import _callable_arg, _int_arg, _path_arg
from hookloop.engine.extra_hooks import EarlyStopping, OptimizationHook, PreemptionHandler
from hookloop.engine.metrics import metrics_of, settle_before_save
from hookloop.engine.parts import hook_keys, report_secondary
from hookloop.engine.stop import Preempted
from hookloop.engine.train_loop import HookBase, TrainerBase
from hookloop.nn.precise_bn import get_bn_modules, update_bn_stats
from hookloop.solver.torch_step import step as _step_scheduler
from hookloop.utils import comm
from hookloop.utils._base import writer_protocol
from hookloop.utils.events import EventStorage, EventWriter

__all__ = [
    "CallbackHook",
    "IterationTimer",
    "PeriodicWriter",
    "LRScheduler",
    "PeriodicCheckpointer",
    "BestCheckpointer",
    "EvalHook",
    "PreciseBN",
    "TorchProfiler",
    "AutogradProfiler",
    "TorchMemoryStats",
    "OptimizationHook",
    "PreemptionHandler",
    "Preempted",
    "EarlyStopping",
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
        # detectron2's before_train only starts the clocks: it may run before any trainer is
        # attached. Without a storage yet, each after_step reads the trainer's.
        trainer: Any = self.trainer
        storage = getattr(trainer, "storage", None) if trainer is not None else None
        if isinstance(storage, EventStorage):
            self._start(storage, trainer.start_iter)
        else:
            self._start(None, 0)

    def __getstate__(self) -> Dict[str, Any]:
        return {**HookBase.__getstate__(self), "_warmup_iter": self._warmup_iter}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        self._configure(state.pop("_warmup_iter"))
        HookBase.__setstate__(self, state)

    def after_train(self) -> None:
        total_time, total_time_minus_hooks = self._elapsed()
        hook_time = total_time - total_time_minus_hooks

        # This run's iterations, as detectron2 counts them (a resumed run's too).
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
        hook_stats = getattr(self.trainer, "hook_stats", None)  # absent on a stand-in trainer
        stats = [row for row in hook_stats() if row.calls] if callable(hook_stats) else []
        if stats:
            # Per-hook timing (the dispatcher times every hook call unless turned off): one
            # row per hook and stage, slowest total first.
            lines = [
                f"{'hook':<32} {'stage':<14} {'calls':>9} {'total s':>9} {'max ms':>8} {'share':>6}"
            ]
            for row in sorted(stats, key=lambda r: -r.total_s):
                lines.append(
                    f"{type(row.hook).__name__:<32} {row.stage:<14} {row.calls:>9} "
                    f"{row.total_s:>9.3f} {row.max_s * 1e3:>8.3f} {row.share:>6.1%}"
                )
            logger.info("Time in hooks:\n" + "\n".join(lines))


_PER_STEP_STAGES = ("before_step", "after_backward", "after_step")


class PeriodicWriter(HookBase):
    """Write events to EventStorage (by calling ``writer.write()``) periodically.

    It is executed every ``period`` iterations and after the last iteration. Note that
    ``period`` does not affect how data is smoothed by each writer. Between periods the
    dispatcher does not call it at all (its period filter, the core's one period rule).

    With ``hook_stats=True`` (hookloop's addition; off by default, so metrics.json keeps
    detectron2's keys), each write first puts every hook's mean time per call since the
    previous write, in milliseconds, as unsmoothed scalars named
    ``hooks/<HookClass>/<stage>_ms`` (``<HookClass>.1`` for a second hook of one class): the
    writers then show them (TensorBoard plots them next to the losses).

    It calls the writers' optional methods (:class:`EventWriter` lists them): in
    ``before_train`` ``_bind_trainer`` (the trainer, a weak proxy: :class:`CommonMetricPrinter`
    then shows the epoch), ``_resume_from`` and ``_subscribe_media``; ``_unsubscribe_media``
    after ``close()``; ``_state_dict``/``_load_state_dict`` with its own state. A writer that is
    not an EventWriter but has ``write()`` and ``close()`` is taken too, with the defaults.
    """

    def __init__(
        self, writers: Iterable[EventWriter], period: int = 20, *, hook_stats: bool = False
    ) -> None:
        """
        Args:
            writers (list[EventWriter]): a list of EventWriter objects
            period (int): the period to write
            hook_stats (bool): also write each hook's time per call (see above)
        """
        if not isinstance(hook_stats, bool):
            raise TypeError(
                f"PeriodicWriter hook_stats must be a bool, got {type(hook_stats).__name__}"
            )
        self._hook_stats = hook_stats
        # Per hook and stage, (calls, total_s) at the previous write.
        self._stats_seen: Dict[Any, Any] = {}
        writers = list(writers)
        for w in writers:
            if not isinstance(w, EventWriter) and not (
                callable(getattr(w, "write", None)) and callable(getattr(w, "close", None))
            ):
                raise TypeError(
                    f"PeriodicWriter got {type(w).__name__!r}, not an EventWriter (nor an object "
                    "with write() and close())"
                )
        if isinstance(period, bool) or not isinstance(period, int):
            raise TypeError(f"PeriodicWriter period must be an int, got {type(period).__name__}")
        if period <= 0:
            raise ValueError(f"PeriodicWriter period must be a positive int, got {period}")
        self._writers = writers
        self._period = period

    def before_train(self) -> None:
        self._stats_seen = {}  # hook_stats() counts from each train()'s start
        self._metrics = metrics_of(self.trainer)
        for writer in self._writers:
            # Writers that show the trainer's state (CommonMetricPrinter: its epoch).
            writer_protocol(writer)._bind_trainer(self.trainer)
        # Drop what an earlier run wrote for iterations >= start_iter (a killed run's steps
        # after its checkpoint; at 0, a fresh start's output replaces the earlier run's), so
        # no output mixes two runs' steps (TensorBoard: its purge marker).
        start_iter = self.trainer.start_iter
        for writer in self._writers:
            writer_protocol(writer)._resume_from(start_iter)
        # Writers that take the storage's images and histograms (TensorBoard, the trackers)
        # each get every one, also with a period longer than another writer's. (A trainer's
        # storage may be a stand-in without a media queue.)
        storage = getattr(self.trainer, "storage", None)
        if hasattr(storage, "_subscribe"):
            for writer in self._writers:
                writer_protocol(writer)._subscribe_media(storage)

    # Writers with a resume state (the trackers' run ids) save it in the trainer state's
    # "hookloop_hooks": detectron2's PeriodicWriter has no load_state_dict.
    _STATE_BEYOND_DETECTRON2 = True

    def state_dict(self) -> Dict[str, Any]:
        """The writers' resume states (a tracker's run id), keyed ``"<index>:<class>"``; empty
        when no writer has one (a checkpoint then has no entry for this hook)."""
        states = {}
        for i, writer in enumerate(getattr(self, "_writers", ())):
            state = writer_protocol(writer)._state_dict()
            if state:
                states[f"{i}:{type(writer).__name__}"] = state
        return {"writers": states} if states else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        writers = {f"{i}:{type(w).__name__}": w for i, w in enumerate(self._writers)}
        for key, state in state_dict.get("writers", {}).items():
            writer = writers.get(key)
            if writer is None:
                logger.warning(f"PeriodicWriter has no writer '{key}'; its state is ignored")
                continue
            writer_protocol(writer)._load_state_dict(state)

    def _dispatch_period(self, stage: str) -> Optional[int]:
        if getattr(self, "_period", None) is None:  # not its __dict__: see dispatch.overrides
            raise TypeError(
                f"{type(self).__name__} was not initialized: its __init__ must call "
                "PeriodicWriter.__init__ (super().__init__(writers, period))"
            )
        # Only this class's own after_step follows the period; a subclass's may not.
        if stage == "after_step" and type(self).after_step is PeriodicWriter.after_step:
            return self._period
        return None

    # The trainer's LossMetrics, whose asynchronous writes a due write waits for (looked up in
    # before_train); False: not looked up yet (a hook whose before_train did not run).
    _metrics: Any = False

    def after_step(self) -> None:
        trainer = self.trainer
        # Period 1 is due at every iteration (a live ProgressBar): no need to ask the core.
        if self._period == 1 or _core.periodic_due(trainer.iter, self._period, trainer.max_iter):
            self._write_due()

    #: The dispatcher, which checks the period itself, calls ``_write_due`` (dispatch.table_for).
    _on_period = {"after_step": "_write_due"}

    def _write_due(self) -> None:
        """``after_step`` at an iteration its period makes due."""
        # SimpleTrainer(async_write_metrics=True): the losses of this iteration may still be on
        # their way to the storage; detectron2 writes without them.
        metrics = self._metrics
        if metrics is False:
            metrics = metrics_of(self.trainer)
        if metrics is not None:
            metrics.wait()
        if self._hook_stats:
            self._put_hook_stats()
        for writer in self._writers:
            writer.write()

    _hook_stats = False
    _stats_seen: Dict[Any, Any] = {}

    def _put_hook_stats(self) -> None:
        """Puts ``hooks/<HookClass>/<stage>_ms``: the mean time per call of each hook in each
        per-step stage since the previous write (those called since)."""
        rows = [r for r in self.trainer.hook_stats() if r.stage in _PER_STEP_STAGES]
        hooks = list({id(r.hook): r.hook for r in rows}.values())  # in order, once each
        names = {id(h): key for key, h in hook_keys(hooks, qualified=False)}
        seen = self._stats_seen
        values = {}
        for row in rows:
            key = (id(row.hook), row.stage)
            calls, total = seen.get(key, (0, 0.0))
            if row.calls > calls:
                ms = (row.total_s - total) / (row.calls - calls) * 1e3
                values[f"hooks/{names[id(row.hook)]}/{row.stage}_ms"] = ms
            seen[key] = (row.calls, row.total_s)
        if values:
            self.trainer.storage.put_scalars(smoothing_hint=False, **values)

    def after_train(self) -> None:
        # Every writer is written and closed even if an earlier one fails; the first error is
        # raised, the others logged and attached to it as notes.
        first: Optional[BaseException] = None
        for writer in self._writers:
            # A closed writer's media reader is forgotten: nothing waits for it any more.
            unsubscribe = writer_protocol(writer)._unsubscribe_media
            for step in (writer.write, writer.close, unsubscribe):
                # If any new data is found (e.g. produced by other after_train), write them
                # before closing
                try:
                    step()
                except Exception as e:
                    if first is None:
                        first = e
                    else:
                        report_secondary(first, e, f"{type(writer).__name__}.{step.__name__}")
        if first is not None:
            raise first


class LRScheduler(HookBase):
    """A hook which executes a torch builtin LR scheduler and summarizes the LR. It is
    executed after every iteration.

    Its step is Python's: torch's ``MultiStepLR``/``StepLR`` between milestones skip their
    Python (:func:`hookloop.solver.torch_step.step`), and hookloop's ``LRMultiplier`` sets the
    LRs in one call into its native schedule.
    """

    # Set by __init__ and before_train; a subclass that skips __init__ finds the defaults.
    _optimizer: Any = None
    _scheduler: Any = None
    _best_param_group_id = 0

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
        for attr in ("optimizer", "scheduler"):
            if getattr(self, "_" + attr) is None and not hasattr(trainer, attr):
                raise TypeError(
                    f"LRScheduler({attr}=None) uses trainer.{attr}, but "
                    f"{trainer.__class__.__name__} has none: pass {attr}= to LRScheduler"
                )
        self._optimizer = self._optimizer or trainer.optimizer
        if self._scheduler is None:
            self._scheduler = trainer.scheduler
        groups = getattr(self._optimizer, "param_groups", None)
        if not isinstance(groups, list):
            raise TypeError(
                "LRScheduler optimizer must be a torch.optim.Optimizer, got "
                f"{type(self._optimizer).__name__}"
            )
        if not groups:
            raise ValueError("LRScheduler optimizer has no param_groups")
        from hookloop.solver.lr_scheduler import LRMultiplier, _is_param_scheduler

        if _is_param_scheduler(self._scheduler):
            # A ParamScheduler (fvcore's or hookloop's): wrapped over the run, as detectron2
            # does for every LazyConfig training script.
            self._scheduler = LRMultiplier(
                self._optimizer,
                self._scheduler,
                trainer.max_iter,
                last_iter=trainer.iter - 1,
            )
        if not callable(getattr(self._scheduler, "step", None)):
            raise TypeError(
                "LRScheduler scheduler must have a step() method (a torch LR scheduler or "
                f"hookloop's LRMultiplier), got {type(self._scheduler).__name__}"
            )
        self._best_param_group_id = LRScheduler.get_best_param_group_id(self._optimizer)

    def after_step(self) -> None:
        lr = self._optimizer.param_groups[self._best_param_group_id]["lr"]
        # Positional: the extension parses no keywords (every iteration).
        self.trainer.storage.put_scalar("lr", lr, False)
        scheduler = self._scheduler
        _step_scheduler(self.scheduler if scheduler is None else scheduler)

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


# ----------------------------------------------------------------------------------------------
# PreciseBN, the profilers and TorchMemoryStats (detectron2's hooks of the same names).


class PreciseBN(HookBase):
    """The standard implementation of BatchNorm uses EMA in inference, which is sometimes
    suboptimal. This class computes the true average of statistics rather than the moving
    average, and put true averages to every BN layer in the given model.

    It is executed every ``period`` iterations and after the last iteration.

    Across processes it runs on every rank (register it on all), each over its own
    ``data_loader`` and without a collective of its own, as detectron2's does: the ranks'
    statistics then differ, and the main process checkpoints its own. A DDP model with
    ``broadcast_buffers=True`` (torch's default) broadcasts rank 0's buffers at each forward.
    """

    def __init__(
        self, period: int, model: torch.nn.Module, data_loader: Iterable[Any], num_iter: int
    ) -> None:
        """
        Args:
            period (int): the period this hook is run, or 0 to not run during training.
                The hook will always run in the end of training.
            model (nn.Module): a module whose all BN layers in training mode will be
                updated by precise BN. Note that user is responsible for ensuring the BN
                layers to be updated are in training mode when this hook is triggered.
            data_loader (iterable): it will produce data to be run by `model(data)`. One
                iterator is made from it, at the first run, and later runs continue it.
            num_iter (int): number of iterations used to compute the precise statistics.
        """
        self._logger = logger
        self._period = _int_arg("PreciseBN", "period", period, minimum=0)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"PreciseBN model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if not isinstance(data_loader, Iterable):
            raise TypeError(
                f"PreciseBN data_loader must be iterable, got {type(data_loader).__name__}"
            )
        self._num_iter = _int_arg("PreciseBN", "num_iter", num_iter, minimum=1)
        self._model = model
        self._data_loader = data_loader
        self._data_iter: Optional[Iterator[Any]] = None
        # Where the runs so far left the data: saved, so a resumed run continues there.
        self._data_position = ReplayIterator(data_loader)
        self._disabled = len(get_bn_modules(model)) == 0
        if self._disabled:
            self._logger.info(
                "PreciseBN is disabled because model does not contain BN layers in training mode."
            )

    def after_step(self) -> None:
        if self._disabled:
            return
        next_iter = self.trainer.iter + 1
        is_final = next_iter == self.trainer.max_iter
        if is_final or (self._period > 0 and next_iter % self._period == 0):
            self.update_stats()

    def update_stats(self) -> None:
        """Update the model with precise statistics. Users can manually call this method."""
        if self._disabled:
            return
        if self._data_iter is None:
            self._data_iter = self._data_position
        data_iter = self._data_iter

        def data_loader() -> Iterator[Any]:
            for num_iter in itertools.count(1):
                if num_iter % 100 == 0:
                    self._logger.info(
                        "Running precise-BN ... {}/{} iterations.".format(num_iter, self._num_iter)
                    )
                # This way we can reuse the same iterator. A loader that runs out raises
                # StopIteration here, which Python turns into RuntimeError, as in detectron2.
                yield next(data_iter)

        with EventStorage():  # capture events in a new storage to discard them
            self._logger.info(
                "Running precise-BN for {} iterations...  ".format(self._num_iter)
                + "Note that this could produce different statistics every time."
            )
            update_bn_stats(self._model, data_loader(), self._num_iter)

    # detectron2's PreciseBN is stateless (its resumed runs start the loader again): the data
    # position is kept where detectron2 does not look.
    _STATE_BEYOND_DETECTRON2 = True

    def state_dict(self) -> Dict[str, Any]:
        """The data position of the runs so far (the random states when the loader's iterator
        was made, and the batches drawn), so that a resumed run draws the batches an
        uninterrupted one would: without it, the statistics after a resume (and the weights
        and evaluations that follow) differ."""
        position = self._data_position.state()
        return {"data": position} if position else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._data_position.load_state(state_dict.get("data"))
        self._data_iter = None


class TorchProfiler(HookBase):
    """A hook which runs `torch.profiler.profile`.

    Examples:
    ::
        hooks.TorchProfiler(
             lambda trainer: 10 < trainer.iter < 20, self.cfg.OUTPUT_DIR
        )

    The above example will run the profiler for iteration 10~20 and dump
    results to ``OUTPUT_DIR``. We did not profile the first few iterations
    because they are typically slower than the rest.
    The result files can be loaded in the ``chrome://tracing`` page in chrome browser,
    and the tensorboard visualizations can be visualized using
    ``tensorboard --logdir OUTPUT_DIR/log``
    """

    def __init__(
        self,
        enable_predicate: Callable[[Any], bool],
        output_dir: Union[str, os.PathLike[str]],
        *,
        activities: Optional[Iterable[Any]] = None,
        save_tensorboard: bool = True,
    ) -> None:
        """
        Args:
            enable_predicate (callable[trainer -> bool]): a function which takes a trainer,
                and returns whether to enable the profiler.
                It will be called once every step, and can be used to select which steps to
                profile.
            output_dir (str): the output directory to dump tracing files.
            activities (iterable): same as in `torch.profiler.profile`.
            save_tensorboard (bool): whether to save tensorboard visualizations at
                (output_dir)/log/
        """
        self._enable_predicate = _callable_arg(
            "TorchProfiler", "enable_predicate", enable_predicate
        )
        self._output_dir = _path_arg("TorchProfiler", "output_dir", output_dir)
        if activities is not None and not isinstance(activities, Iterable):
            raise TypeError(
                f"TorchProfiler activities must be an iterable or None, "
                f"got {type(activities).__name__}"
            )
        self._activities = None if activities is None else list(activities)
        self._save_tensorboard = bool(save_tensorboard)
        self._profiler: Any = None

    def before_step(self) -> None:
        if self._enable_predicate(self.trainer):
            if self._save_tensorboard:
                on_trace_ready = torch.profiler.tensorboard_trace_handler(
                    os.path.join(
                        self._output_dir,
                        "log",
                        "profiler-tensorboard-iter{}".format(self.trainer.iter),
                    ),
                    f"worker{comm.get_rank()}",
                )
            else:
                on_trace_ready = None
            self._profiler = torch.profiler.profile(
                activities=self._activities,
                on_trace_ready=on_trace_ready,
                record_shapes=True,
                profile_memory=True,
                with_stack=True,
                with_flops=True,
            )
            self._profiler.__enter__()
        else:
            self._profiler = None

    def after_step(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        if not self._save_tensorboard:
            os.makedirs(self._output_dir, exist_ok=True)
            out_file = os.path.join(
                self._output_dir, "profiler-trace-iter{}.json".format(self.trainer.iter)
            )
            profiler.export_chrome_trace(out_file)

    def after_train(self) -> None:
        # A step that raised left its profiler running; only one can run per process.
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)


class AutogradProfiler(TorchProfiler):
    """A hook which runs `torch.autograd.profiler.profile`.

    Examples:
    ::
        hooks.AutogradProfiler(
             lambda trainer: 10 < trainer.iter < 20, self.cfg.OUTPUT_DIR
        )

    The above example will run the profiler for iteration 10~20 and dump
    results to ``OUTPUT_DIR``. We did not profile the first few iterations
    because they are typically slower than the rest.
    The result files can be loaded in the ``chrome://tracing`` page in chrome browser.

    Note:
        When used together with NCCL on older version of GPUs,
        autograd profiler may cause deadlock because it unnecessarily allocates
        memory on every device it sees. The memory management calls, if
        interleaved with NCCL calls, lead to deadlock on GPUs that do not
        support ``cudaLaunchCooperativeKernelMultiDevice``.
    """

    def __init__(
        self,
        enable_predicate: Callable[[Any], bool],
        output_dir: Union[str, os.PathLike[str]],
        *,
        use_cuda: bool = True,
    ) -> None:
        """
        Args:
            enable_predicate (callable[trainer -> bool]): a function which takes a trainer,
                and returns whether to enable the profiler.
                It will be called once every step, and can be used to select which steps to
                profile.
            output_dir (str): the output directory to dump tracing files.
            use_cuda (bool): same as in `torch.autograd.profiler.profile`. Without a CUDA
                device only the CPU is profiled (one log line says so).
        """
        warnings.warn(
            "AutogradProfiler has been deprecated in favor of TorchProfiler.",
            DeprecationWarning,
            stacklevel=2,
        )
        self._enable_predicate = _callable_arg(
            "AutogradProfiler", "enable_predicate", enable_predicate
        )
        self._output_dir = _path_arg("AutogradProfiler", "output_dir", output_dir)
        self._use_cuda = bool(use_cuda)
        self._save_tensorboard = False
        self._profiler = None
        if self._use_cuda and not torch.cuda.is_available():
            logger.info("AutogradProfiler: CUDA is not available; profiling the CPU only.")
            self._use_cuda = False

    def before_step(self) -> None:
        if self._enable_predicate(self.trainer):
            self._profiler = torch.autograd.profiler.profile(
                use_device="cuda" if self._use_cuda else None
            )
            self._profiler.__enter__()
        else:
            self._profiler = None


class TorchMemoryStats(HookBase):
    """Writes pytorch's cuda memory statistics periodically.

    Without a CUDA device it logs that once and does nothing else.
    """

    def __init__(self, period: int = 20, max_runs: int = 10) -> None:
        """
        Args:
            period (int): Output stats each 'period' iterations, and after the last one.
            max_runs (int): Stop the logging after 'max_runs' logs; the last one adds
                ``torch.cuda.memory_summary()``.
        """
        self._logger = logger
        self._period = _int_arg("TorchMemoryStats", "period", period, minimum=1)
        self._max_runs = _int_arg("TorchMemoryStats", "max_runs", max_runs, minimum=0)
        self._runs = 0
        self._no_cuda = False

    def after_step(self) -> None:
        if self._runs >= self._max_runs or self._no_cuda:
            return
        next_iter = self.trainer.iter + 1
        if next_iter % self._period == 0 or next_iter == self.trainer.max_iter:
            if not torch.cuda.is_available():
                self._logger.info(
                    "TorchMemoryStats: CUDA is not available; no memory statistics are logged."
                )
                self._no_cuda = True
                return
            max_reserved_mb = torch.cuda.max_memory_reserved() / 1024.0 / 1024.0
            reserved_mb = torch.cuda.memory_reserved() / 1024.0 / 1024.0
            max_allocated_mb = torch.cuda.max_memory_allocated() / 1024.0 / 1024.0
            allocated_mb = torch.cuda.memory_allocated() / 1024.0 / 1024.0

            self._logger.info(
                (
                    " iter: {} "
                    " max_reserved_mem: {:.0f}MB "
                    " reserved_mem: {:.0f}MB "
                    " max_allocated_mem: {:.0f}MB "
                    " allocated_mem: {:.0f}MB "
                ).format(
                    self.trainer.iter,
                    max_reserved_mb,
                    reserved_mb,
                    max_allocated_mb,
                    allocated_mb,
                )
            )

            self._runs += 1
            if self._runs == self._max_runs:
                mem_summary = torch.cuda.memory_summary()
                self._logger.info("\n" + mem_summary)

            torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------------------------
# Checkpointing and evaluation


def _training_finished(trainer: Any) -> bool:
    """Whether the loop ran to ``max_iter`` (``train()`` sets ``iter = max_iter`` only then)."""
    return trainer.iter >= trainer.max_iter


def _evaluate_after_training(trainer: Any) -> bool:
    """Whether ``EvalHook``'s and ``BestCheckpointer``'s ``after_train`` evaluate: detectron2's
    ``iter + 1 >= max_iter``, which holds after hookloop's loop (``iter == max_iter``) and after
    a trainer's own loop that leaves ``iter`` at ``max_iter - 1`` (semi-supervised trainers
    copied detectron2's loop without its final ``self.iter += 1``). Not after ``train()``'s
    loop raised, also in its last step (where detectron2 evaluates)."""
    if getattr(getattr(trainer, "_hookloop", None), "failed", False):
        return False
    return trainer.iter + 1 >= trainer.max_iter


def _ended_cleanly(trainer: Any) -> bool:
    """Whether training finished or stopped through ``request_stop()`` (not by an error)."""
    return _training_finished(trainer) or bool(getattr(trainer, "stopped_early", False))


class PeriodicCheckpointer(_PeriodicCheckpointer, HookBase):
    """Same as :class:`hookloop.checkpoint.PeriodicCheckpointer`, but as a hook.

    Note that when used as a hook, it is unable to save additional data other than what's
    defined by the given ``checkpointer``.

    It is executed every ``period`` iterations and after the last iteration: as in
    detectron2, ``<file_prefix>_final`` is saved in the ``after_step`` of iteration
    ``max_iter - 1``, so only when the last step completed (never after an exception), and
    the trainer state in it has that iteration, from which a resume starts at ``max_iter``.
    When training stops early through ``trainer.request_stop()``, ``after_train`` saves
    ``<file_prefix>_<iter:07d>`` of the stop iteration (unless its period just saved it), the
    newest checkpoint a resume continues from at the next iteration. ``after_train`` waits for
    an ``async_save`` checkpointer's save in flight.

    When the trainer runs epochs (a finite data loader, ``trainer.iters_per_epoch``, that
    ``max_iter`` goes over more than once), the hook passes ``trainer.epoch`` to :meth:`step`,
    so periodic files (and the stop checkpoint) are named
    ``<file_prefix>_Epoch_<epoch:05d>_Iter_<iter:07d>``, as xmodaler's and cvpods' epoch
    checkpointers name them; otherwise ``max_epoch``, when given, derives
    the epoch from the iteration.

    Across processes it saves on the main process only, whatever the checkpointer's
    ``save_to_disk``: registered on every rank (or, as detectron2 does, on the main process
    only), each checkpoint is written once.

    It runs where it is registered, as in detectron2, and saves in two parts: at its place the
    model's and the optimizer's state (every checkpointable but the trainer) as detectron2
    saves them there, and the "Saving checkpoint" line; after the iteration's last hook, the
    trainer's state (the iteration's evaluation and best-model record, the writers' positions,
    the RNG) and the file. A hook registered after it that changes the weights in the same
    ``after_step`` (an EMA hook swapping its weights in) does not change what is saved, and a
    resume still continues as if the run had never stopped. When a hook after it raises in
    that iteration, the file is written in ``after_train`` all the same (detectron2's is on
    disk before that hook runs). Before a save, the losses waiting in the storage's batched
    read are read: a non-finite loss raises there, also one read earlier on another thread,
    before a file holds the weights it made (:func:`~hookloop.engine.metrics.settle_before_save`;
    a stop checkpoint whose last losses failed to read is not saved, and ``train()`` raises).
    With a checkpointer that is not a :class:`hookloop.checkpoint.Checkpointer` (fvcore's),
    the whole save happens at its place.
    """

    _deferred_saves: Optional[DeferredSaves] = None

    def before_train(self) -> None:
        self.max_iter = self.trainer.max_iter
        self._saves().discard()

    def state_dict(self) -> Dict[str, Any]:
        # Stateless in the trainer's checkpoint, as detectron2's hook: detectron2 resuming a
        # hookloop checkpoint calls load_state_dict() on its own hook, which has none. The
        # periodic files of an earlier run are found on disk instead (max_to_keep).
        return {}

    def _dispatch_period(self, stage: str) -> Optional[int]:
        # Between periods the dispatcher skips after_step (its rule is a superset of this one).
        if stage == "after_step" and type(self).after_step is PeriodicCheckpointer.after_step:
            return self.period
        return None

    def _saves(self) -> DeferredSaves:
        """The saves this hook began and has not finished (made on first use: a subclass may
        skip ``__init__``)."""
        saves = self._deferred_saves
        if saves is None:
            saves = self._deferred_saves = DeferredSaves(_is_trainer)
        return saves

    def _trainer_epoch(self) -> Optional[int]:
        """``trainer.epoch`` when the trainer runs epochs (a finite loader that ``max_iter``
        goes over more than once), else None: a run within one pass keeps detectron2's file
        names. Read only on saves."""
        trainer = self.trainer
        if run_epochs(trainer) is None:
            return None
        epoch = getattr(trainer, "epoch", None)
        # A subclass's own `epoch` that is not a count (a method of an epoch mixin): none.
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None

    def after_step(self) -> None:
        if not comm.is_main_process():
            return
        # step(self.trainer.iter, epoch), inlined. No way to use **kwargs.
        iteration = self.trainer.iter
        periodic = (iteration + 1) % self.period == 0
        final = self.max_iter is not None and iteration >= self.max_iter - 1
        if not (periodic or final):
            return
        if not settle_before_save(self.trainer, f"the checkpoint of iteration {iteration}"):
            return
        with deferring(self.checkpointer, self._saves()):
            if periodic:
                self._save_periodic(iteration, {"iteration": iteration}, self._trainer_epoch())
            if final:
                self.checkpointer.save(f"{self.file_prefix}_final", iteration=iteration)

    def after_train(self) -> None:
        trainer = self.trainer
        iteration = trainer.iter
        if (
            getattr(trainer, "stopped_early", False)
            and comm.is_main_process()
            and iteration >= trainer.start_iter
            and (iteration + 1) % self.period != 0
            and settle_before_save(trainer, f"the checkpoint of the stop at iteration {iteration}")
        ):
            with deferring(self.checkpointer, self._saves()):
                self._save_periodic(iteration, {"iteration": iteration}, self._trainer_epoch())

    # The dispatcher calls these after every hook of the stage (dispatch._finishing_entries).
    _finishing = {"after_step": "_finish_step", "after_train": "_finish_train"}

    def _finish_step(self) -> None:
        self._saves().finish()

    def _finish_train(self) -> None:
        finished = _ended_cleanly(self.trainer)
        try:
            # Also when a hook after this one raised in the iteration of a save: as in
            # detectron2, whose file is on disk before that hook runs (to debug its failure).
            self._saves().finish()
        finally:
            _wait_for_saves(self.checkpointer, finished)


def _is_trainer(obj: Any) -> bool:
    """Whether a checkpointable is a trainer, whose state a deferred save takes last."""
    return isinstance(obj, TrainerBase)


def _eval_period(hook: Any, cls: Any, stage: str) -> Optional[int]:
    """The dispatcher's period for an evaluation-style ``after_step`` (``cls``'s own, not a
    subclass's): ``eval_period``, or for 0 ("only after training") one that is never due
    before the last iteration, where the hook's own check skips it too."""
    if stage != "after_step" or type(hook).after_step is not cls.after_step:
        return None
    return hook._period if hook._period > 0 else _NEVER


# A period no run reaches: due only at the last iteration.
_NEVER = 2**62


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
    Across processes every rank keeps the record and the main process alone saves. Before a
    save, the losses waiting in the storage's batched read are read: a non-finite loss, also
    one read earlier on another thread, refuses the save
    (:func:`~hookloop.engine.metrics.settle_before_save`).
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
        self._period = _int_arg("BestCheckpointer", "eval_period", eval_period, 0)
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

    def _best_checking(self) -> None:
        metric_tuple = self.trainer.storage.latest().get(self._val_metric)
        if metric_tuple is None:
            # detectron2's text, its missing space included: logs read alike.
            self._logger.warning(
                f"Given val metric {self._val_metric} does not seem to be computed/stored."
                "Will not be checkpointing based on it."
            )
            return
        latest_metric, metric_iter = metric_tuple
        metric_iter = int(metric_iter)
        # A value checked before (no evaluation since) compares as not better, as in
        # detectron2: the best is saved once, and "Not saving" is logged.
        latest_metric = float(latest_metric)
        if math.isnan(latest_metric) and self.best_metric is not None:
            # NaN compares as not better: detectron2's decision and message.
            self._logger.info(
                f"Not saving as latest eval score for {self._val_metric} is "
                f"{latest_metric:0.5f}, not better than best score {self.best_metric:0.5f} "
                f"@ iteration {self.best_iter}."
            )
            return
        if not math.isfinite(latest_metric) and self.best_metric is None:
            return  # no first model from a non-finite score, silently, as detectron2
        if not math.isfinite(latest_metric):
            self._logger.warning(
                f"Not saving as latest eval score for {self._val_metric} is {latest_metric} "
                f"@ iteration {metric_iter}, which is never the best"
            )
            return
        if self.best_metric is None or self._compare(latest_metric, self.best_metric):
            previous = self.best_metric, self.best_iter
            if comm.is_main_process():
                if not settle_before_save(self.trainer, f"{self._file_prefix}.pth"):
                    return
                _save_with(
                    self._checkpointer,
                    self._file_prefix,
                    {"iteration": metric_iter},
                    tag_last=False,
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

    def _dispatch_period(self, stage: str) -> Optional[int]:
        return _eval_period(self, BestCheckpointer, stage)

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
        try:
            if _evaluate_after_training(self.trainer):
                self._best_checking()
        finally:
            _wait_for_saves(self._checkpointer, _ended_cleanly(self.trainer))

    # Its state goes under the trainer state's "hookloop_hooks": detectron2's BestCheckpointer
    # has no load_state_dict.
    _STATE_BEYOND_DETECTRON2 = True

    def state_dict(self) -> Dict[str, Any]:
        return {"best_metric": self.best_metric, "best_iter": self.best_iter}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or not {"best_metric", "best_iter"} <= set(
            state_dict
        ):
            raise ValueError(
                "BestCheckpointer.load_state_dict() needs a dict with best_metric and best_iter"
            )
        best, best_iter = state_dict["best_metric"], state_dict["best_iter"]
        self.best_metric = None if best is None else float(best)
        self.best_iter = None if best_iter is None else int(best_iter)


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
            (``eval_function=lambda: None``). The function runs on every rank; after it the
            ranks meet at a barrier (``comm.synchronize()``), so that they start the next
            iteration together.
        """
        self._period = _int_arg("EvalHook", "eval_period", eval_period, 0)
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

    def _dispatch_period(self, stage: str) -> Optional[int]:
        return _eval_period(self, EvalHook, stage)

    def after_step(self) -> None:
        next_iter = self.trainer.iter + 1
        if self._period > 0 and next_iter % self._period == 0:
            # do the last eval in after_train
            if next_iter != self.trainer.max_iter:
                self._do_eval()

    def after_train(self) -> None:
        try:
            # Not after a failed training (before its last step).
            if self._eval_after_train and _evaluate_after_training(self.trainer):
                self._do_eval()
        finally:
            # func is likely a closure that holds reference to the trainer, therefore we
            # clean it to avoid circular reference in the end
            self.__dict__.pop("_func", None)
