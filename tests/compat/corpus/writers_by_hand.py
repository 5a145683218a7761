"""Writers and storage driven by hand, outside ``PeriodicWriter``: a ``JSONWriter`` with its own
smoothing window written every few ``storage.step()`` calls, a ``TensorboardXWriter`` closed
without writing and one written through ``_writer``, a standalone ``HistoryBuffer`` timing a
data loader, and a training script that sets ``storage.iter`` itself and calls the
TensorBoard writer (with float and uint8 visualisations in the storage) when it chooses."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd

# --- facebookresearch/detectron2 (tests) ------------------------------------------------------


@pattern("facebookresearch/detectron2", "tests/test_events.py: testSmoothingWithWindowSize")
def wh_d2_test_json_smoothing_window(E, R):
    """detectron2's test of a ``JSONWriter(json_file, window_size=10)`` written by hand: three
    smoothed scalars put every step, every second step and every fifth step over 20
    ``storage.step()`` calls, ``writer.write()`` after every tenth put; then
    ``count_samples(k, 10)`` per name, ``close()``, and the file read back line by line
    (each scalar the median of the samples within the last 10 iterations)."""
    json_file = R.path("test.json")
    with E.EventStorage() as storage:
        writer = E.JSONWriter(json_file, window_size=10)
        for k in range(20):
            storage.put_scalar("key1", k, smoothing_hint=True)
            if (k + 1) % 2 == 0:
                storage.put_scalar("key2", k, smoothing_hint=True)
            if (k + 1) % 5 == 0:
                storage.put_scalar("key3", k, smoothing_hint=True)
            if (k + 1) % 10 == 0:
                writer.write()
            storage.step()
        R.rec("num samples", {k: storage.count_samples(k, 10) for k in ["key1", "key2", "key3"]})
        writer.close()
        with open(json_file) as f:
            data = [json.loads(line) for line in f]
        R.rec("smoothed", [[d[k] for d in data] for k in ("key1", "key2", "key3")])
        R.rec("iterations", [d["iteration"] for d in data])
        R.storage(storage)


@pattern(
    "facebookresearch/detectron2",
    "tests/utils/test_tensorboardx.py: test_no_files_created, test_single_write",
)
def wh_d2_test_tensorboardx_lazy_file(E, R):
    """detectron2's ``TensorboardXWriter`` tests, outside any storage: a writer made on an
    empty folder and closed at once leaves the folder empty (the ``SummaryWriter`` is made at
    first use); a second one, on another folder, writes one scalar through
    ``writer._writer.add_scalar("testing", 1, 1)`` and is closed, and the folder then holds an
    event file (read back here)."""
    empty = os.path.join(R.out, "no_files")
    os.makedirs(empty)
    writer = E.TensorboardXWriter(empty)
    writer.close()
    R.rec("no files", os.listdir(empty))

    single = os.path.join(R.out, "single")
    os.makedirs(single)
    writer = E.TensorboardXWriter(single)
    writer._writer.add_scalar("testing", 1, 1)
    writer.close()
    R.rec("files written", len(os.listdir(single)) > 0)


# --- facebookresearch/d2go --------------------------------------------------------------------


@pattern("facebookresearch/d2go", "tools/benchmark_data.py: main")
def wh_d2go_benchmark_data_history_buffer(E, R):
    """d2go's data-loader benchmark keeps a bare ``HistoryBuffer(max_length=10000)`` of the
    seconds each batch took: ``update(data_time)`` per batch, then the recent ``avg`` and
    ``median`` over ``window_size=20`` logged (per batch and per image); at the end it takes
    the values out of ``values()``, drops the warm-up batches and reports percentiles
    (``method="nearest"``, which numpy 2 names what the script passes as ``interpolation``).
    The batch times are fixed numbers here, and the log is every 8 batches instead of
    ``log_every_n_seconds``; ``latest()`` and ``global_avg()`` are recorded too."""
    window, warmup, batch_size = 20, 5, 2
    time_per_iter = E.HistoryBuffer(max_length=10000)
    for no in range(30):
        data_time = 0.01 + 0.003 * ((no * 7) % 11) + (0.05 if no < 3 else 0.0)
        time_per_iter.update(data_time)
        median = time_per_iter.median(window_size=window)
        avg = time_per_iter.avg(window_size=window)
        if no % 8 == 0:
            log.info(
                "iter: %d; recent per-iter seconds: %.4f (avg) %.4f (median);"
                " recent per-image seconds: %.4f (avg) %.4f (median).",
                no,
                avg,
                median,
                avg / batch_size,
                median / batch_size,
            )
        R.rec("window", no, avg, median)
    R.rec("latest", time_per_iter.latest(), time_per_iter.global_avg())
    values = [x[0] for x in time_per_iter.values()]
    R.rec("iterations", [x[1] for x in time_per_iter.values()])
    values = values[min(warmup, max(len(values) - warmup, 0)) :]
    stats = {"per_iter_avg": float(np.average(values))}
    for p in (1, 10, 50, 90, 99):
        stats[f"per_iter_p{p}"] = float(np.percentile(values, p, method="nearest"))
        stats[f"per_image_p{p}"] = stats[f"per_iter_p{p}"] / batch_size
    R.rec("results", stats)


# --- facebookresearch/detectron2 (plain_train_net with mask visualisation) --------------------


class _MaskRCNNStandIn(TinyDetector):
    """What a Mask R-CNN puts at ``vis_period``: ``mask_rcnn_loss`` puts its accuracy scalars
    and, per instance, a float ``(3, H, 2W)`` image (sigmoid of the mask logits beside the GT
    mask, stacked to three channels); ``visualize_training`` puts one uint8 ``(3, H, W)``
    picture (GT beside proposals, HWC transposed to CHW)."""

    def __init__(self, E, vis_period):
        super().__init__()
        self.E = E
        self.vis_period = vis_period

    def forward(self, batch):
        out = super().forward(batch)
        storage = self.E.get_event_storage()
        logits = batch[:2, :].reshape(2, 2, 2).detach()
        gt_masks = (batch[:2, :].reshape(2, 2, 2) > 0).float()
        accuracy = float(((logits > 0).float() == gt_masks).float().mean())
        storage.put_scalar("mask_rcnn/accuracy", accuracy)
        if self.vis_period > 0 and storage.iter % self.vis_period == 0:
            vis_masks = torch.cat([logits.sigmoid(), gt_masks], axis=2)
            name = "Left: mask prediction;   Right: mask GT"
            for idx, vis_mask in enumerate(vis_masks):
                storage.put_image(name + f" ({idx})", torch.stack([vis_mask] * 3, axis=0))
            level = (storage.iter * 29) % 256
            anno_img = np.full((2, 3, 3), level, dtype=np.uint8)
            prop_img = np.full((2, 3, 3), 255 - level, dtype=np.uint8)
            vis_img = np.concatenate((anno_img, prop_img), axis=1).transpose(2, 0, 1)
            storage.put_image("Left: GT bounding boxes;  Right: Predicted proposals", vis_img)
        return out


@pattern(
    "facebookresearch/detectron2",
    "tools/plain_train_net.py: do_train; "
    "detectron2/modeling/roi_heads/mask_head.py: mask_rcnn_loss (vis_period)",
)
def wh_d2_plain_train_mask_vis_by_hand(E, R):
    """``plain_train_net.py``'s loop with a Mask R-CNN visualising every ``VIS_PERIOD``
    iterations: the writers are made up front (``CommonMetricPrinter(max_iter)``,
    ``JSONWriter``, ``TensorboardXWriter(output_dir)``, here with ``window_size=4``), the loop
    sets ``storage.iter = iteration`` itself, puts the reduced losses and ``lr``, and calls
    every writer when ``iteration - start_iter > 5`` and at ``(iteration + 1) % period == 0``
    or the last iteration, so the float and uint8 images of several iterations wait in the
    storage until the TensorBoard writer takes them. The script never closes its writers
    (closed here after the loop, as interpreter exit would)."""
    max_iter, start_iter, period = 12, 0, 4
    model = _MaskRCNNStandIn(E, vis_period=3)
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.1)
    writers = [
        E.CommonMetricPrinter(max_iter, window_size=4),
        E.JSONWriter(R.path("metrics.json"), window_size=4),
        E.TensorboardXWriter(R.out, window_size=4),
    ]
    log.info("Starting training from iteration %d", start_iter)
    with E.EventStorage(start_iter) as storage:
        for data, iteration in zip(batches(seed=9), range(start_iter, max_iter)):
            storage.iter = iteration
            loss_dict = model(data)
            losses = sum(loss_dict.values())
            assert torch.isfinite(losses).all(), loss_dict
            loss_dict_reduced = {k: v.item() for k, v in loss_dict.items()}
            losses_reduced = sum(loss for loss in loss_dict_reduced.values())
            storage.put_scalars(total_loss=losses_reduced, **loss_dict_reduced)
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
            storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
            scheduler.step()
            if iteration - start_iter > 5 and (
                (iteration + 1) % period == 0 or iteration == max_iter - 1
            ):
                R.rec("images waiting", iteration, len(storage._vis_data))
                for writer in writers:
                    writer.write()
                R.rec("images left", iteration, len(storage._vis_data))
        R.storage(storage)
    for writer in writers:
        writer.close()
