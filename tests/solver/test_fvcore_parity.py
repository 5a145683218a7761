"""Bit-for-bit parity with the real fvcore (a test dependency; skipped where it is missing,
and then tests/solver/test_param_scheduler.py's formulas still check the schedules)."""

from __future__ import annotations

import math
import random

import pytest
from hookloop.solver import WarmupParamScheduler
from hookloop.solver import param_scheduler as H

F = pytest.importorskip("fvcore.common.param_scheduler")


def outcome(f, where):
    try:
        return float(f(where)).hex()
    except Exception:
        return "raises"


def fvcore_warmup(s, factor, length, method, rescale):
    # detectron2's WarmupParamScheduler, built from fvcore's own classes.
    end = s(0.0) if rescale else s(length)
    start = factor * s(0.0)
    if method == "constant":
        warmup = F.ConstantParamScheduler(start)
    else:
        warmup = F.LinearParamScheduler(start, end)
    scaling = ["rescaled", "rescaled" if rescale else "fixed"]
    return F.CompositeParamScheduler([warmup, s], [length, 1 - length], scaling)


def test_random_schedules_match_fvcore():
    rng = random.Random(7)
    wheres = [rng.random() for _ in range(500)] + [i / 1000 for i in range(1001)]
    pairs = []
    for _ in range(20):
        a, b = rng.uniform(-2, 2), rng.uniform(0.001, 3)
        for name in ("Cosine", "Linear", "Exponential", "PolynomialDecay"):
            cls = f"{name}ParamScheduler"
            pairs.append((getattr(F, cls)(a, b), getattr(H, cls)(a, b)))
        n, k = rng.randint(5, 100000), rng.randint(1, 5)
        values = [rng.random() for _ in range(k)]
        pairs.append((F.MultiStepParamScheduler(values, n), H.MultiStepParamScheduler(values, n)))
        pairs.append((F.StepParamScheduler(n, values), H.StepParamScheduler(n, values)))
        g = rng.random()
        pairs.append(
            (
                F.StepWithFixedGammaParamScheduler(b, k, g, n),
                H.StepWithFixedGammaParamScheduler(b, k, g, n),
            )
        )
        cut = sorted(rng.random() for _ in range(2))
        lengths = [cut[0], cut[1] - cut[0], 1 - cut[1]]
        scaling = [rng.choice(["rescaled", "fixed"]) for _ in range(3)]

        def parts(m):
            return [
                m.CosineParamScheduler(1, 0),
                m.LinearParamScheduler(0.5, 2),
                m.MultiStepParamScheduler([1, 0.1], 10),
            ]

        pairs.append(
            (
                F.CompositeParamScheduler(parts(F), list(lengths), scaling),
                H.CompositeParamScheduler(parts(H), list(lengths), scaling),
            )
        )
        length, method, rescale = rng.random() * 0.2, rng.choice(["linear", "constant"]), k > 2
        inner = dict(values=[1, 0.1, 0.01], milestones=[600, 800], num_updates=1000)
        pairs.append(
            (
                fvcore_warmup(F.MultiStepParamScheduler(**inner), 0.001, length, method, rescale),
                WarmupParamScheduler(
                    H.MultiStepParamScheduler(**inner), 0.001, length, method, rescale
                ),
            )
        )
    for theirs, ours in pairs:
        assert ours._native is not None
        bad = [w for w in wheres if outcome(theirs, w) != outcome(ours, w)]
        assert not bad, (type(ours).__name__, bad[:3])


@pytest.mark.parametrize("where", [1.5, -0.1, 2.0, float("nan")])
def test_a_cosine_outside_its_range_continues_as_fvcores(where):
    """fvcore's cosine takes any finite ``where`` (and NaN): hookloop's gives the same values."""
    ours = H.CosineParamScheduler(0.1, 0.001)(where)
    theirs = F.CosineParamScheduler(0.1, 0.001)(where)
    assert (ours == theirs) or (math.isnan(ours) and math.isnan(theirs))


@pytest.mark.parametrize("where", [float("inf"), -float("inf")])
def test_an_infinite_where_is_fvcores_value_error_naming_where(where):
    with pytest.raises(ValueError):
        F.CosineParamScheduler(0.1, 0.001)(where)  # math domain error
    with pytest.raises(
        ValueError, match=r"where in CosineParamScheduler must be finite.*got -?inf"
    ):
        H.CosineParamScheduler(0.1, 0.001)(where)


@pytest.mark.parametrize("lengths", [[1.5, -0.5], [-0.25, 1.25], [1.0005, 0.0]])
def test_a_negative_composite_length_is_refused_where_fvcore_takes_it(lengths):
    """fvcore builds a composite with a negative length (the sum is 1) and maps ``where``
    backwards through it; hookloop refuses it, naming the length."""
    parts = [F.ConstantParamScheduler(1.0), F.ConstantParamScheduler(2.0)]
    F.CompositeParamScheduler(parts, list(lengths), ["rescaled", "rescaled"])
    ours = [H.ConstantParamScheduler(1.0), H.ConstantParamScheduler(2.0)]
    with pytest.raises(ValueError, match=r"lengths\[\d\] must be >= 0"):
        H.CompositeParamScheduler(ours, list(lengths), ["rescaled", "rescaled"])
