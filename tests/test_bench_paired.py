"""``hookloop.bench.paired``: loops in processes of their own, taking turns of a window of
steps. Tiny sizes; no timing is asserted."""

from __future__ import annotations

import statistics

import pytest
from hookloop.bench import paired


def test_every_variant_reports_one_window_per_round_after_the_warmup() -> None:
    ticks = []
    variants = [paired.HAND, paired.HAND_BOOKKEEPING, paired.Variant("hl", "stack")]
    res = paired.run(variants, window=3, rounds=4, warmup=2, tick=lambda: ticks.append(1))
    assert list(res) == variants
    assert all(len(res[v]) == 4 and all(t > 0 for t in res[v]) for v in variants)
    assert len(ticks) == 4  # one per timed round
    r = paired.ratios(res, paired.HAND, variants[2])
    assert r == [h / t for h, t in zip(res[paired.HAND], res[variants[2]])]


def test_a_variant_that_fails_is_a_runtime_error_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)Variant\(impl='hl', hooks='bogus'\) failed.*"
                       r"hooks must be 'none', 'stack' or 'native'"):  # fmt: skip
        paired.run([paired.HAND, paired.Variant("hl", "bogus")], window=2, rounds=1, warmup=0)


@pytest.mark.parametrize(
    "kwargs", [{"window": 0}, {"rounds": 0}, {"warmup": -1}], ids=["window", "rounds", "warmup"]
)
def test_bad_sizes_are_value_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="window and rounds must be positive"):
        paired.run([paired.HAND], **kwargs)


def test_the_same_variant_twice_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="variants must differ"):
        paired.run([paired.HAND, paired.HAND], rounds=1)


def test_median_ci_brackets_the_median_and_repeats_itself() -> None:
    values = [1.0, 0.9, 1.1, 0.95, 1.05, 1.2, 0.8, 1.0, 0.97]
    lo, hi = paired.median_ci(values)
    assert lo <= statistics.median(values) <= hi
    assert (lo, hi) == paired.median_ci(values)
    assert paired.median_ci([2.0]) == (2.0, 2.0)
    with pytest.raises(ValueError, match="at least one value"):
        paired.median_ci([])
