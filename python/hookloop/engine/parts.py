"""hookloop's own state of a trainer, in the one slot ``trainer._hookloop``.

detectron2's trainers have none of it, and code written for them subclasses the trainers,
skips their ``__init__`` (even ``TrainerBase.__init__``) and sets detectron2's attributes by
hand. So the parts are made in ``TrainerBase.__new__``, which runs whatever ``__init__`` does,
as a plain instance attribute (no class-level descriptor, no write to the instance's
``__dict__``: both would make every attribute read of the trainer slower in CPython 3.11).
"""

from __future__ import annotations

import logging
import operator
import time
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from hookloop import _core
from hookloop.data.cursor import DataCursor
from hookloop.engine import dispatch
from hookloop.engine.metrics import LossMetrics
from hookloop.engine.stop import StopController
from hookloop.utils import comm

__all__ = [
    "SimpleTrainerParts",
    "TrainerParts",
    "check_iters",
    "elapsed",
    "hook_keys",
    "report_secondary",
]

logger = logging.getLogger("hookloop.engine.train_loop")

# The trainer state's key for hooks whose state detectron2 does not keep (BestCheckpointer's
# best value): detectron2 reads only "hooks", so it resumes from a hookloop checkpoint.
OWN_HOOK_STATE = "hookloop_hooks"

# Entries kept per scalar in a checkpoint: the printer's ETA takes the median of the last 1000
# `time` values, and writers smooth over windows of 20 by default.
RESUME_HISTORY = 1000

# max_iter for a loop that never set one: no iteration is the last.
NO_MAX_ITER = 2**53


class TrainerParts:
    """What every trainer has beyond detectron2's attributes:

    - ``dispatcher``: the Rust hook dispatcher, which runs the stages over the table
      :mod:`hookloop.engine.dispatch` builds from ``trainer._hooks``;
    - ``stop``: the :class:`~hookloop.engine.stop.StopController`, which owns the stop state;
    - the state of the current ``train()``: whether it failed, its wall-clock span, the
      storage history of a resumed checkpoint.

    It also carries the protocol by which another trainer drives this one's steps
    (``DefaultTrainer`` wraps one): :meth:`wrapped_by`, :meth:`join_run`, :meth:`hooks_ready`
    and :meth:`leave_run`, which a trainer's parts class may extend (the graph trainer's
    prepares its LR table in :meth:`hooks_ready`).
    """

    #: SimpleTrainer's collaborators (None on other trainers).
    data: Optional[DataCursor] = None
    metrics: Optional[LossMetrics] = None
    #: AMPTrainer's autocast device ("cuda" when CUDA is available).
    device_type = "cpu"

    def __init__(self) -> None:
        self.dispatcher = _core.Dispatcher()
        self.stop = StopController()
        #: ``train()``'s loop raised (set before ``after_train``): no evaluation after it.
        self.failed = False
        self.train_time: List[Any] = [0.0, None]
        #: The storage history of a loaded checkpoint, and the iteration it was saved at: it
        #: goes into the run that resumes that checkpoint (train() starts at the iteration
        #: after it, and has iterations to train) and is dropped by any other run
        #: (fine-tuning from loaded weights starts with an empty history, as in detectron2).
        self.resume_storage: Optional[Mapping[str, Any]] = None
        self.resume_storage_iter: Any = None
        #: Values a subclass assigned to hookloop's added names (``epoch``, ``stopped_early``,
        #: ...), which reads of them then give.
        self.assigned: Dict[str, Any] = {}

    def start_run(self, trainer: Any, storage: Any, max_iter: int) -> None:
        """``train()`` opened ``storage``: the recent history of a resumed checkpoint goes into
        it (smoothing and the ETA continue) when this run resumes that checkpoint, the
        dispatcher and the stop controller start."""
        self.train_time = [time.perf_counter(), None]
        saved, self.resume_storage = self.resume_storage, None
        if saved is not None and _resumes(trainer.start_iter, max_iter, self.resume_storage_iter):
            storage._load_state(dict(saved))
            storage.iter = trainer.start_iter
        self.begin(trainer, max_iter)
        self.stop.begin()

    def end_run(self) -> None:
        """``train()`` closed its storage: after a stop across ranks every rank waits for the
        others (none leaves before the main process's checkpoint of the stop is on disk: when
        one process exits, launch() and torchrun stop the others); then the exception the stop
        asked for is raised."""
        after_stop = self.stop.take_raise_after_train()
        if self.stop.stopped_early and self.stop.rides_collective():
            comm.synchronize()
        if after_stop is not None and self.stop.stopped_early:
            raise after_stop

    def begin(self, trainer: Any, max_iter: int) -> None:
        """A run starts (``train()``'s, or a subclass's own loop at ``before_train``): the
        dispatcher learns ``max_iter`` and gets a table for the hook list (statistics start
        again). The stop controller starts only with ``train()`` (:meth:`start_run`): an own
        loop cannot be stopped by ``request_stop``."""
        self.failed = False
        self.dispatcher.begin(max_iter)
        dispatch.set_table(trainer, carry=False)

    # The protocol of a trainer whose steps another trainer drives: ``outer`` runs the loop
    # and owns the hooks and the storage; ``trainer`` runs each step.

    def wrapped_by(self, trainer: Any, outer: Any) -> None:
        """``outer`` now drives ``trainer``: the ``after_backward`` that ``trainer.run_step``
        calls runs ``outer``'s hooks (detectron2's calls the wrapped trainer's, which has no
        hooks), through a weak reference (no cycle back to ``outer``)."""
        method = weakref.WeakMethod(outer.after_backward)

        def after_backward() -> None:
            bound = method()
            if bound is not None:
                bound()

        trainer.after_backward = after_backward

    def join_run(self, trainer: Any, outer: Any) -> None:
        """At ``outer``'s ``before_train``, before its hooks': ``trainer`` sees the run's
        bounds and storage, its collaborators are configured for the run as its own
        ``before_train`` would (the losses read in batches), and a stop requested on ``outer``
        rides on ``trainer``'s metric collective."""
        trainer.start_iter, trainer.max_iter = outer.start_iter, outer.max_iter
        trainer.storage = outer.storage
        stop = outer._hookloop.stop
        stop.collective = self.stop.collective
        if self.metrics is not None:
            self.metrics.configure(trainer, stop)

    def hooks_ready(self, trainer: Any, outer: Any) -> None:
        """``outer``'s hooks ran their ``before_train``."""

    def leave_run(self, trainer: Any) -> Optional[BaseException]:
        """At ``outer``'s ``after_train``, before its hooks': what ``trainer``'s losses still
        wait for is stored; the error of that read is returned, for ``outer`` to raise after
        the hooks."""
        return None if self.metrics is None else self.metrics.settle_last(trainer.storage)


class SimpleTrainerParts(TrainerParts):
    """:class:`TrainerParts` with ``SimpleTrainer``'s collaborators: the
    :class:`~hookloop.data.cursor.DataCursor` (epochs of a finite loader, the data position
    for resume) and the :class:`~hookloop.engine.metrics.LossMetrics` (losses read in
    batches, asynchronous writes, the packed collective across ranks, on which a stop rides)."""

    def __init__(self) -> None:
        super().__init__()
        self.data = DataCursor()
        self.metrics = LossMetrics(self.stop)
        self.stop.collective = True


def check_iters(start_iter: Any, max_iter: Any) -> Tuple[int, int]:
    """Both as ints (numpy ints accepted, as range() accepts them), or a clear error. A
    ``start_iter`` past ``max_iter`` (resuming a finished run with a lower ``max_iter``) runs
    no iteration, as in detectron2, with one warning."""
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
        logger.warning(
            f"train() start_iter ({start_iter}) is past max_iter ({max_iter}): no iteration "
            "runs; before_train and after_train do (a final evaluation, the writers' last write)."
        )
    return start_iter, max_iter


def _resumes(start_iter: int, max_iter: int, saved_iter: Any) -> bool:
    """Whether a run from ``start_iter`` to ``max_iter`` continues the training of a
    checkpoint saved at the end of iteration ``saved_iter``: it starts at the iteration after
    it and trains (a run with no iteration to train, such as a finished run resumed, would
    only show the saved values again: a console line with old losses and a negative ETA)."""
    try:
        return start_iter == operator.index(saved_iter) + 1 and start_iter < max_iter
    except TypeError:
        return False


def hook_keys(hooks: Iterable[Any], qualified: bool = True) -> List[Tuple[str, Any]]:
    """(key, hook) for the hooks' state in a checkpoint: the class's qualified name (its plain
    name unless ``qualified``), then ``Name.1``, ``Name.2`` for later hooks of the same class."""
    seen: Dict[str, int] = {}
    out = []
    for h in hooks:
        name = type(h).__qualname__ if qualified else type(h).__name__
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append((name if n == 0 else f"{name}.{n}", h))
    return out


def elapsed(parts: TrainerParts) -> float:
    """Seconds since the current (or last) ``train()`` started, to its end if it ended."""
    start, end = parts.train_time
    now = time.perf_counter() if end is None else float(end)
    return now - float(start)


def report_secondary(primary: BaseException, secondary: BaseException, where: str) -> None:
    """An error raised while ``primary`` propagates: logged at ERROR, and attached to
    ``primary`` as a note (Python 3.11+), so the first error stays the one raised."""
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
