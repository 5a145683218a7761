"""Checkpointing, mirroring ``fvcore.common.checkpoint``.

Rewrite ``fvcore.common.checkpoint`` and ``detectron2.checkpoint`` (``DetectionCheckpointer``,
which also loads model-zoo ``.pkl`` files) to ``hookloop.checkpoint``.
``hookloop.checkpoint.rng`` captures and restores the random number generators for an exact
resume.
"""

# Every module-level name of fvcore.common.checkpoint is importable from here as from fvcore,
# the private helpers too (research code imports `_strip_prefix_if_present, _IncompatibleKeys`).
from hookloop.checkpoint.checkpointer import (  # noqa: F401
    TORCH_VERSION,
    Checkpointer,
    PeriodicCheckpointer,
    _filter_reused_missing_keys,
    _group_checkpoint_keys,
    _group_to_str,
    _IncompatibleKeys,
    _named_modules_with_dup,
    _strip_prefix_if_present,
    get_missing_parameters_message,
    get_unexpected_parameters_message,
)
from hookloop.checkpoint.detection_checkpoint import DetectionCheckpointer
from hookloop.checkpoint.rng import get_rng_state, set_rng_state

__all__ = [
    "Checkpointer",
    "PeriodicCheckpointer",
    "DetectionCheckpointer",
    "get_missing_parameters_message",
    "get_unexpected_parameters_message",
    "get_rng_state",
    "set_rng_state",
]
