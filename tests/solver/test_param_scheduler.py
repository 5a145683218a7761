"""hookloop.solver.param_scheduler against fvcore's formulas, written out in plain Python in
tests/compat/d2.py: values must match bit for bit."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
from compat import d2
from hookloop import _core
from hookloop.solver import WarmupParamScheduler
from hookloop.solver.param_scheduler import (
    CompositeParamScheduler,
    ConstantParamScheduler,
    CosineParamScheduler,
    ExponentialParamScheduler,
    LinearParamScheduler,
    MultiStepParamScheduler,
    ParamScheduler,
    PolynomialDecayParamScheduler,
    StepParamScheduler,
    StepWithFixedGammaParamScheduler,
    native_schedule,
)

# --- points and comparison ----------------------------------------------------------------

_rng = random.Random(0)
WHERES = (
    [i / 1000 for i in range(1000)]
    + [i / 90000 for i in range(0, 90000, 331)]
    + [i / 37 for i in range(37)]
    + [_rng.random() for _ in range(500)]
    + [0.3 - d2.WHERE_EPSILON, 0.3 - d2.WHERE_EPSILON / 2, 0.3, 0.5 - 1e-7, 0.999999, 0.9999995]
)


def same(a: float, b: float) -> bool:
    """Bit-identical (so 0.0 and -0.0 differ, and NaN equals NaN)."""
    return float(a).hex() == float(b).hex()


def outcome(f, where):
    """The value's bits, or "raises" where the schedule is undefined (both must raise)."""
    try:
        return float(f(where)).hex()
    except (RuntimeError, IndexError, ValueError, ZeroDivisionError):
        return "raises"


def assert_same_everywhere(ours, ref, wheres=WHERES):
    bad = [(w, outcome(ours, w), outcome(ref, w)) for w in wheres]
    bad = [b for b in bad if b[1] != b[2]]
    assert not bad, bad[:5]


# --- values -------------------------------------------------------------------------------

SIMPLE = [
    (ConstantParamScheduler, d2.ConstantParamScheduler, (0.42,)),
    (CosineParamScheduler, d2.CosineParamScheduler, (0.1, 0.0001)),
    (CosineParamScheduler, d2.CosineParamScheduler, (0.0, 1.0)),
    (ExponentialParamScheduler, d2.ExponentialParamScheduler, (2.0, 0.02)),
    (LinearParamScheduler, d2.LinearParamScheduler, (0.0001, 0.01)),
    (LinearParamScheduler, d2.LinearParamScheduler, (1, 0)),
    (PolynomialDecayParamScheduler, d2.PolynomialDecayParamScheduler, (0.1, 0.9)),
    (PolynomialDecayParamScheduler, d2.PolynomialDecayParamScheduler, (1.0, 2)),
    (StepParamScheduler, d2.StepParamScheduler, (120, [0.1, 0.01, 0.001, 0.0001])),
    (
        StepParamScheduler,
        d2.StepParamScheduler,
        (3, [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625]),
    ),
]


@pytest.mark.parametrize("cls,ref,args", SIMPLE, ids=lambda x: getattr(x, "__name__", None))
def test_simple_schedules_match_formulas(cls, ref, args):
    sched = cls(*args)
    assert native_schedule(sched) is not None
    assert_same_everywhere(sched, ref(*args))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(values=[0.1, 0.01, 0.001, 0.0001], num_updates=120, milestones=[30, 60, 80]),
        dict(values=[1, 0.1, 0.01], num_updates=90),
        dict(values=[1, 0.1, 0.01], milestones=[30, 60, 90]),
        dict(values=[1, 0.1, 0.01], milestones=[3, 6, 9]),
        dict(values=[1.0, 0.5, 0.25], num_updates=100),
        dict(values=[1, 0.1, 0.01], milestones=[60000, 80000], num_updates=90000),
        dict(values=[5.0], num_updates=7),
    ],
)
def test_multi_step_matches_formula(kwargs):
    sched = MultiStepParamScheduler(**kwargs)
    ref = d2.MultiStepParamScheduler(**kwargs)
    assert_same_everywhere(sched, ref, WHERES + [1.0])
    # fvcore's attributes, normalized the same way.
    assert sched._num_updates == ref._num_updates
    assert sched._milestones == list(ref._milestones)
    assert sched._param_schedule == kwargs["values"]


def test_multi_step_forms_are_equal():
    a = MultiStepParamScheduler([1, 0.1, 0.01], num_updates=90, milestones=[30, 60])
    b = MultiStepParamScheduler([1, 0.1, 0.01], num_updates=90)
    c = MultiStepParamScheduler([1, 0.1, 0.01], milestones=[30, 60, 90])
    assert a._native == b._native == c._native
    assert a(29 / 90) == 1 and a(30 / 90) == 0.1 and a(1.0) == 0.01


@pytest.mark.parametrize("num_decays,gamma", [(3, 0.1), (1, 0.5), (7, 0.3)])
def test_step_with_fixed_gamma_matches_formula(num_decays, gamma):
    sched = StepWithFixedGammaParamScheduler(0.1, num_decays, gamma, 120)
    assert_same_everywhere(sched, d2.StepWithFixedGammaParamScheduler(0.1, num_decays, gamma, 120))
    assert (sched.base_value, sched.num_decays, sched.gamma, sched.num_updates) == (
        0.1,
        num_decays,
        gamma,
        120,
    )


@pytest.mark.parametrize(
    "lengths,scaling",
    [
        ([0.3, 0.7], ["rescaled", "rescaled"]),
        ([0.3, 0.7], ["rescaled", "fixed"]),
        ([0.3, 0.7], ["fixed", "fixed"]),
        ([0.1, 0.2, 0.7], ["rescaled", "fixed", "rescaled"]),  # sum != 1.0 in floats
        ([0.25, 0.25, 0.5005], ["fixed", "rescaled", "rescaled"]),  # within 1e-3
        ([1.0], ["rescaled"]),
    ],
)
def test_composite_matches_formula(lengths, scaling):
    def parts():
        return [
            ConstantParamScheduler(0.42),
            CosineParamScheduler(0.42, 1e-4),
            LinearParamScheduler(1e-4, 0.0),
        ][: len(lengths)]

    refs = [
        d2.ConstantParamScheduler(0.42),
        d2.CosineParamScheduler(0.42, 1e-4),
        d2.LinearParamScheduler(1e-4, 0.0),
    ][: len(lengths)]
    sched = CompositeParamScheduler(parts(), lengths=list(lengths), interval_scaling=scaling)
    assert native_schedule(sched) is not None
    ref = d2.CompositeParamScheduler(refs, lengths, scaling)
    assert sched._lengths == ref._lengths
    assert_same_everywhere(sched, ref)


def test_composite_does_not_modify_lengths():
    lengths = [0.1, 0.2, 0.7]
    CompositeParamScheduler([ConstantParamScheduler(1.0)] * 3, lengths, ["fixed"] * 3)
    assert lengths == [0.1, 0.2, 0.7]


@pytest.mark.parametrize("method", ["linear", "constant"])
@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize(
    "inner,ref_inner",
    [
        (
            lambda: MultiStepParamScheduler(
                [1, 0.1, 0.01], milestones=[60000, 80000], num_updates=90000
            ),
            lambda: d2.MultiStepParamScheduler(
                [1, 0.1, 0.01], milestones=[60000, 80000], num_updates=90000
            ),
        ),
        (lambda: CosineParamScheduler(1, 0), lambda: d2.CosineParamScheduler(1, 0)),
        (
            lambda: ExponentialParamScheduler(1.0, 0.01),
            lambda: d2.ExponentialParamScheduler(1.0, 0.01),
        ),
    ],
)
def test_warmup_matches_formula(method, rescale, inner, ref_inner):
    length = 100 / 90000
    sched = WarmupParamScheduler(inner(), 0.001, length, method, rescale)
    assert native_schedule(sched) is not None
    ref = d2.WarmupParamScheduler(ref_inner(), 0.001, length, method, rescale)
    iters = [i / 90000 for i in list(range(0, 300)) + list(range(300, 90001, 97))]
    assert_same_everywhere(sched, ref, WHERES + iters)
    assert isinstance(sched, CompositeParamScheduler)
    assert isinstance(sched._schedulers[0], (LinearParamScheduler, ConstantParamScheduler))


def test_warmup_edge_lengths():
    inner = CosineParamScheduler(1.0, 0.0)
    no_warmup = WarmupParamScheduler(inner, 0.001, 0.0)
    assert_same_everywhere(no_warmup, d2.CosineParamScheduler(1.0, 0.0))
    assert_same_everywhere(
        no_warmup, d2.WarmupParamScheduler(d2.CosineParamScheduler(1.0, 0.0), 0.001, 0.0)
    )
    all_warmup = WarmupParamScheduler(inner, 0.5, 1.0, "constant")
    assert all_warmup(0.0) == all_warmup(0.99) == 0.5
    # Past the (empty) last interval: the wrapped schedule, unscaled.
    assert all_warmup(1.0) == 0.0
    # rescale_interval is tested for truth, as in detectron2.
    truthy = WarmupParamScheduler(inner, 0.1, 0.2, rescale_interval=1)  # type: ignore[arg-type]
    assert truthy._interval_scaling == ["rescaled", "rescaled"]


def test_nested_composite():
    inner = WarmupParamScheduler(CosineParamScheduler(1, 0), 0.01, 0.05, rescale_interval=True)
    sched = CompositeParamScheduler(
        [inner, LinearParamScheduler(0.5, 0.0)], [0.5, 0.5], ["rescaled", "fixed"]
    )
    ref = d2.CompositeParamScheduler(
        [
            d2.WarmupParamScheduler(
                d2.CosineParamScheduler(1, 0), 0.01, 0.05, rescale_interval=True
            ),
            d2.LinearParamScheduler(0.5, 0.0),
        ],
        [0.5, 0.5],
        ["rescaled", "fixed"],
    )
    assert native_schedule(sched) is not None
    assert_same_everywhere(sched, ref)


# --- where out of range -------------------------------------------------------------------


def test_where_out_of_range_is_fvcores_runtime_error():
    with pytest.raises(RuntimeError, match="must be in \\[0, 1\\): got 1.0"):
        ConstantParamScheduler(1.0)(1.0)
    ms = MultiStepParamScheduler([1, 0.1], num_updates=10)
    assert ms(1.0) == 0.1
    with pytest.raises(RuntimeError, match="got 1.5"):
        ms(1.5)
    with pytest.raises(IndexError, match="^list index out of range$"):
        StepParamScheduler(10, [1, 0.1])(1.0)  # fvcore: IndexError past the last value
    with pytest.raises(IndexError, match="^list index out of range$"):
        StepWithFixedGammaParamScheduler(0.1, 3, 0.1, 120)(1.0)
    with pytest.raises(ValueError, match="not a real number"):
        PolynomialDecayParamScheduler(1.0, 0.5)(1.5)  # Python: a complex number


# --- bad arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: MultiStepParamScheduler([1, 0.1]), "num_updates and milestones cannot both"),
        (lambda: MultiStepParamScheduler([1, 0.1], 10, [3, 6]), "list of 1 miletones"),
        (lambda: MultiStepParamScheduler([1, 0.1], milestones=[3]), "list of 2 miletones"),
        (
            lambda: MultiStepParamScheduler([1, 0.1, 0.01], num_updates=2),
            "^Total num_updates must be greater than length of param schedule$",
        ),
        (lambda: MultiStepParamScheduler([1, 0.1], 10, [10]), "milestone=10"),
        (
            lambda: MultiStepParamScheduler([1, 0.1, 0.01], 10, [6, 3]),
            "^Milestone must be smaller than start epoch: start_epoch=6, milestone=3$",
        ),
        (lambda: MultiStepParamScheduler([1, 0.1], 10, 5), "^MultiStep .* list of 1 miletones$"),
        (lambda: MultiStepParamScheduler([], 10), "values must not be empty"),
        (lambda: MultiStepParamScheduler([], milestones=[]), "values must not be empty"),
        (lambda: StepParamScheduler(0, [1.0]), "num_updates=0"),
        (lambda: StepParamScheduler(10, []), "at least one param value"),
        (lambda: StepParamScheduler(10, 0.5), "at least one param value"),
        (lambda: StepWithFixedGammaParamScheduler(0, 3, 0.1, 120), "base_value=0"),
        (lambda: StepWithFixedGammaParamScheduler(0.1, 3, -1, 120), "gamma=-1"),
        (lambda: StepWithFixedGammaParamScheduler("a", 3, 0.1, 120), "base_value='a'"),
        (lambda: StepWithFixedGammaParamScheduler(0.1, 0, 0.1, 120), "num_decays=0"),
        (lambda: StepWithFixedGammaParamScheduler(0.1, 3.0, 0.1, 120), "num_decays=3.0"),
        (lambda: StepWithFixedGammaParamScheduler(0.1, 3, 0.1, -5), "num_updates=-5"),
        (
            lambda: CompositeParamScheduler([ConstantParamScheduler(1)], [0.5, 0.5], ["fixed"]),
            "Schedulers and lengths must be same length",
        ),
        (lambda: CompositeParamScheduler([], [], []), "at least one scheduler"),
        (
            lambda: CompositeParamScheduler(
                [ConstantParamScheduler(1)] * 2, [0.5, 0.6], ["fixed"] * 2
            ),
            "sum of all values in lengths must be 1",
        ),
        (
            lambda: CompositeParamScheduler(
                [ConstantParamScheduler(1)] * 2, [0.5, 0.5], ["fixed", "scaled"]
            ),
            "Unsupported interval_scaling",
        ),
        (
            lambda: CompositeParamScheduler([ConstantParamScheduler(1)] * 2, [0.5, 0.5], ["fixed"]),
            "interval_scaling must have one entry per scheduler",
        ),
        (
            lambda: WarmupParamScheduler(CosineParamScheduler(1, 0), 0.1, 0.1, "exp"),
            "Unknown warmup method: exp",
        ),
        (
            lambda: WarmupParamScheduler(CosineParamScheduler(1, 0), 0.1, 1.5),
            "warmup_length must be in \\[0, 1\\]",
        ),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: ConstantParamScheduler("x"), "value"),
        (lambda: CosineParamScheduler(None, 0), "start_value"),
        (lambda: MultiStepParamScheduler("abc", 3), "values"),
        (lambda: CompositeParamScheduler([1], [1.0], ["fixed"]), "schedulers\\[0\\]"),
    ],
)
def test_wrong_types_raise_type_error(build, match):
    with pytest.raises(TypeError, match=match):
        build()


# --- Python schedulers --------------------------------------------------------------------


class Quadratic(ParamScheduler):
    """A user's schedule: evaluated in Python."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, where: float) -> float:
        self.calls += 1
        return (1 - where) ** 2


class LoudCosine(CosineParamScheduler):
    """A built-in subclass that overrides __call__: its own __call__ must be used."""

    def __call__(self, where: float) -> float:
        return 2 * super().__call__(where)


def test_python_subclass_is_called():
    q = Quadratic()
    assert native_schedule(q) is None
    assert q(0.5) == 0.25
    loud = LoudCosine(1.0, 0.0)
    assert native_schedule(loud) is None
    assert loud(0.0) == 2.0
    assert native_schedule(CosineParamScheduler(1.0, 0.0)) is not None


def test_base_class_must_be_overridden():
    with pytest.raises(NotImplementedError):
        ParamScheduler()(0.5)


def test_composite_with_python_part_falls_back_to_python():
    q = Quadratic()
    sched = CompositeParamScheduler(
        [ConstantParamScheduler(0.5), q], [0.25, 0.75], ["rescaled", "fixed"]
    )
    assert native_schedule(sched) is None
    ref = d2.CompositeParamScheduler(
        [d2.ConstantParamScheduler(0.5), lambda w: (1 - w) ** 2],
        [0.25, 0.75],
        ["rescaled", "fixed"],
    )
    assert_same_everywhere(sched, ref)
    assert q.calls > 0
    # A native composite nested in a Python-backed one still works.
    outer = CompositeParamScheduler(
        [sched, CosineParamScheduler(1, 0)], [0.5, 0.5], ["rescaled"] * 2
    )
    outer_ref = d2.CompositeParamScheduler(
        [ref, d2.CosineParamScheduler(1, 0)], [0.5, 0.5], ["rescaled"] * 2
    )
    assert_same_everywhere(outer, outer_ref)


def test_warmup_over_python_scheduler():
    q = Quadratic()
    for method in ("linear", "constant"):
        for rescale in (False, True):
            sched = WarmupParamScheduler(q, 0.01, 0.1, method, rescale)
            assert native_schedule(sched) is None
            ref = d2.WarmupParamScheduler(lambda w: (1 - w) ** 2, 0.01, 0.1, method, rescale)
            assert_same_everywhere(sched, ref)


def test_python_scheduler_errors_pass_through():
    class Broken(ParamScheduler):
        def __call__(self, where: float) -> float:
            raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        WarmupParamScheduler(Broken(), 0.1, 0.1)


# --- copies -------------------------------------------------------------------------------


def test_pickle_and_deepcopy_keep_values():
    scheds = [
        WarmupParamScheduler(
            MultiStepParamScheduler([1, 0.1, 0.01], milestones=[600, 800], num_updates=1000),
            0.001,
            0.01,
        ),
        StepWithFixedGammaParamScheduler(0.1, 3, 0.1, 120),
        StepParamScheduler(10, [1, 0.5]),
        PolynomialDecayParamScheduler(0.1, 0.9),
        ExponentialParamScheduler(2.0, 0.02),
    ]
    for sched in scheds:
        for clone in (pickle.loads(pickle.dumps(sched)), copy.deepcopy(sched)):
            assert type(clone) is type(sched)
            assert clone._native == sched._native
            assert_same_everywhere(clone, sched, WHERES[:200])


def test_native_schedule_surface():
    s = _core.NativeSchedule.cosine(1.0, 0.0)
    assert s(0.5) == s.value(0.5) == s.value(where=0.5)
    assert s.params == {"kind": "cosine", "start_value": 1.0, "end_value": 0.0}
    assert "cosine" in repr(s)
    spans = _core.CompositeSpans([0.3, 0.7], ["rescaled", "fixed"])
    assert spans.locate(0.5) == (1, 0.5)
    assert len(spans) == 2
    assert (
        repr(spans) == "CompositeSpans(lengths=[0.3, 0.7], interval_scaling=['rescaled', 'fixed'])"
    )
    with pytest.raises(ValueError, match="cannot restore NativeSchedule: unknown kind"):
        _core.NativeSchedule._from_params({"kind": "nope"})
    with pytest.raises(ValueError, match="cannot restore NativeSchedule: params have no"):
        _core.NativeSchedule._from_params({"kind": "cosine"})


# --- no panic escapes ---------------------------------------------------------------------

_GARBAGE = [
    0,
    1,
    -1,
    2,
    0.5,
    -0.5,
    1e308,
    -1e308,
    5e-324,
    float("nan"),
    float("inf"),
    -float("inf"),
    2**63,
    -(2**63) - 1,
    True,
    None,
    "1",
    [],
    [1.0],
    (0.5, 0.5),
]


def test_garbage_never_panics():
    """Random bad input raises an ordinary exception: a Rust panic (PanicException, a
    BaseException) would escape the `except Exception` and fail this test."""
    rng = random.Random(1)
    builders = [
        lambda a, b, c, d: _core.NativeSchedule.constant(a),
        lambda a, b, c, d: _core.NativeSchedule.cosine(a, b),
        lambda a, b, c, d: _core.NativeSchedule.exponential(a, b),
        lambda a, b, c, d: _core.NativeSchedule.linear(a, b),
        lambda a, b, c, d: _core.NativeSchedule.polynomial_decay(a, b),
        lambda a, b, c, d: _core.NativeSchedule.multi_step([a, b], c, d),
        lambda a, b, c, d: _core.NativeSchedule.multi_step(d, c),
        lambda a, b, c, d: _core.NativeSchedule.step(a, d),
        lambda a, b, c, d: _core.NativeSchedule.step_with_fixed_gamma(a, b, c, d),
        lambda a, b, c, d: _core.NativeSchedule.composite(
            [_core.NativeSchedule.constant(1.0)] * 2, _core.CompositeSpans(d, ["rescaled"] * 2)
        ),
        lambda a, b, c, d: _core.warmup_parts(_core.NativeSchedule.cosine(1, 0), a, b),
    ]
    built = 0
    for _ in range(3000):
        args = [rng.choice(_GARBAGE) for _ in range(4)]
        try:
            sched = rng.choice(builders)(*args)
        except Exception:
            continue
        built += 1
        if not isinstance(sched, _core.NativeSchedule):
            continue
        for w in (rng.choice(_GARBAGE), rng.random(), -rng.random(), 1.0):
            try:
                sched(w)
                sched.multiplier(rng.choice([-1, 0, 5, 10, 2**40]), rng.choice([-1, 0, 10]))
                sched.step_lrs([{"lr": 1.0}], [rng.choice(_GARBAGE)], 1, 10)
            except Exception:
                pass
    assert built > 100
