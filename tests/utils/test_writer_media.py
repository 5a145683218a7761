"""Images and histograms shared by the writers that take them: each TensorBoard, MLflow and W&B
writer gets every one, whatever the order they write in and whatever their periods; and what
each client stores is what TensorBoard's reader reads back (the real clients: mlflow's sqlite
store, W&B offline read with its own reader)."""

from __future__ import annotations

import io
import json
import logging
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import wandb_env
from hookloop.engine import PeriodicWriter, TrainerBase
from hookloop.utils.events import EventStorage, JSONWriter, TensorboardXWriter
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ALL = {"scalars": 0, "images": 0, "histograms": 0}
IMAGE_ITERS = [0, 3, 6, 9, 12, 15, 18]


class Painter(TrainerBase):
    """A loss every iteration; every third, from the iteration's seed, two images and a
    histogram, which shares its name with the gray image (as detectron2 users name both after
    the layer they show)."""

    def run_step(self):
        i, s = self.iter, self.storage
        s.put_scalar("loss", 1.0 / (i + 1))
        if i % 3 == 0:
            g = torch.Generator().manual_seed(i)
            s.put_image("samples: rgb; left", torch.rand(3, 4, 5, generator=g))
            s.put_image(
                "weights/body", torch.randint(0, 256, (1, 3, 2), generator=g).to(torch.uint8)
            )
            s.put_histogram("weights/body", torch.randn(200, generator=g), bins=1000)


def _tb(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance=ALL)
    acc.Reload()
    return acc


def _tb_images(acc, tag):
    """{step: HWC uint8 array} of a tag's images."""
    return {
        e.step: np.asarray(Image.open(io.BytesIO(e.encoded_image_string))) for e in acc.Images(tag)
    }


def _pixels(img):
    """An image as TensorBoard shows it: HWC, one channel repeated into three (as
    SummaryWriter writes a gray image)."""
    arr = np.asarray(img)
    return np.repeat(arr[:, :, None], 3, axis=2) if arr.ndim == 2 else arr


def test_writers_with_different_periods_each_get_every_image_and_histogram(tmp_path):
    trainer = Painter()
    trainer.register_hooks(
        [
            PeriodicWriter([TensorboardXWriter(tmp_path / "fast")], period=2),
            PeriodicWriter([TensorboardXWriter(tmp_path / "slow")], period=10),
        ]
    )
    trainer.train(0, 20)
    fast, slow = _tb(tmp_path / "fast"), _tb(tmp_path / "slow")
    for acc in (fast, slow):
        assert [e.step for e in acc.Images("samples: rgb; left")] == IMAGE_ITERS
        assert [e.step for e in acc.Histograms("weights/body")] == IMAGE_ITERS
    for tag in ("samples: rgb; left", "weights/body"):
        a, b = _tb_images(fast, tag), _tb_images(slow, tag)
        assert all(np.array_equal(a[k], b[k]) for k in IMAGE_ITERS)
    assert trainer.storage._pending_images() == 0, "every writer took them: none left"


@pytest.mark.parametrize("order", ["tb-first", "tb-last"])
def test_a_hand_written_loop_gives_every_writer_every_image(tmp_path, order):
    """Writers written one after the other, without PeriodicWriter (so never subscribed): the
    one that reads second, at the same iteration, still gets what the first took."""
    writers = [TensorboardXWriter(tmp_path / "a"), TensorboardXWriter(tmp_path / "b")]
    if order == "tb-last":
        writers.reverse()
    with EventStorage(0) as storage:
        for i in range(12):
            storage.iter = i
            storage.put_scalar("loss", float(i))
            if i % 2 == 0:
                storage.put_image("img", torch.full((3, 2, 2), i / 12.0))
            if i % 4 == 3:
                for w in writers:
                    w.write()
        for w in writers:
            w.close()
    for name in ("a", "b"):
        assert [e.step for e in _tb(tmp_path / name).Images("img")] == [0, 2, 4, 6, 8, 10]


def test_a_writer_that_stops_reading_holds_at_most_the_bound(tmp_path, caplog):
    writer = TensorboardXWriter(tmp_path)
    with EventStorage(0, max_images=4) as storage:
        storage._subscribe(writer._media_reader + 10_000)  # a reader that never reads
        with caplog.at_level(logging.WARNING, logger="hookloop.utils.events"):
            for i in range(10):
                storage.iter = i
                storage.put_image("img", torch.zeros(3, 2, 2))
        writer.write()
        writer.close()
    assert storage._pending_images() == 4, "the silent reader still has 4 waiting"
    assert [e.step for e in _tb(tmp_path).Images("img")] == [6, 7, 8, 9]
    warned = [r.getMessage() for r in caplog.records if "not every writer took" in r.getMessage()]
    assert len(warned) == 1


def test_detectron2s_vis_data_and_clear_images_empty_the_queue_for_everyone(tmp_path):
    writer = TensorboardXWriter(tmp_path)
    with EventStorage(0) as storage:
        storage._subscribe(writer._media_reader)
        storage.put_image("img", torch.zeros(3, 2, 2))
        assert [name for name, _, _ in storage._vis_data] == ["img"]
        storage.clear_images()  # a writer of the user's own took them, as detectron2's does
        assert storage._vis_data == []
        writer.write()
        writer.close()
    assert _tb(tmp_path).Tags()["images"] == []


# -- the trackers --------------------------------------------------------------------------


@pytest.fixture
def _isolated_clients(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    wandb_env.isolate(tmp_path, monkeypatch)


def _wandb_history(run_dir):
    """{step: {key: value}} of an offline run, read with the client's own reader (values of
    media keys as it prints them: dotted sub-keys, JSON-encoded)."""
    rows = {}
    for record in wandb_env.records(run_dir):
        if record.get("type") == "history":
            item = record["history"]["item"]
            rows[int(item["_step"])] = item
    return rows


def _decoded(value):
    """A value as the reader prints it: lists and numbers JSON-encoded, strings as they are."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


@pytest.mark.slow
def test_trackers_store_the_images_and_histograms_tensorboard_has(tmp_path, _isolated_clients):
    """TensorBoard at period 5, MLflow and W&B at period 10: every image and histogram in each,
    at its iteration, with TensorBoard's pixels and buckets (W&B's merged to its 512)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    import wandb
    from hookloop.utils._media import rebinned
    from hookloop.utils.events import MLflowWriter, WandbWriter
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow_writer = MLflowWriter(
        uri, experiment_name="media", artifact_location=str(tmp_path / "artifacts")
    )
    wandb_writer = WandbWriter(project="media", dir=tmp_path / "wb", close_timeout=60.0)
    trainer = Painter()
    trainer.register_hooks(
        [
            PeriodicWriter(
                [JSONWriter(tmp_path / "metrics.json"), TensorboardXWriter(tmp_path / "tb")], 5
            ),
            PeriodicWriter([mlflow_writer, wandb_writer], 10),
        ]
    )
    try:
        trainer.train(0, 20)
    finally:
        wandb.teardown()
    tb = _tb(tmp_path / "tb")
    tb_images = {tag: _tb_images(tb, tag) for tag in ("samples: rgb; left", "weights/body")}
    tb_hists = {e.step: e.histogram_value for e in tb.Histograms("weights/body")}
    assert sorted(tb_hists) == IMAGE_ITERS

    # MLflow: image artifacts under the (sanitized) key at their steps; histograms as JSON.
    client = MlflowClient(uri)
    run_id = mlflow_writer._mlflow_run_id
    listed = [a.path for a in client.list_artifacts(run_id, "images")]
    for tag, key in (
        ("samples: rgb; left", "samples_ rgb_ left"),
        ("weights/body", "weights~body"),
    ):
        steps = {}
        for path in listed:
            name = path.split("/", 1)[1]
            if name.startswith(key + "+step+") and name.endswith(".png"):
                local = client.download_artifacts(run_id, path, str(tmp_path / "dl"))
                steps[int(name.split("+")[2])] = _pixels(Image.open(local))
        assert sorted(steps) == IMAGE_ITERS, tag
        assert all(np.array_equal(steps[k], tb_images[tag][k]) for k in IMAGE_ITERS), tag
    hist_files = [a.path for a in client.list_artifacts(run_id, "histograms/weights/body")]
    assert len(hist_files) == len(IMAGE_ITERS)
    for path in hist_files:
        record = json.loads(
            Path(client.download_artifacts(run_id, path, str(tmp_path / "dl"))).read_text()
        )
        want = tb_hists[record["step"]]
        assert record["name"] == "weights/body"
        assert (record["min"], record["max"], record["num"]) == (want.min, want.max, want.num)
        assert record["bucket_counts"] == list(want.bucket)
        assert np.array_equal(np.float32(record["bucket_limits"]), np.float32(want.bucket_limit))

    # W&B: wandb.Image files and wandb.Histogram buckets, at the same steps.
    rows = _wandb_history(wandb_writer._wb_run_dir)
    files = Path(wandb_writer._wb_run_dir) / "files"
    for tag in tb_images:
        steps = {s: row for s, row in rows.items() if f"{tag}._type" in row}
        assert sorted(steps) == IMAGE_ITERS, tag
        for s, row in steps.items():
            assert _decoded(row[f"{tag}._type"]) == "image-file"
            pixels = _pixels(Image.open(files / _decoded(row[f"{tag}.path"])))
            assert np.array_equal(pixels, tb_images[tag][s]), (tag, s)
    # The histogram's name is the gray image's: W&B, one value per key, has it beside.
    hist_steps = {s: row for s, row in rows.items() if "weights/body/histogram._type" in row}
    assert sorted(hist_steps) == IMAGE_ITERS
    for s, row in hist_steps.items():
        want = tb_hists[s]
        counts, edges = rebinned(list(want.bucket), [want.min, *want.bucket_limit], 512)
        assert _decoded(row["weights/body/histogram.values"]) == counts
        assert np.allclose(_decoded(row["weights/body/histogram.bins"]), edges, rtol=1e-6)
        assert sum(counts) == sum(want.bucket) == 200


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_media_not_yet_sent_go_into_the_checkpoint_as_plain_data(monkeypatch):
    """Images and histograms waiting for an unreachable tracker are in the writer's state, and
    that state loads with ``torch.load(weights_only=True)`` (no class of ours in it)."""
    pytest.importorskip("mlflow")
    from hookloop.utils.events import MLflowWriter

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    writer = MLflowWriter(f"http://127.0.0.1:{_free_port()}", run_id="0123abcd", close_timeout=0.0)
    with EventStorage(0) as storage:
        storage.put_scalar("loss", 0.5)
        storage.put_image("img", torch.ones(3, 2, 2))
        storage.put_histogram("h", torch.arange(4.0), bins=2)
        writer.write()
        state = writer._state_dict()
        writer.close()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    ((it, _, values),) = [tuple(row) for row in loaded["pending"]]
    assert it == 0 and loaded["run_id"] == "0123abcd"
    assert values["loss"] == 0.5
    assert values[("image", "img")] == (2, 2, 3, bytes([255]) * 12)
    fields = values[("histogram", "h")]
    assert fields["bucket_counts"] == [2.0, 2.0]
    assert fields["bucket_limits"] == [1.5, 3.0] and fields["min"] == 0.0


@pytest.mark.slow
def test_queued_media_and_the_checkpointed_state_are_bounded_in_bytes(monkeypatch, caplog):
    """Issue 35, case 5: with the tracker down, 60 images of 192 KiB each queue; the writer
    keeps at most ``max_buffered_bytes`` of them (the newest, queued or in flight), drops the
    oldest with a warning, and a checkpoint of its state holds no more than that."""
    pytest.importorskip("mlflow")
    from hookloop.utils.events import MLflowWriter

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = f"http://127.0.0.1:{_free_port()}"
    bound = 1 << 20
    writer = MLflowWriter(uri, run_id="0123abcd", max_buffered_bytes=bound, close_timeout=0.0)
    with caplog.at_level(logging.WARNING, logger="hookloop.utils.trackers"):
        with EventStorage(0) as storage:
            # The writer's lock (reentrant) held across the writes: the sender thread takes
            # its first batch after all 60 are queued, not after however many a loaded
            # machine let through (a batch in flight is kept for its retry, so which images
            # stay would otherwise depend on that timing).
            with writer._lock:
                for i in range(60):
                    storage.iter = i
                    storage.put_scalar("loss", float(i))
                    storage.put_image("img", torch.zeros(3, 256, 256))  # 192 KiB of pixels
                    writer.write()
            state = writer._state_dict()
        writer.close()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert buffer.tell() <= bound + (64 << 10)
    images = [it for it, _, values in state["pending"] if ("image", "img") in values]
    assert 0 < len(images) <= bound // (3 << 16) and max(images) == 59  # the newest kept
    scalars = [it for it, _, values in state["pending"] if "loss" in values]
    assert scalars == list(range(60))  # only images and histograms are bounded in bytes
    assert any("images and histograms" in r.getMessage() for r in caplog.records)
    assert MLflowWriter(uri)._max_bytes == 64 << 20  # the documented default


@pytest.mark.parametrize("closed", ["tensorboard", "mlflow"])
def test_a_closed_writer_no_longer_holds_images_back(tmp_path, caplog, closed):
    """Issue 35 (item 7): after one media writer is closed, the images put for the other are
    not kept for it: no "not every writer took" warning, and the live writer gets them all."""
    if closed == "mlflow":
        pytest.importorskip("mlflow")
        from hookloop.utils.events import MLflowWriter

        early = MLflowWriter(
            f"sqlite:///{tmp_path}/mlflow.db",
            experiment_name="e",
            artifact_location=str(tmp_path / "art"),
            close_timeout=30,
        )
    else:
        early = TensorboardXWriter(tmp_path / "early")
    live = TensorboardXWriter(tmp_path / "live")
    with caplog.at_level(logging.WARNING, logger="hookloop.utils.events"):
        with EventStorage(0, max_images=4, max_histograms=4) as storage:
            for i in range(20):
                storage.iter = i
                storage.put_image("img", torch.zeros(3, 2, 2))
                storage.put_histogram("h", torch.arange(4.0), bins=2)
                for w in (early, live) if i < 5 else (live,):
                    w.write()
                if i == 4:
                    early.close()
            live.close()
    assert not [r for r in caplog.records if "not every writer took" in r.getMessage()]
    assert [e.step for e in _tb(tmp_path / "live").Images("img")] == list(range(20))
    assert [e.step for e in _tb(tmp_path / "live").Histograms("h")] == list(range(20))
    assert storage._pending_images() == 0
