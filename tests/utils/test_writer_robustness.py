"""What the writers promise under kill -9, a full disk, a deleted output directory and fork.

Runs that must die or hit a file-size limit happen in child processes (sys.executable); every
wait is bounded."""

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import page_layout
import pytest
from hookloop.utils.events import EventStorage, JSONWriter, TensorboardXWriter

TIMEOUT = 60


def _child(script, *args):
    return [sys.executable, "-c", textwrap.dedent(script), *map(str, args)]


PAGE = 4096


def _records(path):
    """The whole TFRecords of an event file, and the length of a torn tail after them."""
    data = Path(path).read_bytes()
    out, pos = [], 0
    while pos < len(data):
        if len(data) - pos < 16:
            break
        (n,) = struct.unpack("<Q", data[pos : pos + 8])
        if len(data) - pos < 16 + n:
            break
        out.append(data[pos + 12 : pos + 12 + n])
        pos += 16 + n
    return out, len(data) - pos


def _whole_object(tail):
    """The JSON object ``tail`` holds when it is one whole line (without its newline)."""
    try:
        return json.loads(tail) if tail else None
    except ValueError:
        return None


# Lines and records of 0.2 to 3 KiB: several to a page, and many that cross a page boundary.
KILLED = """
    import sys
    from hookloop.utils.events import EventStorage, JSONWriter, TensorboardXWriter

    out = sys.argv[1]
    pads = ["p" * n for n in (200, 3000, 700, 1500, 300)]
    json_writer = JSONWriter(out + "/metrics.json", fsync="never")
    tb_writer = TensorboardXWriter(out + "/tb", window_size=1, fsync="never")
    with EventStorage() as s:
        i = 0
        while True:
            s.iter = i
            s.put_scalar(pads[i % len(pads)], float(i), smoothing_hint=False)
            json_writer.write()
            tb_writer.write()
            i += 1
"""


@pytest.mark.slow
def test_sigkill_leaves_only_whole_lines_and_records(tmp_path):
    for kill in range(3):
        out = tmp_path / str(kill)
        out.mkdir()
        metrics = out / "metrics.json"
        proc = subprocess.Popen(_child(KILLED, out), stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + TIMEOUT
            # Kill at a different size each time (2, 3, 4 MiB), well inside a run of writes.
            while metrics.stat().st_size < (2 + kill) << 20 if metrics.exists() else True:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "the child wrote too little in time"
                time.sleep(0.01)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(TIMEOUT)
            proc.stderr.close()
        # The documented guarantee: whole lines (records), in order; at most the last one
        # torn, and then only one that crosses a 4096-aligned offset of the file, cut at it.
        data = metrics.read_bytes()
        whole, tail = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1 :]
        rows = [json.loads(line) for line in whole.splitlines()]
        assert [r["iteration"] for r in rows] == list(range(len(rows)))
        assert len(rows) > 100
        last = _whole_object(tail)
        if last is not None:
            # The documented second case: a line already in the file gets trailing spaces
            # before the next line (its newline cut and written again after them); a kill
            # between the two leaves it whole, without its newline.
            assert last["iteration"] == len(rows), "not the next line"
        elif tail:
            assert len(data) % PAGE == 0, f"torn inside a page: ...{tail[-40:]!r}"
            assert tail.startswith(b"{"), "torn between lines"
            assert len(whole) // PAGE == len(data) // PAGE - 1, "the torn line crosses no page"
        (events,) = (out / "tb").glob("events.out.tfevents.*")
        records, torn = _records(events)
        assert len(records) > 100
        if torn:
            size = events.stat().st_size
            assert size % PAGE == 0, "a record torn inside a page"
            assert (size - torn) // PAGE == size // PAGE - 1, "the torn record crosses no page"


FILE_SIZE_LIMIT = """
    import os, resource, signal, sys
    from hookloop.utils.events import EventStorage, JSONWriter

    path, room = sys.argv[1], int(sys.argv[2])
    # A file-size limit is a full disk that only this process sees: a write past it is cut
    # short, the next one fails with EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    first = JSONWriter(path, fsync="never")
    second = JSONWriter(path, fsync="never")
    with EventStorage() as s:
        for i in range(95):  # latest values only: one name per line
            s.put_scalar(f"other{i}", float(i), smoothing_hint=False, cur_iter=i)
        second.write()
        second.flush()
    limit = os.path.getsize(path) + room
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    with EventStorage(1000) as s:
        for i in range(1000, 1050):
            s.put_scalar(f"{i}" + "x" * 150, float(i), smoothing_hint=False, cur_iter=i)
        first.write()  # 50 lines in one batch
    try:
        first.flush()
    except OSError as e:
        print(e.errno, e.filename, e.strerror)
    else:
        print("no error")
    first.close()
    second.close()
"""


def test_disk_full_keeps_other_writers_lines_and_every_whole_line_that_fits(tmp_path):
    path = tmp_path / "metrics.json"
    done = subprocess.run(
        _child(FILE_SIZE_LIMIT, path, 8192), capture_output=True, timeout=TIMEOUT, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = path.read_text().splitlines(keepends=True)
    # The other writer's 95 lines are kept (the last may have gained trailing spaces).
    theirs = [{"iteration": i, f"other{i}": float(i)} for i in range(95)]
    assert [json.loads(line) for line in lines[:95]] == theirs
    # Every whole line that fitted into 8 KiB is kept (lines laid out inside their pages);
    # nothing torn.
    ours = lines[95:]
    assert all(line.endswith("\n") for line in ours)
    assert [json.loads(line)["iteration"] for line in ours] == list(range(1000, 1000 + len(ours)))
    dumps = [json.dumps(row, sort_keys=True) + "\n" for row in theirs]
    dumps += [
        json.dumps({f"{i}" + "x" * 150: float(i), "iteration": i}) + "\n" for i in range(1000, 1050)
    ]
    whole = page_layout.padded("".join(dumps).encode())
    limit = len(page_layout.padded("".join(dumps[:95]).encode())) + 8192
    ends = [whole.index(b"\n", whole.index(d[:20].encode())) + 1 for d in dumps[95:]]
    assert len(ours) == sum(end <= limit for end in ends) < 50
    errno, filename, strerror = done.stdout.split(" ", 2)
    assert int(errno) == 27  # EFBIG
    assert filename == str(path)
    assert f"({50 - len(ours)} of 50 lines not written)" in strerror


@pytest.mark.parametrize("kind", ["json", "tensorboard"])
def test_deleted_output_directory_is_an_error_naming_the_path(tmp_path, kind):
    out = tmp_path / "out"
    if kind == "json":
        out.mkdir()
        writer = JSONWriter(out / "metrics.json", fsync="never")
    else:
        writer = TensorboardXWriter(out, fsync="never")
    with EventStorage() as s:
        s.put_scalar("loss", 1.0, smoothing_hint=False)
        writer.write()
        writer.flush()
        path = Path(writer._native.path)
        assert path.exists()
        shutil.rmtree(out)
        s.step()
        s.put_scalar("loss", 2.0, smoothing_hint=False)
        writer.write()
        with pytest.raises(OSError) as info:
            writer.flush()
    assert info.value.filename == str(path)
    assert "deleted" in str(info.value)
    # close reports it too (nothing written since is kept), and the directory stays gone.
    with pytest.raises(OSError):
        writer.close()
    assert not out.exists()


def test_deletion_is_reported_at_close_without_new_writes(tmp_path):
    path = tmp_path / "metrics.json"
    writer = JSONWriter(path, fsync="never")
    with EventStorage() as s:
        s.put_scalar("loss", 1.0)
        writer.write()
    writer.flush()
    path.unlink()
    with pytest.raises(OSError) as info:
        writer.close()
    assert info.value.filename == str(path)


def _child_uses(writer):
    """In a forked child: write and flush raise OSError, close is a no-op; 0 if so."""
    try:
        writer.write()
        return 2
    except OSError as e:
        if "forked child" not in str(e):
            return 3
    try:
        writer.flush()
        return 4
    except OSError:
        pass
    writer.close()
    return 0 if writer._last_write == 199 else 5


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_forked_child_never_waits_on_a_lock_held_by_the_parent(tmp_path):
    # A FIFO nobody reads blocks the writer thread once its buffer is full, so a flush() in
    # another thread waits, holding the writer's lock, for as long as the test wants; a child
    # forked then inherits that lock locked.
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    writer = JSONWriter(fifo, fsync="never")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    # Entered by hand: leaving the block flushes every writer, which waits for the drain.
    storage = EventStorage().__enter__()
    flusher = threading.Thread(target=writer.flush)
    try:
        for i in range(200):  # 200 lines of 1 KiB: more than the pipe holds
            storage.put_scalar(f"{i}" + "x" * 1000, float(i), smoothing_hint=False, cur_iter=i)
        writer.write()
        flusher.start()
        time.sleep(0.2)  # let it reach the wait (the child's result holds either way)
        codes = []
        for _ in range(3):
            pid = os.fork()
            if pid == 0:  # child: bounded by an alarm that kills it if it blocks
                code = 1
                try:
                    signal.signal(signal.SIGALRM, signal.SIG_DFL)
                    signal.alarm(5)
                    code = _child_uses(writer)
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        assert codes == [0, 0, 0]
    finally:
        # Drain the FIFO so the parent's writer thread can finish.
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                chunk = os.read(reader, 1 << 16)
            except BlockingIOError:
                chunk = b""
            if not chunk:
                if not flusher.is_alive():
                    break
                time.sleep(0.01)
        flusher.join(TIMEOUT)
        storage.__exit__(None, None, None)
        writer.close()
        os.close(reader)
    assert not flusher.is_alive()


def test_json_writer_keeps_a_whole_last_object_and_refuses_a_non_json_file(tmp_path):
    whole = tmp_path / "whole.json"
    whole.write_text('{"iteration": 3, "loss": 1.5}')  # no final newline
    writer = JSONWriter(whole)
    with EventStorage(4) as s:
        s.put_scalar("loss", 2.0)
        writer.write()
    writer.close()
    assert whole.read_text() == '{"iteration": 3, "loss": 1.5}\n{"iteration": 4, "loss": 2.0}\n'

    binary = tmp_path / "model.pth"
    content = bytes(range(256)) * 400
    binary.write_bytes(content)
    with pytest.raises(ValueError, match="is not a JSON-lines file") as info:
        JSONWriter(binary)
    assert str(binary) in str(info.value)
    assert binary.read_bytes() == content


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_training_error_is_not_replaced_by_a_writers_close_error(tmp_path, caplog):
    from hookloop.engine import PeriodicWriter, TrainerBase

    class Trainer(TrainerBase):
        def run_step(self):
            self.storage.put_scalar("loss", 1.0)
            if self.iter == 3:
                raise KeyError("user's error")

    good = tmp_path / "metrics.json"
    trainer = Trainer()
    # The failing writer first: the other one is still written and closed.
    writers = [JSONWriter("/dev/full", fsync="never"), JSONWriter(good)]
    trainer.register_hooks([PeriodicWriter(writers, period=100)])
    with caplog.at_level("ERROR"), pytest.raises(KeyError, match="user's error") as info:
        trainer.train(0, 10)
    if sys.version_info >= (3, 11):
        assert any("/dev/full" in note for note in info.value.__notes__)
    assert any(
        r.levelname == "ERROR" and "after_train" in r.getMessage() and "/dev/full" in r.getMessage()
        for r in caplog.records
    )
    assert json.loads(good.read_text().splitlines()[-1])["iteration"] == 3

    # Without a training error, the writer's error is raised.
    trainer = Trainer()
    trainer.register_hooks([PeriodicWriter([JSONWriter("/dev/full", fsync="never")], 100)])
    trainer.run_step = lambda: trainer.storage.put_scalar("loss", 1.0)
    with pytest.raises(OSError, match="/dev/full"):
        trainer.train(0, 2)


def _tb_images(tb_dir, tag):
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = Path(tb_dir).glob("events.out.tfevents.*")
    acc = EventAccumulator(str(path), size_guidance={"images": 0})
    acc.Reload()
    if tag not in acc.Tags()["images"]:
        return []
    return [np.asarray(Image.open(io.BytesIO(e.encoded_image_string))) for e in acc.Images(tag)]


def test_put_image_refuses_what_cannot_become_pixels_naming_the_image():
    import numpy as np
    import torch

    with EventStorage() as s:
        with pytest.raises(TypeError, match="put_image\\('text'\\).*dtype <U1"):
            s.put_image("text", np.full((3, 2, 2), "a"))
        with pytest.raises(TypeError, match="put_image\\('complex'\\).*complex"):
            s.put_image("complex", torch.zeros(3, 2, 2, dtype=torch.complex64))
        with pytest.raises(ValueError, match="put_image\\('meta'\\).*meta tensor"):
            s.put_image("meta", torch.zeros(3, 2, 2, device="meta"))
        with pytest.raises(ValueError, match="image 'flat'"):
            s.put_image("flat", torch.zeros(2, 2))
        assert s._pending_images() == 0


def test_half_precision_images_convert_and_a_bad_one_skips_only_itself(tmp_path):
    import numpy as np
    import torch

    class Unreadable:  # passes put_image's checks, fails when the writer reads it
        shape = (3, 2, 2)
        dtype = np.dtype(np.float32)

        def detach(self):
            raise RuntimeError("device lost")

    base = torch.linspace(0, 1, 12).reshape(3, 2, 2)
    writer = TensorboardXWriter(tmp_path)
    with EventStorage() as s:
        s.put_image("bf16", base.to(torch.bfloat16))
        s.put_image("bad", Unreadable())
        s.put_image("f16", base.to(torch.float16))
        with pytest.raises(ValueError, match="skipped 1 of 3 images") as info:
            writer.write()
    writer.close()
    assert "image 'bad' at iter 0: RuntimeError: device lost" in str(info.value)
    for tag, dtype in [("bf16", torch.bfloat16), ("f16", torch.float16)]:
        expected = (base.to(dtype).float().numpy() * 255).clip(0, 255).astype(np.uint8)
        (img,) = _tb_images(tmp_path, tag)
        np.testing.assert_array_equal(img, expected.transpose(1, 2, 0))
    assert _tb_images(tmp_path, "bad") == []


LATE_ERROR = """
    from hookloop.utils.events import EventStorage, JSONWriter

    writer = JSONWriter("/dev/full", fsync="never")
    with EventStorage() as s:
        s.put_scalar("loss", 1.0)
        writer.write()  # accepted: the writer thread fails later, and nothing asks again
    # leaving the storage flushed the writer without raising; exit without close()
"""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_error_after_the_last_write_is_logged_at_exit():
    done = subprocess.run(_child(LATE_ERROR), capture_output=True, timeout=TIMEOUT, text=True)
    assert done.returncode == 0  # an atexit handler cannot change it (see _flush_at_exit)
    assert "failed after its last write()" in done.stderr
    assert "No space left on device" in done.stderr and "/dev/full" in done.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_error_is_logged_when_an_unclosed_writer_is_dropped(caplog):
    import gc

    writer = JSONWriter("/dev/full", fsync="never")
    with EventStorage() as s:
        s.put_scalar("loss", 1.0)
        writer.write()
    with caplog.at_level("ERROR", logger="hookloop.utils.events"):
        del writer
        gc.collect()
    (record,) = [r for r in caplog.records if "/dev/full" in r.getMessage()]
    assert record.levelname == "ERROR"
    assert "dropped without close()" in record.getMessage()


def test_a_deleted_log_directory_is_not_recreated_for_a_new_event_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    writer = TensorboardXWriter(out)  # no event file yet
    shutil.rmtree(out)
    with EventStorage() as s:
        s.put_scalar("loss", 1.0)
        writer.write()
        with pytest.raises(OSError) as info:
            writer.flush()
    assert info.value.filename == str(out)
    with pytest.raises(OSError):
        writer.close()
    assert not out.exists()


def test_name_scope_is_per_thread():
    inside, done = threading.Event(), threading.Event()
    with EventStorage() as s:

        def scoped():
            with s.name_scope("val"):
                s.put_scalar("acc", 0.5)
                inside.set()
                assert done.wait(TIMEOUT)

        t = threading.Thread(target=scoped)
        t.start()
        assert inside.wait(TIMEOUT)
        s.put_scalar("loss", 1.0)  # this thread opened no scope
        done.set()
        t.join(TIMEOUT)
        assert set(s.latest()) == {"val/acc", "loss"}


def test_iterations_beyond_2_53_are_refused_not_rounded():
    with EventStorage() as s:
        with pytest.raises(OverflowError, match="cur_iter .*2\\*\\*53"):
            s.put_scalar("a", 1.0, cur_iter=2**53 + 1)
        with pytest.raises(OverflowError, match="EventStorage.iter .*2\\*\\*53"):
            s.iter = 2**60
        s.iter = 2**53
        with pytest.raises(OverflowError, match="2\\*\\*53"):
            s.step()
        assert s.iter == 2**53
        s.put_scalar("a", 1.0, cur_iter=2**53)
        assert s.latest()["a"] == (1.0, 2**53)
        assert s.history("a").values() == [(1.0, 2**53)]


def test_every_entry_point_of_an_iteration_refuses_beyond_2_53():
    from hookloop import _core
    from hookloop.engine import TrainerBase

    # One rule (the core's exact_iter), named by the argument at each entry point.
    for bad in (2**53 + 1, -(2**53) - 1, 2**63 - 1):
        with pytest.raises(OverflowError, match="start_iter .*2\\*\\*53"):
            EventStorage(start_iter=bad)
        with pytest.raises(OverflowError, match="iteration .*2\\*\\*53"):
            _core.HistoryBuffer().update(1.0, bad)
    assert EventStorage(start_iter=2**53).iter == 2**53
    assert EventStorage(start_iter=-(2**53)).iter == -(2**53)
    # A saved state with an iteration beyond it (hand-made: no storage can produce one).
    with EventStorage(start_iter=7) as s:
        s.put_scalar("a", 1.0)
        state = s._state()
    bad_iter = dict(state, iter=2**53 + 1)
    with pytest.raises(OverflowError, match="iter .*2\\*\\*53"):
        EventStorage()._load_state(bad_iter)
    (name, hint, value, _, hist) = state["scalars"][0]
    bad_latest = dict(state, scalars=[(name, hint, value, 2**53 + 1, hist)])
    with pytest.raises(OverflowError, match="iteration .*2\\*\\*53"):
        EventStorage()._load_state(bad_latest)
    loaded = EventStorage()
    loaded._load_state(state)
    assert loaded.iter == 7 and loaded.latest()["a"] == (1.0, 7)
    # The trainer's start_iter reaches the storage, its max_iter the dispatcher.
    with pytest.raises(OverflowError, match="start_iter .*2\\*\\*53"):
        TrainerBase().train(2**53 + 1, 2**53 + 2)
    with pytest.raises(OverflowError, match="max_iter .*2\\*\\*53"):
        TrainerBase().train(0, 2**60)


def _fill(storage, n=300):
    """`n` lines of 4 KiB for a JSONWriter: far more than a pipe holds (64 KiB)."""
    for i in range(n):
        storage.put_scalar(f"{i:04d}" + "x" * 4000, float(i), smoothing_hint=False, cur_iter=i)


def _drain_until_closed(reader):
    """Reads the FIFO until its last writer closed it (bounded)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            if not os.read(reader, 1 << 16):
                return
        except BlockingIOError:
            time.sleep(0.01)
    raise AssertionError("the FIFO's writer never closed it")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_blocked_file_fails_its_own_flush_and_stalls_no_other_writer(tmp_path):
    from hookloop import _core

    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    # A reader that never reads: once the pipe is full, the writer's next write blocks.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    blocked = JSONWriter(fifo, fsync="never")
    json_writer = JSONWriter(tmp_path / "metrics.json", fsync="never")
    tb_writer = TensorboardXWriter(tmp_path / "tb", window_size=1, fsync="never")
    storage = EventStorage().__enter__()  # leaving it flushes every writer, the FIFO's too
    try:
        _fill(storage)
        _core._set_writer_timeout(1.0)
        blocked.write()
        with pytest.raises(OSError) as info:
            blocked.flush()
        assert info.value.filename == str(fifo)
        assert "blocked" in str(info.value)
        # The FIFO holds only its own thread: the other writers write and flush in full.
        _core._set_writer_timeout(None)
        json_writer.write()
        tb_writer.write()
        json_writer.flush()
        tb_writer.flush()
        # Interpreter exit's flush fails naming the FIFO (at once: it is still blocked).
        with pytest.raises(OSError, match="metrics.fifo"):
            _core.flush_writers()
        with pytest.raises(OSError, match="metrics.fifo"):
            blocked.close()
        json_writer.close()
        tb_writer.close()
    finally:
        _core._set_writer_timeout(None)
        _drain_until_closed(reader)  # the FIFO's thread finishes, then closes it
        os.close(reader)
        storage.__exit__(None, None, None)
        for w in (blocked, json_writer, tb_writer):
            w.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(300))
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    records, torn = _records(events)
    assert torn == 0 and len(records) == 1 + 300  # the file version, then one per scalar
    with pytest.raises(ValueError):
        _core._set_writer_timeout(-1.0)


BLOCKED_AT_EXIT = """
    import os, sys
    from hookloop.utils.events import EventStorage, JSONWriter

    fifo, other = sys.argv[1], sys.argv[2]
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # never read: the pipe fills
    blocked = JSONWriter(fifo, fsync="never")
    fine = JSONWriter(other, fsync="never")
    storage = EventStorage().__enter__()  # never left: exit is the only flush
    for i in range(300):
        storage.put_scalar(f"{i:04d}" + "x" * 4000, float(i), smoothing_hint=False, cur_iter=i)
    blocked.write()
    try:
        blocked.flush()  # waits the writer timeout: the FIFO blocks for good
    except OSError:
        pass
    fine.write()  # after the FIFO blocked: written all the same
    # exit without close(): the atexit flush waits for the FIFO at most the writer timeout
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_exit_with_a_blocked_file_is_bounded_logs_it_and_flushes_the_others(tmp_path):
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    other = tmp_path / "metrics.json"
    env = dict(os.environ, HOOKLOOP_WRITER_TIMEOUT="1")
    done = subprocess.run(
        _child(BLOCKED_AT_EXIT, fifo, other),
        capture_output=True,
        timeout=TIMEOUT,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr  # an atexit handler cannot change it
    assert "writers not flushed at exit" in done.stderr
    assert f"blocked writing '{fifo}'" in done.stderr
    rows = [json.loads(line) for line in other.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(300))


@pytest.mark.parametrize("period", [1, 5])
def test_async_metric_writes_lose_no_loss_in_metrics_json(tmp_path, period):
    import torch
    from hookloop.engine import PeriodicWriter, SimpleTrainer

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return {"loss_a": (self.w * x) ** 2, "loss_b": self.w.abs() * 0.5}

    def run(name, async_write):
        torch.manual_seed(0)
        model = Model()
        data = [torch.tensor(float(i % 7) / 7) for i in range(40)]
        trainer = SimpleTrainer(
            model,
            data,
            torch.optim.SGD(model.parameters(), lr=0.01),
            async_write_metrics=async_write,
        )
        trainer.register_hooks([PeriodicWriter([JSONWriter(tmp_path / name)], period=period)])
        trainer.train(0, 40)
        rows = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        for r in rows:
            r.pop("data_time", None)  # timings, different in every run
            r.pop("rank_data_time", None)
        return rows

    sync_rows = run("sync.json", False)
    assert [r["iteration"] for r in sync_rows] == list(range(period - 1, 40, period))
    assert all("loss_a" in r and "total_loss" in r for r in sync_rows)
    assert run("async.json", True) == sync_rows


def test_bad_histograms_are_errors_naming_the_histogram():
    import torch

    with EventStorage() as s:
        for values in ([float("nan"), 1.0], [float("inf")], [1e300, 0.0]):
            with pytest.raises(ValueError, match="put_histogram\\('w'\\).*finite"):
                s.put_histogram("w", torch.tensor(values, dtype=torch.float64))
        with pytest.raises(ValueError, match="put_histogram\\('w'\\) bins"):
            s.put_histogram("w", torch.zeros(3), bins=2**63)
        assert s._histograms == []


@pytest.mark.parametrize(
    "out, error, message",
    [
        ([1.0], TypeError, "must return a loss tensor or a dict .* got list"),
        (None, TypeError, "got NoneType"),
        ({}, ValueError, "got an empty dict"),
        ({"loss": 1.0}, TypeError, "loss 'loss' must be a tensor, got float"),
        ({1: "x"}, TypeError, "str keys, got int key 1"),
    ],
)
def test_run_step_says_what_the_model_should_return(out, error, message):
    import torch
    from hookloop.engine import SimpleTrainer

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return out

    model = Model()
    trainer = SimpleTrainer(model, [torch.tensor(1.0)] * 2, torch.optim.SGD(model.parameters()))
    with pytest.raises(error, match=f"\\[SimpleTrainer\\] .*{message}"):
        trainer.train(0, 1)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--output", "/dev/null/x"], "--output '/dev/null/x' is not a usable directory"),
        (["--device", "nope"], "--device 'nope' is not usable here"),
        (["--period", str(10**20)], "--period must be at most 2\\*\\*53"),
        (["--iters", "0"], "--iters must be positive, got 0"),
    ],
)
def test_demo_reports_bad_options_as_one_line_usage_errors(tmp_path, capsys, args, message):
    from hookloop.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--output", str(tmp_path / "out"), *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(f"hookloop demo: error: {message}", err), err


def test_lr_scheduler_arguments_are_checked_by_name():
    import torch
    from hookloop.engine import LRScheduler, TrainerBase

    class Trainer(TrainerBase):
        def run_step(self):
            pass

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    empty = torch.optim.SGD([p], lr=0.1)
    empty.param_groups.clear()
    cases = [
        ((None, sched), TypeError, "optimizer=None\\) uses trainer.optimizer, but Trainer"),
        ((opt, None), TypeError, "scheduler=None\\) uses trainer.scheduler"),
        (("x", sched), TypeError, "optimizer must be a torch.optim.Optimizer, got str"),
        ((empty, sched), ValueError, "no param_groups"),
        ((opt, "y"), TypeError, "scheduler must have a step\\(\\) method.*got str"),
    ]
    for args, error, message in cases:
        trainer = Trainer()
        trainer.register_hooks([LRScheduler(*args)])
        with pytest.raises(error, match=message):
            trainer.train(0, 1)


def test_writer_ints_beyond_int64_name_the_argument(tmp_path):
    from hookloop.utils.events import CommonMetricPrinter

    with pytest.raises(OverflowError, match="window_size is out of range"):
        JSONWriter(tmp_path / "m.json", window_size=2**64)
    with pytest.raises(OverflowError, match="window_size is out of range"):
        TensorboardXWriter(tmp_path, window_size=2**64)
    with pytest.raises(OverflowError, match="max_iter is out of range"):
        CommonMetricPrinter(2**64)
    with pytest.raises(OverflowError, match="epoch is out of range"):
        CommonMetricPrinter(10, 20, epoch=2**70)


def test_storage_and_history_ints_beyond_int64_name_the_argument():
    from hookloop.utils.events import HistoryBuffer

    big = 2**64
    for call, name in [
        (lambda: EventStorage(max_length=big), "max_length"),
        (lambda: EventStorage(max_images=big), "max_images"),
        (lambda: EventStorage(max_histograms=big), "max_histograms"),
        (lambda: HistoryBuffer(big), "max_length"),
        (lambda: HistoryBuffer(3).median(big), "window_size"),
        (lambda: HistoryBuffer(3).avg(big), "window_size"),
        (lambda: EventStorage().count_samples("a", big), "window_size"),
        (lambda: EventStorage().latest_with_smoothing_hint(big), "window_size"),
    ]:
        with pytest.raises(OverflowError, match=f"{name} is out of range"):
            call()


def test_a_float_among_the_loss_tensors_is_a_type_error_naming_it():
    """``{"a": loss, "b": 1.0}`` sums to a tensor, but ``b`` is not a loss tensor: run_step
    says so (as documented), instead of storing it (detectron2 fails at ``.detach()``)."""
    import torch
    from hookloop.engine import SimpleTrainer

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return {"a": self.w * x, "b": 1.0}

    model = Model()
    trainer = SimpleTrainer(model, [torch.tensor(1.0)] * 2, torch.optim.SGD(model.parameters()))
    with pytest.raises(TypeError, match=r"\[SimpleTrainer\] the model's loss 'b' must be a tensor"):
        trainer.train(0, 1)
    assert "b" not in trainer.storage.histories()
