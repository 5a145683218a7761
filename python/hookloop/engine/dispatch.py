"""The hook table: which hook methods each stage calls, in which order, how often.

Python builds the table from the trainer's hook list (:func:`table_for`) and hands it to the
Rust dispatcher (``_core.Dispatcher.set_table``), which runs the stages. Each stage call
passes ``trainer._hooks``; the dispatcher compares it with the list the table was built from:
after an edit of ``trainer._hooks`` (or a new list assigned) a stage runs nothing and returns
False, and :func:`run_stage` sets a table for the list as it is now and calls it again. The
dispatcher never calls Python to build a table. One rule, :func:`overrides`, decides whether a
hook's stage is called, here and in the graph trainer.

A table entry is ``(hook_index, stage_index, function, self, period)``: the dispatcher calls
``function(self)`` (a Python method as its function and the hook: one vectorcall, no bound
method object), or ``function()`` when ``self`` is None; ``period`` N > 0 calls it only when
``iter + 1`` is a multiple of N and at the last iteration (the core's one period rule). A
periodic hook keeps its own check for code that calls its stage directly (a subclass's loop
running ``for h in self._hooks: h.after_step()``); its class's ``_on_period`` names the method
the dispatcher calls instead, which does not check again: one check per path.
"""

from __future__ import annotations

import logging
import types
from typing import Any, List, Tuple

__all__ = [
    "PRIORITIES",
    "STAGES",
    "base_stage",
    "overrides",
    "priority_of",
    "run_on_exception",
    "run_stage",
    "set_table",
    "table_for",
]

logger = logging.getLogger("hookloop.engine.train_loop")

#: The stages, in the dispatcher's index order.
STAGES = ("before_train", "after_train", "before_step", "after_step", "after_backward")

#: mmengine's priority names; a hook's ``priority`` may be one of them or an int (lower first).
PRIORITIES = {
    "HIGHEST": 0,
    "VERY_HIGH": 10,
    "HIGH": 30,
    "ABOVE_NORMAL": 40,
    "NORMAL": 50,
    "BELOW_NORMAL": 60,
    "LOW": 70,
    "VERY_LOW": 90,
    "LOWEST": 100,
}


def base_stage(method: Any) -> Any:
    """Marks ``HookBase``'s own (empty) stage methods: a hook whose stage is one of them is
    never called."""
    method._base_stage = True
    return method


def overrides(hook: Any, stage: str) -> bool:
    """Whether ``hook`` has its own ``stage`` method (its class's or set on the instance). The
    instance's ``__dict__`` is not read: that would make every later attribute read of the
    hook slower (CPython 3.11 specializes reads only of objects whose ``__dict__`` was never
    asked for)."""
    own = getattr(type(hook), stage, None)
    if not getattr(own, "_base_stage", False):
        return True
    return getattr(getattr(hook, stage, None), "__func__", None) is not own


def priority_of(hook: Any) -> int:
    """A hook's ``priority`` attribute as an int: NORMAL (50) when it has none, so that
    without priorities hooks run in registration order, as detectron2's do. detectron2 has
    no such notion: a ``priority`` that is neither an int nor one of :data:`PRIORITIES`'
    names (a float, another string, an object) is the hook's own data, and counts as
    NORMAL."""
    p = getattr(hook, "priority", None)
    if isinstance(p, str):
        return PRIORITIES.get(p.upper(), PRIORITIES["NORMAL"])
    if isinstance(p, int) and not isinstance(p, bool):
        return p
    return PRIORITIES["NORMAL"]


def table_for(hooks: List[Any]) -> List[Tuple[int, int, Any, Any, int]]:
    """The dispatcher's table for ``hooks``: an entry for each stage a hook overrides or sets
    on the instance, by priority (:func:`priority_of`), then registration order. Methods are
    resolved here, once per table."""
    entries = []
    ranks = []  # the entries' priorities
    for index, hook in enumerate(hooks):
        for stage_index, stage in enumerate(STAGES):
            if not overrides(hook, stage):
                continue
            method = getattr(hook, stage, None)
            if method is None:
                # Not a hook at all: fail at the call, as detectron2's loop would.
                method = _missing_stage(hook, stage)
            period = 0
            # A period is the class's, for its own stage method (not one set on the instance).
            if getattr(method, "__func__", None) is getattr(type(hook), stage, None):
                period_of = getattr(hook, "_dispatch_period", None)
                period = int((period_of(stage) if period_of is not None else None) or 0)
                on_period = getattr(type(hook), "_on_period", {}).get(stage) if period else None
                if on_period is not None:
                    method = getattr(hook, on_period)
            ranks.append(priority_of(hook))
            if isinstance(method, types.MethodType) and method.__self__ is hook:
                entries.append((index, stage_index, method.__func__, hook, period))
            else:
                entries.append((index, stage_index, method, None, period))
    ranked = sorted(range(len(entries)), key=ranks.__getitem__)  # stable
    return [entries[k] for k in ranked] + _finishing_entries(hooks)


def _finishing_entries(hooks: List[Any]) -> List[Tuple[int, int, Any, Any, int]]:
    """The entries that run after every hook of their stage: a hook's ``_finishing`` maps a
    stage to the name of a method that completes what its stage method began there
    (``PeriodicCheckpointer`` writes the checkpoint it took at its place, once the iteration's
    other hooks have run). Called on the stage method's period; registration order."""
    entries = []
    for index, hook in enumerate(hooks):
        for stage, name in getattr(type(hook), "_finishing", {}).items():
            period_of = getattr(hook, "_dispatch_period", None)
            period = int((period_of(stage) if period_of is not None else None) or 0)
            entries.append((index, STAGES.index(stage), getattr(type(hook), name), hook, period))
    return entries


def _missing_stage(hook: Any, stage: str) -> Any:
    def call() -> None:
        getattr(hook, stage)()

    return call


def set_table(trainer: Any, carry: bool = True) -> None:
    """Hands the dispatcher a table for ``trainer._hooks`` as it is now. With ``carry``, each
    hook's statistics continue (an edit during a run); without, they start again (a run)."""
    hooks = trainer._hooks
    trainer._hookloop.dispatcher.set_table(hooks, table_for(hooks), carry)


def run_stage(trainer: Any, stage: str, *args: Any) -> None:
    """Runs ``stage`` of ``trainer``'s hooks (``args``: the iteration, for the stages that
    take it), with a table for the hook list as it is now: the dispatcher's stage runs nothing
    and returns False when ``trainer._hooks`` is not the list its table was set for."""
    call = getattr(trainer._hookloop.dispatcher, stage)
    while not call(trainer._hooks, *args):
        set_table(trainer)


def run_on_exception(hooks: List[Any], exc: BaseException) -> None:
    """Each hook's ``on_exception`` that overrides HookBase's, in registration order; their
    own errors are logged so that ``exc`` propagates unchanged."""
    for h in list(hooks):
        if not overrides(h, "on_exception"):
            continue
        try:
            h.on_exception(exc)
        except Exception:
            logger.exception(f"{type(h).__name__}.on_exception raised; re-raising the original")
