"""MLflowWriter against the real mlflow client: a local tracking store read back with
``MlflowClient``, an unreachable server, a server that never answers, and resume."""

import io
import json
import logging
import socket
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from hookloop.engine import HookBase, PeriodicWriter, TrainerBase
from hookloop.utils.events import EventStorage, JSONWriter, TensorboardXWriter
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

mlflow = pytest.importorskip("mlflow")
from hookloop.utils.events import MLflowWriter  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

# mlflow's stores warn about their own dependencies (SQLAlchemy's deprecations, the file
# store's future removal): not this project's to fix.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(autouse=True)
def _file_store_allowed(monkeypatch):
    # mlflow 3 refuses its file store unless asked; the tests use it beside sqlite.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


class Trainer(TrainerBase):
    """Scalars that depend only on the iteration: a resumed run computes the same ones."""

    def run_step(self):
        i = self.iter
        self.storage.put_scalars(loss=1.0 / (i + 1), acc=(i * 7 % 11) / 11.0)
        self.storage.put_scalar("lr", 0.1 * 0.9**i, smoothing_hint=False)


def _history(client, run_id, key):
    points = client.get_metric_history(run_id, key)
    return sorted(points, key=lambda p: (p.step, p.timestamp))


def _quiet_http(monkeypatch):
    # The client's own retries and timeout, kept short so its thread ends soon after a test.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_points_equal_metrics_json_and_tensorboard(tmp_path, store):
    uri = f"sqlite:///{tmp_path}/mlflow.db" if store == "sqlite" else (tmp_path / "mlruns").as_uri()
    writer = MLflowWriter(
        uri,
        experiment_name="hookloop-test",
        run_name="tiny",
        tags={"model": "mlp"},
        params={"solver": {"base_lr": 0.1, "steps": (10, 20)}, "seed": 3},
    )
    json_path = tmp_path / "metrics.json"
    trainer = Trainer()
    writers = [JSONWriter(json_path), TensorboardXWriter(tmp_path / "tb"), writer]
    trainer.register_hooks([PeriodicWriter(writers, period=7)])
    trainer.train(0, 45)

    rows = [json.loads(line) for line in json_path.read_text().splitlines()]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("hookloop-test").experiment_id])
    assert run.info.run_name == "tiny"
    assert run.info.status == "FINISHED"
    assert run.data.tags["model"] == "mlp"
    assert run.data.params == {"solver.base_lr": "0.1", "solver.steps": "(10, 20)", "seed": "3"}
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for key in ("loss", "acc", "lr"):
        want = [(r["iteration"], r[key]) for r in rows if key in r]
        points = _history(client, run.info.run_id, key)
        assert [(p.step, p.value) for p in points] == want  # exact: both keep a double
        stamps = [p.timestamp for p in points]
        assert stamps == sorted(stamps)
        tb = [(e.step, np.float32(e.value)) for e in acc.Scalars(key)]
        assert tb == [(s, np.float32(v)) for s, v in want]
    assert [r["iteration"] for r in rows] == [6, 13, 20, 27, 34, 41, 44]


@pytest.mark.slow
def test_resume_continues_the_run_with_one_point_per_step(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"

    def run(start, stop, state=None, saved=None):
        trainer = Trainer()
        writer = MLflowWriter(uri, experiment_name="resume")
        hooks = [PeriodicWriter([writer], period=1)]
        if saved is not None:

            class Save(HookBase):
                def after_step(self):
                    if self.trainer.iter == 19:
                        saved.update(self.trainer.state_dict())

            hooks.append(Save())
        trainer.register_hooks(hooks)
        if state is not None:
            trainer.load_state_dict(state)
        trainer.train(start, stop)

    saved = {}
    run(0, 30, saved=saved)  # the "killed" run: it went on past its checkpoint at 20
    assert saved["iteration"] == 19  # a checkpoint after iteration 19: resume at 20
    run(20, 40, state=saved)
    run_uninterrupted = f"sqlite:///{tmp_path}/whole.db"
    trainer = Trainer()
    trainer.register_hooks([PeriodicWriter([MLflowWriter(run_uninterrupted)], period=1)])
    trainer.train(0, 40)

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert len(runs) == 1  # the resumed run logged into the same run
    whole = MlflowClient(run_uninterrupted)
    (reference,) = whole.search_runs(["0"])
    for key in ("loss", "acc", "lr"):
        got = [(p.step, p.value) for p in _history(client, runs[0].info.run_id, key)]
        want = [(p.step, p.value) for p in _history(whole, reference.info.run_id, key)]
        assert got == want
        assert [s for s, _ in got] == list(range(40))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_with(writer, iters=30):
    trainer = Trainer()
    trainer.register_hooks([PeriodicWriter([writer], period=1)])
    trainer.train(0, iters)  # returns: the tracker never blocks training


@pytest.mark.slow
def test_unreachable_server_warns_once_and_at_close_never_raises(tmp_path, monkeypatch, caplog):
    _quiet_http(monkeypatch)
    uri = f"http://127.0.0.1:{_free_port()}"
    writer = MLflowWriter(uri, close_timeout=1.0)

    class FirstFailure(HookBase):
        def after_step(self):  # a loaded machine's first request can outlast close_timeout
            deadline = time.monotonic() + 60
            while writer._error is None and time.monotonic() < deadline:
                time.sleep(0.01)

    trainer = Trainer()
    trainer.register_hooks([PeriodicWriter([writer], period=1), FirstFailure()])
    with caplog.at_level(logging.WARNING, logger="hookloop.utils.trackers"):
        trainer.train(0, 30)
    failed = [r.getMessage() for r in caplog.records if "failed, retrying" in r.getMessage()]
    assert len(failed) == 1 and uri in failed[0]
    lost = [r.getMessage() for r in caplog.records if "were not logged" in r.getMessage()]
    assert len(lost) == 1
    assert uri in lost[0] and "90 of 90 points" in lost[0]


@pytest.mark.slow
def test_a_server_that_never_answers_does_not_stall_training(tmp_path, monkeypatch, caplog):
    _quiet_http(monkeypatch)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)  # accepts connections (the kernel's backlog), never answers
        uri = f"http://127.0.0.1:{server.getsockname()[1]}"
        writer = MLflowWriter(uri, close_timeout=0.5)
        with caplog.at_level(logging.WARNING, logger="hookloop.utils.trackers"):
            _train_with(writer)
    assert any(
        "were not logged" in r.getMessage() and uri in r.getMessage() for r in caplog.records
    )


@pytest.mark.slow
def test_strict_raises_what_was_not_logged(monkeypatch):
    _quiet_http(monkeypatch)
    writer = MLflowWriter(f"http://127.0.0.1:{_free_port()}", strict=True, close_timeout=0.5)
    with pytest.raises(RuntimeError, match="points were not logged"):
        _train_with(writer, iters=3)


@pytest.mark.slow
def test_a_full_buffer_drops_the_oldest_points_counted(monkeypatch, caplog):
    _quiet_http(monkeypatch)
    uri = f"http://127.0.0.1:{_free_port()}"
    writer = MLflowWriter(uri, max_buffered=10, close_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="hookloop.utils.trackers"):
        _train_with(writer, iters=40)
    dropped = [r.getMessage() for r in caplog.records if "dropped the oldest" in r.getMessage()]
    assert dropped, "no drop was reported"
    (lost,) = [r.getMessage() for r in caplog.records if "were not logged" in r.getMessage()]
    assert "120 points" in lost and "dropped from a full buffer" in lost


def test_bad_arguments_name_the_problem(tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    with pytest.raises(TypeError, match="window_size"):
        MLflowWriter(uri, window_size=2.5)
    with pytest.raises(ValueError, match="max_buffered"):
        MLflowWriter(uri, max_buffered=0)
    with pytest.raises(TypeError, match="strict"):
        MLflowWriter(uri, strict="yes")
    with pytest.raises(TypeError, match="config"):
        MLflowWriter(uri, params=[1, 2])


def test_without_the_client_it_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ImportError, match=r"hookloop\[mlflow\]"):
        MLflowWriter("file:///nowhere")


def test_importing_hookloop_does_not_import_the_clients():
    import subprocess

    code = (
        "import sys, hookloop, hookloop.engine, hookloop.utils.events;"
        "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_write_outside_a_storage_and_after_close(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(uri)
    with EventStorage():
        writer.write()  # nothing to write: no run is made
    writer.close()
    assert MlflowClient(uri).search_runs(["0"]) == []
    with pytest.raises(ValueError, match="after close"):
        writer.write()


def test_default_writers_and_the_config_add_trackers(tmp_path, monkeypatch):
    from hookloop.engine import TrainConfig, default_writers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    writers = default_writers(tmp_path, 10, trackers=("mlflow",))
    (tracker,) = [w for w in writers if isinstance(w, MLflowWriter)]
    assert tracker._where() == f"MLflow at sqlite:///{tmp_path}/mlflow.db"
    assert tracker._experiment_name == "hookloop"
    assert tracker._artifact_location == str(tmp_path / "mlartifacts")
    assert [type(w).__name__ for w in writers[:3]] == [
        "CommonMetricPrinter",
        "JSONWriter",
        "TensorboardXWriter",
    ]
    for w in writers:
        w.close()
    with pytest.raises(ValueError, match="'neptune'"):
        default_writers(tmp_path, 10, trackers=("neptune",))
    with pytest.raises(ValueError, match="trackers"):
        TrainConfig(trackers=("neptune",))


def _demo(out, *args, code=0):
    import subprocess

    command = [sys.executable, "-m", "hookloop", "demo", "--output", str(out), "--mlflow"]
    command += ["--iters", "200", "--checkpoint-period", "50", "--eval-period", "1000", *args]
    # Run in out's parent: nothing may land in the working directory (a database store's
    # default experiment would put its artifacts in ./mlruns).
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=out.parent)
    assert proc.returncode == code, proc.stderr
    assert not (out.parent / "mlruns").exists()
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    experiment = client.get_experiment_by_name("hookloop")
    return client, client.search_runs([experiment.experiment_id])


@pytest.mark.slow
def test_the_demo_logs_to_mlflow_and_resumes_into_the_same_run(tmp_path):
    _demo(tmp_path / "cut", "--interrupt-at", "120", code=130)  # as after Ctrl-C
    client, runs = _demo(tmp_path / "cut", "--resume")
    whole, (reference,) = _demo(tmp_path / "whole")
    assert len(runs) == 1
    rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.json").read_text().splitlines()]
    for key in ("total_loss", "lr"):
        got = [(p.step, p.value) for p in _history(client, runs[0].info.run_id, key)]
        assert got == [(r["iteration"], r[key]) for r in rows if key in r]
        want = [(p.step, p.value) for p in _history(whole, reference.info.run_id, key)]
        assert got == want
    # The images and histograms: beside the store, one per step put, as TensorBoard has them.
    acc = EventAccumulator(str(tmp_path / "whole"), size_guidance={"images": 0})
    acc.Reload()
    tb_steps = sorted(e.step for e in acc.Images("weights/body"))
    assert tb_steps, "the demo puts images"
    for c, run in ((client, runs[0]), (whole, reference)):
        paths = [a.path for a in c.list_artifacts(run.info.run_id, "images")]
        steps = sorted(int(p.split("+")[2]) for p in paths if p.endswith(".png"))
        assert steps == tb_steps
        hists = c.list_artifacts(run.info.run_id, "histograms/weights/body")
        assert len(hists) == len(tb_steps)
    assert list((tmp_path / "whole" / "mlartifacts").iterdir())


@pytest.mark.slow
def test_a_batch_that_fails_part_way_is_not_logged_twice(tmp_path):
    # One write of 1500 scalars is two log_batch calls; the second fails once.
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(uri, close_timeout=30)
    writer._BACKOFF = (0.01, 0.05)
    real = writer._client.log_batch
    calls = []

    def log_batch(run_id, metrics=(), **kw):
        calls.append(len(metrics))
        if metrics and len(calls) == 3:  # after the params call and the first half
            raise ConnectionError("dropped")
        return real(run_id, metrics=metrics, **kw)

    writer._client.log_batch = log_batch
    writer.log_params({"a": 1})
    with EventStorage() as storage:
        storage.put_scalars(**{f"m{i:04d}": float(i) for i in range(1500)}, smoothing_hint=False)
        writer.write()
    writer.close()
    client = MlflowClient(uri)
    (run,) = client.search_runs(["0"])
    for key in ("m0000", "m0999", "m1000", "m1499"):
        assert [(p.step, p.value) for p in client.get_metric_history(run.info.run_id, key)] == [
            (0, float(key[1:]))
        ]
    assert calls == [0, 1000, 500, 500]


# -- issue 35: a refused item never blocks the rest; retries exact; backoff; exit; -------------

LONG = "long_" + "x" * 300
# MLflow's names for them (docs/trackers.md): a name past 250 characters keeps its first 241,
# then "-" and its CRC32.
MAPPED = {
    "acc@5": "acc_5",
    "f(x)": "f_x_",
    "top 50%": "top 50_",
    "w[0]": "w_0_",
    "a//b": "a/b",
    "/lead": "lead",
    LONG: f"{LONG[:241]}-{zlib.crc32(LONG.encode()):08x}",
    "retrieval/R@1": "retrieval/R_1",
    "retrieval/R@5": "retrieval/R_5",
}
BAD_NAMES = list(MAPPED)[:7]


class Awkward(TrainerBase):
    """What a user's run puts that MLflow refuses as given: scalar names with ``@ ( ) % [ ]``,
    ``a//b``, a leading ``/``, over 250 characters; a histogram named ``../../x``; a grey and
    alpha image."""

    def run_step(self):
        i, s = self.iter, self.storage
        s.put_scalar("total_loss", 1.0 / (i + 1))
        s.put_scalars(**{n: float(i + k) for k, n in enumerate(BAD_NAMES)}, smoothing_hint=False)
        if i % 10 == 0:
            g = torch.Generator().manual_seed(i)
            s.put_histogram("../../x", torch.randn(50, generator=g), bins=4)
            s.put_image("grey+alpha", torch.rand(2, 3, 4, generator=g))


def _messages(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.mark.slow
def test_names_mlflow_refuses_are_mapped_and_nothing_blocks_the_run(tmp_path, caplog):
    """Issue 35, case 1: an EvalHook's ``{"retrieval": {"R@1": ...}}`` and the other names
    MLflow refuses are logged under MLflow's names (one warning per renamed name), with every
    other point, and the run ends FINISHED with nothing lost."""
    from hookloop.engine import EvalHook

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(
        uri, params={"lr@base": 0.1}, artifact_location=str(tmp_path / "art"), strict=True
    )
    writer._client.create_experiment("e", artifact_location=str(tmp_path / "art"))
    writer._experiment_name = "e"
    metrics = tmp_path / "metrics.json"
    trainer = Awkward()
    evals = EvalHook(10, lambda: {"retrieval": {"R@1": 0.5, "R@5": 0.75}})
    tb = TensorboardXWriter(tmp_path / "tb")
    trainer.register_hooks([evals, PeriodicWriter([JSONWriter(metrics), tb, writer], period=7)])
    with caplog.at_level(logging.WARNING, logger="hookloop.utils"):
        trainer.train(0, 40)  # strict: close() raises if a point was not logged

    client = MlflowClient(uri)
    run = client.get_run(writer._mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr_base": "0.1"}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    written = {k for r in rows for k in r} - {"iteration"}
    assert {"retrieval/R@1", "retrieval/R@5", *BAD_NAMES} <= written
    for key in written:
        want = [(r["iteration"], r[key]) for r in rows if key in r]
        name = MAPPED.get(key, key)
        got = [(p.step, p.value) for p in _history(client, run.info.run_id, name)]
        assert got == want, key
    assert len(MAPPED[LONG]) == 250
    renamed = _messages(caplog, "is logged to MLflow at")
    # Once each: the scalars, the param, the histogram's path and the image's key.
    assert len(renamed) == len(BAD_NAMES) + 2 + 1 + 2, renamed
    assert not _messages(caplog, "failed, retrying") and not _messages(caplog, "refused")
    hists = client.list_artifacts(run.info.run_id, "histograms/__/__/x")
    assert len(hists) == 4
    # The grey and alpha image as TensorBoard shows it: grey in R, G and B, and the alpha.
    tb_acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    tb_acc.Reload()
    (first, *_) = tb_acc.Images("grey+alpha")
    from PIL import Image

    tb_pixels = np.asarray(Image.open(io.BytesIO(first.encoded_image_string)).convert("RGBA"))
    paths = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    (png,) = [p for p in paths if p.endswith(".png") and "+step+0+" in p]
    local = client.download_artifacts(run.info.run_id, png, str(tmp_path / "dl"))
    assert np.array_equal(np.asarray(Image.open(local)), tb_pixels)


@pytest.mark.slow
def test_a_param_mlflow_still_refuses_is_dropped_alone(tmp_path, caplog):
    """Issue 35, case 1: what MLflow refuses after the mapping (a resumed run's param whose
    value changed) is dropped alone, named in one warning and at close(); the other params
    and every point are logged, and the run ends FINISHED."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = MLflowWriter(uri, params={"lr": 0.1})
    with EventStorage() as storage:
        storage.put_scalar("loss", 1.0)
        first.write()
    first.close()
    run_id = first._mlflow_run_id

    again = MLflowWriter(uri, run_id=run_id, params={"lr": 0.2, "seed": 3, "steps": (1, 2)})
    with caplog.at_level(logging.WARNING, logger="hookloop.utils"):
        _train_with(again)
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1", "seed": "3", "steps": "(1, 2)"}
    assert [p.step for p in _history(client, run_id, "loss")] == [0, *range(30)]
    assert len(_history(client, run_id, "acc")) == 30
    (refused,) = _messages(caplog, "refused param 'lr'")
    assert "MlflowException" in refused
    (summary,) = _messages(caplog, "were not logged")
    assert summary.startswith("MLflowWriter: 0 of 90 points were not logged")
    assert summary.endswith("; refused by the tracker and dropped: param 'lr' (1)")


@pytest.mark.slow
def test_rows_written_during_a_backoff_reach_mlflow_once(tmp_path):
    """Issue 35, case 2: ``log_image`` fails once after the batch's scalars went in; rows
    written while the writer waits out its backoff are sent after it, and every point and
    image reaches MLflow once (the retry resumes from the call that failed)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(uri, artifact_location=str(tmp_path / "art"), close_timeout=60)
    writer._client.create_experiment("e", artifact_location=str(tmp_path / "art"))
    writer._experiment_name = "e"
    writer._BACKOFF = (60.0, 60.0)  # the retry comes when close() begins, after the writes
    failed = threading.Event()
    real = writer._client.log_image

    def log_image(*args, **kw):
        if not failed.is_set():
            failed.set()
            raise ConnectionError("dropped")
        return real(*args, **kw)

    writer._client.log_image = log_image
    with EventStorage() as storage:
        for i in range(12):
            storage.iter = i
            storage.put_scalars(loss=float(i), acc=i / 10, smoothing_hint=False)
            if i % 3 == 0:
                storage.put_image("img", torch.full((3, 2, 2), i / 12))
            writer.write()
            if i == 0:
                assert failed.wait(30), "log_image was not called"
    writer.close()
    client = MlflowClient(uri)
    run_id = writer._mlflow_run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    for key, scale in (("loss", 1.0), ("acc", 0.1)):
        got = [(p.step, p.value) for p in _history(client, run_id, key)]
        assert got == [(i, i * scale if key == "loss" else i / 10) for i in range(12)], key
    pngs = [a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
    assert sorted(int(p.split("+")[2]) for p in pngs) == [0, 3, 6, 9]


@pytest.mark.slow
def test_writes_during_an_outage_do_not_wake_the_sender(tmp_path):
    """Issue 35, case 3: while ``log_batch`` fails, a write every few milliseconds does not
    make the writer try again: its attempts are at most what the backoff schedule allows in
    the time the writes took (counted, no timing asserted)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(uri, close_timeout=0.0)
    writer._BACKOFF = (0.05, 0.4)
    attempts = []

    def log_batch(*args, **kw):
        attempts.append(time.monotonic())
        raise ConnectionError("down")

    writer._client.log_batch = log_batch
    with EventStorage() as storage:
        storage.put_scalar("loss", 0.0)
        writer.write()
        deadline = time.monotonic() + 60
        while not attempts and time.monotonic() < deadline:  # the store opens, then fails
            time.sleep(0.01)
        assert attempts, "log_batch was not called"
        for i in range(1, 300):
            storage.iter = i
            storage.put_scalar("loss", float(i))
            writer.write()
            time.sleep(0.002)
    tried, elapsed = len(attempts), time.monotonic() - attempts[0]
    writer.close()
    # Attempt n + 1 comes at least sum(waits[:n]) after the first: the most that fit.
    allowed, waited, wait = 1, 0.0, writer._BACKOFF[0]
    while waited + wait <= elapsed:
        allowed, waited, wait = allowed + 1, waited + wait, min(wait * 2, writer._BACKOFF[1])
    assert 1 <= tried <= allowed + 1, (tried, allowed, elapsed)


_EXIT_SCRIPT = """
import sys
from hookloop.utils.events import EventStorage, MLflowWriter
writer = MLflowWriter(sys.argv[1], close_timeout=float(sys.argv[2]))
with EventStorage() as storage:
    for i in range(10):
        storage.iter = i
        storage.put_scalar("loss", float(i), smoothing_hint=False)
        writer.write()
print("exiting", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("reachable", [True, False])
def test_a_tracker_left_open_is_closed_at_exit(tmp_path, monkeypatch, reachable):
    """Issue 35, case 4: ten writes, then a normal interpreter exit without close(): the
    points reach the tracker and the run ends FINISHED; an unreachable tracker gives up
    within its close_timeout and warns naming what was lost."""
    import os
    import subprocess

    _quiet_http(monkeypatch)
    uri = f"sqlite:///{tmp_path}/mlflow.db" if reachable else f"http://127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, uri, "30" if reachable else "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "exiting"
    if reachable:
        client = MlflowClient(uri)
        (run,) = client.search_runs(["0"])
        assert run.info.status == "FINISHED"
        got = [(p.step, p.value) for p in _history(client, run.info.run_id, "loss")]
        assert got == [(i, float(i)) for i in range(10)]
        assert "were not logged" not in proc.stderr
    else:
        assert f"10 of 10 points were not logged to MLflow at {uri}" in proc.stderr


@pytest.mark.slow
def test_a_forked_child_does_not_close_its_parents_tracker(tmp_path):
    """A forked process (a DataLoader worker) that exits runs threading's exit hook too: it
    must not close the tracker it inherited (end the run, send the queue again)."""
    import multiprocessing

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(uri)
    with EventStorage() as storage:
        storage.put_scalar("loss", 1.0)
        writer.write()
        assert writer.flush(30)
        child = multiprocessing.get_context("fork").Process(target=int)
        child.start()
        child.join(60)
        assert child.exitcode == 0
        client = MlflowClient(uri)
        assert client.get_run(writer._mlflow_run_id).info.status == "RUNNING"
        storage.iter = 1
        storage.put_scalar("loss", 2.0)
        writer.write()
    writer.close()
    run = client.get_run(writer._mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert [p.step for p in _history(client, run.info.run_id, "loss")] == [0, 1]


# -- issue 42: a tracker never merges, drops or duplicates a point; failures that do not lie --


def _crc(name):
    return f"{zlib.crc32(name.encode()):08x}"


def _points_in(client, run_id):
    """Every metric point of the run: (key, step) -> how many times it is there."""
    counts = {}
    for key in client.get_run(run_id).data.metrics:
        for p in client.get_metric_history(run_id, key):
            counts[(key, p.step)] = counts.get((key, p.step), 0) + 1
    return counts


class Colliding(TrainerBase):
    """Names that MLflow's rule maps to one: scalars ``acc@1`` and ``acc_1``, histograms
    ``w@1`` and ``w_1``."""

    def run_step(self):
        i, s = self.iter, self.storage
        s.put_scalars(**{"acc@1": float(i), "acc_1": 100.0 + i}, smoothing_hint=False)
        s.put_histogram("w@1", torch.full((4,), float(i)), bins=2)
        s.put_histogram("w_1", torch.full((4,), 100.0 + i), bins=2)


@pytest.mark.slow
def test_names_that_map_to_one_are_kept_apart(tmp_path, caplog):
    """Issue 42, item 3: ``acc@1`` and ``acc_1`` (and two such histograms, and two such
    params) are two series in MLflow, not one with two points a step: the name MLflow takes
    as given keeps it, the other gets ``-`` and its CRC32; one warning each; a checkpoint
    holds the names chosen."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(
        uri,
        experiment_name="e",
        artifact_location=str(tmp_path / "art"),
        params={"lr@x": 1, "lr_x": 2},
        strict=True,
    )
    trainer = Colliding()
    trainer.register_hooks([PeriodicWriter([writer], period=1)])
    with caplog.at_level(logging.WARNING, logger="hookloop.utils"):
        trainer.train(0, 5)
    client = MlflowClient(uri)
    run_id = writer._mlflow_run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr_x": "2", f"lr_x-{_crc('lr@x')}": "1"}
    other = f"acc_1-{_crc('acc@1')}"
    assert [(p.step, p.value) for p in _history(client, run_id, "acc_1")] == [
        (i, 100.0 + i) for i in range(5)
    ]
    assert [(p.step, p.value) for p in _history(client, run_id, other)] == [
        (i, float(i)) for i in range(5)
    ]
    for folder, written, base in (("w_1", "w_1", 100.0), (f"w_1-{_crc('w@1')}", "w@1", 0.0)):
        paths = [a.path for a in client.list_artifacts(run_id, f"histograms/{folder}")]
        assert len(paths) == 5, folder
        for step, path in enumerate(sorted(paths)):
            local = client.download_artifacts(run_id, path, str(tmp_path))
            with open(local) as f:
                record = json.load(f)
            assert (record["name"], record["step"], record["min"]) == (written, step, base + step)
    both = _messages(caplog, "are both")
    assert len(both) == 3, both  # the metric, the histogram, the param: once each
    assert f"'acc@1' is logged as '{other}'" in " ".join(both)
    assert ["metric", "acc@1", other] in writer._state_dict()["names"]


class MediaOnce(Trainer):
    """Trainer's scalars, and one image at iteration 2."""

    def run_step(self):
        super().run_step()
        if self.iter == 2:
            self.storage.put_image("img", torch.full((3, 4, 4), 0.5))


@pytest.mark.slow
def test_a_resumed_run_sends_what_mlflow_lacks_and_nothing_it_has(tmp_path):
    """Issue 42, item 3: the killed run's scalars of iteration 2 reached MLflow, its image did
    not (log_image failing until the kill); the checkpoint at 3 holds the image. The resumed
    run sends the image at step 2 and none of the scalars MLflow has: every point once."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    art = str(tmp_path / "art")

    def writer():
        w = MLflowWriter(uri, experiment_name="e", artifact_location=art, close_timeout=0)
        return w

    killed = writer()
    killed._BACKOFF = (60.0, 60.0)  # its retry never comes before the "kill"
    failing = threading.Event()

    def log_image(*args, **kw):
        failing.set()
        raise ConnectionError("the artifact store is down")

    killed._client.log_image = log_image
    saved = {}

    class Checkpoint(HookBase):
        def after_step(self):
            if self.trainer.iter == 3:
                assert failing.wait(60), "log_image was not called"
                saved.update(self.trainer.state_dict())

    trainer = MediaOnce()
    trainer.register_hooks([PeriodicWriter([killed], period=1), Checkpoint()])
    trainer.train(0, 6)  # close() with a timeout of 0 stands for the kill: nothing more is sent
    client = MlflowClient(uri)
    run_id = killed._mlflow_run_id
    # The batch with iteration 2's image held 2, or 2 and 3: their scalars went in.
    assert max(step for _, step in _points_in(client, run_id)) in (2, 3)
    assert not client.list_artifacts(run_id, "images")

    resumed = writer()
    resumed._close_timeout = 60.0
    trainer = MediaOnce()
    trainer.register_hooks([PeriodicWriter([resumed], period=1)])
    trainer.load_state_dict(saved)
    trainer.train(4, 8)
    assert resumed._mlflow_run_id == run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    counts = _points_in(client, run_id)
    assert set(counts.values()) == {1}  # nothing twice
    assert sorted(counts) == sorted((k, s) for k in ("loss", "acc", "lr") for s in range(8))
    pngs = [a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
    assert [int(p.split("+")[2]) for p in pngs] == [2]


@pytest.mark.slow
def test_a_file_store_batch_that_fails_part_way_is_retried_from_the_point_that_failed(
    tmp_path, monkeypatch
):
    """Issue 42, item 4: MLflow's file store writes a batch point by point; one that fails
    after 399 of 1000 points (and whose retry would fail again further on) logs each point
    once: the retry asks the run which points it has."""
    from mlflow.store.tracking.file_store import FileStore

    uri = (tmp_path / "mlruns").as_uri()
    writer = MLflowWriter(uri, close_timeout=60, strict=True)
    writer._BACKOFF = (0.01, 0.05)
    real = FileStore._log_run_metric
    written = []

    def log_run_metric(self, run_info, metric):
        written.append(metric.key)
        if len(written) in (400, 1300):  # the second: a whole-batch retry's 900th point
            raise OSError("the disk hiccupped")
        return real(self, run_info, metric)

    monkeypatch.setattr(FileStore, "_log_run_metric", log_run_metric)
    with EventStorage() as storage:
        storage.put_scalars(**{f"m{i:04d}": float(i) for i in range(1000)}, smoothing_hint=False)
        writer.write()
    writer.close()  # strict: raises if a point was not logged
    assert len(written) >= 400
    counts = _points_in(MlflowClient(uri), writer._mlflow_run_id)
    assert counts == {(f"m{i:04d}", 0): 1 for i in range(1000)}


@pytest.mark.slow
def test_a_retried_log_image_does_not_upload_twice(tmp_path, monkeypatch):
    """Issue 42, item 4: ``log_image`` uploads the image, then its compressed copy; the
    copy's upload fails once. The retry does not upload the image again: one of each per
    step."""
    import os

    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(
        uri, experiment_name="e", artifact_location=str(tmp_path / "art"), strict=True
    )
    writer._BACKOFF = (0.01, 0.05)
    real = LocalArtifactRepository.log_artifact
    failed = []

    def log_artifact(self, local_file, artifact_path=None):
        if local_file.endswith(".webp") and not failed:
            failed.append(os.path.basename(local_file))
            raise OSError("the upload was cut")
        return real(self, local_file, artifact_path)

    monkeypatch.setattr(LocalArtifactRepository, "log_artifact", log_artifact)
    with EventStorage() as storage:
        for i in range(3):
            storage.iter = i
            storage.put_scalar("loss", float(i))
            storage.put_image("img", torch.full((3, 4, 4), i / 3))
            writer.write()
    writer.close()  # strict: raises if a point was not logged
    assert failed
    client = MlflowClient(uri)
    run = client.get_run(writer._mlflow_run_id)
    files = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    for ext in (".png", "+compressed.webp"):
        steps = sorted(int(p.split("+")[2]) for p in files if p.endswith(ext))
        assert steps == [0, 1, 2], (ext, files)
    assert run.data.tags["mlflow.loggedImages"] == "True"


@pytest.mark.slow
def test_a_run_deleted_mid_training_is_reported_once(tmp_path, caplog):
    """Issue 42, item 5: the run is deleted on the server at iteration 30 of 100: the writer
    sees it at the first refusal (no point split down and refused alone), says it once with
    its cause, and close() counts what was not logged, without waiting for anything."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(uri, close_timeout=30)
    real = writer._client.log_batch
    calls = []

    def log_batch(*args, **kw):
        calls.append(len(kw.get("metrics", ())))
        return real(*args, **kw)

    writer._client.log_batch = log_batch
    sent_before = []

    class Delete(HookBase):
        def after_step(self):
            if self.trainer.iter == 30:
                assert writer.flush(60)
                sent_before.append(len(calls))
                MlflowClient(uri).delete_run(writer._mlflow_run_id)

    trainer = Trainer()
    trainer.register_hooks([PeriodicWriter([writer], period=1), Delete()])
    with caplog.at_level(logging.WARNING, logger="hookloop.utils"):
        trainer.train(0, 100)
    assert len(calls) - sent_before[0] == 1  # one refused call, then nothing more
    (gone,) = [m for m in _messages(caplog, "no longer takes points") if "not logged" not in m]
    assert f"run {writer._mlflow_run_id} is deleted" in gone and "MlflowException" in gone
    assert not _messages(caplog, "refused")
    (summary,) = _messages(caplog, "were not logged")
    assert summary.startswith("MLflowWriter: 207 of 300 points were not logged to MLflow at")
    assert summary.endswith(f"no longer takes points: run {writer._mlflow_run_id} is deleted")
    run = MlflowClient(uri).get_run(writer._mlflow_run_id)
    assert run.info.lifecycle_stage == "deleted"


@pytest.mark.slow
def test_a_sender_that_dies_says_why_and_the_run_ends_failed(tmp_path, caplog):
    """Issue 42, item 5: ``SystemExit`` raised in the client (not an ``Exception``) stops the
    writer's thread: it says so, with the exception, at once; close() counts what is not in
    MLflow (exactly: the run's points and the count add up) and ends the run FAILED."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(uri, close_timeout=30)
    real = writer._client.log_batch
    calls = []

    def log_batch(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise SystemExit("the client called sys.exit()")
        return real(*args, **kw)

    writer._client.log_batch = log_batch

    class FirstAlone(HookBase):
        def after_step(self):
            if self.trainer.iter == 0:
                assert writer.flush(60)  # the first call holds iteration 0 alone

    trainer = Trainer()
    trainer.register_hooks([PeriodicWriter([writer], period=1), FirstAlone()])
    with caplog.at_level(logging.WARNING, logger="hookloop.utils"):
        trainer.train(0, 10)
    (died,) = _messages(caplog, "the writer's thread stopped on SystemExit")
    assert "the client called sys.exit()" in died
    client = MlflowClient(uri)
    run = client.get_run(writer._mlflow_run_id)
    assert run.info.status == "FAILED"
    (summary,) = _messages(caplog, "were not logged")
    in_mlflow = sum(_points_in(client, run.info.run_id).values())
    assert in_mlflow == 3  # iteration 0's
    assert summary.startswith(f"MLflowWriter: {30 - in_mlflow} of 30 points were not logged")
    assert "the writer's thread stopped: SystemExit: the client called sys.exit()" in summary
    assert summary.endswith("; the run ends FAILED")


def _blocked_second_call(writer):
    """Makes the writer's second ``log_batch`` wait until the returned event is set; the
    first returned event is set when that call began."""
    real = writer._client.log_batch
    calls = []
    began, release = threading.Event(), threading.Event()

    def log_batch(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            began.set()
            assert release.wait(60), "the test did not release the call"
        return real(*args, **kw)

    writer._client.log_batch = log_batch
    return began, release


def _write_five_with_the_second_blocked(writer, began):
    """Five writes of three scalars; the second also has an image, whose call comes after the
    blocked one in the same batch."""
    with EventStorage() as storage:
        for i in range(5):
            storage.iter = i
            storage.put_scalars(a=float(i), b=float(i), c=float(i), smoothing_hint=False)
            if i == 1:
                storage.put_image("img", torch.zeros(3, 2, 2))
            writer.write()
            if i == 0:
                assert writer.flush(60)  # the first batch is the first write's alone
            if i == 1:
                assert began.wait(60), "the second call did not begin"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["timeout", "ctrl-c"])
def test_a_close_that_gives_up_leaves_a_true_state(tmp_path, caplog, how):
    """Issue 42, item 5: close() gives up (its timeout, or Ctrl-C while it waits) while the
    writer's thread is in a call to MLflow: it says how many points are not logged and that
    one call still runs; the thread makes no other call (not the image's of the same batch,
    nor the later batches'), and when that one returns it ends
    the run (FAILED; KILLED after Ctrl-C) and says the final count, which is what MLflow
    has. Ctrl-C is raised again."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(
        uri,
        experiment_name="e",
        artifact_location=str(tmp_path / "art"),
        close_timeout=0.2 if how == "timeout" else 60,
    )
    began, release = _blocked_second_call(writer)
    with caplog.at_level(logging.WARNING, logger="hookloop.utils"):
        _write_five_with_the_second_blocked(writer, began)
        thread = writer._thread
        if how == "ctrl-c":

            def join(timeout=None):
                raise KeyboardInterrupt  # as Ctrl-C arrives while close() waits

            thread.join = join
            with pytest.raises(KeyboardInterrupt):
                writer.close()
        else:
            writer.close()
        (summary,) = _messages(caplog, "were not logged")
        verb = "gave up" if how == "timeout" else "was interrupted"
        assert summary.startswith("MLflowWriter: 13 of 16 points were not logged"), summary
        assert f"; 3 of them in a call to it still running when close() {verb}" in summary
        release.set()
        threading.Thread.join(thread, 60)
        assert not thread.is_alive()
    state = "FAILED" if how == "timeout" else "KILLED"
    (final,) = _messages(caplog, "that close() left running returned")
    assert f"in all, 10 of 16 points are not in it; the run ends {state}" in final
    client = MlflowClient(uri)
    assert client.get_run(writer._mlflow_run_id).info.status == state
    assert sorted(_points_in(client, writer._mlflow_run_id)) == [
        (k, s) for k in "abc" for s in (0, 1)
    ]
    assert not client.list_artifacts(writer._mlflow_run_id, "images")  # no call after it


@pytest.mark.slow
def test_a_checkpoint_holds_at_most_the_byte_bound_as_it_pickles(tmp_path):
    """Issue 42, item 5: random pixels pickle as 1.5 times their bytes (torch.save's protocol
    2); the writer's state holds at most ``max_buffered_bytes`` as pickled (the newest
    images), and loads with ``weights_only=True``."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    bound = 1 << 20
    writer = MLflowWriter(
        uri,
        experiment_name="e",
        artifact_location=str(tmp_path / "art"),
        max_buffered_bytes=bound,
        close_timeout=60,
    )
    real = writer._client.log_image
    began, release = threading.Event(), threading.Event()

    def log_image(*args, **kw):
        began.set()
        assert release.wait(60)
        return real(*args, **kw)

    writer._client.log_image = log_image
    g = torch.Generator().manual_seed(0)
    with EventStorage() as storage:
        for i in range(20):
            storage.iter = i
            storage.put_scalar("loss", float(i))
            storage.put_image(
                "img", torch.randint(0, 256, (3, 190, 190), dtype=torch.uint8, generator=g)
            )
            writer.write()
            if i == 0:
                assert began.wait(60)
        state = writer._state_dict()
        release.set()
    writer.close()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert buffer.tell() <= bound + (64 << 10)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    images = [it for it, _, values in loaded["pending"] if ("image", "img") in values]
    assert images and images[-1] == 19 and images == list(range(20 - len(images), 20))


@pytest.mark.slow
def test_an_item_larger_than_the_byte_bound_is_dropped_naming_the_bound(tmp_path, caplog):
    """Issue 42, item 5: one image larger than ``max_buffered_bytes`` is dropped at write()
    with a message that names the bound (MLflow is up: nothing says it is not taking
    points); the rest is logged, and close() counts it."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = MLflowWriter(
        uri,
        experiment_name="e",
        artifact_location=str(tmp_path / "art"),
        max_buffered_bytes=64 << 10,
    )
    with caplog.at_level(logging.WARNING, logger="hookloop.utils"):
        with EventStorage() as storage:
            storage.put_scalar("loss", 1.0)
            storage.put_image("big", torch.zeros(3, 200, 200))  # 117.2 KiB of pixels
            storage.put_image("small", torch.zeros(3, 8, 8))
            writer.write()
        writer.close()
    (big,) = _messages(caplog, "larger than max_buffered_bytes (64 KiB)")
    assert big.endswith("image 'big' at iter 0 (117.2 KiB)")
    assert not _messages(caplog, "not taking points")
    (summary,) = _messages(caplog, "were not logged")
    assert summary.startswith("MLflowWriter: 1 of 3 points were not logged")
    assert "(1 larger than max_buffered_bytes)" in summary
    client = MlflowClient(uri)
    files = [a.path for a in client.list_artifacts(writer._mlflow_run_id, "images")]
    assert [p.split("+")[0] for p in files if p.endswith(".png")] == ["images/small"]
    assert client.get_run(writer._mlflow_run_id).info.status == "FINISHED"
