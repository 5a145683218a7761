"""``scheduler.step()`` for the LRScheduler hook, with torch's ``MultiStepLR`` and ``StepLR``
stepped without their Python between the steps that change the LR.

Between milestones their ``step()`` (``LRScheduler.step`` → ``_update_lr`` → ``get_lr``) leaves
every ``group["lr"]`` as it is and changes three attributes: ``_step_count += 1``,
``last_epoch += 1`` and ``_last_lr``, a new list of the groups' LRs. That costs ~17.8k
instructions of Python per step, more than the rest of the default stack's bookkeeping
(docs/performance.md). Here those three are set to the values torch's step sets, only when the
outcome is certain: the scheduler is exactly torch's class, no method is replaced on the
instance, it is past its first ``step()`` (whose call-order warnings stay torch's), the next
epoch changes no LR, and every LR is a Python number. Otherwise torch's ``step()`` runs.
Tests compare the state and the LRs with torch's own stepping at every step
(tests/engine/test_torch_scheduler_step.py).

:func:`advance` is the one function that writes torch's private scheduler attributes: this
module's shortcut and ``LRMultiplier.step`` (whose native schedule has set the LRs) call it.
The ``LRScheduler`` hook calls :func:`step`.
"""

from __future__ import annotations

from typing import Any, Dict, List

__all__ = ["advance", "step"]

_MULTI_STEP, _STEP = 0, 1
_KINDS: Dict[type, int] = {}
_REPLACEABLE = ("step", "get_lr", "_update_lr")


def step(scheduler: Any) -> None:
    """``scheduler.step()``, or its three attribute writes when that step changes no LR (one
    function, no nested call: this runs every iteration)."""
    kind = _KINDS.get(type(scheduler)) if _KINDS else _kinds().get(type(scheduler))
    if kind is None:
        return scheduler.step()
    d = vars(scheduler)
    count, last = d.get("_step_count"), d.get("last_epoch")
    if type(count) is not int or type(last) is not int or count <= 1:
        return scheduler.step()  # torch checks the first step
    if "step" in d or "get_lr" in d or "_update_lr" in d:
        return scheduler.step()  # replaced on the instance
    nxt = last + 1
    if kind == _MULTI_STEP:
        milestones = d.get("milestones")
        if milestones is None or nxt in milestones:
            return scheduler.step()
    else:
        size = d.get("step_size")
        if type(size) is not int or size <= 0 or (nxt != 0 and nxt % size == 0):
            return scheduler.step()
    lrs = []  # a loop, not a comprehension: no function frame per step (CPython 3.11)
    for g in scheduler.optimizer.param_groups:
        lr = g["lr"]
        if type(lr) is not float and type(lr) is not int:
            return scheduler.step()  # a tensor LR: torch's
        lrs.append(lr)
    advance(scheduler, lrs)
    return None


def advance(scheduler: Any, lrs: List[Any]) -> None:
    """What torch's ``LRScheduler.step()`` leaves on ``scheduler`` after a step (without the
    deprecated ``epoch``) that set the param groups' LRs to ``lrs``: ``_step_count`` and
    ``last_epoch`` one more, ``_last_lr`` the new LRs. The only writer of those fields in
    hookloop; the caller has set the LRs (or knows they do not change)."""
    d = vars(scheduler)
    d["_step_count"] += 1
    d["last_epoch"] += 1
    d["_last_lr"] = lrs


def _kinds() -> Dict[type, int]:
    """torch's two classes, once ``torch.optim.lr_scheduler`` is imported (a scheduler of
    another class steps with its own ``step()`` meanwhile)."""
    import sys

    module = sys.modules.get("torch.optim.lr_scheduler")
    if module is not None:
        _KINDS.update({module.MultiStepLR: _MULTI_STEP, module.StepLR: _STEP})
    return _KINDS
