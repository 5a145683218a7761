"""``EventStorage`` against detectron2's behaviour, through the public API."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from compat.d2 import EventStorage as RefStorage
from hookloop.utils.events import (
    EventStorage,
    HistoryBuffer,
    get_event_storage,
    has_event_storage,
)
from hypothesis import given, settings
from hypothesis import strategies as st

LOGGER = "hookloop.utils.events"


def detectron2_histogram(name: str, t: torch.Tensor, bins: int, it: int) -> Dict[str, Any]:
    """detectron2's ``EventStorage.put_histogram`` parameters (``compat.d2``'s model)."""
    ref = RefStorage(it)
    ref.put_histogram(name, t, bins=bins)
    (params,) = ref._histograms
    return params


def same(a: float, b: float) -> bool:
    """Identical floats: NaN equals NaN, and the sign of zero counts (no tolerance)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def assert_same_pairs(got: Dict[str, Tuple[float, Any]], want: Dict[str, Tuple[float, Any]]):
    assert list(got) == list(want)
    for k in want:
        assert same(got[k][0], want[k][0]), k
        assert got[k][1] == want[k][1], k
        assert type(got[k][1]) is type(want[k][1]), k


# --- put_scalar / put_scalars --------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (1.5, 1.5),
        (3, 3.0),
        (True, 1.0),
        (np.float32(0.25), 0.25),
        (np.float64(2.5), 2.5),
        (np.int64(7), 7.0),
        (np.array(4.5), 4.5),
        (torch.tensor(0.5), 0.5),
        (torch.tensor(6, dtype=torch.int64), 6.0),
        (torch.tensor(1.25, requires_grad=True), 1.25),
        (torch.tensor(2.0, requires_grad=True) * 3, 6.0),
        (float("nan"), float("nan")),
        (float("inf"), float("inf")),
    ],
    ids=lambda x: type(x).__name__,
)
def test_put_scalar_value_kinds(storage, value, expected):
    storage.put_scalar("m", value)
    v, it = storage.latest()["m"]
    assert type(v) is float
    assert same(v, expected)
    assert it == 0
    assert same(storage.history("m").latest(), expected)


def test_put_scalars_value_kinds(storage):
    storage.put_scalars(
        a=1.0, b=2, c=np.float32(3.0), d=torch.tensor(4.0, requires_grad=True), e=np.array(5)
    )
    assert storage.latest() == {k: (float(i), 0) for i, k in enumerate("abcde", start=1)}
    assert storage.smoothing_hints() == dict.fromkeys("abcde", True)


def test_put_scalars_hint_and_cur_iter(storage):
    storage.put_scalars(smoothing_hint=False, cur_iter=9, lr=0.1, wd=1e-4)
    assert storage.latest() == {"lr": (0.1, 9), "wd": (1e-4, 9)}
    assert storage.smoothing_hints() == {"lr": False, "wd": False}
    storage.put_scalars()  # nothing to put is fine
    assert list(storage.latest()) == ["lr", "wd"]


@pytest.mark.parametrize(
    "bad",
    ["1.0", None, [1.0], torch.zeros(2), torch.zeros(2, 1), np.zeros(3), object()],
    ids=["str", "None", "list", "tensor1d", "tensor2d", "ndarray1d", "object"],
)
def test_bad_value_is_type_error_naming_metric_and_keeps_earlier_values(storage, bad):
    storage.put_scalar("loss_cls", 1.0)
    storage.step()
    storage.put_scalars(loss_box=2.0, acc=0.5)
    before = {k: h.values() for k, h in storage.histories().items()}
    latest_before = storage.latest()

    with pytest.raises(TypeError, match="loss_cls"):
        storage.put_scalar("loss_cls", bad)
    with pytest.raises(TypeError, match="new_metric"):
        storage.put_scalar("new_metric", bad)

    assert {k: h.values() for k, h in storage.histories().items()} == before
    assert storage.latest() == latest_before
    assert "new_metric" not in storage.latest()

    # put_scalars stores the values before the bad one, as detectron2's loop of put_scalar does.
    with pytest.raises(TypeError, match="loss_box"):
        storage.put_scalars(acc=0.75, loss_box=bad)
    assert storage.history("acc").values() == before["acc"] + [(0.75, 1)]
    assert storage.history("loss_box").values() == before["loss_box"]
    # The storage is still usable.
    storage.put_scalar("loss_cls", 3.0)
    assert storage.history("loss_cls").values() == [(1.0, 0), (3.0, 1)]


@pytest.mark.parametrize("bad_iter", ["3", True, [1]])
def test_bad_cur_iter_is_type_error(storage, bad_iter):
    with pytest.raises(TypeError, match="cur_iter"):
        storage.put_scalar("x", 1.0, cur_iter=bad_iter)
    with pytest.raises(TypeError, match="cur_iter"):
        storage.put_scalars(cur_iter=bad_iter, x=1.0)
    assert storage.latest() == {}


def test_cur_iter_overrides_iteration(storage):
    storage.iter = 5
    storage.put_scalar("a", 1.0, cur_iter=3)
    storage.put_scalar("a", 2.0, cur_iter=np.int64(4))
    storage.put_scalar("a", 3.0)
    assert storage.history("a").values() == [(1.0, 3), (2.0, 4), (3.0, 5)]
    assert storage.latest()["a"] == (3.0, 5)
    assert type(storage.latest()["a"][1]) is int
    # latest is the last put even when cur_iter goes backwards.
    storage.put_scalar("a", 4.0, cur_iter=1)
    assert storage.latest()["a"] == (4.0, 1)


def test_hint_change_is_value_error_naming_metric_and_hints(storage):
    storage.put_scalar("lr", 0.1, smoothing_hint=False)
    with pytest.raises(ValueError) as info:
        storage.put_scalar("lr", 0.2, smoothing_hint=True)
    msg = str(info.value).lower()
    assert "lr" in msg and "true" in msg and "false" in msg
    with pytest.raises(ValueError, match="lr"):
        storage.put_scalars(smoothing_hint=True, lr=0.3)
    assert storage.smoothing_hints() == {"lr": False}
    assert storage.latest()["lr"] == (0.1, 0)
    storage.put_scalar("lr", 0.4, smoothing_hint=False)
    assert storage.latest()["lr"] == (0.4, 0)


@pytest.mark.parametrize("hint", [None, 0, 0.0, "", np.bool_(False)])
def test_a_falsy_smoothing_hint_is_false_as_detectron2_reads_it(hint):
    """detectron2 reads the hint for its truth (``if self._smoothing_hints[k]``): ``None``
    was refused here ('NoneType' object cannot be converted to 'PyBool')."""
    ours, ref = EventStorage(0), RefStorage(0)
    for it, value in enumerate([3.0, 1.0, 2.0]):
        ours.iter = ref.iter = it
        for s in (ours, ref):
            s.put_scalar("lr", value, smoothing_hint=hint)
            s.put_scalars(smoothing_hint=hint, wd=value * 2)
    assert ours.smoothing_hints() == {"lr": False, "wd": False}
    assert_same_pairs(ours.latest_with_smoothing_hint(20), ref.latest_with_smoothing_hint(20))
    ours.put_scalar("lr", 4.0, smoothing_hint=False)  # the same hint as before


@pytest.mark.parametrize("hint", [1, "yes", [0], np.bool_(True)])
def test_a_truthy_smoothing_hint_is_true(storage, hint):
    storage.put_scalar("loss", 1.0, smoothing_hint=hint)
    storage.put_scalars(smoothing_hint=hint, time=0.5)
    assert storage.smoothing_hints() == {"loss": True, "time": True}


@pytest.mark.parametrize("name", [5, None, b"loss", ("a",)])
def test_a_name_that_is_not_a_str_is_a_type_error_naming_the_argument(storage, name):
    """Was "'int' object is not an instance of 'str'", naming no argument."""
    with pytest.raises(TypeError, match=r"put_scalar\(\) name must be a str, got "):
        storage.put_scalar(name, 1.0)
    assert storage.latest() == {}


def test_bad_constructor_arguments():
    for kw in ("max_length", "max_images", "max_histograms"):
        with pytest.raises(ValueError, match=kw):
            EventStorage(**{kw: 0})


# --- iteration ---------------------------------------------------------------------------------


def test_iter_step_and_setter():
    s = EventStorage(start_iter=10)
    assert s.iter == 10 and s.iteration == 10
    s.step()
    assert s.iter == 11 and s.iteration == 11
    s.put_scalar("x", 1.0)
    assert s.latest()["x"] == (1.0, 11)
    s.iter = 100
    assert s.iter == 100 and s.iteration == 100
    s.iter = np.int64(7)
    assert s.iter == 7
    s.iter = 8.0  # an integral float is accepted
    assert s.iter == 8 and type(s.iter) is int
    for bad in (1.5, "3", None):
        with pytest.raises(TypeError):
            s.iter = bad
    assert s.iter == 8


# --- history / histories / latest ---------------------------------------------------------------


def test_history_unknown_name_is_key_error(storage):
    storage.put_scalar("loss", 1.0)
    with pytest.raises(KeyError) as info:
        storage.history("los")
    assert info.value.args[0] == "No history metric available for los!"


def test_history_and_histories_are_live(storage):
    for i in range(5):
        storage.iter = i
        storage.put_scalars(loss=float(i), acc=float(-i))
    hist = storage.histories()
    assert isinstance(hist, dict)
    assert list(hist) == ["loss", "acc"]
    assert all(isinstance(h, HistoryBuffer) for h in hist.values())
    loss = hist["loss"]
    view = storage.history("loss")
    assert loss.avg(20) == 2.0
    for i in range(5, 10):
        storage.iter = i
        storage.put_scalar("loss", float(i))
    # Views returned before the puts see them.
    assert loss.avg(20) == 4.5
    assert view.median(3) == 8.0
    assert len(loss) == 10
    assert loss.latest() == 9.0
    assert storage.histories()["acc"].values() == [(float(-i), i) for i in range(5)]
    # New names appear in later calls, and are found in a dict taken before their first put
    # (a hook that keeps storage.histories() from before_train), as the storage's own buffer.
    storage.put_scalar("new", 1.0)
    assert list(storage.histories()) == ["loss", "acc", "new"]
    assert hist["new"].latest() == 1.0
    storage.put_scalar("new", 2.0)
    assert hist["new"].latest() == 2.0


def test_latest_items_densepose_style(storage):
    storage.put_scalar("a", 1.0)
    storage.step()
    storage.put_scalar("b", 2.0, smoothing_hint=False)
    storage.put_scalar("a", 3.0)
    seen = {}
    for k, (v, it) in storage.latest().items():
        seen[k] = (v, it)
    assert seen == {"a": (3.0, 1), "b": (2.0, 1)}
    assert list(storage.latest()) == ["a", "b"]


def test_smoothing_hints(storage):
    storage.put_scalar("loss", 1.0)
    storage.put_scalar("lr", 0.1, smoothing_hint=False)
    storage.put_scalars(smoothing_hint=False, time=0.2)
    assert storage.smoothing_hints() == {"loss": True, "lr": False, "time": False}
    assert list(storage.smoothing_hints()) == ["loss", "lr", "time"]


# --- count_samples / latest_with_smoothing_hint -------------------------------------------------


def test_latest_with_smoothing_hint_counts_iterations_not_samples(storage):
    for i in range(30):
        storage.iter = i
        storage.put_scalar("loss", float(i))
        storage.put_scalar("lr", float(i), smoothing_hint=False)
        if i % 10 == 0:
            storage.put_scalar("sparse", float(i))  # iterations 0, 10, 20
    got = storage.latest_with_smoothing_hint(20)
    # loss: median over iterations 10..29; lr: latest; sparse: 20 and 10 lie in (0, 20].
    assert got == {"loss": (19.5, 29), "lr": (29.0, 29), "sparse": (15.0, 20)}
    assert storage.count_samples("loss", 20) == 20
    assert storage.count_samples("sparse", 20) == 2
    assert storage.count_samples("sparse", 10) == 1
    assert storage.count_samples("sparse", 1000) == 3
    assert storage.count_samples("loss") == 20  # default window 20
    assert storage.latest_with_smoothing_hint() == got  # default window 20
    assert storage.latest_with_smoothing_hint(1) == {
        "loss": (29.0, 29),
        "lr": (29.0, 29),
        "sparse": (20.0, 20),
    }


def test_count_samples_unknown_name_is_key_error_and_creates_nothing(storage):
    storage.put_scalar("loss", 1.0)
    with pytest.raises(KeyError, match="nope"):
        storage.count_samples("nope", 20)
    assert list(storage.histories()) == ["loss"]
    assert list(storage.latest()) == ["loss"]
    assert list(storage.latest_with_smoothing_hint(20)) == ["loss"]
    with pytest.raises(KeyError):
        storage.history("nope")


@pytest.mark.parametrize("window", [0, -1])
def test_bad_windows_are_value_errors(storage, window):
    storage.put_scalar("loss", 1.0)
    with pytest.raises(ValueError, match="window_size"):
        storage.latest_with_smoothing_hint(window)
    with pytest.raises(ValueError, match="window_size"):
        storage.count_samples("loss", window)


NAMES = {"loss": True, "lr": False, "acc": True}
value_st = st.one_of(st.floats(-1e3, 1e3), st.integers(-100, 100), st.just(float("nan")))
iter_st = st.one_of(st.none(), st.integers(-50, 300))
op_st = st.one_of(
    st.tuples(st.just("step")),
    st.tuples(st.just("set_iter"), st.integers(-20, 300)),
    st.tuples(st.just("put"), st.sampled_from(sorted(NAMES)), value_st, iter_st),
    st.tuples(
        st.just("puts"),
        st.sampled_from([True, False]),
        st.dictionaries(st.sampled_from(sorted(NAMES)), value_st, min_size=1),
        iter_st,
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(op_st, max_size=80),
    max_length=st.one_of(st.just(1000000), st.integers(1, 25)),
    windows=st.lists(st.integers(1, 120), min_size=1, max_size=4),
    start_iter=st.integers(-5, 5),
)
def test_smoothing_matches_detectron2(ops, max_length, windows, start_iter):
    s = EventStorage(start_iter, max_length=max_length)
    ref = RefStorage(start_iter, max_length=max_length)
    for op in ops:
        if op[0] == "step":
            s.step()
            ref.step()
        elif op[0] == "set_iter":
            s.iter = op[1]
            ref.iter = op[1]
        elif op[0] == "put":
            _, name, v, it = op
            s.put_scalar(name, v, smoothing_hint=NAMES[name], cur_iter=it)
            ref.put_scalar(name, v, smoothing_hint=NAMES[name], cur_iter=it)
        else:
            _, hint, kwargs, it = op
            # put_scalars takes one hint for all; only keep names whose hint matches.
            kwargs = {k: v for k, v in kwargs.items() if NAMES[k] == hint}
            s.put_scalars(smoothing_hint=hint, cur_iter=it, **kwargs)
            ref.put_scalars(smoothing_hint=hint, cur_iter=it, **kwargs)
    assert s.iter == ref.iter
    assert_same_pairs(s.latest(), ref.latest())
    assert s.smoothing_hints() == ref.smoothing_hints()
    for name, h in s.histories().items():
        got = h.values()
        want = ref.history(name).values()
        assert len(got) == len(want)
        assert all(same(g[0], w[0]) and g[1] == w[1] for g, w in zip(got, want))
    for w in windows:
        assert_same_pairs(s.latest_with_smoothing_hint(w), ref.latest_with_smoothing_hint(w))
        for name in ref.histories():
            assert s.count_samples(name, w) == ref.count_samples(name, w)


# --- name_scope ----------------------------------------------------------------------------------


def test_name_scope_prefixes_and_nests(storage):
    storage.put_scalar("a", 1.0)
    with storage.name_scope("val"):
        storage.put_scalar("acc", 0.5)
        with storage.name_scope("inner/"):
            storage.put_scalars(x=1.0)  # detectron2 replaces the prefix, it does not stack
        storage.put_scalar("loss", 2.0)
    storage.put_scalar("b", 3.0)
    assert list(storage.latest()) == ["a", "val/acc", "inner/x", "val/loss", "b"]
    assert storage.history("val/acc").latest() == 0.5
    assert storage.count_samples("val/loss") == 1
    with storage.name_scope("trail//"):
        storage.put_scalar("y", 1.0)
    assert "trail/y" in storage.latest()


def test_name_scope_restored_after_exception(storage):
    with storage.name_scope("outer"):
        with pytest.raises(ZeroDivisionError):
            with storage.name_scope("inner"):
                storage.put_scalar("before", 1.0)
                1 / 0  # noqa: B018
        storage.put_scalar("after", 2.0)
    storage.put_scalar("top", 3.0)
    assert list(storage.latest()) == ["inner/before", "outer/after", "top"]


def test_name_scope_requires_str(storage):
    with pytest.raises(TypeError):
        with storage.name_scope(3):
            pass


# --- context-manager stack -----------------------------------------------------------------------


def test_get_event_storage_outside_is_runtime_and_assertion_error():
    assert not has_event_storage()
    with pytest.raises(RuntimeError):
        get_event_storage()
    with pytest.raises(AssertionError):
        get_event_storage()


def test_context_stack():
    outer = EventStorage()
    inner = EventStorage(5)
    with outer as s:
        assert s is outer
        assert has_event_storage()
        assert get_event_storage() is outer
        with inner:
            assert get_event_storage() is inner
        assert get_event_storage() is outer
    assert not has_event_storage()


def test_context_stack_popped_on_exception():
    with pytest.raises(KeyError):
        with EventStorage() as s:
            assert get_event_storage() is s
            raise KeyError("boom")
    assert not has_event_storage()


def test_exit_out_of_order_is_error():
    a, b = EventStorage(), EventStorage()
    a.__enter__()
    b.__enter__()
    try:
        with pytest.raises(RuntimeError):
            a.__exit__(None, None, None)
        assert get_event_storage() is b
    finally:
        b.__exit__(None, None, None)
        a.__exit__(None, None, None)
    assert not has_event_storage()


# --- images --------------------------------------------------------------------------------------


def test_put_image_and_clear(storage):
    img_t = torch.rand(3, 4, 5)
    img_n = np.zeros((1, 2, 2), dtype=np.uint8)
    storage.put_image("t", img_t)
    storage.iter = 7
    storage.put_image("n", img_n)
    storage.put_image("rgba", torch.zeros(4, 1, 1))
    vis = storage._vis_data
    assert [(name, it) for name, _, it in vis] == [("t", 0), ("n", 7), ("rgba", 7)]
    assert vis[0][1] is img_t and vis[1][1] is img_n  # kept as given
    storage.clear_images()
    assert storage._vis_data == []


@pytest.mark.parametrize(
    "shape", [(3, 4), (5, 4, 4), (1, 3, 4, 4), (3, 0, 4), (3, 4, 0), (8, 8, 3)]
)
def test_put_image_non_chw_is_value_error(storage, shape):
    with pytest.raises(ValueError, match="img"):
        storage.put_image("img", np.zeros(shape, dtype=np.float32))
    with pytest.raises(ValueError, match="img"):
        storage.put_image("img", torch.zeros(shape))
    assert storage._vis_data == []


def test_put_image_non_array_is_type_error(storage):
    with pytest.raises(TypeError, match="img"):
        storage.put_image("img", [[[0.0]]])
    with pytest.raises(TypeError, match="img"):
        storage.put_image("img", None)
    with pytest.raises(TypeError):
        storage.put_image(3, torch.zeros(3, 2, 2))
    assert storage._vis_data == []


def test_images_bounded_drop_oldest_with_one_warning(caplog):
    s = EventStorage(max_images=2)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for i in range(5):
        s.iter = i
        s.put_image(f"img{i}", torch.zeros(1, 2, 2))
    assert [(n, it) for n, _, it in s._vis_data] == [("img3", 3), ("img4", 4)]
    warnings_ = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings_) == 1
    assert "image" in warnings_[0].getMessage()


# --- histograms ----------------------------------------------------------------------------------

HIST_KEYS = {
    "tag",
    "min",
    "max",
    "num",
    "sum",
    "sum_squares",
    "bucket_limits",
    "bucket_counts",
    "global_step",
}


@pytest.mark.parametrize("bins", [1, 7, 1000])
def test_put_histogram_matches_detectron2(storage, bins):
    g = torch.Generator().manual_seed(bins)
    t = torch.randn(513, generator=g)
    storage.iter = 42
    storage.put_histogram("w", t, bins=bins)
    (got,) = storage._histograms
    assert set(got) == HIST_KEYS
    want = detectron2_histogram("w", t, bins, 42)
    assert got == want
    assert len(got["bucket_limits"]) == len(got["bucket_counts"]) == bins
    assert sum(got["bucket_counts"]) == 513


def test_put_histogram_default_bins_and_requires_grad(storage):
    t = torch.linspace(-1, 1, 100).requires_grad_()
    storage.put_histogram("g", t)
    (got,) = storage._histograms
    assert got == detectron2_histogram("g", t.detach(), 1000, 0)


def test_put_histogram_float64_matches_detectron2(storage):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(300, generator=g, dtype=torch.float64)
    storage.put_histogram("w64", t, bins=20)
    assert storage._histograms[0] == detectron2_histogram("w64", t, 20, 0)


def test_put_histogram_multi_dim_counts_every_value(storage):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    storage.put_histogram("m", t, bins=4)
    (got,) = storage._histograms
    assert got == detectron2_histogram("m", t, 4, 0)
    assert sum(got["bucket_counts"]) == 12
    assert got["num"] == 3  # detectron2's len(hist_tensor): the first dimension


def test_put_histogram_bad_input(storage):
    with pytest.raises(TypeError, match="h"):
        storage.put_histogram("h", np.zeros(3))
    with pytest.raises(TypeError):
        storage.put_histogram(1, torch.zeros(3))
    for bins in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="bins"):
            storage.put_histogram("h", torch.zeros(3), bins=bins)
    with pytest.raises(ValueError, match="empty"):
        storage.put_histogram("h", torch.zeros(0))
    assert storage._histograms == []


def test_clear_histograms(storage):
    storage.put_histogram("a", torch.ones(3), bins=2)
    storage.put_histogram("b", torch.ones(3), bins=2)
    assert [h["tag"] for h in storage._histograms] == ["a", "b"]
    storage.clear_histograms()
    assert storage._histograms == []


def test_histograms_bounded_drop_oldest_with_one_warning(caplog):
    s = EventStorage(max_histograms=2)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for i in range(5):
        s.iter = i
        s.put_histogram(f"h{i}", torch.ones(4), bins=3)
    assert [(h["tag"], h["global_step"]) for h in s._histograms] == [("h3", 3), ("h4", 4)]
    warnings_ = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings_) == 1
    assert "histogram" in warnings_[0].getMessage()


# --- threads -------------------------------------------------------------------------------------


def test_concurrent_puts_lose_nothing():
    s = EventStorage()
    n_threads, n = 4, 1500
    errors: List[BaseException] = []
    start = threading.Barrier(n_threads + 1)

    def worker(t: int) -> None:
        try:
            start.wait()
            for k in range(n):
                v = float(t * n + k)
                s.put_scalar("shared", v)
                s.put_scalar(f"own{t}", v, smoothing_hint=False, cur_iter=k)
                s.put_scalars(shared2=v, **{f"own2_{t}": v})
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    start.wait()
    reads = 0
    while any(th.is_alive() for th in threads) or reads < 10:
        smoothed = s.latest_with_smoothing_hint(20)
        for h in s.histories().values():
            h.avg(20)
            h.median(7)
        assert all(len(pair) == 2 for pair in smoothed.values())
        if "shared" in s.latest():
            assert s.count_samples("shared", 20) >= 1
        reads += 1
    for th in threads:
        th.join()
    assert not errors

    everything = [float(i) for i in range(n_threads * n)]
    for name in ("shared", "shared2"):
        vals = [v for v, _ in s.history(name).values()]
        assert sorted(vals) == everything
        for t in range(n_threads):  # each thread's puts keep their order
            mine = [v for v in vals if t * n <= v < (t + 1) * n]
            assert mine == everything[t * n : (t + 1) * n]
    for t in range(n_threads):
        mine = everything[t * n : (t + 1) * n]
        assert s.history(f"own{t}").values() == [(v, k) for k, v in enumerate(mine)]
        assert [v for v, _ in s.history(f"own2_{t}").values()] == mine
    assert len(s.latest()) == 2 + 2 * n_threads


# --- memory --------------------------------------------------------------------------------------


def test_heap_bytes_one_metric():
    n = 100_000
    s = EventStorage(max_length=n)
    assert s._heap_bytes() == 0
    for i in range(n):
        s.put_scalar("loss", float(i), cur_iter=i)
    assert n * 8 <= s._heap_bytes() <= n * 8 + 1024
    for i in range(n, n + n // 2):  # wrapping past max_length allocates nothing more
        s.put_scalar("loss", float(i), cur_iter=i)
    assert s._heap_bytes() <= n * 8 + 1024
    assert len(s.history("loss")) == n


def test_heap_bytes_default_max_length_and_irregular_iterations():
    n = 100_000
    s = EventStorage()
    for i in range(n):
        s.put_scalar("loss", float(i), cur_iter=i)
    # The ring grows by doubling: at most twice the entries' 8 bytes.
    assert n * 8 <= s._heap_bytes() <= 2 * n * 8 + 1024
    s2 = EventStorage()
    rng = np.random.default_rng(0)
    its = np.cumsum(rng.integers(1, 4, size=20_000) ** 2).tolist()  # mostly irregular steps
    for it in its:
        s2.put_scalar("x", 1.0, cur_iter=it)
    assert s2.history("x").values()[-1] == (1.0, its[-1])
    # Worst case 8 + 16 bytes an entry, doubled for growth.
    assert s2._heap_bytes() <= 2 * 20_000 * 24 + 1024


def test_recorded_losses_are_stored_as_write_metrics_stores_them():
    """The pending queue's losses: several iterations recorded, then read in one batch, make
    the same puts as one _write_metrics call per iteration; bad input is a clear error."""
    one, many = EventStorage(0), EventStorage(0)
    pending = [(i, 0.01 * i, {"a": float(i), "b": torch.tensor(2.0 * i)}, "") for i in range(4)]
    for it, dt, losses, prefix in pending:
        one._write_metrics(losses, dt, dt, it, prefix)
        many._record_losses(it, dt, losses, prefix)
    assert many._pending_counts() == (8, 0)
    assert one._state() == many._state()  # _state reads the storage: the queue is read first
    with pytest.raises(TypeError, match="keys"):
        EventStorage(0)._record_losses(0, 0.0, {1: 1.0})
    bad = EventStorage(0)
    bad._record_losses(2, 0.0, {"a": float("nan")})
    with pytest.raises(FloatingPointError, match="iteration=2"):
        bad.latest()
    assert bad._pending_counts() == (0, 0)  # a failed read drops its batch
    strange = EventStorage(0)
    strange._record_losses(0, 0.0, {"a": "one"})
    with pytest.raises(TypeError, match="'a'"):
        strange.latest()


# --- assigning the private dicts -----------------------------------------------------------------


def test_a_validation_hook_that_prunes_its_losses_writes_what_detectron2_writes(tmp_path):
    """A ``ValidationLoss`` hook copied into several detectron2 ``train_net.py`` scripts puts
    ``val_*`` losses every few steps and, at the other steps, assigns the storage's
    ``_latest_scalars`` and ``_history`` filtered dicts without them, so the writers show them
    only at the steps that computed them. The same run on the reference engine (a model of
    detectron2's) writes the same metrics.json and leaves the same storage."""
    import itertools
    import json
    import types
    from collections import defaultdict

    from compat import d2
    from hookloop.engine import HookBase, SimpleTrainer, hooks
    from hookloop.utils.events import JSONWriter
    from torch import nn

    def run(E: Any, out: Any) -> Tuple[List[Dict[str, Any]], Any]:
        class ValidationLoss(E.HookBase):
            def after_step(self) -> None:
                storage = self.trainer.storage
                if self.trainer.iter % 3 == 0:
                    storage.put_scalars(val_total_loss=0.5 * self.trainer.iter, val_acc=0.25)
                    return
                scalars = {}
                for k, v in storage._latest_scalars.items():
                    if "val_" not in k:
                        scalars[k] = v
                storage._latest_scalars = scalars
                history = defaultdict(E.HistoryBuffer)
                for k, v in storage._history.items():
                    if "val_" not in k:
                        history[k] = v
                storage._history = history

        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        data = [torch.randn(4, 3) for _ in range(4)]

        def loss(x: torch.Tensor) -> Dict[str, torch.Tensor]:
            return {"loss_a": model(x).pow(2).mean(), "loss_b": model(x).abs().mean()}

        wrapped = type("M", (nn.Module,), {"forward": lambda self, x: loss(x)})()
        wrapped.inner = model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = E.SimpleTrainer(wrapped, itertools.cycle(data), opt)
        trainer.register_hooks(
            [ValidationLoss(), E.PeriodicWriter([E.JSONWriter(str(out))], period=2)]
        )
        trainer.train(0, 11)
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        timing = ("data_time", "rank_data_time")
        for line in lines:
            for k in timing:
                line.pop(k, None)
        s = trainer.storage
        state = (
            {k: (float(v), it) for k, (v, it) in s.latest().items() if k not in timing},
            {k: h.values() for k, h in s.histories().items() if k not in timing},
            s.smoothing_hints(),
        )
        return lines, state

    hookloop = types.SimpleNamespace(
        HookBase=HookBase,
        HistoryBuffer=HistoryBuffer,
        SimpleTrainer=SimpleTrainer,
        PeriodicWriter=hooks.PeriodicWriter,
        JSONWriter=JSONWriter,
    )
    lines, state = run(hookloop, tmp_path / "hookloop.json")
    ref_lines, ref_state = run(d2, tmp_path / "reference.json")
    assert lines == ref_lines
    assert state == ref_state
    # The writes (odd iterations and the last) see the val_ losses only after the steps that
    # put them (3 and 9): pruned at 1, 5, 7 and 10; put again at 9, with a new history.
    assert [("val_acc" in line, line["iteration"]) for line in lines] == [
        (False, 1),
        (True, 3),
        (False, 5),
        (False, 7),
        (True, 9),
        (False, 10),
    ]
    assert lines[4]["val_total_loss"] == 4.5  # the median of a new history: 4.5 alone
    assert "val_acc" not in state[0] and "val_acc" not in state[1]
    assert state[2]["val_acc"] is True  # the hint stays, as detectron2's _smoothing_hints


def test_assigning_the_private_dicts_checks_what_it_is_given(storage):
    storage.put_scalars(loss=1.0, val_loss=2.0)
    storage.put_scalar("lr", 0.1, smoothing_hint=False)
    with pytest.raises(TypeError, match=r"_latest_scalars must be a dict .* got list"):
        storage._latest_scalars = [("loss", (1.0, 0))]
    with pytest.raises(TypeError, match=r"_history must be a dict of HistoryBuffer, got str"):
        storage._history = "loss"
    # Only leaving names out: a value is put with put_scalar.
    with pytest.raises(ValueError, match=r"_latest_scalars\['loss'\] = \(5.0, 0\).*put_scalar"):
        storage._latest_scalars = {"loss": (5.0, 0)}
    with pytest.raises(ValueError, match=r"_latest_scalars\['new'\]"):
        storage._latest_scalars = {**storage._latest_scalars, "new": (1.0, 0)}
    assert list(storage.latest()) == ["loss", "val_loss", "lr"]  # nothing forgotten
    storage._latest_scalars = {"loss": (1.0, 0), "lr": (0.1, 0)}
    assert list(storage.latest()) == ["loss", "lr"] and list(storage.histories()) == ["loss", "lr"]
    # A forgotten name keeps its smoothing hint: a put with the other one is refused.
    storage._history = {"loss": storage.history("loss")}
    with pytest.raises(ValueError, match="smoothing_hint for 'lr' changed from False to True"):
        storage.put_scalar("lr", 0.2)
    # A history assigned to a name makes it that name's, as histories()[name] = buffer does.
    buffer = HistoryBuffer()
    buffer.update(3.0, 0)
    storage._history = {"loss": storage.history("loss"), "lr": buffer}
    assert storage.latest()["lr"] == (3.0, 0) and storage.smoothing_hints()["lr"] is False
    # NaN latest values compare equal to themselves.
    storage.put_scalar("nan", float("nan"))
    storage._latest_scalars = {k: (v, it) for k, (v, it) in storage.latest().items()}
    assert "nan" in storage.latest()
