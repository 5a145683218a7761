"""LR schedules, mirroring ``detectron2.solver``.

Rewrite ``detectron2.solver`` -> ``hookloop.solver`` and ``fvcore.common.param_scheduler`` ->
``hookloop.solver.param_scheduler`` to switch. The built-in schedules evaluate in Rust.
"""

from hookloop.solver.lr_scheduler import (
    LRMultiplier,
    WarmupCosineLR,
    WarmupMultiStepLR,
    WarmupParamScheduler,
)

__all__ = ["LRMultiplier", "WarmupCosineLR", "WarmupMultiStepLR", "WarmupParamScheduler"]
