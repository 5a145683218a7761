"""Checkpointing, mirroring ``fvcore.common.checkpoint``.

Rewrite ``fvcore.common.checkpoint`` (and ``detectron2.checkpoint`` for these two names) to
``hookloop.checkpoint``. ``hookloop.checkpoint.rng`` captures and restores the random number
generators for an exact resume.
"""

from hookloop.checkpoint.checkpointer import (
    Checkpointer,
    PeriodicCheckpointer,
    _IncompatibleKeys,  # noqa: F401 (importable like fvcore's, for subclasses)
    get_missing_parameters_message,
    get_unexpected_parameters_message,
)
from hookloop.checkpoint.rng import get_rng_state, set_rng_state

__all__ = [
    "Checkpointer",
    "PeriodicCheckpointer",
    "get_missing_parameters_message",
    "get_unexpected_parameters_message",
    "get_rng_state",
    "set_rng_state",
]
