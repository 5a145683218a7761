"""What hookloop adds to detectron2's trainers, beside the stages: stopping a run cleanly, the
hook table and its timings (``TrainerBase``), and the epochs of a finite loader
(``SimpleTrainer``). None of these names is detectron2's: a subclass may assign its own, which
reads then give (the loop never reads them). An assigned value is kept in the trainer's parts
(``assigned``), not in the instance's ``__dict__``: reading an instance's ``__dict__`` makes
every later attribute read of that object slower in CPython 3.11 (no specialized lookup),
and the trainer's attributes are read at every step."""

from __future__ import annotations

from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    List,
    NamedTuple,
    Optional,
    Tuple,
    TypeVar,
    overload,
)

from hookloop.data.cursor import iters_per_epoch
from hookloop.engine import dispatch
from hookloop.engine.parts import elapsed

__all__ = ["Added", "EpochAdditions", "HookStat", "TrainerAdditions"]

T = TypeVar("T")


class Added(Generic[T]):
    """A name hookloop adds to a trainer: reads give ``read(trainer)``, or the value a
    subclass assigned to the name (kept in the trainer's parts, ``assigned``)."""

    def __init__(self, read: Callable[[Any], T], doc: str) -> None:
        self._read = read
        self.__doc__ = doc
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, trainer: None, owner: Optional[type] = None) -> "Added[T]": ...

    @overload
    def __get__(self, trainer: object, owner: Optional[type] = None) -> T: ...

    def __get__(self, trainer: Any, owner: Optional[type] = None) -> Any:
        if trainer is None:
            return self  # the class's attribute: the descriptor
        assigned: Dict[str, T] = trainer._hookloop.assigned
        return assigned[self._name] if self._name in assigned else self._read(trainer)

    def __set__(self, trainer: Any, value: T) -> None:
        trainer._hookloop.assigned[self._name] = value


class HookStat(NamedTuple):
    """The time one hook spent in one stage, from :meth:`TrainerBase.hook_stats`."""

    hook: Any
    #: ``"before_train"``, ``"before_step"``, ``"after_backward"``, ``"after_step"`` or
    #: ``"after_train"``.
    stage: str
    calls: int
    total_s: float
    max_s: float
    #: ``total_s`` as a fraction of the training time so far (``train()``'s wall time).
    share: float


class TrainerAdditions:
    """``TrainerBase``'s additions: :meth:`request_stop` and what it leaves
    (:attr:`stop_requested`, :attr:`stopped_early`), :meth:`hooks_table`, :meth:`hook_stats`."""

    _hookloop: Any
    _hooks: List[Any]

    stop_requested: Added[bool] = Added(
        lambda t: t._hookloop.stop.requested,
        "Whether :meth:`request_stop` was called during the current (or last) ``train()``.",
    )
    stopped_early: Added[bool] = Added(
        lambda t: t._hookloop.stop.stopped_early,
        "Whether the current (or last) ``train()`` ended through :meth:`request_stop` before "
        "``max_iter``.",
    )

    def request_stop(self, raise_after_train: Optional[BaseException] = None) -> None:
        """Ends training cleanly after the current step: every hook's ``after_step`` of the
        iteration in progress runs, then ``after_train``, with ``iter`` at that iteration
        and :attr:`stopped_early` set (``PeriodicCheckpointer`` then saves a checkpoint of
        it, from which a resume continues at the next iteration). Called before the first
        step (in ``before_train``), no step runs. The stop is a flag the loop reads between
        iterations; the trainer's hook list is not touched.

        Across processes (``SimpleTrainer``/``AMPTrainer``, also inside ``DefaultTrainer``, with
        more than one rank) the stop is not taken alone: the request rides on the next packed
        metric collective (the one every ``gather_metric_period`` iterations), and every rank
        stops after that iteration, the same one. A stop requested on one rank therefore
        takes effect at the next period boundary (at once when requested in ``run_step``
        before that iteration's collective), and not at all when no collective remains before
        ``max_iter`` (training then finishes). A preemption on one rank
        (:class:`~hookloop.engine.stop.Preempted`) makes every rank raise it. With
        ``async_write_metrics`` the agreement of one period's collective is applied at the
        next period boundary. Other trainers stop alone.

        Args:
            raise_after_train: an exception that ``train()`` raises after ``after_train``
                when the run stopped early (not when the stop came in the last iteration:
                training then finished normally; ``PreemptionHandler`` passes
                :class:`~hookloop.engine.stop.Preempted` for the process's exit status).
        """
        self._hookloop.stop.request(raise_after_train)

    def hooks_table(self) -> Dict[str, List[Any]]:
        """The hooks each stage calls, in call order (registration order, unless hooks declare
        a ``priority``): what the dispatcher runs, for checking where a hook lands."""
        dispatch.set_table(self)  # for the list as it is now
        dispatcher = self._hookloop.dispatcher
        table = {}
        for stage in dispatch.STAGES:
            hooks = list(dispatcher.hooks_for(stage))
            # A hook's finishing part (dispatch._finishing_entries) is not a place of its own.
            table[stage] = [h for i, h in enumerate(hooks) if not any(h is g for g in hooks[:i])]
        return table

    def hook_stats(self) -> List[HookStat]:
        """Per hook and stage, the time spent in it since ``train()`` started: a
        :class:`HookStat` ``(hook, stage, calls, total_s, max_s, share)`` per entry of the
        dispatch table, in call order. Every hook call is timed (one clock read per call, a
        few nanoseconds; ``trainer._hookloop.dispatcher.timing = False`` turns it off, and the
        counts then stay zero). ``share`` is ``total_s`` over the training time so far."""
        total = elapsed(self._hookloop)
        rows: Dict[Tuple[int, str], List[Any]] = {}
        for h, stage, calls, t, longest in self._hookloop.dispatcher.hook_stats():
            row = rows.get((id(h), stage))
            if row is None:
                rows[id(h), stage] = [h, stage, calls, t, longest]
            else:
                # A hook's finishing part (dispatch._finishing_entries) counts with its stage:
                # both run on the same iterations.
                row[2], row[3], row[4] = max(row[2], calls), row[3] + t, max(row[4], longest)
        return [
            HookStat(h, stage, calls, t, longest, t / total if total > 0 else 0.0)
            for h, stage, calls, t, longest in rows.values()
        ]


class EpochAdditions:
    """``SimpleTrainer``'s additions: the epoch of a finite loader."""

    _hookloop: Any
    data_loader: Any

    epoch: Added[int] = Added(
        lambda t: t._hookloop.data.epoch,
        "The epoch of a finite data loader (0 for the first pass).",
    )
    iters_per_epoch: Added[Optional[int]] = Added(
        lambda t: iters_per_epoch(t.data_loader),
        "``len(data_loader)`` when the loader has a length, else None.",
    )
