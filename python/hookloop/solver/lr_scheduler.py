"""LR schedulers, mirroring ``detectron2.solver.lr_scheduler``."""

from __future__ import annotations

import logging
import math
import operator
from bisect import bisect_right
from typing import Any, Dict, List, Mapping, Optional

import torch

from hookloop import _core
from hookloop.solver.param_scheduler import (
    CompositeParamScheduler,
    ConstantParamScheduler,
    LinearParamScheduler,
    ParamScheduler,
    native_schedule,
)
from hookloop.solver.torch_step import advance

try:
    from torch.optim.lr_scheduler import LRScheduler
except ImportError:  # torch < 2.0
    from torch.optim.lr_scheduler import _LRScheduler as LRScheduler  # type: ignore[attr-defined]

__all__ = ["WarmupParamScheduler", "LRMultiplier", "WarmupMultiStepLR", "WarmupCosineLR"]

logger = logging.getLogger(__name__)


class WarmupParamScheduler(CompositeParamScheduler):
    """
    Add an initial warmup stage to another scheduler.
    """

    def __init__(
        self,
        scheduler: ParamScheduler,
        warmup_factor: float,
        warmup_length: float,
        warmup_method: str = "linear",
        rescale_interval: bool = False,
    ):
        """
        Args:
            scheduler: warmup will be added at the beginning of this scheduler
            warmup_factor: the factor w.r.t the initial value of ``scheduler``, e.g. 0.001
            warmup_length: the relative length (in [0, 1]) of warmup steps w.r.t the entire
                training, e.g. 0.01
            warmup_method: one of "linear" or "constant"
            rescale_interval: whether we will rescale the interval of the scheduler after
                warmup
        """
        # Where the warmup starts and ends, and the two intervals, by the core's rule; a
        # Python `scheduler` is evaluated through its own __call__.
        start_value, end_value, spans = _core.warmup_parts(
            native_schedule(scheduler) or scheduler,
            warmup_factor,
            warmup_length,
            warmup_method,
            rescale_interval,
        )
        warmup: ParamScheduler
        if warmup_method == "constant":
            warmup = ConstantParamScheduler(start_value)
        else:
            warmup = LinearParamScheduler(start_value, end_value)
        self._build([warmup, scheduler], spans)


def _is_param_scheduler(obj: Any) -> bool:
    """hookloop's ParamScheduler, or fvcore's (a codebase may still build those): the latter
    are evaluated in Python."""
    if isinstance(obj, ParamScheduler):
        return True
    return any(
        c.__name__ == "ParamScheduler" and c.__module__ == "fvcore.common.param_scheduler"
        for c in type(obj).__mro__
    )


def _plain_lrs(lrs: List[Any]) -> bool:
    return all(type(lr) is float or type(lr) is int for lr in lrs)


def _lrs_str(lrs: Optional[List[Any]]) -> str:
    """LRs for a message: one group's as a number, several as a list."""
    if not lrs:
        return "unknown"
    values = [f"{float(lr):.6g}" for lr in lrs]
    return values[0] if len(values) == 1 else "[" + ", ".join(values) + "]"


# Instance attributes that are not scheduler state (torch saves every other one).
_NOT_STATE = frozenset({"optimizer", "_multiplier", "_native", "_fast"})


class LRMultiplier(LRScheduler):
    """
    A LRScheduler which uses fvcore :class:`ParamScheduler` to multiply the
    learning rate of each param in the optimizer.
    Every step, the learning rate of each parameter becomes its initial value
    multiplied by the output of the given :class:`ParamScheduler`.

    The absolute learning rate value of each parameter can be different.
    This scheduler can be used as long as the relative scale among them do
    not change during training.

    Examples:
    ::
        LRMultiplier(
            opt,
            WarmupParamScheduler(
                MultiStepParamScheduler(
                    [1, 0.1, 0.01],
                    milestones=[60000, 80000],
                    num_updates=90000,
                ), 0.001, 100 / 90000
            ),
            max_iter=90000
        )

    With a built-in multiplier (no Python ``__call__`` anywhere in it) and float learning
    rates, :meth:`step` does its work in one call into Rust: the multiplier at
    ``last_epoch / max_iter`` once, then every group's ``lr``. The values are those of
    detectron2's ``base_lr * multiplier(last_epoch / max_iter)``; torch's own bookkeeping of
    the step is :func:`hookloop.solver.torch_step.advance`. Otherwise (a Python multiplier,
    tensor learning rates, the first step, the deprecated ``epoch``) it is torch's ``step()``.

    The state (:meth:`state_dict`) is torch's (``base_lrs``, ``last_epoch``, ``_step_count``,
    ``_last_lr``, ...) plus ``_max_iter``. A state saved with another ``max_iter`` loads as
    in detectron2 (the rest of the schedule is evaluated over the new length), with one
    warning naming both lengths and the LR before and after; a saved ``last_epoch`` past
    ``max_iter`` loads with one warning naming both, and stepping past ``max_iter`` raises
    ``ValueError`` naming the iteration. detectron2's states (``base_lrs`` and
    ``last_epoch`` only) load as they are.
    """

    # Whether step() may take the one-call native path; set once base_lrs are known.
    _fast = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        multiplier: ParamScheduler,
        max_iter: int,
        last_iter: int = -1,
    ):
        """
        Args:
            optimizer, last_iter: See ``torch.optim.lr_scheduler.LRScheduler``.
                ``last_iter`` is the same as ``last_epoch``.
            multiplier: a fvcore ParamScheduler that defines the multiplier on
                every LR of the optimizer
            max_iter: the total number of training iterations
        """
        if not _is_param_scheduler(multiplier):
            raise ValueError(
                "_LRMultiplier(multiplier=) must be an instance of fvcore "
                f"ParamScheduler. Got {multiplier} instead."
            )
        if isinstance(max_iter, bool):
            raise TypeError("max_iter must be an int, got bool")
        try:
            max_iter = operator.index(max_iter)
        except TypeError:
            raise TypeError(f"max_iter must be an int, got {type(max_iter).__name__}") from None
        _core.NativeSchedule.progress(0, max_iter)  # ValueError unless max_iter > 0
        self._multiplier = multiplier
        self._max_iter = max_iter
        self._native = native_schedule(multiplier)
        super().__init__(optimizer, last_epoch=last_iter)
        self._fast = self._native is not None and _plain_lrs(self.base_lrs)

    def state_dict(self) -> Dict[str, Any]:
        # fvcore schedulers are stateless: only the torch scheduler's state, and max_iter.
        return {k: v for k, v in self.__dict__.items() if k not in _NOT_STATE}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads :meth:`state_dict`'s state (or detectron2's), keeping this scheduler's
        ``max_iter``. A state saved with another ``max_iter`` loads as in detectron2: the rest
        of the schedule is evaluated over this scheduler's length from the saved
        ``last_epoch`` (a finished run extended by raising ``max_iter``), with one warning
        naming both lengths and the LR at ``last_epoch`` under each. A ``last_epoch`` past
        ``max_iter`` (a finished run relaunched with a lower ``max_iter``, whose ``train()``
        then runs no iteration) loads too, with one warning naming both: the schedule has no
        value there, and a :meth:`step` raises ``ValueError``. detectron2's states (no
        ``_max_iter``) load without a word, as in detectron2."""
        state = {k: v for k, v in state_dict.items() if k not in _NOT_STATE}
        saved_max_iter = state.pop("_max_iter", None)
        self.__dict__.update(state)
        self._fast = self._native is not None and _plain_lrs(self.base_lrs)
        last_epoch = self.last_epoch
        if saved_max_iter is None or saved_max_iter == self._max_iter:
            return
        if isinstance(last_epoch, int) and last_epoch > self._max_iter:
            logger.warning(
                f"LRMultiplier: the checkpoint was saved with max_iter={saved_max_iter} at "
                f"iteration {last_epoch} (last_epoch), past this scheduler's "
                f"max_iter={self._max_iter}: the schedule has no LR there, and a step raises "
                f"ValueError. Build the LRMultiplier with a max_iter of at least {last_epoch} "
                "to train on."
            )
        else:
            before = state.get("_last_lr")
            try:
                after: Optional[List[Any]] = self.get_lr()
            except (ValueError, RuntimeError, IndexError):  # no value at where = 1.0
                after = None
            logger.warning(
                f"LRMultiplier: the checkpoint was saved with max_iter={saved_max_iter}; this "
                f"scheduler has max_iter={self._max_iter}. The schedule continues from "
                f"iteration {last_epoch} over the new length (as detectron2 does): the LR at "
                f"iteration {last_epoch} was {_lrs_str(before)} and is {_lrs_str(after)} "
                "under the new length."
            )

    def get_lr(self) -> List[Any]:
        native = self._native
        if native is not None:
            multiplier = native.multiplier(self.last_epoch, self._max_iter)
        else:
            where = _core.NativeSchedule.progress(self.last_epoch, self._max_iter)
            multiplier = self._multiplier(where)
        return [base_lr * multiplier for base_lr in self.base_lrs]

    def step(self, epoch: Optional[int] = None) -> None:
        # torch's own step for the first user step (where it checks the call order) and for
        # the deprecated `epoch` argument.
        native = self._native
        if self._fast and native is not None and epoch is None and self._step_count != 1:
            lrs: List[Any] = native.step_lrs(
                self.optimizer.param_groups, self.base_lrs, self.last_epoch + 1, self._max_iter
            )
            advance(self, lrs)
        else:
            super().step(epoch)


# detectron2's legacy schedulers, kept for code that still builds them. Their arithmetic stays
# in Python: it is not an LRMultiplier's (`base_lr * factor * decay`, not
# `base_lr * multiplier`), so a native schedule would round differently. As in torch,
# `last_epoch` counts iterations here.


class WarmupMultiStepLR(LRScheduler):
    """detectron2's legacy warmup + multi-step schedule; prefer :class:`LRMultiplier` over
    ``WarmupParamScheduler(MultiStepParamScheduler(...))``.

    At iteration ``i`` each LR is ``base_lr * warmup(i) * gamma ** (number of milestones <= i)``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        milestones: List[int],
        gamma: float = 0.1,
        warmup_factor: float = 0.001,
        warmup_iters: int = 1000,
        warmup_method: str = "linear",
        last_epoch: int = -1,
    ):
        logger.warning(
            "WarmupMultiStepLR is deprecated! Use LRMultipilier with fvcore ParamScheduler instead!"
        )
        if list(milestones) != sorted(milestones):
            raise ValueError(
                f"Milestones should be a list of increasing integers. Got {milestones}"
            )
        self.milestones = milestones
        self.gamma = gamma
        self.warmup_factor = warmup_factor
        self.warmup_iters = warmup_iters
        self.warmup_method = warmup_method
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[Any]:
        it = self.last_epoch
        factor = _get_warmup_factor_at_iter(
            self.warmup_method, it, self.warmup_iters, self.warmup_factor
        )
        decay = self.gamma ** bisect_right(self.milestones, it)
        # (base_lr * factor) * decay: the grouping of detectron2's expression.
        return [base_lr * factor * decay for base_lr in self.base_lrs]

    def _compute_values(self) -> List[Any]:
        return self.get_lr()


class WarmupCosineLR(LRScheduler):
    """detectron2's legacy warmup + half-cosine schedule; prefer :class:`LRMultiplier` over
    ``WarmupParamScheduler(CosineParamScheduler(1, 0), ...)``.

    At iteration ``i`` each LR is ``base_lr * warmup(i) * 0.5 * (1 + cos(pi * i / max_iters))``:
    the cosine runs from iteration 0, not from the end of the warmup.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_iters: int,
        warmup_factor: float = 0.001,
        warmup_iters: int = 1000,
        warmup_method: str = "linear",
        last_epoch: int = -1,
    ):
        logger.warning(
            "WarmupCosineLR is deprecated! Use LRMultipilier with fvcore ParamScheduler instead!"
        )
        if isinstance(max_iters, bool) or not isinstance(max_iters, (int, float)):
            raise TypeError(f"WarmupCosineLR max_iters must be a number, got {max_iters!r}")
        if not max_iters > 0:
            # detectron2 divides by it at the first step (ZeroDivisionError for 0).
            raise ValueError(f"WarmupCosineLR max_iters must be positive, got {max_iters!r}")
        self.max_iters = max_iters
        self.warmup_factor = warmup_factor
        self.warmup_iters = warmup_iters
        self.warmup_method = warmup_method
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[Any]:
        it = self.last_epoch
        factor = _get_warmup_factor_at_iter(
            self.warmup_method, it, self.warmup_iters, self.warmup_factor
        )
        cosine = 1.0 + math.cos(math.pi * it / self.max_iters)
        # ((base_lr * factor) * 0.5) * cosine: the grouping of detectron2's expression.
        return [base_lr * factor * 0.5 * cosine for base_lr in self.base_lrs]

    def _compute_values(self) -> List[Any]:
        return self.get_lr()


def _get_warmup_factor_at_iter(
    method: str, iter: int, warmup_iters: int, warmup_factor: float
) -> float:
    """The LR warmup factor at iteration ``iter`` (see :paper:`ImageNet in 1h`): 1.0 from
    ``warmup_iters`` on; before, ``warmup_factor`` for ``method="constant"``, or the linear
    ramp from ``warmup_factor`` (at 0) towards 1.0 for ``"linear"``.

    Args:
        method (str): warmup method; either "constant" or "linear".
        iter (int): iteration at which to calculate the warmup factor.
        warmup_iters (int): the number of warmup iterations.
        warmup_factor (float): the base warmup factor (the meaning changes according
            to the method used).

    Returns:
        float: the effective warmup factor at the given iteration.
    """
    if iter >= warmup_iters:
        return 1.0
    if method == "linear":
        alpha = iter / warmup_iters
        return warmup_factor * (1 - alpha) + alpha
    if method == "constant":
        return warmup_factor
    raise ValueError(f"Unknown warmup method: {method}")
