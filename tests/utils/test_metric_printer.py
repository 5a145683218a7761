"""CommonMetricPrinter: each logged line equals detectron2's (tests/compat/reference.py)."""

import datetime
import logging
import math
import re

import pytest
import torch
from compat import reference as ref
from hookloop.utils.events import CommonMetricPrinter, EventStorage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LOGGER = "hookloop.utils.events"
ETA = r"eta: (\d+ days?, )?\d+:\d\d:\d\d  "


def _max_mem_mb():
    # what detectron2 appends on a CUDA machine (nothing allocates between the two reads)
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1024.0 / 1024.0
    return None


def _lines(caplog):
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO
    ]


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def _strip_eta(line):
    return re.sub("^ " + ETA, " ", line)


def _check_write(printer, oracle, storage, log, wall_eta=False):
    """One printer.write(); returns the line after checking it against the reference. With
    ``wall_eta`` the ETA (estimated from wall time, so not reproducible) is left out of the
    comparison."""
    before = len(_lines(log))
    printer.write()
    expected, eta_seconds = oracle.line(storage, _max_mem_mb())
    lines = _lines(log)
    if expected is None:
        assert len(lines) == before
        return None
    assert len(lines) == before + 1
    if wall_eta:
        assert _strip_eta(lines[-1]) == _strip_eta(expected)
    else:
        assert lines[-1] == expected
    if eta_seconds is not None:
        assert storage.latest()["eta_seconds"] == (eta_seconds, storage.iter)
        assert storage.smoothing_hints()["eta_seconds"] is False
    return lines[-1]


def _put_all(s, i):
    s.put_scalar("total_loss", 2.0 / (i + 1))
    s.put_scalars(loss_cls=0.3 + (i % 5) * 0.01, loss_box_reg=0.123456789 * (i % 3))
    s.put_scalar("[metric]accuracy", (i % 10) / 10.0)
    s.put_scalar("[metric]loss_like", i * 1e-6)  # both a loss and a metric
    s.put_scalar("other", 123.0)  # neither: not printed
    s.put_scalar("time", 0.2 + (i % 4) * 0.05)
    s.put_scalar("data_time", 0.001 * (i % 6))
    s.put_scalar("lr", 0.02 * 0.99**i, smoothing_hint=False)


@pytest.mark.parametrize("window", [1, 5, 20])
@pytest.mark.parametrize("max_iter", [None, 1000])
def test_full_lines_match_reference(log, window, max_iter):
    printer = CommonMetricPrinter(max_iter, window_size=window)
    oracle = ref.CommonMetricPrinterRef(max_iter, window)
    with EventStorage() as s:
        for i in range(60):
            s.iter = i
            _put_all(s, i)
            if i % 20 == 19:
                line = _check_write(printer, oracle, s, log)
                assert ("eta: " in line) == (max_iter is not None)
                assert "other" not in line
    assert len(_lines(log)) == 3


@pytest.mark.parametrize(
    "names",
    [
        (),
        ("time",),
        ("data_time",),
        ("lr",),
        ("time", "lr"),
        ("data_time", "lr", "loss"),
        ("[metric]iou", "loss/a", "loss/b"),
    ],
)
def test_optional_fields(log, names):
    printer = CommonMetricPrinter(max_iter=50, window_size=3)
    oracle = ref.CommonMetricPrinterRef(50, 3)
    with EventStorage(4) as s:
        for i in range(4, 12):
            s.iter = i
            for k, name in enumerate(names):
                s.put_scalar(name, 0.1 * (k + 1) * (i % 4 + 1), smoothing_hint=name != "lr")
            if i >= 9:
                line = _check_write(printer, oracle, s, log, wall_eta="time" not in names)
                # without a time metric the ETA comes from the second write on
                assert bool(re.match("^ " + ETA, line)) == ("time" in names or i > 9), line
    assert len(_lines(log)) == 3
    assert ("lr: N/A  " in _lines(log)[0]) == ("lr" not in names)


def test_losses_on_irregular_iterations_use_an_iteration_window(log):
    # the window counts iterations, not samples: a loss put every 3rd iteration gets about
    # window / 3 samples
    printer = CommonMetricPrinter(window_size=10)
    oracle = ref.CommonMetricPrinterRef(None, 10)
    with EventStorage() as s:
        for i in range(50):
            s.iter = i
            if i % 3 == 0:
                s.put_scalar("sparse_loss", float(i))
            s.put_scalar("dense_loss", float(i % 7))
            s.put_scalar("data_time", float(i % 5), cur_iter=i)
            if i % 10 == 9:
                _check_write(printer, oracle, s, log)
        s.put_scalar("late_loss", 1.0, cur_iter=3)
        s.put_scalar("late_loss", 5.0, cur_iter=40)
        s.put_scalar("late_loss", 9.0, cur_iter=45)
        _check_write(printer, oracle, s, log)
    assert "sparse_loss: 43.5  " in _lines(log)[-1]  # samples at 39, 42, 45, 48
    assert "late_loss: 7  " in _lines(log)[-1]  # samples at 40, 45


def test_eta_from_median_time_over_1000_samples(log):
    printer = CommonMetricPrinter(max_iter=100_000)
    oracle = ref.CommonMetricPrinterRef(100_000)
    with EventStorage() as s:
        for i in range(1300):
            s.iter = i
            # 300 slow iterations first: they leave the 1000-sample window
            s.put_scalar("time", 5.0 if i < 300 else 0.25 + (i % 3) * 0.01)
            if i in (299, 700, 1299):
                _check_write(printer, oracle, s, log)
    lines = _lines(log)
    slow = datetime.timedelta(seconds=int(5.0 * (100_000 - 300)))
    assert lines[0].startswith(f" eta: {slow}  iter: 299  ")
    eta, it = s.latest()["eta_seconds"]
    assert it == 1299 and eta == pytest.approx(0.26 * (100_000 - 1300))
    assert lines[-1].startswith(f" eta: {datetime.timedelta(seconds=int(eta))}  iter: 1299  ")


def test_no_eta_without_max_iter_and_nothing_at_max_iter(log):
    with EventStorage(7) as s:
        s.put_scalar("time", 0.5)
        s.put_scalar("loss", 1.0)
        CommonMetricPrinter().write()
        assert _lines(log) == [ref.CommonMetricPrinterRef().line(s, _max_mem_mb())[0]]
        assert "eta" not in _lines(log)[0]
        assert "eta_seconds" not in s.latest()
        s.iter = 20
        CommonMetricPrinter(max_iter=20).write()
        assert len(_lines(log)) == 1
        assert "eta_seconds" not in s.latest()


def test_wall_time_eta_from_the_second_write(log):
    printer = CommonMetricPrinter(max_iter=1000)
    with EventStorage() as s:
        for i in range(3):
            s.iter = i * 10
            s.put_scalar("total_loss", 1.0)
            printer.write()
    first, second, third = _lines(log)
    assert first.startswith(" iter: 0  total_loss: 1  ")
    assert re.match("^ " + ETA + "iter: 10  total_loss: 1  ", second), second
    assert re.match("^ " + ETA + "iter: 20  ", third), third
    assert "eta_seconds" not in s.latest()


@pytest.mark.parametrize(
    "iteration,epoch", [(0, 1), (249, 1), (250, 2), (499, 2), (500, 3), (750, 4), (998, 4)]
)
def test_epoch_field(log, iteration, epoch):
    printer = CommonMetricPrinter(max_iter=1000, epoch=4)
    oracle = ref.CommonMetricPrinterRef(1000, epoch=4)
    with EventStorage(iteration) as s:
        s.put_scalar("time", 0.5)
        s.put_scalar("total_loss", 0.75)
        line = _check_write(printer, oracle, s, log)
    assert f"  iter: {iteration}  epoch: {epoch}/4  total_loss: 0.75  " in line


def test_epoch_with_uneven_split_matches_reference(log):
    printer = CommonMetricPrinter(max_iter=10, epoch=4)
    oracle = ref.CommonMetricPrinterRef(10, epoch=4)
    with EventStorage() as s:
        for i in range(10):
            s.iter = i
            s.put_scalar("time", 0.5)
            _check_write(printer, oracle, s, log)
    assert len(_lines(log)) == 10


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_size": 0},
        {"window_size": -1},
        {"max_iter": 10, "epoch": 0},
        {"epoch": 2},  # epoch needs max_iter
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        CommonMetricPrinter(**kwargs)


def test_large_eta_formats_days(log):
    printer = CommonMetricPrinter(max_iter=10_000)
    oracle = ref.CommonMetricPrinterRef(10_000)
    with EventStorage(5) as s:
        s.put_scalar("time", 100.0)
        line = _check_write(printer, oracle, s, log)
    assert line.startswith(" eta: 11 days, 13:36:40  iter: 5  ")


# Finite floats of every magnitude (subnormals to 1e308) and the non-finite ones. -0.0 is
# mapped to 0.0: np.median turns it into 0.0 and that divergence has its own test in
# test_json_writer.py.
_any_float = st.floats(allow_nan=True, allow_infinity=True).map(lambda x: 0.0 if x == 0 else x)
_magnitudes = st.one_of(
    _any_float,
    st.floats(min_value=-1e-300, max_value=1e-300),
    st.builds(lambda m, e: m * 10.0**e, st.floats(-10, 10), st.integers(-30, 30)),
).map(lambda x: 0.0 if x == 0 else x)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    losses=st.lists(st.tuples(_magnitudes, _magnitudes), min_size=1, max_size=25),
    times=st.lists(st.floats(min_value=0.0, max_value=1e4), min_size=1, max_size=5),
    data_time=st.floats(min_value=0.0, max_value=1e6),
    lr=_any_float,
    window=st.integers(1, 30),
    max_iter=st.one_of(st.none(), st.integers(30, 10**6)),
)
def test_random_values_format_like_python(log, losses, times, data_time, lr, window, max_iter):
    log.clear()
    printer = CommonMetricPrinter(max_iter, window_size=window)
    oracle = ref.CommonMetricPrinterRef(max_iter, window)
    with EventStorage() as s:
        for i, (a, b) in enumerate(losses):
            s.iter = i
            s.put_scalar("loss_a", a)
            s.put_scalar("[metric]b", b)
        for t in times:
            s.put_scalar("time", t)
        s.put_scalar("data_time", data_time)
        s.put_scalar("lr", lr, smoothing_hint=False)
        _check_write(printer, oracle, s, log)


@pytest.mark.parametrize(
    "value,text",
    [
        (0.00012345678, "0.0001235"),
        (1.23456e-05, "1.235e-05"),
        (12345.678, "1.235e+04"),
        (1234.5, "1234"),  # ties to even
        (1235.5, "1236"),
        (100.0, "100"),
        (1e300, "1e+300"),
        (5e-324, "4.941e-324"),
        (math.inf, "inf"),
        (math.nan, "nan"),
        (-2.5e-7, "-2.5e-07"),
    ],
)
def test_loss_format_examples(log, value, text):
    with EventStorage() as s:
        s.put_scalar("loss", value)
        CommonMetricPrinter().write()
    assert f" loss: {text}  " in _lines(log)[-1]
    assert format(value, ".4g") == text


# ----------------------------------------------------------------------------------------------
# The trainer's epochs (PeriodicWriter gives the printer its trainer)


def _epoch_run(log, iters_per_epoch, max_iter=25, period=10):
    from hookloop.engine import PeriodicWriter, TrainerBase

    class Runner(TrainerBase):
        """Counts epochs as SimpleTrainer does over a finite loader of 10 batches."""

        epoch = 0

        def run_step(self):
            if iters_per_epoch:
                self.epoch = self.iter // iters_per_epoch
            self.storage.put_scalars(total_loss=0.75, time=0.5)

    trainer = Runner()
    trainer.iters_per_epoch = iters_per_epoch
    trainer.register_hooks([PeriodicWriter([CommonMetricPrinter(max_iter)], period=period)])
    trainer.train(0, max_iter)
    return _lines(log)


def test_line_shows_the_trainers_epoch(log):
    mem = _max_mem_mb()
    tail = "" if mem is None else f"max_mem: {mem:.0f}M"
    # 25 iterations of a 10-batch loader: 3 epochs; written at 9, 19 and 24 (the last).
    assert _epoch_run(log, 10) == [
        " eta: 0:00:07  iter: 9  epoch: 1/3  total_loss: 0.75    time: 0.5000  "
        "last_time: 0.5000   lr: N/A  " + tail,
        " eta: 0:00:02  iter: 19  epoch: 2/3  total_loss: 0.75    time: 0.5000  "
        "last_time: 0.5000   lr: N/A  " + tail,
        " eta: 0:00:00  iter: 24  epoch: 3/3  total_loss: 0.75    time: 0.5000  "
        "last_time: 0.5000   lr: N/A  " + tail,
    ]


def test_line_without_epochs_is_detectron2s(log):
    lines = _epoch_run(log, None)
    oracle = ref.CommonMetricPrinterRef(25)
    with EventStorage(9) as s:
        for i in range(10):
            s.iter = i
            s.put_scalars(total_loss=0.75, time=0.5)
        expected, _ = oracle.line(s, _max_mem_mb())
    assert lines[0] == expected
    assert "epoch" not in "".join(lines)


def test_printer_holds_its_trainer_weakly(log):
    import gc

    from hookloop.engine import TrainerBase

    class Runner(TrainerBase):
        iters_per_epoch, epoch, max_iter = 10, 1, 30

        def run_step(self):
            pass

    printer, trainer = CommonMetricPrinter(30), Runner()
    printer._bind_trainer(trainer)
    with EventStorage(12) as s:
        s.put_scalar("total_loss", 0.5)
        printer.write()
        del trainer
        gc.collect()
        printer.write()  # the trainer is gone: the line has no epoch, and nothing raises
    first, second = _lines(log)
    assert " iter: 12  epoch: 2/3  total_loss: 0.5  " in first
    assert " iter: 12  total_loss: 0.5  " in second


def test_each_line_names_the_printers_write_as_its_origin(log):
    # As logger.info inside write() would: the record's file, function and line are those of
    # CommonMetricPrinter.write, the same for every line and for a subclass that calls it.
    import inspect

    import hookloop.utils.events as events

    class Subclass(CommonMetricPrinter):
        def write(self):
            super().write()

    source, first = inspect.getsourcelines(CommonMetricPrinter.write)
    with EventStorage(0) as storage:
        for printer in (CommonMetricPrinter(), CommonMetricPrinter(), Subclass()):
            storage.put_scalar("total_loss", 1.0)
            printer.write()
            storage.step()
    records = [r for r in log.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert len(records) == 3
    origins = {(r.pathname, r.filename, r.module, r.funcName, r.lineno) for r in records}
    ((pathname, filename, module, func, lineno),) = origins
    assert pathname == events.__file__ and (filename, module) == ("events.py", "events")
    assert func == "write" and first < lineno < first + len(source)
    assert "_getframe" in source[lineno - first]  # the line that found the origin
