"""Every public call of the extension, driven with extreme and wrong values, raises an ordinary
Python exception (or succeeds): no Rust panic (``PanicException``, a ``BaseException`` that
``except Exception`` does not catch) ever escapes."""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest
import torch
from hookloop import _core
from hookloop.utils.events import EventStorage

BAD = [
    2**70,
    -(2**70),
    2**63,
    2**63 - 1,
    -(2**63),
    0,
    -1,
    1e300,
    -1e300,
    math.nan,
    math.inf,
    -0.0,
    True,
    None,
    "",
    "x" * 300,
    "\udcff",
    [],
    (1, 2),
    {},
    b"\x00",
    object(),
    np.int64(-(2**63)),
    np.float32(np.nan),
    torch.zeros(()),
    torch.zeros(3),
    torch.tensor([math.inf]),
]


def drive(fn, arity):
    """Calls ``fn`` with every combination of bad values for its first ``arity`` arguments
    (capped), and fails on anything that is not an ``Exception``."""
    if arity == 0:
        combos = iter([()])
    elif arity <= 2:
        combos = itertools.product(BAD, repeat=arity)
    else:
        combos = zip(*[BAD] * arity)
    for args in combos:
        try:
            fn(*args)
        except Exception:
            pass
        except BaseException as e:  # PanicException and friends
            pytest.fail(f"{fn!r}{args!r} raised {type(e).__name__}: {e}")


@pytest.fixture
def storage():
    s = EventStorage(start_iter=5)
    s.put_scalar("loss", 1.0)
    return s


def test_storage_calls(storage):
    drive(lambda a, b: storage.put_scalar("loss", a, cur_iter=b), 2)
    drive(lambda a, b: storage.put_scalar(a, b), 2)
    drive(lambda a, b: storage.put_scalars(cur_iter=a, x=b), 2)
    drive(lambda a: storage.put_scalar("h", 1.0, smoothing_hint=a), 1)
    drive(lambda a: storage.put_scalars(smoothing_hint=a, y=1.0), 1)
    drive(lambda a, b: storage._write_metrics({"l": a}, b, b, 3), 2)
    drive(lambda a, b: storage._write_metrics({"l": 1.0}, 0.0, 0.0, a, b), 2)
    drive(lambda a, b: storage.latest_with_smoothing_hint(a), 1)
    drive(lambda a, b: storage.count_samples(a, b), 2)
    drive(lambda a: setattr(storage, "iter", a), 1)
    drive(lambda a: storage.history(a), 1)
    drive(lambda a, b: storage._put_image(a, b), 2)
    drive(lambda a, b, c, d, e, f, g, h: storage._put_histogram("h", a, b, c, d, e, f, g, h), 8)
    drive(lambda a: storage._state(a), 1)
    drive(lambda a: EventStorage()._load_state(a), 1)
    drive(lambda a, b: EventStorage(a, max_length=b), 2)
    drive(lambda a, b: EventStorage(max_images=a, max_histograms=b), 2)
    top = EventStorage(start_iter=2**53)  # the largest exact iteration
    with pytest.raises(OverflowError):
        top.step()


def test_history_calls():
    h = _core.HistoryBuffer(4)
    for i in range(6):
        h.update(float(i))
    drive(lambda a, b: h.update(a, b), 2)
    drive(lambda a: h.median(a), 1)
    drive(lambda a: h.avg(a), 1)
    drive(lambda a: _core.HistoryBuffer(a), 1)
    drive(lambda a: h.__setstate__(a), 1)


def test_writer_and_printer_calls(tmp_path, storage):
    drive(lambda a, b: _core.JSONWriter(os.path.join(tmp_path, "m.json"), a, b).close(), 2)
    drive(lambda a, b: _core.TensorboardXWriter(str(tmp_path), a, "h", "", b).close(), 2)
    w = _core.TensorboardXWriter(str(tmp_path), 20)
    drive(lambda a, b: w.add_points(scalars=[("t", a, b)]), 2)
    drive(lambda a, b: w.add_points(images=[("i", a, b, b, 3, b"\x00")]), 2)
    drive(lambda a, b: w.add_points(histograms=[("h", a, b, b, b, b, b, [a], [b])]), 2)
    w.close()
    drive(lambda a, b: _core.CommonMetricPrinter(a, b), 2)
    drive(lambda a, b: _core.CommonMetricPrinter(a, 20, b), 2)
    for max_iter in (2**63 - 1, -(2**63), 0):
        for it in (2**53, -(2**53)):  # the extremes a storage takes
            p = _core.CommonMetricPrinter(max_iter, 20, 7)
            s = EventStorage(start_iter=it)
            s.put_scalar("time", 0.1)
            s.put_scalar("loss", 1.0)
            try:
                p.format(s)
                p.format(s)
            except Exception:
                pass


def test_dispatch_and_hook_calls(storage):
    drive(lambda a, b: _core.periodic_due(a, b, 10), 2)
    drive(lambda a, b: _core.check_chw(a, b), 2)
    d = _core.Dispatcher()
    drive(lambda a: d.begin(a), 1)
    drive(lambda a, b: d.before_step(a, b), 2)
    drive(lambda a, b: d.after_train(a, b), 2)
    drive(lambda a: d.hooks_for(a), 1)
    drive(lambda a: setattr(d, "timing", a), 1)
    drive(lambda a, b: d.set_table(a, b), 2)
    with pytest.raises(ValueError, match="stage"):
        d.set_table([object()], [(0, 99, print, None, 0)])
    with pytest.raises(IndexError):
        d.set_table([], [(3, 0, print, None, 0)])
    t = _core._IterationTimerBase()
    drive(lambda a: t._configure(a), 1)
    drive(lambda a, b: t._start(a, b), 2)
    drive(lambda a, b, c: _core._register_tensor_reads(a, b, c), 3)


def test_out_of_range_iteration_says_so(storage):
    with pytest.raises(OverflowError, match="out of range"):
        storage.put_scalar("loss", 1.0, cur_iter=2**70)
    with pytest.raises(OverflowError, match="out of range"):
        storage.iter = 2**63
    with pytest.raises(OverflowError, match="out of range"):
        EventStorage(start_iter=2**64)


def test_hint_change_message_uses_python_bools(storage):
    storage.iter = 120
    with pytest.raises(ValueError, match="changed from True to False at iter 120"):
        storage.put_scalar("loss", 1.0, smoothing_hint=False)
