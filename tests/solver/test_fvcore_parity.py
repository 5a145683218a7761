"""Bit-for-bit parity with the real fvcore (a test dependency; skipped where it is missing,
and then tests/solver/test_param_scheduler.py's formulas still check the schedules)."""

from __future__ import annotations

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
