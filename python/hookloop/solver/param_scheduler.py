"""fvcore's parameter schedulers, mirroring ``fvcore.common.param_scheduler``.

Rewrite ``fvcore.common.param_scheduler`` -> ``hookloop.solver.param_scheduler`` to switch.
The built-in schedulers evaluate in Rust (``hookloop._core.NativeSchedule``) with values
bit-identical to fvcore's Python formulas; the rules (validation, formulas, how a composite
finds its interval) live once, in ``rust/hookloop-core/src/schedule.rs``.

A Python subclass of :class:`ParamScheduler` that overrides ``__call__`` works everywhere a
built-in does, at Python cost: a :class:`CompositeParamScheduler` containing one evaluates
in Python, locating the interval with the same native rule.

Built-in schedulers are immutable: their native schedule is built once, in ``__init__``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

from hookloop import _core

__all__ = [
    "ParamScheduler",
    "ConstantParamScheduler",
    "CosineParamScheduler",
    "ExponentialParamScheduler",
    "LinearParamScheduler",
    "CompositeParamScheduler",
    "MultiStepParamScheduler",
    "StepParamScheduler",
    "StepWithFixedGammaParamScheduler",
    "PolynomialDecayParamScheduler",
]


class ParamScheduler:
    """
    Base class for parameter schedulers.
    A parameter scheduler defines a mapping from a progress value in [0, 1) to
    a number (e.g. learning rate).

    Subclass it in Python and override ``__call__`` for a schedule of your own.
    """

    # To be used for comparisons with where
    WHERE_EPSILON = 1e-6

    # The Rust schedule of a built-in scheduler (None for Python ones).
    _native: Optional[_core.NativeSchedule] = None

    def __call__(self, where: float) -> float:
        """
        Get the value of the param for a given point at training.

        We update params (such as learning rate) based on the percent progress
        of training completed. This allows a scheduler to be agnostic to the
        exact length of a particular run (e.g. 120 epochs vs 90 epochs), as
        long as the relative progress where params should be updated is the same.
        However, it assumes that the total length of training is known.

        Args:
            where: A float in [0,1) that represents how far training has progressed

        """
        native = self._native
        if native is not None:
            return native(where)
        return self._call_python(where)

    def _call_python(self, where: float) -> float:
        raise NotImplementedError("Param schedulers must override __call__")


def native_schedule(scheduler: Any) -> Optional[_core.NativeSchedule]:
    """The Rust schedule that computes ``scheduler``'s values, or None when they come from
    Python (a subclass that overrides ``__call__``, a composite of one, any other callable).
    """
    if type(scheduler).__call__ is not ParamScheduler.__call__:
        return None
    native: Optional[_core.NativeSchedule] = scheduler._native
    return native


def _int_if_integral(x: float) -> Union[int, float]:
    return int(x) if float(x).is_integer() else x


class ConstantParamScheduler(ParamScheduler):
    """
    Returns a constant value for a param.
    """

    def __init__(self, value: float) -> None:
        self._value = value
        self._native = _core.NativeSchedule.constant(value)


class CosineParamScheduler(ParamScheduler):
    """
    Cosine decay or cosine warmup schedules based on start and end values.
    The schedule is updated based on the fraction of training progress.
    The schedule was proposed in 'SGDR: Stochastic Gradient Descent with
    Warm Restarts' (https://arxiv.org/abs/1608.03983). Note that this class
    only implements the cosine annealing part of SGDR, and not the restarts.

    Example:

        .. code-block:: python

          CosineParamScheduler(start_value=0.1, end_value=0.0001)
    """

    def __init__(self, start_value: float, end_value: float) -> None:
        self._start_value = start_value
        self._end_value = end_value
        self._native = _core.NativeSchedule.cosine(start_value, end_value)


class ExponentialParamScheduler(ParamScheduler):
    """
    Exponential schedule parameterized by a start value and decay.
    The schedule is updated based on the fraction of training
    progress, `where`, with the formula
    `param_t = start_value * (decay ** where)`.

    Example:

        .. code-block:: python

            ExponentialParamScheduler(start_value=2.0, decay=0.02)

    Corresponds to a decreasing schedule with values in [2.0, 0.04).
    """

    def __init__(self, start_value: float, decay: float) -> None:
        self._start_value = start_value
        self._decay = decay
        self._native = _core.NativeSchedule.exponential(start_value, decay)


class LinearParamScheduler(ParamScheduler):
    """
    Linearly interpolates parameter between ``start_value`` and ``end_value``.
    Can be used for either warmup or decay based on start and end values.
    The schedule is updated after every train step by default.

    Example:

        .. code-block:: python

            LinearParamScheduler(start_value=0.0001, end_value=0.01)

    Corresponds to a linear increasing schedule with values in [0.0001, 0.01)
    """

    def __init__(self, start_value: float, end_value: float) -> None:
        self._start_value = start_value
        self._end_value = end_value
        self._native = _core.NativeSchedule.linear(start_value, end_value)


class MultiStepParamScheduler(ParamScheduler):
    """
    Takes a predefined schedule for a param value, and a list of epochs or steps
    which stand for the upper boundary (excluded) of each range.

    Example:

        .. code-block:: python

          MultiStepParamScheduler(
            values=[0.1, 0.01, 0.001, 0.0001],
            milestones=[30, 60, 80, 120]
          )

    Then the param value will be 0.1 for epochs 0-29, 0.01 for
    epochs 30-59, 0.001 for epochs 60-79, 0.0001 for epochs 80-120.
    Note that the length of values must be equal to the length of milestones
    plus one.
    """

    def __init__(
        self,
        values: List[float],
        num_updates: Optional[int] = None,
        milestones: Optional[List[int]] = None,
    ) -> None:
        """
        Args:
            values: param value in each range
            num_updates: the end of the last range. If None, will use ``milestones[-1]``
            milestones: the boundary of each range. If None, will evenly split ``num_updates``

        For example, all the following combinations define the same scheduler:

        * num_updates=90, milestones=[30, 60], values=[1, 0.1, 0.01]
        * num_updates=90, values=[1, 0.1, 0.01]
        * milestones=[30, 60, 90], values=[1, 0.1, 0.01]
        * milestones=[3, 6, 9], values=[1, 0.1, 0.01]  (ParamScheduler is scale-invariant)
        """
        if milestones is not None:
            # fvcore's check, before any other of values: milestones that are not a list of the
            # right length (for any values with a length, a dict too) are a ValueError.
            expected = len(values) - int(num_updates is not None)
            if not isinstance(milestones, Sequence) or len(milestones) != expected:
                raise ValueError(f"MultiStep scheduler requires a list of {expected} miletones")
        self._native = _core.NativeSchedule.multi_step(values, num_updates, milestones)
        params = self._native.params
        self._param_schedule = values
        self._num_updates = _int_if_integral(params["num_updates"])
        self._milestones: List[Union[int, float]] = [
            _int_if_integral(m) for m in params["milestones"]
        ]


class PolynomialDecayParamScheduler(ParamScheduler):
    """
    Decays the param value after every epoch according to a
    polynomial function with a fixed power.
    The schedule is updated after every train step by default.

    Example:

        .. code-block:: python

          PolynomialDecayParamScheduler(base_value=0.1, power=0.9)

    Then the param value will be 0.1 for epoch 0, 0.099 for epoch 1, and
    so on.
    """

    def __init__(self, base_value: float, power: float) -> None:
        self._base_value = base_value
        self._power = power
        self._native = _core.NativeSchedule.polynomial_decay(base_value, power)


class StepParamScheduler(ParamScheduler):
    """
    Takes a fixed schedule for a param value.  If the length of the
    fixed schedule is less than the number of epochs, then the epochs
    are divided evenly among the param schedule.
    The schedule is updated after every train epoch by default.

    Example:

        .. code-block:: python

          StepParamScheduler(values=[0.1, 0.01, 0.001, 0.0001], num_updates=120)

    Then the param value will be 0.1 for epochs 0-29, 0.01 for
    epochs 30-59, 0.001 for epoch 60-89, 0.0001 for epochs 90-119.
    """

    def __init__(self, num_updates: Union[int, float], values: List[float]) -> None:
        if not isinstance(values, Sequence):
            raise ValueError(
                "StepParamScheduler: Step scheduler requires a list of at least one param "
                f"value, got values of type {type(values).__name__}"
            )
        self._native = _core.NativeSchedule.step(num_updates, values)
        self._param_schedule = values


class StepWithFixedGammaParamScheduler(ParamScheduler):
    """
    Decays the param value by gamma at equal number of steps so as to have the
    specified total number of decays.

    Example:

        .. code-block:: python

          StepWithFixedGammaParamScheduler(
            base_value=0.1, gamma=0.1, num_decays=3, num_updates=120)

    Then the param value will be 0.1 for epochs 0-29, 0.01 for
    epochs 30-59, 0.001 for epoch 60-89, 0.0001 for epochs 90-119.
    """

    def __init__(
        self,
        base_value: float,
        num_decays: int,
        gamma: float,
        num_updates: int,
    ) -> None:
        for name, k in (("base_value", base_value), ("gamma", gamma)):
            if not isinstance(k, (int, float)):
                raise ValueError(
                    "StepWithFixedGammaParamScheduler: base_value and gamma must be positive "
                    f"numbers: {name}={k!r}"
                )
        self._native = _core.NativeSchedule.step_with_fixed_gamma(
            base_value, num_decays, gamma, num_updates
        )
        self.base_value = base_value
        self.num_decays = num_decays
        self.gamma = gamma
        self.num_updates = num_updates


class CompositeParamScheduler(ParamScheduler):
    """
    Composite parameter scheduler composed of intermediate schedulers.
    Takes a list of schedulers and a list of lengths corresponding to
    percentage of training each scheduler should run for. Schedulers
    are run in order. All values in lengths should sum to 1.0.

    Each scheduler also has a corresponding interval scale. If interval
    scale is 'fixed', the intermediate scheduler will be run without any rescaling
    of the time. If interval scale is 'rescaled', intermediate scheduler is
    run such that each scheduler will start and end at the same values as it
    would if it were the only scheduler. Default is 'rescaled' for all schedulers.

    Example:

        .. code-block:: python

              schedulers = [
                ConstantParamScheduler(value=0.42),
                CosineParamScheduler(start_value=0.42, end_value=1e-4)
              ]
              CompositeParamScheduler(
                schedulers=schedulers,
                interval_scaling=['rescaled', 'rescaled'],
                lengths=[0.3, 0.7])

    The parameter value will be 0.42 for the first [0%, 30%) of steps,
    and then will cosine decay from 0.42 to 0.0001 for [30%, 100%) of
    training.

    A composite of built-in schedulers evaluates in Rust; one that contains a Python
    scheduler evaluates in Python. Unlike fvcore, ``lengths`` is not modified in place; the
    normalized lengths are ``self._lengths``.
    """

    def __init__(
        self,
        schedulers: Sequence[ParamScheduler],
        lengths: List[float],
        interval_scaling: Sequence[str],
    ) -> None:
        if len(schedulers) != len(lengths):
            raise ValueError(
                "CompositeParamScheduler: Schedulers and lengths must be same length: "
                f"{len(schedulers)} schedulers, {len(lengths)} lengths"
            )
        self._build(schedulers, _core.CompositeSpans(lengths, interval_scaling))

    def _build(self, schedulers: Sequence[Any], spans: _core.CompositeSpans) -> None:
        for i, s in enumerate(schedulers):
            if not callable(s):
                raise TypeError(
                    f"CompositeParamScheduler: schedulers[{i}] must be a ParamScheduler, "
                    f"got {type(s).__name__}"
                )
        self._spans = spans
        self._lengths = spans.lengths
        self._schedulers: List[Callable[[float], float]] = list(schedulers)
        self._interval_scaling = spans.interval_scaling
        natives = [native_schedule(s) for s in schedulers]
        if all(n is not None for n in natives):
            self._native = _core.NativeSchedule.composite(natives, spans)  # type: ignore[arg-type]
        else:
            self._native = None

    def _call_python(self, where: float) -> float:
        # Same interval rule as the native composite; only the part runs in Python.
        i, sub_where = self._spans.locate(where)
        return self._schedulers[i](sub_where)
