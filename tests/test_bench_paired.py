"""``lab.paired`` (``benches/lab/paired.py``): loops in processes of their own, taking turns of
a window of steps. Tiny sizes; no timing is asserted."""

from __future__ import annotations

import random
import statistics
from typing import Any

import numpy as np
import pytest
from lab import paired


def test_every_process_reports_one_window_per_round_after_the_warmup() -> None:
    ticks = []
    variants = [paired.HAND, paired.HAND_BOOKKEEPING, paired.Variant("hl", "stack")]
    res = paired.run(
        variants, window=3, rounds=4, warmup=2, replicas=2, tick=lambda: ticks.append(1)
    )
    assert list(res) == variants
    for v in variants:
        assert len(res[v]) == 2  # processes
        assert all(len(w) == 4 and all(t > 0 for t in w) for w in res[v])
    assert len(ticks) == 4  # one per timed round
    # a round's time of a loop is the mean over its processes; ratios are formed per round
    hand = [(a + b) / 2 for a, b in zip(*res[paired.HAND])]
    assert paired.windows(res, paired.HAND) == pytest.approx(hand)
    stack = [(a + b) / 2 for a, b in zip(*res[variants[2]])]
    r = paired.ratios(res, paired.HAND, variants[2])
    assert r == pytest.approx([h / t for h, t in zip(hand, stack)])


def test_a_variant_that_fails_is_a_runtime_error_with_its_traceback() -> None:
    named = r"Variant\(impl='hl', hooks='bogus', period=20, writers=\(\)\) failed"
    with pytest.raises(RuntimeError, match=rf"(?s){named}.*hooks must be 'none', 'stack'"):
        paired.run([paired.HAND, paired.Variant("hl", "bogus")], window=2, rounds=1, warmup=0)


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 0}, {"rounds": 0}, {"warmup": -1}, {"replicas": 0}],
    ids=["window", "rounds", "warmup", "replicas"],
)
def test_bad_sizes_are_value_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="window, rounds and replicas must be positive"):
        paired.run([paired.HAND], **kwargs)


def test_the_same_variant_twice_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="variants must differ"):
        paired.run([paired.HAND, paired.HAND], rounds=1)


A, B = paired.Variant("hand"), paired.Variant("hl")


def test_ratio_ci_brackets_the_median_ratio_and_repeats_itself() -> None:
    rnd = random.Random(1)
    times = {
        A: [[1.0 + 0.1 * rnd.random() for _ in range(50)] for _ in range(3)],
        B: [[1.1 + 0.1 * rnd.random() for _ in range(50)] for _ in range(3)],
    }
    lo, hi = paired.ratio_ci(times, A, B)
    assert lo < statistics.median(paired.ratios(times, A, B)) < hi < 1.0
    assert (lo, hi) == paired.ratio_ci(times, A, B)
    assert paired.ratio_ci(times, A, A) == (1.0, 1.0)  # a loop against itself
    with pytest.raises(ValueError, match="at least one round"):
        paired.ratio_ci({A: [[]], B: [[]]}, A, B)
    with pytest.raises(ValueError, match="3 rounds of .* 2 of"):
        paired.ratio_ci({A: [[1.0] * 3], B: [[1.0] * 2]}, A, B)


def test_ratio_ci_covers_the_spread_between_processes_not_only_the_rounds() -> None:
    # Every round alike, but B's two processes run at different speeds: resampling only the
    # rounds would give a zero-width interval; resampling the processes gives their spread.
    times = {A: [[1.0] * 40, [1.0] * 40], B: [[1.0] * 40, [1.2] * 40]}
    lo, hi = paired.ratio_ci(times, A, B)
    assert lo == pytest.approx(1 / 1.2) and hi == pytest.approx(1.0)
    assert paired.ratios(times, A, B) == pytest.approx([1 / 1.1] * 40)
    one = {A: [[1.0] * 40], B: [[1.1] * 40]}  # one process each: the rounds' noise only
    assert paired.ratio_ci(one, A, B) == pytest.approx((1 / 1.1, 1 / 1.1))


def test_bootstrap_ci_of_a_statistic_of_three_loops() -> None:
    # C costs 0.3 over A in every round and B 0.1: the ratio of their costs over A is 3
    # whatever is resampled; B named twice is drawn once (its two arguments are the same).
    C = paired.Variant("hl", "stack")
    times = {A: [[1.0] * 30] * 2, B: [[1.1] * 30] * 2, C: [[1.3] * 30] * 2}

    def over(a: Any, b: Any, c: Any) -> float:
        return float(np.median(c - a) / np.median(b - a))

    lo, hi = paired.bootstrap_ci(times, [A, B, C], over)
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
    two = {B: [[1.0] * 30, [1.2] * 30]}  # B's processes differ: drawn twice, x and y would
    assert paired.bootstrap_ci(two, [B, B], lambda x, y: float(np.max(np.abs(x - y)))) == (
        0.0,
        0.0,
    )
    with pytest.raises(ValueError, match="30 rounds of .* 2 of"):
        paired.bootstrap_ci({**times, C: [[1.0] * 2]}, [A, C], over)
