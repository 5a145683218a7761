"""The training engine, mirroring ``detectron2.engine``."""

from hookloop.engine.hooks import *  # noqa: F401,F403
from hookloop.engine.train_loop import AMPTrainer, HookBase, SimpleTrainer, TrainerBase

__all__ = [k for k in globals().keys() if not k.startswith("_")]
