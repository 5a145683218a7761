"""The trainer's losses on their way into the storage: ``SimpleTrainer._write_metrics``'s work.

detectron2 reads every loss at every step (``v.detach().cpu().item()``, a device
synchronization each). :class:`LossMetrics`, ``SimpleTrainer``'s collaborator, keeps them as
tensors instead and reads them in one batch, before anything reads the storage (a writer, a
hook's ``latest()``) and at least every ``LossMetrics.READ_EVERY`` recorded iterations. The
values, iterations and key order stored are those of the per-step path, which runs when asked
for (``check_finite_every_step``), for asynchronous writes and across processes. Across
processes every loss of every rank travels in one packed collective, which also carries the
stop protocol's codes (:mod:`hookloop.engine.stop`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import weakref
from collections import deque
from typing import Any, Deque, List, Mapping, Optional, Tuple

import torch

from hookloop.utils import comm
from hookloop.utils._tensors import read_scalars, stack_scalars
from hookloop.utils.events import _CURRENT_STORAGE_STACK, get_event_storage

__all__ = ["LossMetrics", "metrics_of", "write_metrics_across"]

# The trainer's logger: these records are detectron2's train_loop records (filters and the
# corpus match them by logger name).
logger = logging.getLogger("hookloop.engine.train_loop")

# One recorded iteration: (iteration, data_time, loss_dict, prefix).
_Entry = Tuple[int, float, Mapping[str, Any], str]


class LossMetrics:
    """The losses a trainer recorded but has not read yet, and its asynchronous writes."""

    #: At most this many recorded iterations of losses wait, as tensors, for one batched read.
    READ_EVERY = 20
    #: At most this many batches of CUDA losses are copied to the host without being waited
    #: for (until something reads the storage); then they are read.
    MAX_IN_FLIGHT = 50

    def __init__(self) -> None:
        #: Read the losses in batches (set at ``before_train``).
        self.deferring = False
        self._pending_writes: Deque[concurrent.futures.Future] = deque()
        # Losses recorded but not read yet. The training thread appends to this one list
        # without a lock (an append is atomic); a settle, which any thread reading the storage
        # may run, removes what it takes, under _lock. The list is never replaced: an append
        # made while a settle runs lands either in what it takes or in a list it left empty
        # (and that append sets the storage's flag again).
        self._pending: List[_Entry] = []
        self._lock = threading.RLock()
        # Losses of earlier iterations on their way to the host (a CUDA copy not waited for).
        self._in_flight: List[Tuple[List[_Entry], _HostCopy]] = []
        self._storage: Any = None
        self._every_step = False  # see read_every_step
        self._direct: Optional[bool] = None
        this = weakref.ref(self)  # the storage holds this function: no cycle through it

        def settle() -> None:
            metrics = this()
            if metrics is not None:
                metrics.settle()

        self._settler = settle

    def configure(self, trainer: Any) -> None:
        """At ``before_train``: deferred reads in one process; the per-step path when asked
        for, for asynchronous writes, and across processes (whose reduction is per write)."""
        self.deferring = not (
            trainer.check_finite_every_step
            # detectron2's name, set in __init__ (a subclass may skip it)
            or getattr(trainer, "async_write_metrics", False)
            or (comm._initialized() and comm.get_world_size() > 1)
        )
        # Whether a reader comes at every step (read_every_step), and, decided at the first
        # write then, whether the losses are on the CPU (read at once) or not (deferred).
        self._every_step = False
        self._direct = None

    def read_every_step(self) -> None:
        """Something reads the storage at every iteration (a ``PeriodicWriter`` of period 1
        says so at its ``before_train``). Losses on the CPU are then put at once, in one call
        into the core, instead of kept for a read that comes at the same step anyway: no
        pending list, no copy of the loss dict, no settle. Losses on a device stay deferred:
        their one batched copy to the host then waits until the writer reads, after the
        optimizer's step was queued."""
        self._every_step = True

    def write(
        self, trainer: Any, loss_dict: Mapping[str, Any], data_time: float, prefix: str, it: int
    ) -> None:
        """``_write_metrics`` of iteration ``it``: kept for a batched read, or put now."""
        if (it + 1) % trainer.gather_metric_period:
            return
        if self.deferring:
            if self._every_step and not self._pending:
                direct = self._direct
                if direct is None:
                    direct = self._direct = not any(_off_cpu(v) for v in loss_dict.values())
                if direct:
                    try:
                        trainer.storage._write_metrics_batch([(it, data_time, loss_dict, prefix)])
                    except Exception:
                        logger.exception("Exception in writing metrics: ")
                        raise
                    return
            # Kept as tensors: no device synchronization, no torch call, this step. The dict
            # is copied: a model may return the same dict every step, refilled.
            pending = self._pending
            pending.append((it, data_time, dict(loss_dict), prefix))
            if len(pending) == 1:
                self._storage = storage = trainer.storage
                storage._defer(self._settler)
            elif len(pending) >= self.READ_EVERY:
                self._read_pending(self.MAX_IN_FLIGHT)
            return
        stop = trainer._hookloop.stop
        try:
            agreed = write_metrics_across(loss_dict, data_time, it, prefix, stop.outgoing())
        except Exception:
            logger.exception("Exception in writing metrics: ")
            raise
        stop.agreed(agreed)

    def _read_pending(self, max_in_flight: int) -> None:
        """The pending losses are READ_EVERY iterations long. CUDA losses start their
        copy to the host (one stack, one non-blocking copy into pinned memory, an event after
        it) without waiting for it, so no iteration synchronizes until something reads the
        storage; other losses are put now."""
        with self._lock:
            pending = self._pending
            tensors = (
                _losses_if(pending, _is_cuda) if len(self._in_flight) < max_in_flight else None
            )
            flat = stack_scalars(tensors) if tensors else None
            if flat is not None:
                self._in_flight.append((self._take_pending(), _HostCopy(flat)))
                return  # the storage's deferred flag stays set: a read completes the copy
        self._storage._settle()

    def _take_pending(self) -> List[_Entry]:
        """The pending entries, removed from the list in place (under the lock): what the
        training thread appends meanwhile stays for the next settle."""
        pending = self._pending
        taken = pending[:]
        del pending[: len(taken)]
        return taken

    def settle(self) -> None:
        """Puts the pending losses of every recorded iteration with the one write_metrics
        rule, in one call into the core per batch. Losses on a device are read in one batch
        (one stack, one copy to the host: one synchronization, or a wait for a copy started
        earlier); on the CPU the core reads each with ``item()``, which costs less than
        stacking many small tensors."""
        with self._lock:
            in_flight, self._in_flight = self._in_flight, []
            pending = self._take_pending()
            batches: List[Tuple[List[_Entry], Optional[List[float]]]] = [
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
                    self._storage._write_metrics_batch(entries, values)
            except Exception:
                logger.exception("Exception in writing metrics: ")
                raise

    # Asynchronous writes (async_write_metrics)

    def submit(self, trainer: Any, loss_dict: Mapping[str, Any], data_time: float) -> None:
        """Writes metrics on the trainer's executor thread, after re-raising any earlier
        write's error. The executor gets a copy of the loss dict: the model may refill its dict
        at the next step before the executor reads it (detectron2 hands over the model's)."""
        self.raise_async_errors()
        it = trainer.iter
        loss_dict = dict(loss_dict)
        stop = trainer._hookloop.stop
        executor = trainer.concurrent_executor
        if (it + 1) % trainer.gather_metric_period == 0 and stop.rides_collective():
            # Across ranks: the stop agreed in the previous period's collective is taken
            # here, at the same iteration on every rank (the wait is for a write a period
            # old); this period's collective carries the stop code read now.
            self.wait()
            agreed, stop.agreed_async = stop.agreed_async, 0
            stop.agreed(agreed)
            # Its own group: on the default one, this thread's collective could meet DDP's
            # all-reduces in a different order on each rank (made here, on the training
            # thread, where every rank reaches the first one at the same point).
            group = comm._get_off_thread_group()
            self._pending_writes.append(
                executor.submit(
                    _write_async,
                    stop,
                    trainer.gather_metric_period,
                    loss_dict,
                    data_time,
                    it,
                    stop.outgoing(),
                    group,
                )  # fmt: skip
            )
            return
        self._pending_writes.append(
            executor.submit(trainer._write_metrics, loss_dict, data_time, iter=it)
        )

    def wait(self) -> None:
        """Waits for the asynchronous metric writes queued so far, re-raising the first error.
        A periodic writer calls this when it is due, so its lines carry every loss of the
        iterations they cover, as in the synchronous mode."""
        pending = self._pending_writes
        while pending:
            pending.popleft().result()

    def raise_async_errors(self) -> None:
        """Re-raises, on the training thread, an exception from a finished asynchronous metric
        write (the oldest first)."""
        pending = self._pending_writes
        while pending and pending[0].done():
            pending.popleft().result()

    def settle_last(self, storage: Any) -> Optional[BaseException]:
        """At ``after_train``, before the hooks read the storage: the last deferred losses are
        put; the error of that settle is returned, for :meth:`take_errors`."""
        try:
            storage._settle()
        except Exception as error:
            return error
        return None

    def take_errors(self, first: Optional[BaseException]) -> List[BaseException]:
        """``first`` (the last settle's error), then the errors of this run's asynchronous
        writes; the queue is emptied."""
        errors = [e for e in (f.exception() for f in self._pending_writes) if e is not None]
        if first is not None:
            errors.insert(0, first)
        self._pending_writes.clear()
        return errors


def _write_async(
    stop: Any,
    gather_metric_period: int,
    loss_dict: Mapping[str, torch.Tensor],
    data_time: float,
    it: int,
    code: int,
    group: Any,
) -> None:
    """A write on the executor thread with the stop code the training thread read at this
    step; the agreed code waits for the training thread (:meth:`LossMetrics.submit`)."""
    if (it + 1) % gather_metric_period != 0:
        return
    try:
        agreed = write_metrics_across(loss_dict, data_time, it, "", code, group)
    except Exception:
        logger.exception("Exception in writing metrics: ")
        raise
    if agreed:
        stop.agreed_async = agreed


def metrics_of(trainer: Any) -> Optional[LossMetrics]:
    """The :class:`LossMetrics` of ``trainer`` (a ``DefaultTrainer``: of the trainer it wraps),
    or None for a trainer that has none."""
    for t in (trainer, getattr(trainer, "_trainer", None)):
        metrics = getattr(getattr(t, "_hookloop", None), "metrics", None)
        if metrics is not None:
            return metrics  # type: ignore[no-any-return]
    return None


def write_metrics_across(
    loss_dict: Mapping[str, torch.Tensor],
    data_time: float,
    cur_iter: int,
    prefix: str,
    stop: int,
    group: Optional[Any] = None,
) -> int:
    """``SimpleTrainer.write_metrics``, which also carries this rank's stop code (see
    :meth:`StopController.outgoing`) in the packed collective (on ``group``, by default the
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


def _mean(values: List[float]) -> float:
    """numpy.mean of the values gathered from the ranks."""
    import numpy as np

    return float(np.mean(values))


def _losses_if(pending: List[_Entry], accept: Any) -> Optional[List[Any]]:
    """Every loss of the ``pending`` iterations, when ``accept`` takes each of them (tried on
    the first one before the list is built), else None."""
    if not accept(next(iter(pending[0][2].values()), None)):
        return None
    values = [v for _, _, losses, _ in pending for v in losses.values()]
    return values if all(map(accept, values)) else None


def _off_cpu(value: Any) -> bool:
    # is_cpu, not .device.type: a device object per call costs seven times as much
    return isinstance(value, torch.Tensor) and not value.is_cpu


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
