"""The training engine, mirroring ``detectron2.engine``."""

from hookloop.engine.hooks import *  # noqa: F403
from hookloop.engine.hooks import __all__ as _hooks_all
from hookloop.engine.launch import DEFAULT_TIMEOUT, WorkerError, launch
from hookloop.engine.train_loop import AMPTrainer, HookBase, SimpleTrainer, TrainerBase

__all__ = [
    "AMPTrainer",
    "DEFAULT_TIMEOUT",
    "HookBase",
    "SimpleTrainer",
    "TrainerBase",
    "WorkerError",
    "launch",
    *_hooks_all,
]
