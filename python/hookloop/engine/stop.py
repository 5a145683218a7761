"""Stopping a running ``train()`` cleanly: :meth:`TrainerBase.request_stop`'s machinery.

A trainer holds one :class:`StopController`, the only owner of its stop state. A request
applied marks it ``applied``, which ``TrainerBase.before_step`` reads first: the next iteration
raises :class:`StopTraining` before any of its hooks, and ``train()`` ends there, marking the
run ``stopped_early``. The trainer's hook list is never touched. Across ranks a request does
not stop one rank alone: it rides on the next packed metric collective
(:mod:`hookloop.engine.metrics`) as a stop code, and every rank applies the largest code any
rank sent after the same iteration. A ``DefaultTrainer``'s controller is the one its wrapped
trainer's metric collective carries (``LossMetrics.configure``).
"""

from __future__ import annotations

from typing import Any, Optional

from hookloop.utils import comm

__all__ = ["Preempted", "StopController", "StopTraining"]


class Preempted(SystemExit):
    """Raised by ``train()`` after ``after_train`` when :class:`PreemptionHandler` stopped the
    run on a signal. A ``SystemExit`` whose code is ``128 + signum`` (143 for SIGTERM, 138 for
    SIGUSR1 on Linux), the status a shell reports for a process killed by that signal: left
    uncaught, the process exits with it and no traceback, and a job scheduler or a wrapper
    script can tell a preempted run (requeue it, resume) from a finished one (0) or a crash
    (1)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + int(signum))
        self.signum = int(signum)

    def __reduce__(self) -> Any:
        return (type(self), (self.signum,))


class StopTraining(BaseException):
    """Control flow of a stop, raised by ``TrainerBase.before_step`` before the first hook of
    the iteration after it and caught in ``train()``. A ``BaseException``, so that a hook's
    ``except Exception`` does not swallow it."""


class StopController:
    """The stop protocol of one trainer (shared by a ``DefaultTrainer`` and the trainer it
    wraps): whether a stop was requested and applied in this ``train()``, the exception to
    raise after ``after_train``, and the stop codes of the cross-rank agreement.

    Attributes:
        requested (bool): a stop was requested (or agreed) in the current ``train()``.
        applied (bool): the stop is taken: the next ``before_step`` raises
            :class:`StopTraining`.
        stopped_early (bool): the current (or last) ``train()`` ended through the stop.
        collective (bool): the trainer running the steps makes a packed metric collective
            (``SimpleTrainer`` and ``AMPTrainer``), on which a stop rides with several ranks.
        raise_after_train: what ``train()`` raises after ``after_train`` when it stopped early.
        agreed_async (int): the code agreed by the last asynchronous metric write, applied at
            the next period boundary on the training thread.
    """

    def __init__(self) -> None:
        self._running = False
        self.requested = False
        self.applied = False
        self.stopped_early = False
        self.collective = False
        self.raise_after_train: Optional[BaseException] = None
        self.agreed_async = 0

    @property
    def running(self) -> bool:
        """Whether a ``train()`` loop is running (a stop can be requested)."""
        return self._running

    def begin(self) -> None:
        """A ``train()`` starts its loop."""
        self._running = True
        self.requested = False
        self.applied = False
        self.stopped_early = False
        self.raise_after_train = None
        self.agreed_async = 0

    def end(self) -> None:
        """The loop ended: no stop can be requested any more, and none is pending."""
        self._running = False
        self.applied = False

    def take_raise_after_train(self) -> Optional[BaseException]:
        """The exception a stop asked ``train()`` to raise, cleared for the next run."""
        exc, self.raise_after_train = self.raise_after_train, None
        return exc

    def rides_collective(self) -> bool:
        """Whether a request waits for the next packed metric collective (a trainer that makes
        one, with more than one rank) instead of being taken at once."""
        return self.collective and comm._initialized() and comm.get_world_size() > 1

    def request(self, raise_after_train: Optional[BaseException] = None) -> None:
        """:meth:`TrainerBase.request_stop`."""
        if not self._running:
            raise RuntimeError(
                "request_stop() stops a running train() (call it from a hook or run_step); "
                "no training is running"
            )
        if raise_after_train is not None and not isinstance(raise_after_train, BaseException):
            raise TypeError(
                "request_stop() raise_after_train must be an exception, got "
                f"{type(raise_after_train).__name__}"
            )
        if raise_after_train is not None and self.raise_after_train is None:
            self.raise_after_train = raise_after_train
        if self.requested:
            return
        self.requested = True
        if not self.rides_collective():
            self._apply()
        # Else the next packed collective carries it (outgoing), and agreed() applies it on
        # every rank at the same iteration.

    def _apply(self) -> None:
        if self._running:
            self.applied = True

    def outgoing(self) -> int:
        """What this rank puts in the next collective's stop slot: 0 (no stop pending), 1 (a
        stop), or ``1 + signum`` for a preemption by that signal."""
        if not self.requested or self.applied:
            return 0
        signum = getattr(self.raise_after_train, "signum", None)
        if isinstance(self.raise_after_train, SystemExit) and isinstance(signum, int):
            return 1 + signum
        return 1

    def agreed(self, code: int) -> None:
        """The largest stop code any rank sent in this iteration's collective: every rank
        stops after this iteration; a preemption anywhere is raised everywhere."""
        if not code or not self._running:
            return
        self.requested = True
        if code > 1 and self.raise_after_train is None:
            self.raise_after_train = Preempted(code - 1)
        self._apply()
