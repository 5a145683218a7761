"""The training engine, mirroring ``detectron2.engine``."""

from hookloop.engine.defaults import (
    DefaultTrainer,
    TrainConfig,
    create_ddp_model,
    default_writers,
)
from hookloop.engine.hooks import *  # noqa: F403
from hookloop.engine.hooks import __all__ as _hooks_all
from hookloop.engine.train_loop import AMPTrainer, HookBase, SimpleTrainer, TrainerBase

__all__ = [
    "AMPTrainer",
    "DefaultTrainer",
    "HookBase",
    "SimpleTrainer",
    "TrainConfig",
    "TrainerBase",
    "create_ddp_model",
    "default_writers",
    *_hooks_all,
]
