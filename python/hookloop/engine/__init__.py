"""The training engine, mirroring ``detectron2.engine``."""

from hookloop.engine.defaults import (
    DefaultTrainer,
    TrainConfig,
    create_ddp_model,
    default_writers,
)
from hookloop.engine.graph import CUDAGraphTrainer
from hookloop.engine.hooks import *  # noqa: F403
from hookloop.engine.hooks import __all__ as _hooks_all
from hookloop.engine.launch import DEFAULT_TIMEOUT, WorkerError, launch
from hookloop.engine.train_loop import AMPTrainer, HookBase, HookStat, SimpleTrainer, TrainerBase

__all__ = [
    "AMPTrainer",
    "CUDAGraphTrainer",
    "DEFAULT_TIMEOUT",
    "DefaultTrainer",
    "HookBase",
    "HookStat",
    "SimpleTrainer",
    "TrainConfig",
    "TrainerBase",
    "WorkerError",
    "create_ddp_model",
    "default_writers",
    "launch",
    *_hooks_all,
]
