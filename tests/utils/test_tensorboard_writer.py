"""TensorBoard event files, read back with tensorboard's own reader (and its server)."""

import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from compat import d2
from compat import reference as ref
from hookloop.engine import PeriodicWriter, TrainerBase
from hookloop.utils.events import (
    EventStorage,
    EventWriter,
    JSONWriter,
    TensorboardXWriter,
    get_event_storage,
)
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

ALL = {"scalars": 0, "images": 0, "histograms": 0, "compressedHistograms": 0, "tensors": 0}


class RefWriter(EventWriter):
    def __init__(self, impl):
        self.impl = impl

    def write(self):
        self.impl.write(get_event_storage())


class Trainer(TrainerBase):
    def run_step(self):
        i, s = self.iter, self.storage
        s.put_scalar("total_loss", 1.0 / (i + 1) + (i % 4) * 0.1)
        s.put_scalar("lr", 0.1 * 0.9**i, smoothing_hint=False)
        s.put_scalar("损失/ü 😀", (i % 7) / 3.0)
        s.put_scalar('q"b\\', i * 1e-7, smoothing_hint=False)
        if i % 4 == 1:
            s.put_scalar("eval/AP", i / 3.0, cur_iter=max(0, i - 2))


def _event_files(d):
    return sorted(p for p in Path(d).iterdir() if p.name.startswith("events.out.tfevents."))


def _only_event_file(d):
    files = _event_files(d)
    assert len(files) == 1, files
    return files[0]


def _accumulator(path):
    acc = EventAccumulator(str(path), size_guidance=ALL, purge_orphaned_data=False)
    acc.Reload()
    return acc


def _json_series(path):
    """{tag: [(step, float32 value)]} from metrics.json, in file order."""
    series = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        it = row.pop("iteration")
        for k, v in row.items():
            series.setdefault(k, []).append((it, np.float32(v)))
    return series


def _run(tmp_path, window=10, period=7, max_iter=40):
    tb_dir = tmp_path / "tb"
    tb_ref = ref.TensorboardScalarsRef(window)
    writers = [
        JSONWriter(tmp_path / "metrics.json", window),
        TensorboardXWriter(tb_dir, window),
        RefWriter(tb_ref),
    ]
    trainer = Trainer()
    trainer.register_hooks([PeriodicWriter(writers, period=period)])
    trainer.train(0, max_iter)
    return tb_dir, tb_ref


@pytest.mark.parametrize("window,period", [(1, 1), (10, 7), (20, 20)])
def test_scalars_equal_metrics_json_and_reference(tmp_path, window, period):
    tb_dir, tb_ref = _run(tmp_path, window, period)
    acc = _accumulator(_only_event_file(tb_dir))
    got = {
        tag: [(e.step, np.float32(e.value)) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }
    assert got == _json_series(tmp_path / "metrics.json")
    expected = {}
    for tag, value, step in tb_ref.calls:
        expected.setdefault(tag, []).append((step, np.float32(value)))
    assert got == expected
    # with period 1, eval/AP (reported 2 iterations late) is never newer than the last write
    assert {"total_loss", "lr", "损失/ü 😀", 'q"b\\'} <= set(got)
    assert ("eval/AP" in got) == (period > 1)


def test_file_version_is_the_first_event(tmp_path):
    tb_dir, _ = _run(tmp_path)
    events = list(EventFileLoader(str(_only_event_file(tb_dir))).Load())
    assert events[0].file_version == "brain.Event:2"
    assert events[0].step == 0
    assert all(not e.HasField("file_version") for e in events[1:])
    assert all(len(e.summary.value) == 1 for e in events[1:])
    assert _accumulator(_only_event_file(tb_dir)).file_version == 2.0


def test_no_file_before_first_write_and_file_name(tmp_path):
    tb_dir = tmp_path / "tb"
    w = TensorboardXWriter(tb_dir)
    assert not tb_dir.exists() or not _event_files(tb_dir)
    with EventStorage(3) as s:
        w.write()  # nothing to write yet
        w.flush()
        assert not tb_dir.exists() or not _event_files(tb_dir)
        s.put_scalar("loss", 1.0)
        w.write()
        w.flush()
    path = _only_event_file(tb_dir)
    pattern = (
        r"events\.out\.tfevents\.\d{10}\."
        + re.escape(socket.gethostname())
        + r"\."
        + str(os.getpid())
        + r"\.\d+"
    )
    assert re.fullmatch(pattern, path.name), path.name
    assert abs(int(path.name.split(".")[3]) - time.time()) < 24 * 3600
    w.close()
    assert _only_event_file(tb_dir) == path


def test_writer_that_never_writes_leaves_no_file(tmp_path):
    tb_dir = tmp_path / "tb"
    tb_dir.mkdir()
    w = TensorboardXWriter(tb_dir)
    w.close()
    assert list(tb_dir.iterdir()) == []


def test_filename_suffix_and_unique_names(tmp_path):
    w1 = TensorboardXWriter(tmp_path, filename_suffix=".rank0")
    w2 = TensorboardXWriter(tmp_path)
    with EventStorage() as s:
        s.put_scalar("a", 1.0)
        w1.write()
        w2.write()
    w1.close()
    w2.close()
    names = [p.name for p in _event_files(tmp_path)]
    assert len(names) == 2
    assert sum(n.endswith(".rank0") for n in names) == 1


def _expected_pixels(img):
    arr = img.numpy() if isinstance(img, torch.Tensor) else np.asarray(img)
    if arr.dtype != np.uint8:
        arr = (arr.astype(np.float32) * np.float32(255)).clip(0, 255).astype(np.uint8)
    if arr.shape[0] == 1:  # SummaryWriter writes a grey image as RGB, the channel repeated
        arr = np.concatenate([arr] * 3)
    return arr.transpose(1, 2, 0)


def _decode(image_event):
    pil = Image.open(io.BytesIO(image_event.encoded_image_string))
    arr = np.asarray(pil)
    return arr[:, :, None] if arr.ndim == 2 else arr


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["uint8", "float_tensor", "float_array"])
def test_images_decode_to_the_expected_pixels(tmp_path, channels, kind):
    g = torch.Generator().manual_seed(channels)
    images = []
    for step, (h, w) in [(2, (5, 7)), (6, (3, 2))]:
        if kind == "uint8":
            img = torch.randint(0, 256, (channels, h, w), dtype=torch.uint8, generator=g)
        else:
            # values outside [0, 1] are clipped
            img = torch.rand((channels, h, w), generator=g) * 1.4 - 0.2
            if kind == "float_array":
                img = img.numpy()
        images.append((step, img))
    tb_dir = tmp_path / "tb"
    writer = TensorboardXWriter(tb_dir)
    with EventStorage() as s:
        for i in range(8):
            s.iter = i
            s.put_scalar("loss", float(i))
            for step, img in images:
                if step == i:
                    s.put_image("img/sample", img)
            if i in (3, 7):
                writer.write()
        writer.write()  # the images were taken once
    writer.close()
    acc = _accumulator(_only_event_file(tb_dir))
    assert acc.Tags()["images"] == ["img/sample"]
    events = acc.Images("img/sample")
    assert [e.step for e in events] == [2, 6]
    for event, (_, img) in zip(events, images):
        expected = _expected_pixels(img)
        assert (event.height, event.width) == expected.shape[:2]
        decoded = _decode(event)
        assert decoded.dtype == np.uint8
        np.testing.assert_array_equal(decoded, expected)


def test_histograms_carry_detectron2_fields(tmp_path):
    g = torch.Generator().manual_seed(0)
    t1 = torch.randn(500, generator=g) * 3 + 1
    t2 = torch.rand(64, generator=g)
    tb_dir = tmp_path / "tb"
    writer = TensorboardXWriter(tb_dir)
    with EventStorage(4) as s:
        s.put_histogram("weights/w1", t1, bins=17)
        s.iter = 5
        s.put_histogram("weights/w2", t2)
        writer.write()
    writer.close()
    acc = _accumulator(_only_event_file(tb_dir))
    assert sorted(acc.Tags()["histograms"]) == ["weights/w1", "weights/w2"]
    for tag, t, bins, step in [("weights/w1", t1, 17, 4), ("weights/w2", t2, 1000, 5)]:
        (event,) = acc.Histograms(tag)
        assert event.step == step
        h = event.histogram_value
        ref_storage = d2.EventStorage(step)  # detectron2's EventStorage.put_histogram
        ref_storage.put_histogram(tag, t, bins=bins)
        (want,) = ref_storage._histograms
        assert h.min == want["min"] and h.max == want["max"]
        assert h.num == want["num"]
        assert h.sum == want["sum"]
        assert h.sum_squares == want["sum_squares"]
        assert list(h.bucket_limit) == want["bucket_limits"]
        assert list(h.bucket) == want["bucket_counts"]
        assert sum(h.bucket) == len(t)


def test_summary_writer_shim_lands_in_the_same_file(tmp_path):
    tb_dir = tmp_path / "tb"
    writer = TensorboardXWriter(tb_dir)
    shim = writer._writer
    assert shim.get_logdir() == str(tb_dir)
    with EventStorage(1) as s:
        s.put_scalar("loss", 0.5)
        writer.write()
    shim.add_scalar("shim/scalar", torch.tensor(2.5), global_step=4)
    shim.add_scalar("shim/scalar", 3, 9, walltime=1234.5)
    hwc = np.linspace(0, 1, 2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    shim.add_image("shim/image", hwc, 4, dataformats="HWC")
    shim.add_image("shim/gray", np.full((1, 2, 2), 7, dtype=np.uint8), 5)
    shim.add_histogram_raw("shim/hist", 0.0, 2.0, 3.0, 3.0, 5.0, [1.0, 2.0], [1, 2], 6)
    shim.flush()
    path = _only_event_file(tb_dir)
    shim.close()
    assert _only_event_file(tb_dir) == path
    acc = _accumulator(path)
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("shim/scalar")] == [(4, 2.5), (9, 3.0)]
    assert acc.Scalars("shim/scalar")[1].wall_time == 1234.5
    (img,) = acc.Images("shim/image")
    assert img.step == 4
    np.testing.assert_array_equal(
        _decode(img), (hwc * np.float32(255)).clip(0, 255).astype(np.uint8)
    )
    (gray,) = acc.Images("shim/gray")
    np.testing.assert_array_equal(_decode(gray), np.full((2, 2, 3), 7, dtype=np.uint8))
    (hist,) = acc.Histograms("shim/hist")
    h = hist.histogram_value
    assert (hist.step, h.min, h.max, h.num, h.sum, h.sum_squares) == (6, 0.0, 2.0, 3.0, 3.0, 5.0)
    assert (list(h.bucket_limit), list(h.bucket)) == ([1.0, 2.0], [1.0, 2.0])
    with EventStorage() as s, pytest.raises(ValueError):
        writer.write()


def test_log_dir_under_a_regular_file_raises_at_write_or_close(tmp_path):
    parent = tmp_path / "regular_file"
    parent.write_text("")
    log_dir = parent / "tb"
    writer = TensorboardXWriter(log_dir)  # lazy: nothing happens yet
    errors = []
    with EventStorage() as s:
        s.put_scalar("loss", 1.0)
        writer.write()
        s.iter = 1
        s.put_scalar("loss", 2.0)
        try:
            writer.write()
        except OSError as e:
            errors.append(e)
    try:
        writer.close()
    except OSError as e:
        errors.append(e)
    assert errors, "the I/O error was swallowed"
    for e in errors:
        assert str(log_dir) in str(e)
        assert e.filename.startswith(str(log_dir))


def test_unknown_kwarg_and_bad_options(tmp_path):
    with pytest.raises(TypeError):
        TensorboardXWriter(tmp_path, no_such_option=1)
    with pytest.raises(ValueError, match="fsync"):
        TensorboardXWriter(tmp_path, fsync="sometimes")
    with pytest.raises(ValueError):
        TensorboardXWriter(tmp_path, window_size=0)
    # SummaryWriter's own keywords are accepted
    TensorboardXWriter(tmp_path, max_queue=10, flush_secs=120, comment="x").close()
    assert _event_files(tmp_path) == []


@pytest.mark.parametrize("shape", [(5, 4, 4), (4, 4), (3, 4, 4, 1), (3, 0, 4), (3, 4, 0)])
def test_non_chw_image_is_rejected_at_put(shape):
    with EventStorage() as s:
        with pytest.raises(ValueError):
            s.put_image("bad", torch.zeros(shape))
        assert s._vis_data == []


def test_write_after_close_raises(tmp_path):
    writer = TensorboardXWriter(tmp_path)
    writer.close()
    with EventStorage() as s:
        s.put_scalar("a", 1.0)
        with pytest.raises(ValueError):
            writer.write()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get_json(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_tensorboard_server_serves_the_scalars(tmp_path):
    tb_dir, _ = _run(tmp_path, window=10, period=5)
    expected = _json_series(tmp_path / "metrics.json")
    port = _free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tb_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--load_fast=false"]
    cmd += ["--reload_interval", "1"]
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        got = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.poll() is None:
            try:
                tags = _get_json(f"{base}/tags").get(".", {})
                if set(tags) == set(expected):
                    got = {}
                    for tag in tags:
                        q = urllib.parse.urlencode({"run": ".", "tag": tag})
                        got[tag] = [
                            (step, np.float32(v)) for _, step, v in _get_json(f"{base}/scalars?{q}")
                        ]
                    if got == expected:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        assert server.poll() is None, "tensorboard exited early"
        assert got == expected
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server.stdout.close()


def test_summary_writer_shim_text_and_histograms_match_summary_writer(tmp_path):
    """``_writer.add_text`` and ``_writer.add_histogram`` (the calls training scripts make on
    detectron2's writer, a torch ``SummaryWriter``) read back as SummaryWriter's do."""
    from torch.utils.tensorboard import SummaryWriter

    g = torch.Generator().manual_seed(3)
    values = [torch.randn(50, generator=g) * 3, torch.rand(7, generator=g)]

    def drive(w):
        w.add_text("notes", "lr=0.1, **bold**", 2)
        w.add_histogram("weights", values[0], 3)
        w.add_histogram("weights", values[1].numpy(), 5, bins=4)
        w.add_histogram("weights/few", values[0], 6, max_bins=10)
        w.flush()

    ours = TensorboardXWriter(tmp_path / "ours")
    drive(ours._writer)
    ours.close()
    theirs = SummaryWriter(str(tmp_path / "theirs"))
    drive(theirs)
    theirs.close()
    a = _accumulator(_only_event_file(tmp_path / "ours"))
    b = _accumulator(_only_event_file(tmp_path / "theirs"))
    assert a.Tags()["tensors"] == b.Tags()["tensors"] == ["notes/text_summary"]
    (ta,), (tb,) = a.Tensors("notes/text_summary"), b.Tensors("notes/text_summary")
    assert (ta.step, ta.tensor_proto) == (tb.step, tb.tensor_proto)
    assert a.SummaryMetadata("notes/text_summary") == b.SummaryMetadata("notes/text_summary")
    assert sorted(a.Tags()["histograms"]) == sorted(b.Tags()["histograms"])
    for tag in b.Tags()["histograms"]:
        ha, hb = a.Histograms(tag), b.Histograms(tag)
        assert [h.step for h in ha] == [h.step for h in hb]
        for x, y in zip(ha, hb):
            x, y = x.histogram_value, y.histogram_value
            assert (x.num, list(x.bucket_limit), list(x.bucket)) == (
                y.num, list(y.bucket_limit), list(y.bucket)
            )  # fmt: skip
            assert (x.min, x.max) == pytest.approx((y.min, y.max))
            assert (x.sum, x.sum_squares) == pytest.approx((y.sum, y.sum_squares), rel=1e-6)


def test_summary_writer_shim_rejects_bad_text_and_empty_histograms(tmp_path):
    writer = TensorboardXWriter(tmp_path)
    with pytest.raises(TypeError, match="notes"):
        writer._writer.add_text("notes", 3, 1)
    with pytest.raises(ValueError, match="empty"):
        writer._writer.add_histogram("h", torch.zeros(0), 1)
    writer.close()


@pytest.mark.parametrize(
    "method, args",
    [
        ("add_text", ("notes", "hi")),
        ("add_scalar", ("s", 1.0)),
        ("add_image", ("img", torch.zeros(3, 2, 2))),
        ("add_histogram", ("h", torch.arange(4.0))),
        ("add_histogram_raw", ("h", 0.0, 1.0, 2.0, 1.0, 1.0, [1.0], [2.0])),
    ],
)
def test_summary_writer_shim_names_a_global_step_beyond_int64(tmp_path, method, args):
    """Was ``OverflowError: Python int too large to convert to C long``; torch's
    SummaryWriter raises a ValueError too."""
    writer = TensorboardXWriter(tmp_path)
    add = getattr(writer._writer, method)
    for step in (2**70, -(2**63) - 1, math.inf):
        with pytest.raises(ValueError, match=rf"{method}\('{args[0]}'\): global_step must"):
            add(*args, global_step=step)
    with pytest.raises(TypeError, match=rf"{method}\('{args[0]}'\): global_step must be an int"):
        add(*args, global_step=[1])
    add(*args, global_step=2**63 - 1)
    add(*args, global_step=np.int64(5))
    writer.close()
