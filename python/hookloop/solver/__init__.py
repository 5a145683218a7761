"""LR schedules and optimizer builders, mirroring ``detectron2.solver``.

Rewrite ``detectron2.solver`` -> ``hookloop.solver`` and ``fvcore.common.param_scheduler`` ->
``hookloop.solver.param_scheduler`` to switch. The built-in schedules evaluate in Rust.
"""

from hookloop.solver.build import (
    build_lr_scheduler,
    build_optimizer,
    get_default_optimizer_params,
)
from hookloop.solver.lr_scheduler import (
    LRMultiplier,
    LRScheduler,
    WarmupCosineLR,
    WarmupMultiStepLR,
    WarmupParamScheduler,
)

__all__ = [
    "LRMultiplier",
    "LRScheduler",
    "WarmupCosineLR",
    "WarmupMultiStepLR",
    "WarmupParamScheduler",
    "build_lr_scheduler",
    "build_optimizer",
    "get_default_optimizer_params",
]
