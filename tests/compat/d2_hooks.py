"""The reference engine's checkpointing hook: fvcore's own ``PeriodicCheckpointer`` (the real
upstream, a test dependency) as a ``compat.d2`` hook, as ``detectron2.engine.hooks`` defines
it. It lives here rather than in ``compat.d2`` because the package does not depend on fvcore.
"""

from __future__ import annotations

from fvcore.common.checkpoint import Checkpointer
from fvcore.common.checkpoint import PeriodicCheckpointer as FvPeriodicCheckpointer

from compat import d2

__all__ = ["Checkpointer", "FvPeriodicCheckpointer", "PeriodicCheckpointer"]


class PeriodicCheckpointer(FvPeriodicCheckpointer, d2.HookBase):
    """fvcore's periodic saver as a hook: every ``period`` iterations and at the last one."""

    def before_train(self) -> None:
        self.max_iter = self.trainer.max_iter

    def after_step(self) -> None:
        self.step(self.trainer.iter)
