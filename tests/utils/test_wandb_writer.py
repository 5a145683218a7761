"""WandbWriter against the real wandb client, offline: what a run's ``.wandb`` file holds, read
back with the client's own reader (``wandb-core leet inspect --json``: wandb 0.31 has no Python
reader of the file any more), is what ``JSONWriter`` writes for the same training."""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import wandb_env
from hookloop.engine import HookBase, PeriodicWriter, TrainerBase
from hookloop.utils.events import JSONWriter

wandb = pytest.importorskip("wandb")

from hookloop.utils.trackers import _Phase  # noqa: E402
from hookloop.utils.wandb_writer import WandbWriter  # noqa: E402  (needs wandb)

# Every wait on the client is bounded (its offline init takes about a second).
CLOSE_TIMEOUT = 60.0
READ_TIMEOUT = wandb_env.READ_TIMEOUT


@pytest.fixture(autouse=True)
def _isolated_wandb(tmp_path, monkeypatch):
    wandb_env.isolate(tmp_path, monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def _stop_wandb_service():
    """The client's service process lives for the process; it goes with this module."""
    yield
    wandb.teardown()


_records = wandb_env.records


def _history(records):
    """{step: {name: value}} of the run's history, without W&B's own ``_`` keys."""
    rows = {}
    for r in records:
        if r["type"] == "history":
            item = r["history"]["item"]
            step = r["history"].get("step", {}).get("num", 0)
            assert step not in rows, f"step {step} logged twice"
            assert item["_step"] == step
            rows[step] = {k: v for k, v in item.items() if not k.startswith("_")}
    return rows


def _run_record(records):
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run


def _metrics_json(path):
    rows = {}
    for line in Path(path).read_text("utf-8").splitlines():
        row = json.loads(line)
        rows[row.pop("iteration")] = row
    return rows


class Scripted(TrainerBase):
    """Puts scalars that depend on the iteration only (a resumed run puts the same ones):
    smoothed and not, scoped, some every few iterations, one for an earlier iteration."""

    def run_step(self):
        i, s = self.iter, self.storage
        r = random.Random(i)
        s.put_scalar("total_loss", r.uniform(0.0, 3.0))
        s.put_scalars(loss_cls=r.uniform(0, 1), loss_box_reg=r.expovariate(3.0))
        s.put_scalar("lr", 0.02 * 0.97**i, smoothing_hint=False)
        s.put_scalar("big", r.uniform(-1e16, 1e16), smoothing_hint=False)
        if i % 3 == 0:
            s.put_scalar("tiny", r.gauss(0.0, 1e-300), smoothing_hint=False)
        with s.name_scope("scope"):
            s.put_scalar("inner_loss", r.random())
        if i % 4 == 1:
            s.put_scalar("eval/AP", r.random() * 100, cur_iter=max(0, i - 2))


def _writer(tmp_path, **kw):
    kw.setdefault("project", "hookloop-test")
    return WandbWriter(
        mode="offline", dir=tmp_path, window_size=4, close_timeout=CLOSE_TIMEOUT, strict=True, **kw
    )


def test_logs_what_json_writer_writes(tmp_path):
    metrics = tmp_path / "metrics.json"
    writer = _writer(tmp_path, name="parity")
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), writer], period=3)])
    before = time.time()
    trainer.train(0, 20)  # after_train closes the writers: strict, so nothing was lost
    after = time.time()

    assert writer._wb_run_dir is not None and writer._wb_run_dir.startswith(str(tmp_path))
    records = _records(writer._wb_run_dir)
    expected = _metrics_json(metrics)
    assert len(expected) >= 7 and max(expected) == 19
    logged = _history(records)
    # Every step and value; floats exactly (both are the shortest repr of the same double).
    assert logged == expected
    for step, row in logged.items():
        for name, value in row.items():
            assert math.copysign(1, value) == math.copysign(1, expected[step][name])
    # The points' time is the training thread's at write().
    for r in records:
        if r["type"] == "history":
            assert before <= r["history"]["item"]["_timestamp"] <= after
    run = _run_record(records)
    assert run["run_id"] == writer._run_id()
    assert run["project"] == "hookloop-test"
    assert run["display_name"] == "parity"
    assert any(r["type"] == "exit" for r in records), "the run was not finished"
    state = writer._state_dict()
    assert state == {"run_id": writer._run_id(), "last_step": 19, "pending": [], "names": []}


def test_config_is_flattened_into_the_run_config(tmp_path):
    class Opaque:
        def __str__(self):
            return "opaque!"

    config = {
        "solver": {"base_lr": 0.02, "steps": (3, 4), "amp": {"enabled": False}},
        "model": {"name": "R50", "weights": None, "obj": Opaque()},
        "seed": 7,
    }
    writer = _writer(tmp_path, id="cfg123", config=config)
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([writer], period=5)])
    trainer.train(0, 5)
    run = _run_record(_records(writer._wb_run_dir))
    assert run["run_id"] == "cfg123"
    got = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert got == {
        "solver.base_lr": 0.02,
        "solver.steps": [3, 4],
        "solver.amp.enabled": False,
        "model.name": "R50",
        "model.weights": None,
        "model.obj": "opaque!",
        "seed": 7,
    }


class _Checkpoint(HookBase):
    """Saves the trainer's state at one iteration, as a checkpointer would (after the
    writers: PeriodicWriter's state goes with it)."""

    def __init__(self, at):
        self.at = at
        self.state = None

    def after_step(self):
        if self.trainer.iter == self.at:
            self.state = self.trainer.state_dict()


def test_resume_continues_the_run_id_offline(tmp_path):
    """A run killed after its checkpoint (at 9) logged 10..14; the resumed run logs into the
    same run id, offline into a new run folder that holds 10..14 again (the offline client
    does not know the run's steps), after the rows the checkpoint held as not yet sent."""
    metrics = tmp_path / "metrics.json"
    first = _writer(tmp_path)
    checkpoint = _Checkpoint(at=9)
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), first], period=2), checkpoint])
    trainer.train(0, 15)
    state = checkpoint.state
    assert state is not None
    killed = _history(_records(first._wb_run_dir))
    assert max(killed) == 14

    second = _writer(tmp_path)  # a new id of its own, until the checkpoint's replaces it
    assert second._run_id() != first._run_id()
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), second], period=2)])
    trainer.load_state_dict(state)
    assert second._run_id() == first._run_id() and second._resumed
    trainer.train(state["iteration"] + 1, 15)

    assert second._wb_run_dir != first._wb_run_dir
    records = _records(second._wb_run_dir)
    assert _run_record(records)["run_id"] == first._run_id()
    resumed = _history(records)
    expected = _metrics_json(metrics)  # the resumed JSONWriter rewrote 10..14
    assert {it: row for it, row in resumed.items() if it >= 10} == {
        it: row for it, row in expected.items() if it >= 10
    }
    # Rows still queued at the checkpoint (the run not yet open) go into it and are sent
    # again by the resumed run: the same values.
    assert all(resumed[it] == expected[it] for it in resumed if it < 10)
    assert set(it for it in resumed if it < 10) == {
        it
        for it, *_ in state["hookloop_hooks"]["PeriodicWriter"]["writers"]["1:WandbWriter"][
            "pending"
        ]
    }
    assert {it: row for it, row in killed.items() if it < 10} == {
        it: row for it, row in expected.items() if it < 10
    }
    # The killed run's own points after its checkpoint are the same values.
    assert {it: row for it, row in killed.items() if it >= 10} == {
        it: row for it, row in resumed.items() if it >= 10
    }


def test_given_id_is_not_replaced_by_a_checkpoint(tmp_path):
    writer = _writer(tmp_path, id="mine42")
    writer._load_state_dict({"run_id": "other1", "last_step": 3})
    assert writer._run_id() == "mine42" and not writer._resumed
    writer.close()  # never opened: no run, nothing lost


def test_several_runs_in_one_process_log_to_their_own(tmp_path):
    a = _writer(tmp_path / "a", id="runaaa")
    b = _writer(tmp_path / "b", id="runbbb")
    metrics = tmp_path / "metrics.json"
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([a, JSONWriter(metrics, 4), b], period=4)])
    trainer.train(0, 8)
    ha, hb = (_history(_records(w._wb_run_dir)) for w in (a, b))
    assert ha == hb == _metrics_json(metrics) and max(ha) == 7
    assert _run_record(_records(a._wb_run_dir))["run_id"] == "runaaa"
    assert _run_record(_records(b._wb_run_dir))["run_id"] == "runbbb"


def test_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r'pip install "hookloop\[wandb\]"'):
        WandbWriter()


def test_lazy_export():
    from hookloop.utils import events

    assert events.WandbWriter is WandbWriter


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"project": 3}, TypeError),
        ({"entity": b"x"}, TypeError),
        ({"name": 1.0}, TypeError),
        ({"id": 12}, TypeError),
        ({"dir": 5}, TypeError),
        ({"mode": 1}, TypeError),
        ({"mode": "bogus"}, ValueError),
        ({"id": "a/b"}, ValueError),
        ({"id": ""}, ValueError),
        ({"project": "a#b"}, ValueError),
        ({"config": 5}, TypeError),
        ({"window_size": 0}, ValueError),
        ({"window_size": 2.0}, TypeError),
        ({"max_buffered": True}, TypeError),
        ({"strict": 1}, TypeError),
        ({"close_timeout": -1}, ValueError),
    ],
)
def test_bad_arguments(kwargs, error):
    with pytest.raises(error, match="WandbWriter"):
        WandbWriter(**kwargs)


def test_where_names_the_project_mode_and_place(tmp_path):
    w = WandbWriter(project="proj", dir=tmp_path)
    assert w._where() == f"W&B project proj (offline, {tmp_path})"
    w.close()


def test_disabled_mode_logs_nothing_and_closes_cleanly(tmp_path):
    writer = WandbWriter(mode="disabled", dir=tmp_path, strict=True, close_timeout=CLOSE_TIMEOUT)
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([writer], period=2)])
    trainer.train(0, 4)  # strict: raises if a point was not taken
    assert not list(tmp_path.glob("wandb/*run-*/*.wandb"))


class _FakeRun:
    """What an online wandb.init returns for a run that has steps 0..11 (the server tells the
    client its starting step; no server here, so the run is a stand-in)."""

    id = "fake12"
    dir = None
    starting_step = 12

    def __init__(self):
        self.logged = []

    def log(self, data, step=None, commit=None):
        self.logged.append(step)

    def finish(self, exit_code=None):
        self.exit_code = exit_code


@pytest.mark.parametrize("resumed", [True, False])
def test_online_steps_below_the_run_step_are_not_sent(monkeypatch, caplog, resumed):
    run = _FakeRun()
    monkeypatch.setattr(wandb, "init", lambda **kw: run)
    writer = WandbWriter(mode="online", strict=True, close_timeout=CLOSE_TIMEOUT)
    if resumed:
        writer._load_state_dict({"run_id": "fake12", "last_step": 9})
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([writer], period=3)])
    with caplog.at_level("WARNING", logger="hookloop.utils.wandb_writer"):
        trainer.train(0, 16)
    assert run.logged and min(run.logged) >= 12 and max(run.logged) == 15
    warned = [r for r in caplog.records if "already has steps below 12" in r.getMessage()]
    assert len(warned) == (0 if resumed else 1)


# -- a client that fails -----------------------------------------------------------------------

# Retry waits short enough that a test's outage of a few calls clears in well under a second
# (the writer's own start at 0.5 s and double to 30 s).
FAST_BACKOFF = (0.01, 0.05)
RETRYING = "failed, retrying with backoff"


class _FailingLog:
    """Wraps ``wandb.init``: the real client opens the run, and the run's ``log`` raises
    ``wandb.Error`` on the calls that ``fails(n)`` (n counts the calls from 1) says; the other
    calls are the real ``Run.log``."""

    def __init__(self, monkeypatch, fails):
        self.fails = fails
        self.calls = 0
        self.failed = 0
        self.run = None
        real_init = wandb.init

        def init(**kwargs):
            run = real_init(**kwargs)
            real_log = run.log

            def log(*args, **kw):
                self.calls += 1
                if self.fails(self.calls):
                    self.failed += 1
                    raise wandb.Error(f"log refused (call {self.calls})")
                return real_log(*args, **kw)

            run.log = log
            self.run = run
            return run

        monkeypatch.setattr(wandb, "init", init)


class _FlushAt(HookBase):
    """At one iteration, waits (bounded) until the writer has sent everything queued: the
    outage clears while training goes on."""

    def __init__(self, writer, at):
        self.writer, self.at = writer, at
        self.flushed = None
        self.sent = None

    def after_step(self):
        if self.trainer.iter == self.at:
            self.flushed = self.writer.flush(CLOSE_TIMEOUT)
            self.sent = self.writer._sent


def _warnings(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _points(rows):
    return sum(len(row) for row in rows.values())


@pytest.mark.parametrize(
    "fails",
    [lambda n: n <= 3, lambda n: n == 2],
    ids=["first-three-calls", "mid-batch"],
)
def test_a_client_error_is_retried_and_every_point_logged_once(
    tmp_path, monkeypatch, caplog, fails
):
    """``run.log`` raises (the first three calls; or the second, after the first row of the
    first batch went in, so the batch is sent again from its first row): training goes on,
    one warning names the project and the error, and once the error clears every step is in
    the run once, with JSONWriter's values."""
    failing = _FailingLog(monkeypatch, fails)
    metrics = tmp_path / "metrics.json"
    writer = _writer(tmp_path)  # strict: close() raises if a point was not logged
    writer._BACKOFF = FAST_BACKOFF
    flush = _FlushAt(writer, at=10)
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), writer], period=3), flush])
    with caplog.at_level("WARNING", logger="hookloop.utils"):
        trainer.train(0, 20)

    assert trainer.iter == 20  # every iteration ran
    assert failing.failed == (3 if failing.fails(3) else 1)
    assert flush.flushed is True
    (retrying,) = _warnings(caplog, RETRYING)
    assert "WandbWriter: logging to W&B project hookloop-test (offline, " in retrying
    first = 1 if failing.fails(1) else 2
    assert retrying.endswith(f"Error: log refused (call {first})")
    assert len(_warnings(caplog, "works again")) == 1
    assert not _warnings(caplog, "were not logged")
    records = _records(writer._wb_run_dir)
    expected = _metrics_json(metrics)
    assert _history(records) == expected  # every step once, JSONWriter's values
    assert any(r["type"] == "exit" for r in records), "the run was not finished"


@pytest.mark.parametrize("strict", [False, True])
def test_a_permanent_client_error_is_named_at_close(tmp_path, monkeypatch, caplog, strict):
    """``run.log`` works to iteration 10, then raises for good: training completes, and
    close() (bounded by a small ``close_timeout``) says how many points did not go in, of how
    many, and the error; ``strict=True`` raises that as a RuntimeError."""
    broken = {"now": False}
    failing = _FailingLog(monkeypatch, lambda n: broken["now"])
    metrics = tmp_path / "metrics.json"
    writer = WandbWriter(
        project="hookloop-test",
        mode="offline",
        dir=tmp_path,
        window_size=4,
        close_timeout=1.0,
        strict=strict,
    )
    writer._BACKOFF = FAST_BACKOFF

    class Break(_FlushAt):
        def after_step(self):
            super().after_step()
            if self.trainer.iter == self.at:
                broken["now"] = True

    flush = Break(writer, at=10)
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), writer], period=3), flush])
    with caplog.at_level("WARNING", logger="hookloop.utils"):
        if strict:
            with pytest.raises(RuntimeError, match="points were not logged") as raised:
                trainer.train(0, 20)
            messages = [str(raised.value)]
        else:
            trainer.train(0, 20)
            messages = _warnings(caplog, "were not logged")

    assert trainer.iter == 20  # every iteration ran
    assert flush.flushed is True and 0 < flush.sent
    assert failing.failed >= 1
    total = _points(_metrics_json(metrics))  # JSONWriter wrote them all
    assert flush.sent < total
    (message,) = messages
    assert message.startswith(
        f"WandbWriter: {total - flush.sent} of {total} points were not logged to "
        "W&B project hookloop-test (offline, "
    ), message
    # The thread may still be retrying (until close_timeout), so the call named is any one.
    assert re.search(r"; last error: Error: log refused \(call \d+\)$", message), message
    assert len(_warnings(caplog, RETRYING)) == 1
    # The writer leaves a run it could not log to open (its client does not answer); the
    # test ends it, not the client's teardown at the module's end.
    failing.run.finish()


def test_a_failing_wandb_init_never_stops_training(tmp_path, monkeypatch, caplog):
    """``wandb.init`` raises on every try: training completes, one warning names the project
    and the error, close() says every point was not logged, and a checkpoint still holds the
    run id chosen at construction (with the rows not yet sent), for a resumed run."""
    tries = []

    def init(**kwargs):
        tries.append(kwargs)
        raise wandb.Error("init refused")

    monkeypatch.setattr(wandb, "init", init)
    metrics = tmp_path / "metrics.json"
    writer = WandbWriter(
        project="hookloop-test", mode="offline", dir=tmp_path, window_size=4, close_timeout=1.0
    )
    writer._BACKOFF = FAST_BACKOFF
    checkpoint = _Checkpoint(at=9)
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), writer], period=3), checkpoint])
    with caplog.at_level("WARNING", logger="hookloop.utils"):
        trainer.train(0, 20)

    assert trainer.iter == 20  # every iteration ran
    assert tries and all(t["id"] == writer._run_id() for t in tries)
    (retrying,) = _warnings(caplog, RETRYING)
    assert "WandbWriter: logging to W&B project hookloop-test (offline, " in retrying
    assert retrying.endswith("Error: init refused")
    total = _points(_metrics_json(metrics))
    (message,) = _warnings(caplog, "were not logged")
    assert message.startswith(f"WandbWriter: {total} of {total} points were not logged to ")
    assert message.endswith("; last error: Error: init refused")
    assert writer._wb_run is None and not list(tmp_path.glob("wandb/*run-*"))
    state = checkpoint.state["hookloop_hooks"]["PeriodicWriter"]["writers"]["1:WandbWriter"]
    assert state["run_id"] == writer._run_id() and state["last_step"] == -1
    # Every row written before the checkpoint, none sent: JSONWriter's rows, for the resumed
    # run to send first.
    pending = {it: values for it, _, values in state["pending"]}
    assert pending and max(pending) <= 9
    assert pending == {it: row for it, row in _metrics_json(metrics).items() if it in pending}


def test_an_error_that_clears_while_closing_loses_nothing(tmp_path, monkeypatch):
    """``run.log`` fails all through training and on the first try after close() began, then
    works: close() (60 s to drain) retries, and every step goes into the run."""
    writer = _writer(tmp_path)  # strict: close() raises if a point was not logged
    writer._BACKOFF = FAST_BACKOFF
    closing_calls = []

    def fails(n):
        if writer._phase < _Phase.CLOSING:
            return True
        closing_calls.append(n)
        return len(closing_calls) == 1

    failing = _FailingLog(monkeypatch, fails)
    metrics = tmp_path / "metrics.json"
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), writer], period=3)])
    try:
        trainer.train(0, 20)
    finally:
        if failing.run is not None and writer._error is not None:
            failing.run.finish()  # the writer leaves a run it could not log to open
    assert _history(_records(writer._wb_run_dir)) == _metrics_json(metrics)


# -- issue 35 ----------------------------------------------------------------------------------


class _Odd(Scripted):
    """Scripted's scalars, a name W&B keeps for itself (a leading ``_``), and every fifth
    iteration a grey and alpha image (which ``wandb.Image`` refuses as it is)."""

    def run_step(self):
        super().run_step()
        i, s = self.iter, self.storage
        s.put_scalar("_private", float(i), smoothing_hint=False)
        if i % 5 == 0:
            import torch

            s.put_image("mask", torch.full((2, 2, 3), 0.5))


def test_what_wandb_refuses_as_given_is_converted_and_nothing_blocks_the_run(tmp_path, caplog):
    """Issue 35, case 1, for W&B: an EvalHook's ``retrieval/R@1``, a ``_``-name (logged as
    ``-private``, one warning) and a grey and alpha image (logged as RGBA, as TensorBoard
    shows it) go into the run with every other point; the run is finished."""
    from hookloop.engine import EvalHook
    from PIL import Image

    metrics = tmp_path / "metrics.json"
    writer = _writer(tmp_path)  # strict: close() raises if a point was not logged
    trainer = _Odd()
    evals = EvalHook(5, lambda: {"retrieval": {"R@1": 0.5}})
    trainer.register_hooks([evals, PeriodicWriter([JSONWriter(metrics, 4), writer], period=3)])
    with caplog.at_level("WARNING", logger="hookloop.utils"):
        trainer.train(0, 12)
    records = _records(writer._wb_run_dir)
    assert any(r["type"] == "exit" for r in records), "the run was not finished"
    logged = _history(records)
    expected = _metrics_json(metrics)
    assert {k for row in expected.values() for k in row} >= {"retrieval/R@1", "_private"}
    for step, row in expected.items():
        got = {("_private" if k == "-private" else k): v for k, v in logged[step].items()}
        assert {k: v for k, v in got.items() if not k.startswith("mask")} == row, step
    (renamed,) = _warnings(caplog, "is logged to W&B")
    assert "'_private' is logged to W&B project hookloop-test" in renamed
    assert renamed.endswith("as '-private' (the names it takes)")
    steps = sorted(s for s, row in logged.items() if "mask._type" in row)
    assert steps == [0, 5, 10]
    name = logged[5]["mask.path"]  # as the reader prints it: a str, maybe JSON-encoded
    path = Path(writer._wb_run_dir) / "files" / (json.loads(name) if name[0] == '"' else name)
    pixels = np.asarray(Image.open(path))
    assert pixels.shape == (2, 3, 4) and (pixels == 127).all()  # grey 0.5 in R, G, B; alpha


def test_a_value_wandb_refuses_is_dropped_alone(tmp_path, monkeypatch, caplog):
    """Issue 35, case 1, for W&B: a value ``run.log`` refuses (``ValueError``) is dropped
    alone: the rest of its step is logged (one value at a time, then the step's commit), it
    is named in one warning and at close(), and the run is finished."""

    def refuse_bad(data):
        if "loss_cls" in data:
            raise ValueError("cannot take loss_cls")

    real_init = wandb.init

    def init(**kwargs):
        run = real_init(**kwargs)
        real_log = run.log

        def log(data, *args, **kw):
            refuse_bad(data)
            return real_log(data, *args, **kw)

        run.log = log
        return run

    monkeypatch.setattr(wandb, "init", init)
    metrics = tmp_path / "metrics.json"
    writer = WandbWriter(
        project="hookloop-test", mode="offline", dir=tmp_path, window_size=4, close_timeout=60
    )
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), writer], period=3)])
    with caplog.at_level("WARNING", logger="hookloop.utils"):
        trainer.train(0, 12)
    records = _records(writer._wb_run_dir)
    assert any(r["type"] == "exit" for r in records), "the run was not finished"
    expected = _metrics_json(metrics)
    without = {s: {k: v for k, v in row.items() if k != "loss_cls"} for s, row in expected.items()}
    assert _history(records) == without
    (refused,) = _warnings(caplog, "refused 'loss_cls'")
    assert "ValueError: cannot take loss_cls" in refused
    n = sum("loss_cls" in row for row in expected.values())
    (summary,) = _warnings(caplog, "were not logged")
    assert summary.startswith(f"WandbWriter: {n} of {_points(expected)} points were not logged")
    assert summary.endswith(f"; refused by the tracker and dropped: 'loss_cls' ({n})")


def test_rows_written_during_a_backoff_reach_wandb_once(tmp_path, monkeypatch):
    """Issue 35, case 2, for W&B: ``run.log`` fails on the second row of the first batch;
    the rows written while the writer waits out its backoff are sent after the retry, which
    resumes from the row that failed: every step once, JSONWriter's values."""
    import threading

    failed = threading.Event()

    def fails(n):
        if n == 2:
            failed.set()
            return True
        return False

    _FailingLog(monkeypatch, fails)
    metrics = tmp_path / "metrics.json"
    writer = _writer(tmp_path)  # strict: close() raises if a point was not logged
    writer._BACKOFF = (60.0, 60.0)  # the retry comes when close() begins

    class WaitForTheFailure(HookBase):
        def after_step(self):
            if self.trainer.iter == 3:
                assert failed.wait(READ_TIMEOUT), "run.log was not called twice"

    trainer = Scripted()
    writers = PeriodicWriter([JSONWriter(metrics, 4), writer], period=3)
    trainer.register_hooks([writers, WaitForTheFailure()])
    trainer.train(0, 20)
    records = _records(writer._wb_run_dir)
    assert _history(records) == _metrics_json(metrics)
    assert any(r["type"] == "exit" for r in records), "the run was not finished"


_EXIT_SCRIPT = """
import sys
from hookloop.utils.events import EventStorage, WandbWriter
writer = WandbWriter(project="hookloop-test", mode="offline", dir=sys.argv[1])
with EventStorage() as storage:
    for i in range(10):
        storage.iter = i
        storage.put_scalar("loss", float(i), smoothing_hint=False)
        writer.write()
"""


def test_a_writer_left_open_is_closed_at_exit(tmp_path):
    """Issue 35, case 4, for W&B: ten writes, then a normal interpreter exit without close():
    the run holds the ten points and is finished (the writer is closed before W&B's own exit
    handlers end its runs)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=READ_TIMEOUT,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    records = _records(run_dir)
    assert _history(records) == {i: {"loss": float(i)} for i in range(10)}
    assert any(r["type"] == "exit" for r in records), "the run was not finished"


# -- issue 42 ----------------------------------------------------------------------------------


def test_names_that_map_to_one_wandb_key_are_kept_apart(tmp_path, caplog):
    """Issue 42, item 3, for W&B: ``_x`` (logged as ``-x``: W&B keeps ``_`` keys) and ``-x``
    are two keys, not one: ``-x`` keeps its name, ``_x`` gets ``-`` and its CRC32; one
    warning."""
    import zlib

    class Both(TrainerBase):
        def run_step(self):
            i = self.iter
            self.storage.put_scalars(**{"_x": float(i), "-x": 100.0 + i}, smoothing_hint=False)

    writer = _writer(tmp_path)  # strict: close() raises if a point was not logged
    trainer = Both()
    trainer.register_hooks([PeriodicWriter([writer], period=1)])
    with caplog.at_level("WARNING", logger="hookloop.utils"):
        trainer.train(0, 4)
    other = f"-x-{zlib.crc32(b'_x'):08x}"
    assert _history(_records(writer._wb_run_dir)) == {
        i: {"-x": 100.0 + i, other: float(i)} for i in range(4)
    }
    (both,) = _warnings(caplog, "are both")
    assert both.endswith(f"'_x' is logged as '{other}'")


class _LateMedia(HookBase):
    """Puts an image and a histogram at every iteration after ``PeriodicWriter`` wrote it (a
    visualisation hook registered after the writers)."""

    def after_step(self):
        import torch

        i, s = self.trainer.iter, self.trainer.storage
        s.put_image("late", torch.full((3, 2, 2), i / 10))
        s.put_histogram("late_h", torch.arange(4.0) + i, bins=2)


def test_media_put_after_the_writer_reach_wandb_at_their_iteration(tmp_path):
    """Issue 42, item 3: images and histograms that a hook after ``PeriodicWriter`` puts at
    an iteration the writer already wrote reach W&B at that iteration's step (the next write
    takes them, and W&B's newest step is still open), as TensorBoard has them: 5 of 5."""
    from hookloop.utils.events import TensorboardXWriter
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = tmp_path / "metrics.json"
    writer = _writer(tmp_path)  # strict: close() raises if a point was not logged (or refused)
    tb = TensorboardXWriter(tmp_path / "tb")
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([JSONWriter(metrics, 4), tb, writer], period=1)])
    trainer.register_hooks([_LateMedia()])
    trainer.train(0, 5)
    logged = _history(_records(writer._wb_run_dir))
    assert sorted(s for s, row in logged.items() if row.get("late._type") == "image-file") == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert sorted(s for s, row in logged.items() if any(k.startswith("late_h") for k in row)) == [
        0,
        1,
        2,
        3,
        4,
    ]
    expected = _metrics_json(metrics)
    for step, row in expected.items():
        assert {k: v for k, v in logged[step].items() if not k.startswith("late")} == row
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "histograms": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("late")] == [0, 1, 2, 3, 4]
    assert [e.step for e in acc.Histograms("late_h")] == [0, 1, 2, 3, 4]


def test_a_wandb_sender_that_dies_ends_the_run_failed(tmp_path, monkeypatch, caplog):
    """Issue 42, item 5, for W&B: ``SystemExit`` raised in ``run.log`` stops the writer's
    thread with a message naming it; close() counts what was not logged and ends the run
    with exit code 1 (W&B shows it failed), not 0."""
    _FailingLog(monkeypatch, lambda n: n == 2)
    real_init = wandb.init

    def init(**kwargs):
        run = real_init(**kwargs)
        failing_log = run.log

        def log(*args, **kw):
            try:
                return failing_log(*args, **kw)
            except wandb.Error as e:
                raise SystemExit(str(e)) from None

        run.log = log
        return run

    monkeypatch.setattr(wandb, "init", init)
    writer = WandbWriter(project="hookloop-test", dir=tmp_path, close_timeout=CLOSE_TIMEOUT)
    flush = _FlushAt(writer, at=0)
    trainer = Scripted()
    trainer.register_hooks([PeriodicWriter([writer], period=1), flush])
    with caplog.at_level("WARNING", logger="hookloop.utils"):
        trainer.train(0, 5)
    (died,) = _warnings(caplog, "the writer's thread stopped on SystemExit")
    assert "log refused (call 2)" in died
    (summary,) = _warnings(caplog, "were not logged")
    assert summary.endswith("; the run ends FAILED")
    records = _records(writer._wb_run_dir)
    (exit_record,) = [r for r in records if r["type"] == "exit"]
    assert exit_record["exit"]["exit_code"] == 1
