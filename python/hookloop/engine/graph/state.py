"""The phase of a :class:`GraphStep`: where it stands between construction, capture and
replay, and whether the run has turned eager.

Three things, each with one meaning:

- :class:`Phase`, the life of the capture, moved only by :meth:`StepState.move`:

  ==========================  ==========  ==================================================
  from                        to          by
  ==========================  ==========  ==================================================
  NEW                         CONFIGURED  ``configure`` (``CUDAGraphTrainer.__init__``; for a
                                          subclass that skipped it, ``prepare``)
  CONFIGURED, WARMING         WARMING     ``prepare`` (``before_train``; the first step after
                                          a load)
  WARMING                     CAPTURED    a capture's first replay (the guard bakes)
  CAPTURED                    WARMING     ``invalidate`` (a change the guard saw, a load, a
                                          new number of param groups) or ``prepare``
  WARMING, CAPTURED           CONFIGURED  the trainer's ``load_state_dict`` (``prepared =
                                          False``)
  ==========================  ==========  ==================================================

  NEW: made, ``configure`` not run. CONFIGURED: options set and the seam chosen; ``prepare``
  is due. WARMING: prepared (the step counter, the LR table and the graph source set for this
  run), no graph captured since the last ``invalidate``: each batch signature warms up, then
  captures. CAPTURED: a graph is captured and what it baked in is watched (the guard).
- ``eager_reason``, the run's mode: None while the graph trains; once a problem makes capture
  impossible and ``fallback="eager"``, why, and every later step is eager. Never cleared: the
  phase still moves (an eager run is prepared too: its device step counter).
- ``in_step``: inside the trainer's step (placing the batch, a warm-up, the capture, a replay,
  an eager step). What the step itself assigns on the model is part of what is captured: only
  an assignment outside it drops the graphs.
"""

from __future__ import annotations

import enum
import warnings
from typing import Dict, FrozenSet, Optional

__all__ = ["Phase", "StepState"]


class Phase(enum.Enum):
    """The life of the capture (see the module docstring)."""

    NEW = "new"
    CONFIGURED = "configured"
    WARMING = "warming"
    CAPTURED = "captured"


#: The moves :meth:`StepState.move` makes; anything else is a bug in the step.
_MOVES: Dict[Phase, FrozenSet[Phase]] = {
    Phase.NEW: frozenset({Phase.CONFIGURED}),
    Phase.CONFIGURED: frozenset({Phase.WARMING}),
    Phase.WARMING: frozenset({Phase.CONFIGURED, Phase.WARMING, Phase.CAPTURED}),
    Phase.CAPTURED: frozenset({Phase.CONFIGURED, Phase.WARMING}),
}


class StepState:
    """The phase, the run's mode and whether the trainer's step is running."""

    __slots__ = ("phase", "eager_reason", "in_step")

    def __init__(self) -> None:
        self.phase = Phase.NEW
        self.eager_reason: Optional[str] = None
        self.in_step = False

    def move(self, to: Phase) -> None:
        """The one transition: to ``to``, along one of the moves of the module docstring."""
        if to not in _MOVES[self.phase]:
            raise RuntimeError(f"GraphStep cannot go from {self.phase.name} to {to.name}")
        self.phase = to

    @property
    def prepared(self) -> bool:
        """Whether ``prepare`` ran since the construction or the last load."""
        return self.phase is Phase.WARMING or self.phase is Phase.CAPTURED

    def invalidated(self) -> None:
        """The graphs were dropped: a captured step warms up and captures again."""
        if self.phase is Phase.CAPTURED:
            self.move(Phase.WARMING)

    def unprepared(self) -> None:
        """A load: ``prepare`` is due again before the next step."""
        if self.prepared:
            self.move(Phase.CONFIGURED)

    def refuse(self, kind: type, message: str, fallback: Optional[str]) -> None:
        """A problem that makes capture impossible: raised, or with ``fallback="eager"``,
        one warning and eager steps for the rest of the run."""
        if fallback != "eager":
            raise kind(message)
        if self.eager_reason is None:
            warnings.warn(f"{message}. Training eagerly (fallback='eager').", RuntimeWarning, 3)
        self.eager_reason = message
