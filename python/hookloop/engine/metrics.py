"""The trainer's losses on their way into the storage: ``SimpleTrainer._write_metrics``'s work.

detectron2 reads every loss at every step (``v.detach().cpu().item()``, a device
synchronization each). By default hookloop hands them, as tensors, to the storage's pending
queue (``EventStorage._record_losses``: core ``pending``), which reads them in one batch before
anything reads the storage (a writer, a hook's ``latest()``) and at least every 20 recorded
iterations, and stores them by the one ``write_metrics`` rule at their own iterations.
:class:`LossMetrics` keeps only what is its own: choosing that path or the per-step one (asked
for with ``check_finite_every_step``, and taken for asynchronous writes and across processes),
the asynchronous writes, and the packed collective across processes, which also carries the
stop protocol's codes (:mod:`hookloop.engine.stop`).

A loss read later must be read with the value of its iteration: a tensor that can still change
(a leaf: an ``nn.Parameter``, a buffer, a tensor given as it is) is copied when recorded
(:func:`hookloop.utils._tensors.snapshot_losses`). And a save must not hold the weights a
non-finite loss made: :func:`settle_before_save`, which every checkpoint hook calls.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
from collections import deque
from typing import Any, Deque, List, Mapping, Optional

import torch

from hookloop.utils import comm
from hookloop.utils._tensors import read_scalars, snapshot_losses
from hookloop.utils.events import _CURRENT_STORAGE_STACK, get_event_storage

__all__ = ["LossMetrics", "metrics_of", "settle_before_save", "write_metrics_across"]

# The trainer's logger: these records are detectron2's train_loop records (filters and the
# corpus match them by logger name).
logger = logging.getLogger("hookloop.engine.train_loop")


class LossMetrics:
    """How a trainer's losses reach the storage, and its asynchronous writes."""

    def __init__(self, stop: Any) -> None:
        #: The :class:`~hookloop.engine.stop.StopController` whose codes the packed collective
        #: carries: the trainer's own, or the one of the trainer that drives it
        #: (:meth:`configure`).
        self.stop = stop
        #: Hand the losses to the storage's pending queue (set at ``before_train``).
        self.deferring = False
        #: Copy the losses that can still change before they are read (set at
        #: ``before_train``; not a CUDA graph's ring slots, which stay until read).
        self.snapshot = True
        #: The error of the last read at ``after_train`` (:meth:`settle_last`), which the
        #: trainer raises after every hook's ``after_train``.
        self.ending_error: Optional[BaseException] = None
        self._pending_writes: Deque[concurrent.futures.Future] = deque()

    def configure(self, trainer: Any, stop: Any = None) -> None:
        """Where every run begins (``before_train``): the storage's pending queue in one
        process; the per-step path when asked for, for asynchronous writes, and across
        processes (whose reduction is per write). ``stop``: the controller whose codes the
        collective carries, when another trainer drives this one
        (``TrainerParts.join_run``)."""
        if stop is not None:
            self.stop = stop
        self.deferring = not (
            trainer.check_finite_every_step
            # detectron2's name, set in __init__ (a subclass may skip it)
            or getattr(trainer, "async_write_metrics", False)
            or (comm._initialized() and comm.get_world_size() > 1)
        )
        # CUDAGraphTrainer hands over views of its loss ring, whose slots are not written
        # again before the queue has read them (graph.py's ring invariant).
        self.snapshot = getattr(getattr(trainer, "_hookloop", None), "graph", None) is None

    def write(
        self, trainer: Any, loss_dict: Mapping[str, Any], data_time: float, prefix: str, it: int
    ) -> None:
        """``_write_metrics`` of iteration ``it``: queued for a batched read, or put now."""
        if (it + 1) % trainer.gather_metric_period:
            return
        if self.deferring:
            # Kept as tensors: no device synchronization, no torch call, this step. The
            # queue copies the dict's items (a model may return the same dict refilled).
            # A failed read of the queue (here, when one is due) logs detectron2's
            # "Exception in writing metrics" itself (utils/_tensors.write_failed).
            if type(loss_dict) is not dict:
                loss_dict = _as_dict(loss_dict)
            if self.snapshot:
                loss_dict = snapshot_losses(loss_dict)
            trainer.storage._record_losses(it, data_time, loss_dict, prefix)
            return
        stop = self.stop
        try:
            agreed = write_metrics_across(loss_dict, data_time, it, prefix, stop.outgoing())
        except Exception:
            logger.exception("Exception in writing metrics: ")
            raise
        stop.agreed(agreed)

    # Asynchronous writes (async_write_metrics)

    def submit(self, trainer: Any, loss_dict: Mapping[str, Any], data_time: float) -> None:
        """Writes metrics on the trainer's executor thread, after re-raising any earlier
        write's error. The executor gets a copy of the loss dict: the model may refill its dict
        at the next step before the executor reads it (detectron2 hands over the model's)."""
        self.raise_async_errors()
        it = trainer.iter
        loss_dict = snapshot_losses(dict(loss_dict))
        stop = self.stop
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
        """At ``after_train``, before the hooks read the storage: what waits in its pending
        queue is stored; the error of that read is returned, for :meth:`take_errors`."""
        self.ending_error = None
        try:
            storage._settle()
        except Exception as error:
            self.ending_error = error
        return self.ending_error

    def take_errors(self, first: Optional[BaseException]) -> List[BaseException]:
        """``first`` (the last settle's error), then the errors of this run's asynchronous
        writes; the queue is emptied."""
        errors = [e for e in (f.exception() for f in self._pending_writes) if e is not None]
        if first is not None:
            errors.insert(0, first)
        self._pending_writes.clear()
        self.ending_error = None
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


def settle_before_save(trainer: Any, what: str) -> bool:
    """Whether ``what`` (a checkpoint a hook of ``trainer`` saves: periodic, final, stop, best)
    may be saved now. First its asynchronous metric writes are waited for and the losses
    waiting in its storage's batched read are read. A non-finite loss raises
    ``FloatingPointError`` naming its iteration, also one found before (by another thread
    polling the storage, or read earlier and caught), so that no file holds the weights it made
    and ``max_to_keep`` deletes no good file for them. In ``after_train``, when the last read
    failed (the trainer raises that error once every hook's ``after_train`` ran), the save is
    refused with a logged error instead: the hooks after this one still end their run.

    A ``Checkpointer.save()`` that user code calls itself is not checked."""
    metrics = metrics_of(trainer)
    if metrics is not None:
        if metrics.ending_error is not None:
            logger.error(
                f"Not saving {what}: reading the last losses failed, and training raises it "
                f"after every hook's after_train: {metrics.ending_error!r}"
            )
            return False
        metrics.wait()
    settle = getattr(getattr(trainer, "storage", None), "_settle_before_save", None)
    if settle is not None:
        settle()
    return True


def metrics_of(trainer: Any) -> Optional[LossMetrics]:
    """The :class:`LossMetrics` of ``trainer`` (a ``DefaultTrainer``: of the trainer it wraps),
    or None for a trainer that has none."""
    for t in (trainer, getattr(trainer, "_trainer", None)):
        metrics = getattr(getattr(t, "_hookloop", None), "metrics", None)
        if isinstance(metrics, LossMetrics):
            return metrics
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
        loss_dict = _as_dict(loss_dict)
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


def _as_dict(loss_dict: Mapping[str, Any]) -> dict:
    if not isinstance(loss_dict, Mapping):
        raise TypeError(f"write_metrics() needs a dict of losses, got {type(loss_dict).__name__}")
    return dict(loss_dict)
