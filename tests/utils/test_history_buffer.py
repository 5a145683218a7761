"""``HistoryBuffer`` against fvcore's behaviour, through the public API: the property tests run
against the reference model and against the real fvcore alike."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, List

import numpy as np
import pytest
import torch
from compat.d2 import HistoryBuffer as RefHistoryBuffer
from hookloop.utils.events import HistoryBuffer
from hypothesis import given, settings
from hypothesis import strategies as st

try:  # the real fvcore, a test dependency: the reference model and fvcore are checked alike
    from fvcore.common.history_buffer import HistoryBuffer as FvcoreHistoryBuffer
except ImportError:  # pragma: no cover - installed by the "test" extra
    FvcoreHistoryBuffer = None

REFERENCES = [
    pytest.param(RefHistoryBuffer, id="model"),
    pytest.param(
        FvcoreHistoryBuffer,
        id="fvcore",
        marks=pytest.mark.skipif(FvcoreHistoryBuffer is None, reason="fvcore is not installed"),
    ),
]


def same(a: float, b: float) -> bool:
    """Identical floats: NaN equals NaN, and the sign of zero counts (no tolerance)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def assert_matches(h: HistoryBuffer, ref: Any, windows: List[int]) -> None:
    got = h.values()
    want = ref.values()
    assert len(got) == len(want) == len(h)
    for (gv, gi), (wv, wi) in zip(got, want):
        assert same(gv, wv)
        assert gi == wi
    assert same(h.global_avg(), ref.global_avg())
    if want:
        assert same(h.latest(), ref.latest())
    for w in windows:
        assert same(h.median(w), quiet(ref.median, w)), w
        assert same(h.avg(w), quiet(ref.avg, w)), w


def quiet(f: Callable[[int], Any], w: int) -> float:
    """The model's ``f(w)`` as a float, without numpy's warning on an empty window (fvcore warns
    and returns NaN). hookloop's calls stay outside, where a warning would fail the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(f(w))


# --- basics -------------------------------------------------------------------------------------


def test_update_latest_and_default_iteration_is_running_count():
    h = HistoryBuffer()
    h.update(1.0)
    h.update(2.0)
    h.update(5.0, 10)
    h.update(7.0)  # default iteration is the number of updates so far, not last + 1
    assert h.values() == [(1.0, 0), (2.0, 1), (5.0, 10), (7.0, 3)]
    assert h.latest() == 7.0
    assert len(h) == 4
    assert h._count == 4


def test_median_avg_global_avg_small():
    h = HistoryBuffer()
    for v in [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]:
        h.update(v)
    assert h.median(5) == 3.0  # [1, 4, 2, 3, 10]
    assert h.median(6) == 3.5
    assert h.median(2) == 6.5
    assert h.median(1) == 10.0
    assert h.median(1000) == 3.5  # window larger than the buffer: everything
    assert h.avg(2) == 6.5
    assert h.avg(6) == 25.0 / 6
    assert h.global_avg() == pytest.approx(25.0 / 6)


def test_max_length_default_and_custom():
    assert HistoryBuffer().max_length == 1_000_000
    h = HistoryBuffer(max_length=7)
    assert h.max_length == 7
    assert h._max_length == 7


def test_ring_wraps_and_global_avg_includes_evicted():
    h = HistoryBuffer(max_length=3)
    for i in range(10):
        h.update(float(i))
    assert h.values() == [(7.0, 7), (8.0, 8), (9.0, 9)]
    assert len(h) == 3
    assert h._count == 10
    assert h.latest() == 9.0
    assert h.median(100) == 8.0
    assert h.avg(100) == 8.0
    assert h.global_avg() == pytest.approx(4.5)  # mean of 0..9, not of 7..9


def test_max_length_one():
    h = HistoryBuffer(max_length=1)
    for i in range(5):
        h.update(float(i), 100 + i)
    assert h.values() == [(4.0, 104)]
    assert h.median(3) == 4.0
    assert h.global_avg() == pytest.approx(2.0)


def test_values_types_ints_stay_ints():
    h = HistoryBuffer()
    h.update(3)  # an int value is stored as a float
    h.update(2.5, 7)
    h.update(np.float32(1.5), np.int64(9))
    vals = h.values()
    assert vals == [(3.0, 0), (2.5, 7), (1.5, 9)]
    assert all(type(v) is float for v, _ in vals)
    assert all(type(it) is int for _, it in vals)


def test_float_iterations_read_back():
    h = HistoryBuffer()
    h.update(1.0, 0.5)
    h.update(2.0, 1.75)
    assert h.values() == [(1.0, 0.5), (2.0, 1.75)]


def test_float_iteration_read_back_exactly():
    # 0.1 - 1.1 rounds to exactly -1.0; the iteration must still read back as 0.1.
    h = HistoryBuffer()
    h.update(1.0, 1.1)
    h.update(2.0, 0.1)
    assert h.values() == [(1.0, 1.1), (2.0, 0.1)]


def test_nan_and_inf_are_stored():
    h = HistoryBuffer()
    h.update(1.0)
    h.update(float("inf"))
    assert h.latest() == float("inf")
    assert h.median(2) == float("inf")
    assert h.avg(2) == float("inf")
    h.update(float("nan"))
    assert math.isnan(h.latest())
    assert math.isnan(h.median(3))
    assert math.isnan(h.avg(1))
    assert math.isnan(h.median(2))  # [inf, nan]
    assert math.isnan(h.global_avg())
    h.update(float("-inf"))
    assert h.values()[-1][0] == float("-inf")
    assert len(h) == 4


@pytest.mark.parametrize("n", [1, 2])
def test_median_of_negative_zeros_is_positive_zero_like_numpy(n):
    # np.median ends with a mean, which turns -0.0 into 0.0 (np.median([-0.0]) is 0.0).
    h = HistoryBuffer()
    for _ in range(n):
        h.update(-0.0)
    assert h.latest() == 0.0 and math.copysign(1.0, h.latest()) == -1.0  # stored as given
    assert same(h.median(n), float(np.median([-0.0] * n)))
    assert math.copysign(1.0, h.median(n)) == 1.0
    assert same(h.avg(n), float(np.mean([-0.0] * n)))


def test_empty_buffer():
    h = HistoryBuffer()
    with pytest.raises(IndexError):
        h.latest()
    assert math.isnan(h.median(3))
    assert math.isnan(h.avg(3))
    assert h.global_avg() == 0.0
    assert h.values() == []
    assert len(h) == 0


@pytest.mark.parametrize("window", [0, -1, -20])
def test_bad_window_is_value_error(window):
    h = HistoryBuffer()
    h.update(1.0)
    with pytest.raises(ValueError, match="window_size"):
        h.median(window)
    with pytest.raises(ValueError, match="window_size"):
        h.avg(window)


@pytest.mark.parametrize("max_length", [0, -3])
def test_bad_max_length_is_value_error(max_length):
    with pytest.raises(ValueError, match="max_length"):
        HistoryBuffer(max_length)


@pytest.mark.parametrize(
    "bad",
    [
        "1.0",
        None,
        [1.0],
        (1.0,),
        torch.zeros(2, 2),
        torch.zeros(2),
        np.zeros((2, 2)),
        np.zeros(3),
        object(),
    ],
    ids=["str", "None", "list", "tuple", "tensor2d", "tensor1d", "ndarray2d", "ndarray1d", "obj"],
)
def test_non_number_value_is_type_error_and_stores_nothing(bad):
    h = HistoryBuffer()
    h.update(1.0)
    with pytest.raises(TypeError):
        h.update(bad)
    assert h.values() == [(1.0, 0)]
    assert h._count == 1


@pytest.mark.parametrize(
    "value",
    [
        2,
        True,
        np.float64(2.0),
        np.float32(2.0),
        np.int64(2),
        np.array(2.0),
        torch.tensor(2.0),
        torch.tensor(2.0, requires_grad=True),
        torch.tensor(2, dtype=torch.int32),
    ],
    ids=["int", "bool", "f64", "f32", "i64", "array0d", "tensor0d", "tensor_grad", "tensor_int"],
)
def test_scalar_like_values_are_accepted(value):
    h = HistoryBuffer()
    h.update(value)
    assert h.latest() == (1.0 if value is True else 2.0)
    assert type(h.latest()) is float


def test_bad_iteration_is_type_error():
    h = HistoryBuffer()
    with pytest.raises(TypeError, match="iteration"):
        h.update(1.0, "3")
    with pytest.raises(TypeError, match="iteration"):
        h.update(1.0, True)
    assert len(h) == 0


# --- properties against the reference model -----------------------------------------------------

values_st = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1e6, 1e6),
    st.integers(-1000, 1000),
)
iteration_st = st.one_of(st.none(), st.integers(-(10**6), 10**6))


@pytest.mark.parametrize("Ref", REFERENCES)
@settings(max_examples=200, deadline=None)
@given(
    updates=st.lists(st.tuples(values_st, iteration_st), max_size=60),
    max_length=st.integers(1, 40),
    windows=st.lists(st.integers(1, 80), min_size=1, max_size=5),
)
def test_matches_reference_model(Ref, updates, max_length, windows):
    h = HistoryBuffer(max_length)
    ref = Ref(max_length)
    for v, it in updates:
        h.update(v, it)
        ref.update(float(v), it)
    assert_matches(h, ref, windows + [10**9])
    # Iterations given as ints (or defaulted) read back as ints.
    assert all(type(it) is int for _, it in h.values())


@pytest.mark.parametrize("Ref", REFERENCES)
@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(0, 700),
    max_length=st.integers(1, 600),
    scale=st.sampled_from([1e-3, 1.0, 1e8, 1e300]),
    seed=st.integers(0, 2**32 - 1),
    windows=st.lists(st.integers(1, 700), min_size=1, max_size=4),
)
def test_long_windows_match_numpy_exactly(Ref, n, max_length, scale, seed, windows):
    # Long windows exercise numpy's pairwise summation (blocks of 8, halves above 128) and the
    # wrapped ring (the window spans the end of the ring storage).
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal(n) * scale).tolist()
    h = HistoryBuffer(max_length)
    ref = Ref(max_length)
    for v in data:
        h.update(v)
        ref.update(v)
    assert_matches(h, ref, windows + [max_length, 10**9])


@pytest.mark.parametrize("Ref", REFERENCES)
@settings(max_examples=150, deadline=None)
@given(
    updates=st.lists(
        st.tuples(
            st.floats(-10, 10),
            st.one_of(
                st.integers(-1000, 1000),
                st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False),
            ),
        ),
        max_size=40,
    ),
    max_length=st.integers(1, 20),
)
def test_float_iterations_match_reference(Ref, updates, max_length):
    h = HistoryBuffer(max_length)
    ref = Ref(max_length)
    for v, it in updates:
        h.update(v, it)
        ref.update(v, it)
    assert_matches(h, ref, [1, 3, max_length])
