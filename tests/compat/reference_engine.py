"""A pure-Python training-loop engine with detectron2's semantics: the one model of detectron2
and fvcore behaviour that hookloop is checked and measured against.

Written for hookloop (not copied from detectron2 or fvcore), it does the same work per call as
``detectron2.engine`` / ``detectron2.utils.events`` and fvcore's ``HistoryBuffer`` and
``Timer``. The tests use it as their oracle, as ``compat.d2`` (directly, or through
``compat.reference`` for the writers); the benchmarks in ``benches/`` run it as their
baseline (``benches/lab`` puts this directory on ``sys.path``), so that "reference / hookloop"
ratios measure what a detectron2 user would save. It is not part of the package, and it
imports nothing from hookloop, so it shares none of hookloop's code.

- ``HistoryBuffer`` is fvcore's: a list of ``(value, iteration)`` tuples that evicts with
  ``list.pop(0)`` once ``max_length`` (1e6) entries are held, ``np.median`` / ``np.mean`` over
  the window, a running global mean.
- ``EventStorage`` is a ``defaultdict`` of those histories; ``put_scalar`` converts with
  ``float()``; smoothing reads ``count_samples`` samples back from the newest.
- ``TrainerBase.train`` is ``for self.iter in range(...)``, and each stage loops over every hook,
  calling ``HookBase``'s no-op methods too.
- ``SimpleTrainer.write_metrics`` reads each loss with ``v.detach().cpu().item()``, goes through
  ``comm.gather`` (``[metrics]`` in one process) and ``np.max`` / ``np.mean``.
- The writers: ``JSONWriter`` (``json.dumps(sort_keys=True)``, flush and ``os.fsync`` on every
  write), ``TensorboardXWriter`` (torch's ``SummaryWriter``, one ``add_scalar`` per scalar),
  ``CommonMetricPrinter`` (detectron2's format string, ``logging.info``).
- fvcore's parameter schedules and detectron2's ``WarmupParamScheduler`` / ``LRMultiplier``:
  the formulas with the same float operations in the same order (``sum()``, ``**``,
  ``math.cos``, ``int()``, ``bisect_right``), so hookloop's native schedules must match them bit
  for bit; ``LRMultiplier`` is a torch ``LRScheduler`` whose ``get_lr`` calls the Python
  schedule, i.e. what a detectron2 step costs. Constructors do not validate (the tests check
  hookloop's validation on their own); ``CompositeParamScheduler`` copies ``lengths`` where
  fvcore rewrites the caller's list.

Differences, for the benchmarks: ``EventStorage`` takes ``max_length`` (the length of its
histories; fvcore's default when omitted), and ``TensorboardXWriter`` creates its
``SummaryWriter`` in ``__init__`` (detectron2 <= 0.6; newer versions create it at the first
write), so that creating the event file is not timed as part of a write. For the tests:
``CommonMetricPrinter.format_line`` is ``write()``'s line on a given storage, and two
``TrainerBase`` class attributes (``hook_types``, ``iter_ends_at_max_iter``) default to
detectron2's behaviour and let a test run hookloop's hooks and end state under this loop.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import datetime
import functools
import json
import logging
import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = [
    "HistoryBuffer",
    "EventStorage",
    "get_event_storage",
    "EventWriter",
    "JSONWriter",
    "TensorboardXWriter",
    "CommonMetricPrinter",
    "HookBase",
    "TrainerBase",
    "SimpleTrainer",
    "Timer",
    "IterationTimer",
    "LRScheduler",
    "PeriodicWriter",
    "comm",
    "ParamScheduler",
    "ConstantParamScheduler",
    "CosineParamScheduler",
    "ExponentialParamScheduler",
    "LinearParamScheduler",
    "MultiStepParamScheduler",
    "PolynomialDecayParamScheduler",
    "StepParamScheduler",
    "StepWithFixedGammaParamScheduler",
    "CompositeParamScheduler",
    "WarmupParamScheduler",
    "LRMultiplier",
]

# The hooks, as the corpus's backends list them (``compat.backends``).
HOOK_NAMES = (
    "CallbackHook",
    "IterationTimer",
    "PeriodicWriter",
    "LRScheduler",
    "EvalHook",
    "TorchProfiler",
    "AutogradProfiler",
)

# CommonMetricPrinter logs here (detectron2 uses "detectron2.utils.events").
EVENTS_LOGGER = "compat.d2.utils.events"

# detectron2's module loggers, under compat.d2. instead of detectron2.
logger = logging.getLogger("compat.d2.engine.train_loop")
hooks_logger = logging.getLogger("compat.d2.engine.hooks")


# ---------------------------------------------------------------------------------------------
# fvcore.common.history_buffer / fvcore.common.timer


class HistoryBuffer:
    """fvcore's history of ``(value, iteration)`` pairs, at most ``max_length`` of them."""

    def __init__(self, max_length: int = 1000000) -> None:
        self._max_length = max_length
        self._data: List[Tuple[float, Any]] = []
        self._count = 0
        self._global_avg = 0.0

    def update(self, value: float, iteration: Optional[Any] = None) -> None:
        if iteration is None:
            iteration = self._count
        if len(self._data) == self._max_length:
            # O(len): moves every remaining pointer down one slot.
            self._data.pop(0)
        self._data.append((value, iteration))
        self._count += 1
        self._global_avg += (value - self._global_avg) / self._count

    def latest(self) -> float:
        return self._data[-1][0]

    def median(self, window_size: int) -> float:
        return np.median([x[0] for x in self._data[-window_size:]])  # type: ignore[return-value]

    def avg(self, window_size: int) -> float:
        return np.mean([x[0] for x in self._data[-window_size:]])  # type: ignore[return-value]

    def global_avg(self) -> float:
        return self._global_avg

    def values(self) -> List[Tuple[float, Any]]:
        return self._data


class Timer:
    """fvcore's pausable timer."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._start = time.perf_counter()
        self._paused: Optional[float] = None
        self._total_paused = 0.0
        self._count_start = 1

    def pause(self) -> None:
        if self._paused is not None:
            raise ValueError("Trying to pause a Timer that is already paused!")
        self._paused = time.perf_counter()

    def is_paused(self) -> bool:
        return self._paused is not None

    def resume(self) -> None:
        if self._paused is None:
            raise ValueError("Trying to resume a Timer that is not paused!")
        self._total_paused += time.perf_counter() - self._paused
        self._paused = None
        self._count_start += 1

    def seconds(self) -> float:
        end_time = self._paused if self._paused is not None else time.perf_counter()
        return end_time - self._start - self._total_paused

    def avg_seconds(self) -> float:
        return self.seconds() / self._count_start


# ---------------------------------------------------------------------------------------------
# detectron2.utils.comm (the single-process paths, with the same checks)


class comm:  # noqa: N801 - used as a module namespace, like ``detectron2.utils.comm``
    @staticmethod
    def get_world_size() -> int:
        if not torch.distributed.is_available():
            return 1
        if not torch.distributed.is_initialized():
            return 1
        return torch.distributed.get_world_size()

    @staticmethod
    def get_rank() -> int:
        if not torch.distributed.is_available():
            return 0
        if not torch.distributed.is_initialized():
            return 0
        return torch.distributed.get_rank()

    @staticmethod
    def is_main_process() -> bool:
        return comm.get_rank() == 0

    @staticmethod
    def synchronize() -> None:
        """A barrier across processes; nothing to wait for in a single process."""
        if comm.get_world_size() == 1:
            return
        torch.distributed.barrier()

    @staticmethod
    def get_local_rank() -> int:
        # detectron2 asserts a local process group only once torch.distributed is initialized.
        if not torch.distributed.is_available():
            return 0
        if not torch.distributed.is_initialized():
            return 0
        raise NotImplementedError("the reference engine runs in one process")

    @staticmethod
    def all_gather(data: Any, group: Any = None) -> List[Any]:
        if comm.get_world_size() == 1:
            return [data]
        raise NotImplementedError("the reference engine runs in one process")

    @staticmethod
    def shared_random_seed() -> Any:
        # rank 0's ``np.random.randint(2**31)`` (a Python int), as detectron2's.
        ints = np.random.randint(2**31)
        return comm.all_gather(ints)[0]

    @staticmethod
    def gather(data: Any, dst: int = 0, group: Any = None) -> List[Any]:
        if comm.get_world_size() == 1:
            return [data]
        raise NotImplementedError("the reference engine runs in one process")

    @staticmethod
    def reduce_dict(input_dict: Dict[str, Any], average: bool = True) -> Dict[str, Any]:
        # detectron2 returns the dict itself in one process (no copy).
        if comm.get_world_size() < 2:
            return input_dict
        raise NotImplementedError("the reference engine runs in one process")


# ---------------------------------------------------------------------------------------------
# detectron2.utils.events

_CURRENT_STORAGE_STACK: List[EventStorage] = []


def get_event_storage() -> EventStorage:
    assert len(_CURRENT_STORAGE_STACK), (
        "get_event_storage() has to be called inside a 'with EventStorage(...)' context!"
    )
    return _CURRENT_STORAGE_STACK[-1]


class EventStorage:
    """detectron2's metric storage: histories, latest values and smoothing hints in dicts."""

    def __init__(self, start_iter: int = 0, *, max_length: int = 1000000) -> None:
        self._history: Dict[str, HistoryBuffer] = defaultdict(
            lambda: HistoryBuffer(max_length=max_length)
        )
        self._smoothing_hints: Dict[str, bool] = {}
        self._latest_scalars: Dict[str, Tuple[float, Any]] = {}
        self._iter = start_iter
        self._current_prefix = ""
        self._vis_data: List[Any] = []
        self._histograms: List[Any] = []

    def put_scalar(
        self, name: str, value: Any, smoothing_hint: bool = True, cur_iter: Optional[int] = None
    ) -> None:
        name = self._current_prefix + name
        cur_iter = self._iter if cur_iter is None else cur_iter
        history = self._history[name]
        value = float(value)
        history.update(value, cur_iter)
        self._latest_scalars[name] = (value, cur_iter)

        existing_hint = self._smoothing_hints.get(name)
        if existing_hint is not None:
            assert existing_hint == smoothing_hint, (
                "Scalar {} was put with a different smoothing_hint!".format(name)
            )
        else:
            self._smoothing_hints[name] = smoothing_hint

    def put_scalars(
        self, *, smoothing_hint: bool = True, cur_iter: Optional[int] = None, **kwargs: Any
    ) -> None:
        for k, v in kwargs.items():
            self.put_scalar(k, v, smoothing_hint=smoothing_hint, cur_iter=cur_iter)

    def put_image(self, img_name: str, img_tensor: Any) -> None:
        self._vis_data.append((img_name, img_tensor, self._iter))

    def put_histogram(self, hist_name: str, hist_tensor: torch.Tensor, bins: int = 1000) -> None:
        """detectron2's histogram parameters for ``add_histogram_raw``: ``num`` is ``len`` (the
        first dimension), the edges are float32 ``linspace(min, max)``, counts from ``histc``."""
        ht_min, ht_max = hist_tensor.min().item(), hist_tensor.max().item()
        hist_counts = torch.histc(hist_tensor, bins=bins)
        hist_edges = torch.linspace(start=ht_min, end=ht_max, steps=bins + 1, dtype=torch.float32)
        self._histograms.append(
            dict(
                tag=hist_name,
                min=ht_min,
                max=ht_max,
                num=len(hist_tensor),
                sum=float(hist_tensor.sum()),
                sum_squares=float(torch.sum(hist_tensor**2)),
                bucket_limits=hist_edges[1:].tolist(),
                bucket_counts=hist_counts.tolist(),
                global_step=self._iter,
            )
        )

    def history(self, name: str) -> HistoryBuffer:
        ret = self._history.get(name, None)
        if ret is None:
            raise KeyError("No history metric available for {}!".format(name))
        return ret

    def histories(self) -> Dict[str, HistoryBuffer]:
        return self._history

    def latest(self) -> Dict[str, Tuple[float, Any]]:
        return self._latest_scalars

    def latest_with_smoothing_hint(self, window_size: int = 20) -> Dict[str, Tuple[float, Any]]:
        result = {}
        for k, (v, itr) in self._latest_scalars.items():
            result[k] = (
                self._history[k].median(self.count_samples(k, window_size))
                if self._smoothing_hints[k]
                else v,
                itr,
            )
        return result

    def count_samples(self, name: str, window_size: int = 20) -> int:
        samples = 0
        data = self._history[name].values()
        for _, iter_ in reversed(data):
            if iter_ > data[-1][1] - window_size:
                samples += 1
            else:
                break
        return samples

    def smoothing_hints(self) -> Dict[str, bool]:
        return self._smoothing_hints

    def step(self) -> None:
        self._iter += 1

    @property
    def iter(self) -> int:
        return self._iter

    @iter.setter
    def iter(self, val: int) -> None:
        self._iter = int(val)

    @property
    def iteration(self) -> int:
        return self._iter

    def __enter__(self) -> EventStorage:
        _CURRENT_STORAGE_STACK.append(self)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        assert _CURRENT_STORAGE_STACK[-1] == self
        _CURRENT_STORAGE_STACK.pop()

    @contextmanager
    def name_scope(self, name: str) -> Iterator[None]:
        old_prefix = self._current_prefix
        self._current_prefix = name.rstrip("/") + "/"
        yield
        self._current_prefix = old_prefix

    def clear_images(self) -> None:
        self._vis_data = []

    def clear_histograms(self) -> None:
        self._histograms = []


class EventWriter:
    def write(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JSONWriter(EventWriter):
    """One ``json.dumps(sort_keys=True)`` line per new iteration; flush + fsync every write."""

    def __init__(self, json_file: str, window_size: int = 20) -> None:
        self._file_handle = open(json_file, "a")
        self._window_size = window_size
        self._last_write = -1

    def write(self) -> None:
        storage = get_event_storage()
        to_save: Dict[Any, Dict[str, Any]] = defaultdict(dict)

        for k, (v, itr) in storage.latest_with_smoothing_hint(self._window_size).items():
            # keep scalars that have not been written
            if itr <= self._last_write:
                continue
            to_save[itr][k] = v
        if len(to_save):
            all_iters = sorted(to_save.keys())
            self._last_write = max(all_iters)

        for itr, scalars_per_iter in to_save.items():
            scalars_per_iter["iteration"] = itr
            self._file_handle.write(json.dumps(scalars_per_iter, sort_keys=True) + "\n")
        self._file_handle.flush()
        try:
            os.fsync(self._file_handle.fileno())
        except AttributeError:
            pass

    def close(self) -> None:
        self._file_handle.close()


class TensorboardXWriter(EventWriter):
    """Scalars (and images, histograms) through torch's ``SummaryWriter``."""

    def __init__(self, log_dir: str, window_size: int = 20, **kwargs: Any) -> None:
        self._window_size = window_size
        self._writer_args = {"log_dir": log_dir, **kwargs}
        self._last_write = -1

    @functools.cached_property
    def _writer(self) -> Any:
        # Created at first use, as detectron2's: a writer that never writes leaves no file.
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(**self._writer_args)

    def write(self) -> None:
        storage = get_event_storage()
        new_last_write = self._last_write
        for k, (v, itr) in storage.latest_with_smoothing_hint(self._window_size).items():
            if itr > self._last_write:
                self._writer.add_scalar(k, v, itr)
                new_last_write = max(new_last_write, itr)
        self._last_write = new_last_write

        if len(storage._vis_data) >= 1:
            for img_name, img, step_num in storage._vis_data:
                self._writer.add_image(img_name, img, step_num)
            storage.clear_images()

        if len(storage._histograms) >= 1:
            for params in storage._histograms:
                self._writer.add_histogram_raw(**params)
            storage.clear_histograms()

    def close(self) -> None:
        if "_writer" in self.__dict__:
            self._writer.close()


class CommonMetricPrinter(EventWriter):
    """detectron2's one-line log of ETA, iteration, smoothed losses, times and lr."""

    def __init__(self, max_iter: Optional[int] = None, window_size: int = 20) -> None:
        self.logger = logging.getLogger(EVENTS_LOGGER)
        self._max_iter = max_iter
        self._window_size = window_size
        self._last_write: Optional[Tuple[int, float]] = None

    def _get_eta(self, storage: EventStorage) -> Optional[str]:
        if self._max_iter is None:
            return ""
        iteration = storage.iter
        try:
            eta_seconds = storage.history("time").median(1000) * (self._max_iter - iteration - 1)
            storage.put_scalar("eta_seconds", eta_seconds, smoothing_hint=False)
            return str(datetime.timedelta(seconds=int(eta_seconds)))
        except KeyError:
            # estimate eta on our own - more noisy
            eta_string = None
            if self._last_write is not None:
                estimate_iter_time = (time.perf_counter() - self._last_write[1]) / (
                    iteration - self._last_write[0]
                )
                eta_seconds = estimate_iter_time * (self._max_iter - iteration - 1)
                eta_string = str(datetime.timedelta(seconds=int(eta_seconds)))
            self._last_write = (iteration, time.perf_counter())
            return eta_string

    def write(self) -> None:
        storage = get_event_storage()
        if storage.iter == self._max_iter:
            # This hook only reports training progress (loss, ETA, etc) but not other data,
            # therefore do not write anything after training succeeds, even if this method
            # is called.
            return
        if torch.cuda.is_available():
            max_mem_mb = torch.cuda.max_memory_allocated() / 1024.0 / 1024.0
        else:
            max_mem_mb = None
        self.logger.info(self.format_line(storage, max_mem_mb))

    def format_line(self, storage: EventStorage, max_mem_mb: Optional[float]) -> str:
        """The line ``write()`` logs for ``storage`` (which gets ``eta_seconds`` when the ETA
        comes from the ``time`` history), before ``max_iter`` is reached."""
        iteration = storage.iter
        try:
            avg_data_time = storage.history("data_time").avg(
                storage.count_samples("data_time", self._window_size)
            )
            last_data_time = storage.history("data_time").latest()
        except KeyError:
            # they may not exist in the first few iterations (due to warmup)
            # or when SimpleTrainer is not used
            avg_data_time = None
            last_data_time = None
        try:
            avg_iter_time = storage.history("time").global_avg()
            last_iter_time = storage.history("time").latest()
        except KeyError:
            avg_iter_time = None
            last_iter_time = None
        try:
            lr = "{:.5g}".format(storage.history("lr").latest())
        except KeyError:
            lr = "N/A"

        eta_string = self._get_eta(storage)

        # NOTE: max_mem is parsed by grep in "dev/parse_results.sh"
        return str.format(
            " {eta}iter: {iter}  {losses}  {non_losses}  {avg_time}{last_time}"
            + "{avg_data_time}{last_data_time} lr: {lr}  {memory}",
            eta=f"eta: {eta_string}  " if eta_string else "",
            iter=iteration,
            losses="  ".join(
                [
                    "{}: {:.4g}".format(k, v.median(storage.count_samples(k, self._window_size)))
                    for k, v in storage.histories().items()
                    if "loss" in k
                ]
            ),
            non_losses="  ".join(
                [
                    "{}: {:.4g}".format(k, v.median(storage.count_samples(k, self._window_size)))
                    for k, v in storage.histories().items()
                    if "[metric]" in k
                ]
            ),
            avg_time="time: {:.4f}  ".format(avg_iter_time) if avg_iter_time is not None else "",
            last_time="last_time: {:.4f}  ".format(last_iter_time)
            if last_iter_time is not None
            else "",
            avg_data_time="data_time: {:.4f}  ".format(avg_data_time)
            if avg_data_time is not None
            else "",
            last_data_time="last_data_time: {:.4f}  ".format(last_data_time)
            if last_data_time is not None
            else "",
            lr=lr,
            memory="max_mem: {:.0f}M".format(max_mem_mb) if max_mem_mb is not None else "",
        )


# ---------------------------------------------------------------------------------------------
# detectron2.engine.train_loop


class HookBase:
    trainer: Any = None

    def before_train(self) -> None:
        pass

    def after_train(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        # No load_state_dict: detectron2's HookBase has none (a hook that returns state must
        # bring its own, or loading the trainer's state fails on it).
        return {}


class TrainerBase:
    # What register_hooks accepts: detectron2 asserts its own HookBase. A test widens it to run
    # hookloop's hooks under this loop.
    hook_types: Tuple[type, ...] = (HookBase,)
    # detectron2 ends a finished train() with ``self.iter += 1``: max_iter, except that
    # train(n, n) leaves n + 1. True gives hookloop's ``self.iter = max_iter``.
    iter_ends_at_max_iter = False

    def __init__(self) -> None:
        self._hooks: List[HookBase] = []
        self.iter: int = 0
        self.start_iter: int = 0
        self.max_iter: int
        self.storage: EventStorage

    def register_hooks(self, hooks: Iterable[Optional[HookBase]]) -> None:
        import weakref

        kept = [h for h in hooks if h is not None]
        for h in kept:
            assert isinstance(h, self.hook_types)
            h.trainer = weakref.proxy(self)
        self._hooks.extend(kept)

    def train(self, start_iter: int, max_iter: int) -> None:
        logger.info("Starting training from iteration {}".format(start_iter))

        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter

        with EventStorage(start_iter) as self.storage:
            try:
                self.before_train()
                for self.iter in range(start_iter, max_iter):
                    self.before_step()
                    self.run_step()
                    self.after_step()
                # self.iter == max_iter can be used by `after_train` to tell whether the
                # training successfully finished or failed due to exceptions.
                if self.iter_ends_at_max_iter:
                    self.iter = max_iter
                else:
                    self.iter += 1
            except Exception:
                logger.exception("Exception during training:")
                raise
            finally:
                self.after_train()

    def before_train(self) -> None:
        for h in self._hooks:
            h.before_train()

    def after_train(self) -> None:
        self.storage.iter = self.iter
        for h in self._hooks:
            h.after_train()

    def before_step(self) -> None:
        # Maintain the invariant that storage.iter == trainer.iter for the entire execution
        # of each step
        self.storage.iter = self.iter
        for h in self._hooks:
            h.before_step()

    def after_backward(self) -> None:
        for h in self._hooks:
            h.after_backward()

    def after_step(self) -> None:
        for h in self._hooks:
            h.after_step()

    def run_step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """The iteration and each stateful hook's state, keyed by its class's qualified name;
        a second stateful hook of the same class is not saved."""
        ret: Dict[str, Any] = {"iteration": self.iter}
        hooks_state: Dict[str, Any] = {}
        for h in self._hooks:
            sd = h.state_dict()
            if sd:
                name = type(h).__qualname__
                if name not in hooks_state:
                    hooks_state[name] = sd
        if hooks_state:
            ret["hooks"] = hooks_state
        return ret

    def load_state_dict(self, state_dict: Any) -> None:
        self.iter = state_dict["iteration"]
        for key, value in state_dict.get("hooks", {}).items():
            for h in self._hooks:
                if type(h).__qualname__ == key:
                    h.load_state_dict(value)  # type: ignore[attr-defined] # the hook's own
                    break
            else:
                logger.warning(f"Cannot find the hook '{key}', its state_dict is ignored.")


class SimpleTrainer(TrainerBase):
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
        model.train()
        self.model = model
        self.data_loader = data_loader
        self._data_loader_iter_obj: Optional[Iterator[Any]] = None
        self.optimizer = optimizer
        self.gather_metric_period = gather_metric_period
        self.zero_grad_before_forward = zero_grad_before_forward
        self.async_write_metrics = async_write_metrics
        self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def run_step(self) -> None:
        assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
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
            self.concurrent_executor.submit(
                self._write_metrics, loss_dict, data_time, iter=self.iter
            )
        else:
            self._write_metrics(loss_dict, data_time)

        self.optimizer.step()

    @property
    def _data_loader_iter(self) -> Iterator[Any]:
        if self._data_loader_iter_obj is None:
            self._data_loader_iter_obj = iter(self.data_loader)
        return self._data_loader_iter_obj

    def _write_metrics(
        self,
        loss_dict: Dict[str, torch.Tensor],
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
        loss_dict: Dict[str, torch.Tensor], data_time: float, cur_iter: int, prefix: str = ""
    ) -> None:
        metrics_dict = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        metrics_dict["data_time"] = data_time

        storage = get_event_storage()
        # Keep track of data time per rank
        storage.put_scalar("rank_data_time", data_time, cur_iter=cur_iter)

        # Gather metrics among all workers for logging
        all_metrics_dict = comm.gather(metrics_dict)

        if comm.is_main_process():
            # data_time among workers can have high variance. The actual latency
            # caused by data_time is the maximum among workers.
            data_time = np.max([x.pop("data_time") for x in all_metrics_dict])
            storage.put_scalar("data_time", data_time, cur_iter=cur_iter)

            # average the rest metrics
            metrics_dict = {
                k: np.mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0].keys()
            }
            total_losses_reduced = sum(metrics_dict.values())
            if not np.isfinite(total_losses_reduced):
                raise FloatingPointError(
                    f"Loss became infinite or NaN at iteration={cur_iter}!\n"
                    f"loss_dict = {metrics_dict}"
                )

            storage.put_scalar(
                "{}total_loss".format(prefix), total_losses_reduced, cur_iter=cur_iter
            )
            if len(metrics_dict) > 1:
                storage.put_scalars(cur_iter=cur_iter, **metrics_dict)  # type: ignore[arg-type]

    def reset_data_loader(self, data_loader_builder: Any) -> None:
        del self.data_loader
        self.data_loader = data_loader_builder()
        self._data_loader_iter_obj = None

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["optimizer"] = self.optimizer.state_dict()
        return ret

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])

    def after_train(self) -> None:
        super().after_train()
        self.concurrent_executor.shutdown(wait=True)


class AMPTrainer(SimpleTrainer):
    """SimpleTrainer with a ``GradScaler`` and autocast; a step needs CUDA."""

    def __init__(
        self,
        model: torch.nn.Module,
        data_loader: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        gather_metric_period: int = 1,
        zero_grad_before_forward: bool = False,
        grad_scaler: Any = None,
        precision: torch.dtype = torch.float16,
        log_grad_scaler: bool = False,
        async_write_metrics: bool = False,
    ) -> None:
        super().__init__(
            model, data_loader, optimizer, gather_metric_period, zero_grad_before_forward
        )
        if grad_scaler is None:
            grad_scaler = torch.amp.GradScaler("cuda")
        self.grad_scaler = grad_scaler
        self.precision = precision
        self.log_grad_scaler = log_grad_scaler

    def run_step(self) -> None:
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        assert torch.cuda.is_available(), "[AMPTrainer] CUDA is required for AMP training!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        if self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        with torch.autocast("cuda", dtype=self.precision):
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
            get_event_storage().put_scalar("[metric]grad_scaler", self.grad_scaler.get_scale())
        self.after_backward()
        self._write_metrics(loss_dict, data_time)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def state_dict(self) -> Dict[str, Any]:
        ret = super().state_dict()
        ret["grad_scaler"] = self.grad_scaler.state_dict()
        return ret

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


# ---------------------------------------------------------------------------------------------
# detectron2.engine.hooks


class IterationTimer(HookBase):
    def __init__(self, warmup_iter: int = 3) -> None:
        self._warmup_iter = warmup_iter
        self._step_timer = Timer()
        self._start_time = time.perf_counter()
        self._total_timer = Timer()

    def before_train(self) -> None:
        self._start_time = time.perf_counter()
        self._total_timer.reset()
        self._total_timer.pause()

    def after_train(self) -> None:
        total_time = time.perf_counter() - self._start_time
        total_time_minus_hooks = self._total_timer.seconds()
        hook_time = total_time - total_time_minus_hooks

        num_iter = self.trainer.storage.iter + 1 - self.trainer.start_iter - self._warmup_iter

        if num_iter > 0 and total_time_minus_hooks > 0:
            # Speed is meaningful only after warmup
            # NOTE this format is parsed by grep in some scripts
            hooks_logger.info(
                "Overall training speed: {} iterations in {} ({:.4f} s / it)".format(
                    num_iter,
                    str(datetime.timedelta(seconds=int(total_time_minus_hooks))),
                    total_time_minus_hooks / num_iter,
                )
            )

        hooks_logger.info(
            "Total training time: {} ({} on hooks)".format(
                str(datetime.timedelta(seconds=int(total_time))),
                str(datetime.timedelta(seconds=int(hook_time))),
            )
        )

    def before_step(self) -> None:
        self._step_timer.reset()
        self._total_timer.resume()

    def after_step(self) -> None:
        # +1 because we're in after_step, the current step is done
        # but not yet counted
        iter_done = self.trainer.storage.iter - self.trainer.start_iter + 1
        if iter_done >= self._warmup_iter:
            sec = self._step_timer.seconds()
            self.trainer.storage.put_scalars(time=sec)
        else:
            self._start_time = time.perf_counter()
            self._total_timer.reset()

        self._total_timer.pause()


class PeriodicWriter(HookBase):
    def __init__(self, writers: List[EventWriter], period: int = 20) -> None:
        self._writers = writers
        for w in writers:
            assert isinstance(w, EventWriter), w
        self._period = period

    def after_step(self) -> None:
        if (self.trainer.iter + 1) % self._period == 0 or (
            self.trainer.iter == self.trainer.max_iter - 1
        ):
            for writer in self._writers:
                writer.write()

    def after_train(self) -> None:
        for writer in self._writers:
            # If any new data is found (e.g. produced by other after_train),
            # write them before closing
            writer.write()
            writer.close()


class LRScheduler(HookBase):
    def __init__(self, optimizer: Any = None, scheduler: Any = None) -> None:
        self._optimizer = optimizer
        self._scheduler = scheduler

    def before_train(self) -> None:
        self._optimizer = self._optimizer or self.trainer.optimizer
        if isinstance(self.scheduler, ParamScheduler):
            self._scheduler = LRMultiplier(
                self._optimizer,
                self.scheduler,
                self.trainer.max_iter,
                last_iter=self.trainer.iter - 1,
            )
        self._best_param_group_id = LRScheduler.get_best_param_group_id(self._optimizer)

    @staticmethod
    def get_best_param_group_id(optimizer: torch.optim.Optimizer) -> int:
        # NOTE: some heuristics on what LR to summarize
        # summarize the param group with most parameters
        largest_group = max(len(g["params"]) for g in optimizer.param_groups)

        if largest_group == 1:
            # If all groups have one parameter,
            # then find the most common initial LR, and use it for summary
            from collections import Counter

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

    def after_step(self) -> None:
        lr = self._optimizer.param_groups[self._best_param_group_id]["lr"]
        self.trainer.storage.put_scalar("lr", lr, smoothing_hint=False)
        self.scheduler.step()

    @property
    def scheduler(self) -> Any:
        return self._scheduler or self.trainer.scheduler

    def state_dict(self) -> Dict[str, Any]:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LRScheduler):
            return self.scheduler.state_dict()
        return {}

    def load_state_dict(self, state_dict: Any) -> None:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LRScheduler):
            hooks_logger.info("Loading scheduler from state_dict ...")
            self.scheduler.load_state_dict(state_dict)


class CallbackHook(HookBase):
    """Calls the given functions with the trainer; drops them after training."""

    def __init__(
        self,
        *,
        before_train: Any = None,
        after_train: Any = None,
        before_step: Any = None,
        after_step: Any = None,
    ) -> None:
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
        del self._before_train, self._after_train
        del self._before_step, self._after_step

    def before_step(self) -> None:
        if self._before_step:
            self._before_step(self.trainer)

    def after_step(self) -> None:
        if self._after_step:
            self._after_step(self.trainer)


class TorchProfiler(HookBase):
    """Runs ``torch.profiler.profile`` around the steps ``enable_predicate(trainer)`` picks;
    the trace goes to ``output_dir/log/profiler-tensorboard-iter<N>/`` (TensorBoard's
    handler, worker ``worker<rank>``) or, without ``save_tensorboard``, to
    ``output_dir/profiler-trace-iter<N>.json``."""

    def __init__(
        self,
        enable_predicate: Any,
        output_dir: str,
        *,
        activities: Any = None,
        save_tensorboard: bool = True,
    ) -> None:
        self._enable_predicate = enable_predicate
        self._activities = activities
        self._output_dir = output_dir
        self._save_tensorboard = save_tensorboard

    def before_step(self) -> None:
        if self._enable_predicate(self.trainer):
            on_trace_ready = None
            if self._save_tensorboard:
                on_trace_ready = torch.profiler.tensorboard_trace_handler(
                    os.path.join(
                        self._output_dir,
                        "log",
                        "profiler-tensorboard-iter{}".format(self.trainer.iter),
                    ),
                    f"worker{comm.get_rank()}",
                )
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
        self._profiler.__exit__(None, None, None)
        if not self._save_tensorboard:
            os.makedirs(self._output_dir, exist_ok=True)
            out_file = os.path.join(
                self._output_dir, "profiler-trace-iter{}.json".format(self.trainer.iter)
            )
            self._profiler.export_chrome_trace(out_file)


class AutogradProfiler(TorchProfiler):
    """detectron2's deprecated profiler hook: ``torch.autograd.profiler.profile(use_cuda=...)``
    around the steps the predicate picks. As detectron2's, it sets none of
    ``TorchProfiler``'s other attributes (its ``after_step`` reads ``_save_tensorboard``)."""

    def __init__(self, enable_predicate: Any, output_dir: str, *, use_cuda: bool = True) -> None:
        import warnings

        # detectron2 gives no stacklevel (only the category and message are compared).
        warnings.warn("AutogradProfiler has been deprecated in favor of TorchProfiler.")  # noqa: B028
        self._enable_predicate = enable_predicate
        self._use_cuda = use_cuda
        self._output_dir = output_dir

    def before_step(self) -> None:
        if self._enable_predicate(self.trainer):
            self._profiler = torch.autograd.profiler.profile(use_cuda=self._use_cuda)
            self._profiler.__enter__()
        else:
            self._profiler = None


def flatten_results_dict(results: Dict[str, Any]) -> Dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a/b": 1}``."""
    r: Dict[str, Any] = {}
    for k, v in results.items():
        if isinstance(v, dict):
            for kk, vv in flatten_results_dict(v).items():
                r[k + "/" + kk] = vv
        else:
            r[k] = v
    return r


class EvalHook(HookBase):
    """Runs ``eval_function`` every ``eval_period`` iterations (but the last) and after
    training; puts its flattened results unsmoothed."""

    def __init__(self, eval_period: int, eval_function: Any, eval_after_train: bool = True):
        self._period = eval_period
        self._func = eval_function
        self._eval_after_train = eval_after_train

    def _do_eval(self) -> None:
        results = self._func()
        if results:
            assert isinstance(results, dict), (
                "Eval function must return a dict. Got {} instead.".format(results)
            )
            flattened_results = flatten_results_dict(results)
            for k, v in flattened_results.items():
                try:
                    v = float(v)
                except Exception as e:
                    raise ValueError(
                        "[EvalHook] eval_function should return a nested dict of float. "
                        "Got '{}: {}' instead.".format(k, v)
                    ) from e
            self.trainer.storage.put_scalars(**flattened_results, smoothing_hint=False)

    def after_step(self) -> None:
        next_iter = self.trainer.iter + 1
        if self._period > 0 and next_iter % self._period == 0:
            if next_iter != self.trainer.max_iter:
                self._do_eval()

    def after_train(self) -> None:
        if self._eval_after_train and self.trainer.iter + 1 >= self.trainer.max_iter:
            self._do_eval()
        del self._func


# ---------------------------------------------------------------------------------------------
# fvcore.common.param_scheduler / detectron2.solver.lr_scheduler

WHERE_EPSILON = 1e-6


class ParamScheduler:
    WHERE_EPSILON = WHERE_EPSILON

    def __call__(self, where: float) -> float:
        raise NotImplementedError


class ConstantParamScheduler(ParamScheduler):
    def __init__(self, value: float) -> None:
        self._value = value

    def __call__(self, where: float) -> float:
        if where >= 1.0:
            raise RuntimeError(f"where in ParamScheduler must be in [0, 1]: got {where}")
        return self._value


class CosineParamScheduler(ParamScheduler):
    def __init__(self, start_value: float, end_value: float) -> None:
        self._start_value, self._end_value = start_value, end_value

    def __call__(self, where: float) -> float:
        start, end = self._start_value, self._end_value
        return end + 0.5 * (start - end) * (1 + math.cos(math.pi * where))


class ExponentialParamScheduler(ParamScheduler):
    def __init__(self, start_value: float, decay: float) -> None:
        self._start_value, self._decay = start_value, decay

    def __call__(self, where: float) -> float:
        return self._start_value * (self._decay**where)


class LinearParamScheduler(ParamScheduler):
    def __init__(self, start_value: float, end_value: float) -> None:
        self._start_value, self._end_value = start_value, end_value

    def __call__(self, where: float) -> float:
        return self._end_value * where + self._start_value * (1 - where)


class MultiStepParamScheduler(ParamScheduler):
    def __init__(
        self,
        values: List[float],
        num_updates: Optional[int] = None,
        milestones: Optional[List[int]] = None,
    ) -> None:
        if num_updates is None and milestones is None:
            raise ValueError("num_updates and milestones cannot both be None")
        if milestones is None:
            width = math.ceil(num_updates / float(len(values)))  # type: ignore[operator]
            milestones = [width * (k + 1) for k in range(len(values) - 1)]
        else:
            expected = len(values) - int(num_updates is not None)
            if not (isinstance(milestones, Sequence) and len(milestones) == expected):
                raise ValueError(f"MultiStep scheduler requires a list of {expected} miletones")
        if num_updates is None:
            num_updates, milestones = milestones[-1], milestones[:-1]
        if num_updates < len(values):
            raise ValueError("Total num_updates must be greater than length of param schedule")
        self._param_schedule = values
        self._num_updates = num_updates
        self._milestones = list(milestones)
        start_epoch = 0
        for milestone in self._milestones:
            if milestone >= self._num_updates:
                raise ValueError(
                    "Milestone must be smaller than total number of updates: "
                    f"num_updates={int(self._num_updates)}, milestone={int(milestone)}"
                )
            if start_epoch >= milestone:
                raise ValueError(
                    "Milestone must be smaller than start epoch: "
                    f"start_epoch={int(start_epoch)}, milestone={int(milestone)}"
                )
            start_epoch = milestone

    def __call__(self, where: float) -> float:
        if where > 1.0:
            raise RuntimeError(f"where in ParamScheduler must be in [0, 1]: got {where}")
        epoch_num = int((where + self.WHERE_EPSILON) * self._num_updates)
        return self._param_schedule[bisect.bisect_right(self._milestones, epoch_num)]


class PolynomialDecayParamScheduler(ParamScheduler):
    def __init__(self, base_value: float, power: float) -> None:
        self._base_value, self._power = base_value, power

    def __call__(self, where: float) -> float:
        return self._base_value * (1 - where) ** self._power


class StepParamScheduler(ParamScheduler):
    def __init__(self, num_updates: float, values: List[float]) -> None:
        self._param_schedule = values

    def __call__(self, where: float) -> float:
        return self._param_schedule[int((where + self.WHERE_EPSILON) * len(self._param_schedule))]


class StepWithFixedGammaParamScheduler(ParamScheduler):
    def __init__(self, base_value: float, num_decays: int, gamma: float, num_updates: int) -> None:
        values = [base_value]
        for _ in range(num_decays):
            values.append(values[-1] * gamma)
        self._step_param_scheduler = StepParamScheduler(num_updates, values)

    def __call__(self, where: float) -> float:
        return self._step_param_scheduler(where)


class CompositeParamScheduler(ParamScheduler):
    def __init__(
        self, schedulers: List[Any], lengths: List[float], interval_scaling: List[str]
    ) -> None:
        lengths = list(lengths)
        if sum(lengths) != 1.0:
            lengths[-1] = 1.0 - sum(lengths[:-1])
        self._schedulers, self._lengths = schedulers, lengths
        self._interval_scaling = interval_scaling

    def __call__(self, where: float) -> float:
        i = 0
        running_total = self._lengths[i]
        while (where + self.WHERE_EPSILON) > running_total and i < len(self._schedulers) - 1:
            i += 1
            running_total += self._lengths[i]
        scheduler_where = where
        if self._interval_scaling[i] == "rescaled":
            scheduler_start = running_total - self._lengths[i]
            scheduler_where = (where - scheduler_start) / self._lengths[i]
        return self._schedulers[i](scheduler_where)


class WarmupParamScheduler(CompositeParamScheduler):
    def __init__(
        self,
        scheduler: Any,
        warmup_factor: float,
        warmup_length: float,
        warmup_method: str = "linear",
        rescale_interval: bool = False,
    ) -> None:
        end_value = scheduler(0.0) if rescale_interval else scheduler(warmup_length)
        start_value = warmup_factor * scheduler(0.0)
        warmup: ParamScheduler
        if warmup_method == "constant":
            warmup = ConstantParamScheduler(start_value)
        else:
            warmup = LinearParamScheduler(start_value, end_value)
        super().__init__(
            [warmup, scheduler],
            [warmup_length, 1 - warmup_length],
            ["rescaled", "rescaled" if rescale_interval else "fixed"],
        )


class LRMultiplier(torch.optim.lr_scheduler.LRScheduler):
    def __init__(
        self, optimizer: torch.optim.Optimizer, multiplier: Any, max_iter: int, last_iter: int = -1
    ) -> None:
        self._multiplier = multiplier
        self._max_iter = max_iter
        super().__init__(optimizer, last_epoch=last_iter)

    def state_dict(self) -> Dict[str, Any]:
        return {"base_lrs": self.base_lrs, "last_epoch": self.last_epoch}

    def get_lr(self) -> List[Any]:
        multiplier = self._multiplier(self.last_epoch / self._max_iter)
        return [base_lr * multiplier for base_lr in self.base_lrs]
