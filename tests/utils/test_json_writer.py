"""metrics.json: byte-for-byte what detectron2's JSONWriter writes (tests/compat/reference.py
is the oracle), through PeriodicWriter and a real TrainerBase."""

import json
import math
import random

import page_layout
import pytest
from compat import reference as ref
from hookloop.engine import PeriodicWriter, TrainerBase
from hookloop.utils.events import EventStorage, EventWriter, JSONWriter, get_event_storage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

UNICODE_NAME = "损失/ü"
EMOJI_NAME = "emoji 😀/x"
QUOTE_NAME = 'quote"back\\slash/\t'


class RefWriter(EventWriter):
    """Runs the reference writer at the moments PeriodicWriter runs the real one."""

    def __init__(self, impl):
        self.impl = impl

    def write(self):
        self.impl.write(get_event_storage())


class ScriptedTrainer(TrainerBase):
    """Puts a fixed pseudo-random script of scalars: several per iteration, some only every
    few iterations, some at other iterations than the current one (``cur_iter``)."""

    def __init__(self, seed, hint=True, fail_at=None):
        super().__init__()
        self.rng = random.Random(seed)
        self.hint = hint
        self.fail_at = fail_at

    def run_step(self):
        i, s, r = self.iter, self.storage, self.rng
        s.put_scalar("total_loss", r.uniform(0.0, 3.0))
        s.put_scalars(loss_cls=r.uniform(0, 1), loss_box_reg=r.expovariate(3.0))
        s.put_scalar("lr", 0.02 * 0.97**i, smoothing_hint=False)
        if i % 3 == 0:
            s.put_scalar(UNICODE_NAME, r.gauss(0.0, 1e-3), smoothing_hint=self.hint)
        if i % 5 == 2:
            s.put_scalar(EMOJI_NAME, r.uniform(-1e6, 1e6), smoothing_hint=self.hint)
        s.put_scalar(QUOTE_NAME, float(i) / 7.0, smoothing_hint=self.hint)
        with s.name_scope("scope"):
            s.put_scalar("inner_loss", r.random())
        if r.random() < 0.4:
            # an evaluation-like scalar reported for an earlier or later iteration
            s.put_scalar("eval/AP", r.random() * 100, cur_iter=max(0, i + r.randint(-8, 3)))
        if i == self.fail_at:
            raise RuntimeError("boom")


def _train(tmp_path, period, window, hint, max_iter=45, seed=0, start_iter=0):
    real = tmp_path / "metrics.json"
    expected = tmp_path / "expected.json"
    trainer = ScriptedTrainer(seed, hint)
    writers = [JSONWriter(real, window_size=window), RefWriter(ref.JSONWriterRef(expected, window))]
    trainer.register_hooks([PeriodicWriter(writers, period=period)])
    trainer.train(start_iter, max_iter)
    return real, expected


def _iterations(path):
    return [json.loads(line)["iteration"] for line in path.read_text("utf-8").splitlines()]


@pytest.mark.parametrize("hint", [True, False])
@pytest.mark.parametrize("window", [1, 10, 20])
@pytest.mark.parametrize("period", [1, 7, 20])
def test_metrics_json_matches_detectron2_bytes(tmp_path, period, window, hint):
    real, expected = _train(tmp_path, period, window, hint, seed=period * 100 + window)
    data = real.read_bytes()
    # detectron2's bytes, with the trailing spaces that keep each line inside its page.
    assert data == page_layout.padded(expected.read_bytes())
    assert data.endswith(b"\n")
    rows = [json.loads(line) for line in data.decode("ascii").splitlines()]
    iters = [row["iteration"] for row in rows]
    assert len(iters) == len(set(iters)), "an iteration was written twice"
    assert max(iters) >= 44
    # ensure_ascii: names are escaped, and they round-trip
    names = set().union(*rows)
    assert {UNICODE_NAME, EMOJI_NAME, QUOTE_NAME, "scope/inner_loss"} <= names


def test_lines_are_sorted_json_with_escapes(tmp_path):
    path = tmp_path / "m.json"
    w = JSONWriter(path, window_size=1)
    with EventStorage(3) as s:
        s.put_scalar("b", 0.5)
        s.put_scalar(UNICODE_NAME, 1e-05)
        s.put_scalar(EMOJI_NAME, 1e16, smoothing_hint=False)
        s.put_scalar(QUOTE_NAME, 2)
        w.write()
    w.close()
    assert path.read_bytes() == (
        b'{"b": 0.5, "emoji \\ud83d\\ude00/x": 1e+16, "iteration": 3, '
        b'"quote\\"back\\\\slash/\\t": 2.0, "\\u635f\\u5931/\\u00fc": 1e-05}\n'
    )


def test_start_iter_and_resume_appends(tmp_path):
    """A resumed run appends detectron2's lines, after dropping the lines of iterations >= its
    start_iter that the earlier run wrote, and writes nothing for iterations before its
    start_iter: the file reads as one uninterrupted run (hookloop's resume guarantee)."""
    real = tmp_path / "metrics.json"
    expected = tmp_path / "expected.json"
    for start, stop in [(0, 13), (13, 30)]:
        if expected.exists():
            lines = expected.read_text().splitlines(keepends=True)
            expected.write_text(
                "".join(line for line in lines if json.loads(line)["iteration"] < start)
            )
        trainer = ScriptedTrainer(start)
        reference = ref.JSONWriterRef(expected, 10)
        reference._writer._last_write = start - 1  # as an uninterrupted run's writer would be
        writers = [JSONWriter(real, 10), RefWriter(reference)]
        trainer.register_hooks([PeriodicWriter(writers, period=4)])
        trainer.train(start, stop)
    assert real.read_bytes() == expected.read_bytes()
    iters = _iterations(real)
    assert iters[0] == 3
    assert max(iters) >= 29


def test_a_run_from_iteration_0_replaces_an_earlier_runs_lines_and_keeps_them_aside(
    tmp_path, caplog
):
    """detectron2 appends a fresh run's lines to an existing metrics.json, which then holds two
    runs' steps; hookloop's run from 0 replaces them, after copying the earlier file to the
    first free ``metrics.json.N``, with one warning naming both."""
    path = tmp_path / "metrics.json"
    earlier = '{"iteration": 3, "old": 1.0}\n{"iteration": 7, "old": 2.0}\n'
    path.write_text(earlier)
    (tmp_path / "metrics.json.1").write_text("taken\n")
    for start, stop in [(0, 6), (0, 6)]:
        with caplog.at_level("WARNING", logger="hookloop"):
            trainer = ScriptedTrainer(0)
            trainer.register_hooks([PeriodicWriter([JSONWriter(path, 10)], period=4)])
            trainer.train(start, stop)
    assert (tmp_path / "metrics.json.1").read_text() == "taken\n"
    assert (tmp_path / "metrics.json.2").read_text() == earlier
    first_run = (tmp_path / "metrics.json.3").read_text()
    assert 3 in _iterations(tmp_path / "metrics.json.3")
    assert path.read_text() == first_run  # the second run replaced the first's lines
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert f"{path} held 2 line(s) of an earlier run" in warnings[0]
    assert warnings[0].endswith(f"(the earlier file is kept as {path}.2)")


def test_a_first_run_into_an_empty_directory_keeps_nothing_aside(tmp_path, caplog):
    path = tmp_path / "metrics.json"
    with caplog.at_level("WARNING", logger="hookloop"):
        trainer = ScriptedTrainer(0)
        trainer.register_hooks([PeriodicWriter([JSONWriter(path, 10)], period=4)])
        trainer.train(0, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_second_writer_appends_to_existing_file(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text('{"iteration": 0, "old": 1.0}\n')
    w1 = JSONWriter(path)
    with EventStorage(1) as s:
        s.put_scalar("a", 1.0, smoothing_hint=False)
        w1.write()
        w1.close()
        w2 = JSONWriter(path)
        s.iter = 2
        s.put_scalar("a", 3.0, smoothing_hint=False)
        w2.write()
        w2.close()
    assert path.read_text() == (
        '{"iteration": 0, "old": 1.0}\n{"a": 1.0, "iteration": 1}\n{"a": 3.0, "iteration": 2}\n'
    )


def test_torn_last_line_is_cut_when_reopened(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_bytes(b'{"iteration": 1, "a": 1.0}\n{"iteration": 2, "a"')
    w = JSONWriter(path)
    with EventStorage(3) as s:
        s.put_scalar("a", 4.0)
        w.write()
    w.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 3]


def test_flush_makes_lines_visible_before_close(tmp_path):
    path = tmp_path / "metrics.json"
    expected = tmp_path / "expected.json"
    w, r = JSONWriter(path, 5), ref.JSONWriterRef(expected, 5)
    with EventStorage() as s:
        for i in range(12):
            s.iter = i
            s.put_scalar("loss", i * 0.25)
            if i % 4 == 3:
                w.write()
                r.write(s)
                w.flush()
                assert path.read_bytes() == expected.read_bytes()
        w.write()  # nothing new: no line
        w.flush()
        assert path.read_bytes() == expected.read_bytes()
    w.close()
    assert _iterations(path) == [3, 7, 11]


def test_nothing_new_writes_nothing(tmp_path):
    path = tmp_path / "metrics.json"
    w = JSONWriter(path)
    with EventStorage(5) as s:
        w.write()
        s.put_scalar("a", 1.0)
        w.write()
        w.write()
        s.iter = 6
        w.write()
    w.close()
    assert path.read_text() == '{"a": 1.0, "iteration": 5}\n'


def test_exception_in_training_still_writes_and_closes(tmp_path):
    real = tmp_path / "metrics.json"
    expected = tmp_path / "expected.json"
    trainer = ScriptedTrainer(7, fail_at=12)
    json_writer = JSONWriter(real, 20)
    writers = [json_writer, RefWriter(ref.JSONWriterRef(expected, 20))]
    trainer.register_hooks([PeriodicWriter(writers, period=5)])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train(0, 100)
    assert real.read_bytes() == expected.read_bytes()
    assert 12 in _iterations(real)
    with EventStorage(), pytest.raises(ValueError, match="closed"):
        json_writer.write()


_finite_or_not = st.floats(allow_nan=True, allow_infinity=True).map(
    # -0.0 has its own test below (test_negative_zero_loss_is_smoothed_like_numpy).
    lambda x: 0.0 if x == 0 else x
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.lists(
        st.tuples(_finite_or_not, st.floats(), st.integers(0, 3)), min_size=1, max_size=30
    ),
    window=st.integers(1, 25),
    period=st.integers(1, 6),
)
def test_random_values_match_reference_bytes(tmp_path_factory, data, window, period):
    d = tmp_path_factory.mktemp("json")
    real, expected = d / "m.json", d / "e.json"
    w, r = JSONWriter(real, window), ref.JSONWriterRef(expected, window)
    with EventStorage() as s:
        for i, (smoothed, raw, skip) in enumerate(data):
            s.iter = i
            s.put_scalar("loss", smoothed)
            s.put_scalar("raw", raw, smoothing_hint=False, cur_iter=max(0, i - skip))
            if i % period == 0 or i == len(data) - 1:
                w.write()
                r.write(s)
    w.close()
    assert real.read_bytes() == expected.read_bytes()


def test_non_finite_values_are_written_as_python_json(tmp_path):
    path = tmp_path / "m.json"
    w = JSONWriter(path)
    with EventStorage() as s:
        s.put_scalar("a", math.nan, smoothing_hint=False)
        s.put_scalar("b", math.inf, smoothing_hint=False)
        s.put_scalar("c", -math.inf, smoothing_hint=False)
        s.put_scalar("d", -0.0, smoothing_hint=False)
        w.write()
    w.close()
    assert path.read_text() == (
        '{"a": NaN, "b": Infinity, "c": -Infinity, "d": -0.0, "iteration": 0}\n'
    )


@pytest.mark.parametrize("n", [1, 2, 3])
def test_negative_zero_loss_is_smoothed_like_numpy(tmp_path, n):
    # fvcore's median is np.median, whose mean step turns -0.0 into 0.0.
    real, expected = tmp_path / "m.json", tmp_path / "e.json"
    w, r = JSONWriter(real), ref.JSONWriterRef(expected)
    with EventStorage() as s:
        for i in range(n):
            s.iter = i
            s.put_scalar("loss", -0.0)
        w.write()
        r.write(s)
    w.close()
    assert real.read_text() == expected.read_text() == f'{{"iteration": {n - 1}, "loss": 0.0}}\n'


def test_unwritable_path_fails_at_construction_naming_it(tmp_path):
    parent = tmp_path / "regular_file"
    parent.write_text("")
    bad = parent / "metrics.json"
    with pytest.raises(OSError) as info:
        JSONWriter(bad)
    assert str(bad) in str(info.value)
    assert info.value.filename == str(bad)


@pytest.mark.parametrize("window", [0, -3])
def test_bad_window_size(tmp_path, window):
    with pytest.raises(ValueError):
        JSONWriter(tmp_path / "m.json", window_size=window)


def test_invalid_fsync_option(tmp_path):
    with pytest.raises(ValueError, match="fsync"):
        JSONWriter(tmp_path / "m.json", fsync="sometimes")


@pytest.mark.parametrize("fsync", ["always", "close", "never"])
def test_fsync_options_write_the_same(tmp_path, fsync):
    path = tmp_path / "m.json"
    w = JSONWriter(str(path), window_size=2, fsync=fsync)
    with EventStorage() as s:
        for i in range(3):
            s.iter = i
            s.put_scalar("loss", float(i))
            w.write()
    w.close()
    assert _iterations(path) == [0, 1, 2]
    assert json.loads(path.read_text().splitlines()[-1])["loss"] == 1.5


def test_write_after_close_raises_value_error(tmp_path):
    w = JSONWriter(tmp_path / "m.json")
    w.close()
    w.close()  # closing twice is harmless
    with EventStorage() as s:
        s.put_scalar("a", 1.0)
        with pytest.raises(ValueError):
            w.write()
