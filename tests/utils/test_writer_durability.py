"""What the writers leave on disk when a run is killed, exits without closing, or the disk
is full. The runs happen in child processes (sys.executable)."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import page_layout
import pytest
from hookloop.utils.events import EventStorage, JSONWriter
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TIMEOUT = 60


def _child(script, *args):
    return [sys.executable, "-c", textwrap.dedent(script), *map(str, args)]


def _event_file(d):
    files = [p for p in Path(d).iterdir() if p.name.startswith("events.out.tfevents.")]
    assert len(files) == 1, files
    return files[0]


def _json_rows(path):
    # every line must be whole JSON
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _whole_json_rows(path):
    """What hookloop guarantees after SIGKILL: every newline-terminated line is whole JSON;
    only an unterminated tail (a write the kill stopped part-way) may be torn."""
    text = Path(path).read_text()
    whole = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines()]


def _scalars(tb_dir, tag):
    acc = EventAccumulator(str(_event_file(tb_dir)), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _assert_tb_matches_json(tb_dir, rows, tag="loss"):
    by_iter = {r["iteration"]: np.float32(r[tag]) for r in rows}
    points = _scalars(tb_dir, tag)
    assert points, "no scalar could be read back"
    steps = [s for s, _ in points]
    assert steps == list(range(steps[0], steps[0] + len(steps)))
    for step, value in points:
        if step in by_iter:
            assert np.float32(value) == by_iter[step]
    return steps


KILLED_RUN = """
    import sys
    from hookloop.engine import PeriodicWriter, TrainerBase
    from hookloop.utils.events import JSONWriter, TensorboardXWriter

    out = sys.argv[1]

    class Trainer(TrainerBase):
        def run_step(self):
            i = self.iter
            self.storage.put_scalar("loss", 1.0 / (i + 1), smoothing_hint=False)
            self.storage.put_scalar("损失/ü", i * 0.5)
            self.storage.put_scalar("lr", 0.1, smoothing_hint=False)

    trainer = Trainer()
    writers = [JSONWriter(out + "/metrics.json"), TensorboardXWriter(out + "/tb")]
    trainer.register_hooks([PeriodicWriter(writers, period=1)])
    trainer.train(0, 10**9)
"""


@pytest.mark.slow
def test_sigkill_mid_run_leaves_readable_files(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = subprocess.Popen(_child(KILLED_RUN, tmp_path), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()
            # The writer thread writes both files at each of its 5 ms pickups, in no fixed
            # order: wait until both exist, so the kill cannot fall between them.
            events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
            if events and metrics.exists() and metrics.read_bytes().count(b"\n") >= 300:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the child wrote fewer than 300 lines in time")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(TIMEOUT)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    rows = _whole_json_rows(metrics)
    assert len(rows) >= 300
    assert [r["iteration"] for r in rows] == list(range(len(rows)))
    assert rows[7] == {
        "iteration": 7,
        "loss": 0.125,
        "lr": 0.1,
        "损失/ü": 1.75,
    }  # median of 0, 0.5, ..., 3.5
    steps = _assert_tb_matches_json(tmp_path / "tb", rows)
    assert steps[0] == 0

    # reopening cuts a torn tail, and the file stays appendable with whole lines
    w = JSONWriter(metrics)
    with EventStorage(10**6) as s:
        s.put_scalar("loss", 2.0)
        w.write()
    w.close()
    after = _json_rows(metrics)
    assert after[: len(rows)] == rows
    assert after[-1] == {"iteration": 10**6, "loss": 2.0}


WIDE_RUN = """
    import sys
    from hookloop.utils.events import EventStorage, JSONWriter

    # Lines of ~40 B to ~4 KiB: iteration i puts (i * 37) % 200 scalars besides the loss.
    writer = JSONWriter(sys.argv[1])
    names = [f"metric/{n:03d}" for n in range(200)]
    with EventStorage() as storage:
        for i in range(10**9):
            storage.iter = i
            storage.put_scalar("loss", i * 0.5, smoothing_hint=False)
            for name in names[: (i * 37) % 200]:
                storage.put_scalar(name, 0.25, smoothing_hint=False)
            writer.write()
"""


@pytest.mark.slow
def test_every_line_up_to_4_kib_is_whole_after_sigkill(tmp_path):
    # The documented guarantee: after kill -9 at any moment, every line of at most 4 KiB
    # parses, the last one included (it may lack its newline). Each run appends to the
    # file the killed runs left, whose last line it pads when its first line needs to.
    metrics = tmp_path / "metrics.json"
    rng = random.Random(0)
    runs = []
    for _ in range(12):
        before = metrics.stat().st_size if metrics.exists() else 0
        proc = subprocess.Popen(_child(WIDE_RUN, metrics), stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                assert proc.poll() is None, proc.stderr.read().decode()
                if metrics.exists() and metrics.stat().st_size > before + (256 << 10):
                    break
                time.sleep(0.01)
            else:
                pytest.fail("the child wrote less than 256 KiB in time")
            time.sleep(rng.uniform(0, 0.05))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(TIMEOUT)
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        text = metrics.read_text()
        lines = text.splitlines()
        assert max(map(len, lines)) > 3500  # the widths the test is about
        runs.append([json.loads(line)["iteration"] for line in lines])  # every line parses
    # The runs' iterations, in order: each run's own 0, 1, 2, ... after the earlier ones'.
    for earlier, later in zip(runs, runs[1:]):
        assert later[: len(earlier)] == earlier
        added = later[len(earlier) :]
        assert added == list(range(len(added)))
    assert runs[0] == list(range(len(runs[0])))


PAGE_LIMITED_RUN = """
    import resource, signal, sys
    from hookloop.utils.events import EventStorage, JSONWriter

    # Lines of ~40 B to ~4 KiB, as WIDE_RUN's; every other write is flushed, so that a line
    # is padded both in its own batch and as the file's last line.
    path, limit, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    writer = JSONWriter(path, fsync="never")
    names = [f"metric/{k:03d}" for k in range(200)]
    if limit:
        # The file may not grow past `limit`: the write that would is cut at it, and the next
        # write kills the process with SIGXFSZ (which Python ignores unless told otherwise).
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    with EventStorage() as storage:
        for i in range(n):
            storage.iter = i
            storage.put_scalar("loss", i * 0.5, smoothing_hint=False)
            for name in names[: (i * 37) % 200]:
                storage.put_scalar(name, 0.25, smoothing_hint=False)
            writer.write()
            if i % 2:
                writer.flush()
    writer.close()
"""


@pytest.mark.slow
def test_a_kill_where_a_line_would_cross_a_page_boundary_leaves_every_line_whole(tmp_path):
    """The kill lands, without timing, where the padding matters. Linux stops a killed write
    only at a page boundary of the file; each run here stops at one exactly: its file may
    not grow past the boundary (RLIMIT_FSIZE), so the write crossing it is cut there and the
    next write kills the process (SIGXFSZ), as a SIGKILL during that write would. The
    boundaries are those that fall inside a line of detectron2's unpadded layout: without the
    padding the run would be cut inside that line."""
    n = 30
    full = tmp_path / "full.json"
    done = subprocess.run(
        _child(PAGE_LIMITED_RUN, full, 0, n), capture_output=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr.decode()
    data = full.read_bytes()
    rows = [json.loads(line) for line in data.splitlines()]
    assert [r["iteration"] for r in rows] == list(range(n))
    unpadded = b"".join(line.rstrip(b" ") + b"\n" for line in data.splitlines())
    assert max(map(len, unpadded.splitlines(keepends=True))) <= page_layout.PAGE
    boundaries = page_layout.crossed_boundaries(unpadded)
    assert len(boundaries) >= 10, boundaries
    for limit in boundaries:
        path = tmp_path / f"killed_at_{limit}.json"
        done = subprocess.run(
            _child(PAGE_LIMITED_RUN, path, limit, n),
            capture_output=True,
            timeout=TIMEOUT,
            cwd=tmp_path,
        )
        assert done.returncode == -signal.SIGXFSZ, (limit, done.stderr.decode())
        left = path.read_bytes()
        assert len(left) == limit  # the run was stopped at the boundary, not before
        # Every line parses, the last one included: none was cut at the boundary.
        got = [json.loads(line) for line in left.decode().splitlines()]
        assert got == rows[: len(got)], limit
        assert left == data[:limit] and left.endswith(b"\n"), limit


UNCLOSED_RUN = """
    import sys
    from hookloop.utils.events import EventStorage, JSONWriter, TensorboardXWriter

    out, n, fsync = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    json_writer = JSONWriter(out + "/metrics.json", fsync=fsync)
    tb_writer = TensorboardXWriter(out + "/tb", fsync=fsync)
    storage = EventStorage()
    with storage:
        for i in range(n):
            storage.iter = i
            storage.put_scalar("loss", i * 0.25, smoothing_hint=False)
            json_writer.write()
            tb_writer.write()
    # exits here without close() or flush(); the writers are still referenced
"""


@pytest.mark.slow
@pytest.mark.parametrize("fsync", ["always", "periodic", "never"])
def test_normal_exit_without_close_flushes_everything(tmp_path, fsync):
    n = 500
    done = subprocess.run(
        _child(UNCLOSED_RUN, tmp_path, n, fsync), capture_output=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr.decode()
    rows = _json_rows(tmp_path / "metrics.json")
    assert rows == [{"iteration": i, "loss": i * 0.25} for i in range(n)]
    assert _assert_tb_matches_json(tmp_path / "tb", rows) == list(range(n))


EXCEPTION_RUN = """
    import sys
    from hookloop.engine import PeriodicWriter, TrainerBase
    from hookloop.utils.events import JSONWriter, TensorboardXWriter

    out = sys.argv[1]

    class Trainer(TrainerBase):
        def run_step(self):
            self.storage.put_scalar("loss", float(self.iter), smoothing_hint=False)
            if self.iter == 37:
                raise RuntimeError("diverged")

    trainer = Trainer()
    writers = [JSONWriter(out + "/metrics.json"), TensorboardXWriter(out + "/tb")]
    trainer.register_hooks([PeriodicWriter(writers, period=10)])
    trainer.train(0, 1000)
"""


@pytest.mark.slow
def test_exception_in_training_writes_the_last_iteration(tmp_path):
    done = subprocess.run(_child(EXCEPTION_RUN, tmp_path), capture_output=True, timeout=TIMEOUT)
    assert done.returncode != 0
    assert b"RuntimeError: diverged" in done.stderr
    rows = _json_rows(tmp_path / "metrics.json")
    assert [r["iteration"] for r in rows] == [9, 19, 29, 37]
    assert rows[-1] == {"iteration": 37, "loss": 37.0}
    assert _scalars(tmp_path / "tb", "loss") == [(9, 9.0), (19, 19.0), (29, 29.0), (37, 37.0)]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_is_reported_naming_the_file():
    w = JSONWriter("/dev/full", fsync="never")
    errors = []
    with EventStorage() as s:
        for i in range(3):
            s.iter = i
            s.put_scalar("loss", 1.0)
            try:
                w.write()
            except OSError as e:
                errors.append(e)
    try:
        w.close()
    except OSError as e:
        errors.append(e)
    assert errors, "ENOSPC was swallowed"
    for e in errors:
        assert "/dev/full" in str(e)
        assert e.filename == "/dev/full"
        assert e.errno == 28  # ENOSPC


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_is_reported_by_flush():
    w = JSONWriter("/dev/full", fsync="never")
    with EventStorage() as s:
        s.put_scalar("loss", 1.0)
        w.write()
    errors = []
    for op in (w.flush, w.close):
        try:
            op()
        except OSError as e:
            errors.append(e)
    assert errors and all("/dev/full" in str(e) for e in errors)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_cannot_write_through_the_parents_writer(tmp_path):
    # A forked child (a DataLoader worker, say) inherits the writer but not its thread:
    # writing must fail clearly, closing must not hang, and the parent's file stays whole.
    from hookloop.utils.events import EventStorage, JSONWriter

    path = tmp_path / "metrics.json"
    writer = JSONWriter(path)
    with EventStorage() as storage:
        storage.put_scalar("a", 1.0)
        writer.write()
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                storage.step()
                storage.put_scalar("a", 2.0)
                writer.write()
            except OSError as e:
                code = 0 if "forked child" in str(e) and str(path) in str(e) else 2
            writer.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        writer.close()
    assert path.read_text() == '{"a": 1.0, "iteration": 0}\n'
