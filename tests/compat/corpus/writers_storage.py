"""Custom ``EventWriter`` subclasses, and model and trainer code that reads and fills the
storage: tracker writers (a stand-in client records what they send), metric printers,
``TensorboardXWriter._writer`` used directly, images and histograms put from a forward pass."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict

import numpy as np
import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd


class _TrackerRun:
    """Stands in for a tracker's run object (``wandb.init(...)``): records every call, with
    the logged dicts kept as dicts (so the harness masks their wall-clock keys)."""

    def __init__(self, R, name="run"):
        self.R = R
        self.name = name

    def log(self, data, step=None, commit=None):
        self.R.rec(self.name + ".log", dict(data), step, commit)

    def finish(self, exit_code=None):
        self.R.rec(self.name + ".finish", exit_code)


def _trainer(E, model=None, seed=1):
    model = model if model is not None else TinyDetector()
    return E.SimpleTrainer(model, batches(seed), sgd(model))


# --- IDEA-Research/detrex -------------------------------------------------------------------


class _VisDetector(TinyDetector):
    """Puts a ``(3, H, W)`` uint8 visualisation every ``vis_period`` iterations, read from
    ``get_event_storage().iter`` inside ``forward`` (as detectron2's meta-architectures do)."""

    def __init__(self, E, vis_period, name="vis", grey=False):
        super().__init__()
        self.E = E
        self.vis_period = vis_period
        self.vis_name = name
        self.grey = grey

    def forward(self, batch):
        out = super().forward(batch)
        if self.training and self.vis_period > 0:
            storage = self.E.get_event_storage()
            if storage.iter % self.vis_period == 0:
                level = (storage.iter * 37) % 256
                img = np.full((1 if self.grey else 3, 4, 5), level, dtype=np.uint8)
                img[:, 1, :] = 255 - level
                storage.put_image(f"{self.vis_name} {storage.iter}", img)
        return out


@pattern("IDEA-Research/detrex", "detrex/utils/events.py: WandbWriter")
def ws_detrex_wandb_writer(E, R):
    """detrex's ``WandbWriter``: ``run.log({k: v}, step=iter)`` for each smoothed scalar newer
    than ``self._last_write``, then every ``storage._vis_data`` image transposed to HWC and
    logged at its own step, then ``storage.clear_images()``; ``close`` finishes the run."""

    class WandbWriter(E.EventWriter):
        def __init__(self, run, window_size=20):
            self._window_size = window_size
            self._writer = run
            self._last_write = -1

        def write(self):
            storage = E.get_event_storage()
            new_last_write = self._last_write
            for k, (v, it) in storage.latest_with_smoothing_hint(self._window_size).items():
                if it > self._last_write:
                    self._writer.log({k: v}, step=it)
                    new_last_write = max(new_last_write, it)
            self._last_write = new_last_write
            if len(storage._vis_data) >= 1:
                for img_name, img, step_num in storage._vis_data:
                    hwc = img.transpose(1, 2, 0)
                    self._writer.log(
                        {img_name: ("image", hwc.shape, int(hwc.sum()))}, step=step_num
                    )
                storage.clear_images()
            R.rec("images left", len(storage._vis_data))

        def close(self):
            if hasattr(self, "_writer"):
                self._writer.finish()

    model = _VisDetector(E, vis_period=3)
    t = _trainer(E, model)
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter([WandbWriter(_TrackerRun(R), window_size=4)], period=4),
        ]
    )
    t.train(0, 10)
    R.rec("last write", t._hooks[1]._writers[0]._last_write)


# --- leggedrobotics/rsl_panoptic ------------------------------------------------------------


@pattern(
    "leggedrobotics/rsl_panoptic",
    "panoptic_models/panoptic_models/mask2former/utils/wandb_writer.py: WandbWriter",
)
def ws_rsl_panoptic_wandb_writer(E, R):
    """rsl_panoptic's Mask2Former ``WandbWriter``: groups the smoothed scalars newer than
    ``_last_write`` by their own iteration (``defaultdict(dict)``), moves ``_last_write`` to
    the newest, and logs one dict per iteration with an ``iteration`` key. An evaluation hook
    puts its metrics with ``smoothing_hint=False`` only every few iterations, so one write
    sees scalars of several iterations."""

    class WandbWriter(E.EventWriter):
        def __init__(self, run, window_size=20):
            self._window_size = window_size
            self._last_write = -1
            self.run = run

        def write(self):
            storage = E.get_event_storage()
            to_save = defaultdict(dict)
            for k, (v, it) in storage.latest_with_smoothing_hint(self._window_size).items():
                if it <= self._last_write:
                    continue
                to_save[it][k] = v
            if len(to_save):
                all_iters = sorted(to_save.keys())
                self._last_write = max(all_iters)
            for itr, scalars_per_iter in to_save.items():
                scalars_per_iter["iteration"] = itr
                self.run.log(scalars_per_iter)

    class EvalMetrics(E.HookBase):
        def after_step(self):
            next_iter = self.trainer.iter + 1
            if next_iter % 3 == 0:
                storage = self.trainer.storage
                storage.put_scalars(
                    **{"sem_seg/mIoU": 10.0 * next_iter, "sem_seg/fwIoU": 1.0 / next_iter},
                    smoothing_hint=False,
                )

    t = _trainer(E)
    t.register_hooks(
        [
            EvalMetrics(),
            E.hooks.PeriodicWriter([WandbWriter(_TrackerRun(R), window_size=3)], period=5),
        ]
    )
    t.train(0, 11)
    R.storage(t.storage)


# --- nhm0819/detectron2_training ------------------------------------------------------------


@pattern("nhm0819/detectron2_training", "wandb_log.py: WandB_Printer")
def ws_nhm_wandb_printer(E, R):
    """A ``WandB_Printer`` run every iteration (``PeriodicWriter(..., period=1)``) next to
    the default writers: collects the smoothed scalars newer than ``_last_write`` and logs
    them with ``iter`` and ``global_step`` set to ``storage.iter``, at ``step=storage.iter``."""

    class WandB_Printer(E.EventWriter):
        def __init__(self, run, window_size=20, **kwargs):
            self._window_size = window_size
            self._last_write = -1
            self.run = run

        def write(self):
            storage = E.get_event_storage()
            metrics_dict = {}
            new_last_write = self._last_write
            for k, (v, it) in storage.latest_with_smoothing_hint(self._window_size).items():
                if it > self._last_write:
                    metrics_dict[k] = v
                    new_last_write = max(new_last_write, it)
            self._last_write = new_last_write
            metrics_dict["iter"] = metrics_dict["global_step"] = storage.iter
            self.run.log(metrics_dict, step=storage.iter)

    model = TinyDetector()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    t = E.SimpleTrainer(model, batches(), optimizer)
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(optimizer, scheduler),
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(7), E.JSONWriter(R.path("metrics.json"))], period=3
            ),
            E.hooks.PeriodicWriter([WandB_Printer(_TrackerRun(R))], period=1),
        ]
    )
    t.train(0, 7)


# --- NVlabs/ODISE ---------------------------------------------------------------------------


@pattern("NVlabs/ODISE", "odise/utils/events.py: CommonMetricPrinter(_CommonMetricPrinter)")
def ws_odise_metric_printer(E, R):
    """ODISE's printer subclasses ``CommonMetricPrinter``: calls ``super().__init__`` with
    ``max_iter``/``window_size`` and adds ``run_name``; its ``write`` reads ``self._max_iter``,
    ``storage.history("data_time").avg(20)``, ``history("time").global_avg()``,
    ``history("lr").latest()``, ``self._get_eta(storage)``, and prints every history whose
    ``storage.smoothing_hints()[k]`` is True, at ``v.median(self._window_size)``, on
    ``self.logger``."""

    class CommonMetricPrinter(E.CommonMetricPrinter):
        def __init__(self, max_iter=None, window_size=20, run_name=""):
            super().__init__(max_iter=max_iter, window_size=window_size)
            self.run_name = run_name

        def write(self):
            storage = E.get_event_storage()
            iteration = storage.iter
            if iteration == self._max_iter:
                return
            try:
                data_time = storage.history("data_time").avg(20)
            except KeyError:
                data_time = None
            try:
                iter_time = storage.history("time").global_avg()
            except KeyError:
                iter_time = None
            try:
                lr = "{:.5g}".format(storage.history("lr").latest())
            except KeyError:
                lr = "N/A"
            eta_string = self._get_eta(storage)
            hide = ["eta_seconds", "data_time", "time", "lr"]
            losses = "  ".join(
                "{}: {:.4g}".format(k, v.median(self._window_size))
                for k, v in storage.histories().items()
                if k not in hide and storage.smoothing_hints()[k]
            )
            self.logger.info(
                (
                    "{run_name}  {eta}iter: {iter}{max_iter}  {losses}  {time}{data_time}lr: {lr}"
                ).format(
                    run_name=self.run_name,
                    eta=f"eta: {eta_string}  " if eta_string else "",
                    iter=iteration,
                    max_iter=f"/{self._max_iter}" if self._max_iter else "",
                    losses=losses,
                    time="time: {:.4f}  ".format(iter_time) if iter_time is not None else "",
                    data_time="data_time: {:.4f}  ".format(data_time)
                    if data_time is not None
                    else "",
                    lr=lr,
                )
            )

    class Metric(E.HookBase):
        def after_step(self):
            # a non-smoothed metric, which the printer hides
            self.trainer.storage.put_scalar("val/PQ", 3.0 * self.trainer.iter, smoothing_hint=False)

    printer = CommonMetricPrinter(max_iter=8, window_size=4, run_name="odise_tiny")
    R.rec("printer", printer._max_iter, printer._window_size, printer.run_name)
    t = _trainer(E)
    t.register_hooks(
        [E.hooks.IterationTimer(), Metric(), E.hooks.PeriodicWriter([printer], period=3)]
    )
    t.train(0, 8)


@pattern("NVlabs/ODISE", "odise/utils/events.py: WandbWriter (progress, close)")
def ws_odise_wandb_close(E, R):
    """ODISE's ``WandbWriter`` logs every smoothed scalar plus ``progress = storage.iter /
    max_iter``; ``close`` reads ``get_event_storage().iter`` to finish the run (0) or mark it
    unfinished (1), and treats the ``AssertionError`` of no storage as unfinished. Closed by
    ``PeriodicWriter.after_train`` inside the storage, then again after it."""

    class WandbWriter(E.EventWriter):
        def __init__(self, run, max_iter, window_size=20):
            self._window_size = window_size
            self._run = run
            self._max_iter = max_iter

        def write(self):
            storage = E.get_event_storage()
            log_dict = {}
            for k, (v, _) in storage.latest_with_smoothing_hint(self._window_size).items():
                log_dict[k] = v
            log_dict["progress"] = storage.iter / self._max_iter
            self._run.log(log_dict)

        def close(self):
            try:
                storage = E.get_event_storage()
                iteration = storage.iter
                if iteration >= self._max_iter - 1:
                    self._run.finish()
                else:
                    self._run.finish(1)
            except AssertionError:
                self._run.finish(1)

    writer = WandbWriter(_TrackerRun(R), max_iter=6, window_size=2)
    t = _trainer(E)
    t.register_hooks([E.hooks.PeriodicWriter([writer], period=2)])
    t.train(0, 6)
    writer.close()  # after training: no storage any more
    try:
        E.get_event_storage()
    except AssertionError as e:
        R.rec("no storage", isinstance(e, AssertionError), str(e))


# --- facebookresearch/Detic -----------------------------------------------------------------


@pattern("facebookresearch/Detic", "detic/modeling/meta_arch/custom_rcnn.py: vis_period")
def ws_detic_vis_period(E, R):
    """Detic's ``CustomRCNN.forward`` checks ``get_event_storage().iter % self.vis_period``
    and visualises (``storage.put_image`` of an RGB uint8 ``(3, H, W)`` array, and a grey
    one); the default writers, run by ``PeriodicWriter``, put them in TensorBoard with the
    scalars."""

    class CustomRCNN(_VisDetector):
        def forward(self, batch):
            out = super().forward(batch)
            storage = self.E.get_event_storage()
            if storage.iter % self.vis_period == 1:
                grey = torch.linspace(0, 1, 12).reshape(1, 3, 4)
                storage.put_image("proposals (grey)", grey)
            return out

    model = CustomRCNN(E, vis_period=4, name="Left: GT bounding boxes;  Right: Predicted proposals")
    t = _trainer(E, model)
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter(
                [
                    E.CommonMetricPrinter(9),
                    E.JSONWriter(R.path("metrics.json")),
                    E.TensorboardXWriter(R.out),
                ],
                period=4,
            ),
        ]
    )
    t.train(0, 9)


# --- facebookresearch/CutLER ----------------------------------------------------------------


def _log_classification_stats(E, pred_logits, gt_classes, prefix="fast_rcnn"):
    """CutLER's (and detectron2's) classification statistics, put from the box head's
    ``losses``: accuracy always, foreground accuracy and false negatives when there is
    foreground."""
    num_instances = gt_classes.numel()
    if num_instances == 0:
        return
    pred_classes = pred_logits.argmax(dim=1)
    bg_class_ind = pred_logits.shape[1] - 1
    fg_inds = (gt_classes >= 0) & (gt_classes < bg_class_ind)
    num_fg = fg_inds.nonzero().numel()
    fg_gt_classes = gt_classes[fg_inds]
    fg_pred_classes = pred_classes[fg_inds]
    num_false_negative = (fg_pred_classes == bg_class_ind).nonzero().numel()
    num_accurate = (pred_classes == gt_classes).nonzero().numel()
    fg_num_accurate = (fg_pred_classes == fg_gt_classes).nonzero().numel()
    storage = E.get_event_storage()
    storage.put_scalar(f"{prefix}/cls_accuracy", num_accurate / num_instances)
    if num_fg > 0:
        storage.put_scalar(f"{prefix}/fg_cls_accuracy", fg_num_accurate / num_fg)
        storage.put_scalar(f"{prefix}/false_negative", num_false_negative / num_fg)


class _BoxHead(nn.Module):
    """Three-way classifier (two classes and background) over the batch's rows; the labels
    have no foreground every third iteration."""

    def __init__(self, E):
        super().__init__()
        self.E = E
        self.cls_score = nn.Linear(4, 3)

    def losses(self, batch, prefix="fast_rcnn"):
        scores = self.cls_score(batch)
        it = self.E.get_event_storage().iter
        if it % 3 == 2:
            gt = torch.full((batch.shape[0],), 2, dtype=torch.long)
        else:
            gt = (batch[:, 0] > 0).long()
        _log_classification_stats(self.E, scores, gt, prefix)
        return {"loss_cls": nn.functional.cross_entropy(scores, gt)}


@pattern(
    "facebookresearch/CutLER", "cutler/modeling/roi_heads/fast_rcnn.py: _log_classification_stats"
)
def ws_cutler_cls_stats(E, R):
    """CutLER's box head logs ``fast_rcnn/cls_accuracy`` every iteration and the foreground
    statistics only when a batch has foreground, through ``get_event_storage().put_scalar``
    inside ``losses``; metrics.json and the console show what each write saw."""

    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.box_predictor = _BoxHead(E)

        def forward(self, batch):
            return self.box_predictor.losses(batch)

    model = Detector()
    t = _trainer(E, model, seed=3)
    t.register_hooks(
        [
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(8), E.JSONWriter(R.path("metrics.json"), window_size=2)],
                period=2,
            )
        ]
    )
    t.train(0, 8)
    R.storage(t.storage)


@pattern("facebookresearch/CutLER", "cutler/modeling/roi_heads/custom_cascade_rcnn.py: name_scope")
def ws_cutler_cascade_name_scope(E, R):
    """CutLER's cascade head computes each stage's losses inside
    ``with storage.name_scope("stage{}".format(stage))``, so the statistics the box predictor
    puts become ``stage0/fast_rcnn/cls_accuracy``...; the losses get a ``_stage{k}`` suffix
    outside the scope, and the head puts one more scalar after the loop."""

    class CascadeHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.box_predictor = nn.ModuleList([_BoxHead(E), _BoxHead(E)])

        def forward(self, batch):
            losses = {}
            storage = E.get_event_storage()
            for stage, predictor in enumerate(self.box_predictor):
                with storage.name_scope("stage{}".format(stage)):
                    stage_losses = predictor.losses(batch * (stage + 1))
                losses.update({k + "_stage{}".format(stage): v for k, v in stage_losses.items()})
            storage.put_scalar("roi_head/num_stages", float(len(self.box_predictor)))
            return losses

    t = _trainer(E, CascadeHead(), seed=5)
    t.register_hooks(
        [
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(6), E.JSONWriter(R.path("metrics.json"))], period=3
            )
        ]
    )
    t.train(0, 6)
    R.storage(t.storage)
    R.rec("prefix after", t.storage._current_prefix)


# --- facebookresearch/d2go ------------------------------------------------------------------


@pattern("facebookresearch/d2go", "d2go/utils/visualization.py: DataLoaderVisWrapper")
def ws_d2go_loader_vis(E, R):
    """d2go wraps the train loader: each batch it reads ``get_event_storage()`` (skipping
    when the ``AssertionError`` says there is none), and every ``log_frequency`` iterations
    writes up to ``log_limit`` images straight through ``tbx_writer._writer.add_image(tag=...,
    img_tensor=..., global_step=storage.iter, dataformats="HWC")``; the same
    ``TensorboardXWriter`` is one of the trainer's writers."""

    class DataLoaderVisWrapper:
        def __init__(self, tbx_writer, data_loader, log_frequency, log_limit):
            self.tbx_writer = tbx_writer
            self.data_loader = data_loader
            self.log_frequency = log_frequency
            self._remaining = log_limit

        def __iter__(self):
            for data in self.data_loader:
                self._maybe_write_vis(data)
                yield data

        def _maybe_write_vis(self, data):
            try:
                storage = E.get_event_storage()
            except AssertionError:
                R.rec("no storage: not visualised")
                return
            if (
                self.log_frequency == 0
                or not storage.iter % self.log_frequency == 0
                or self._remaining <= 0
            ):
                return
            length = min(len(data), self._remaining)
            self._remaining -= length
            for i in range(length):
                level = int((data[i, 0].item() + 3) * 40) % 256
                rgb = np.full((2, 3, 3), level, dtype=np.uint8)
                grey = np.full((2, 3, 1), 255 - level, dtype=np.uint8)
                tag = [f"train_loader_batch_{storage.iter}", f"img_{i}"]
                for k, img in (("rgb", rgb), ("grey", grey)):
                    self.tbx_writer._writer.add_image(
                        tag="/".join(tag + [k]),
                        img_tensor=img,
                        global_step=storage.iter,
                        dataformats="HWC",
                    )

    def endless(seed):
        g = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randn(2, 4, generator=g)

    tbx_writer = E.TensorboardXWriter(R.out)
    loader = DataLoaderVisWrapper(tbx_writer, endless(2), log_frequency=3, log_limit=3)
    first = next(iter(loader))  # before training: outside any storage
    R.rec("first batch", first)
    model = TinyDetector()
    t = E.SimpleTrainer(model, loader, sgd(model))
    t.register_hooks([E.hooks.PeriodicWriter([tbx_writer], period=4)])
    t.train(0, 8)


@pattern("facebookresearch/d2go", "d2go/runner/default_runner.py: do_test results to TensorBoard")
def ws_d2go_eval_to_tensorboard(E, R):
    """d2go's ``do_test`` flattens the nested results and writes each with
    ``tbx_writer._writer.add_scalar("eval_{}".format(k), v, train_iter)``, then
    ``tbx_writer._writer.flush()``; it runs from an ``EvalHook`` while the same writer also
    writes the training scalars."""

    def flatten_results_dict(results):
        r = {}
        for k, v in results.items():
            if isinstance(v, dict):
                for kk, vv in flatten_results_dict(v).items():
                    r[k + "/" + kk] = vv
            else:
                r[k] = v
        return r

    tbx_writer = E.TensorboardXWriter(R.out)
    state = {}

    def do_test():
        train_iter = state["trainer"].iter
        results = {"coco_val": {"bbox": {"AP": 10.0 + train_iter, "AP50": 0.5 * train_iter}}}
        for k, v in flatten_results_dict(results).items():
            tbx_writer._writer.add_scalar("eval_{}".format(k), v, train_iter)
        tbx_writer._writer.flush()
        R.rec("logdir", tbx_writer._writer.get_logdir() == R.out)
        return results

    t = _trainer(E)
    state["trainer"] = t
    t.register_hooks(
        [
            E.hooks.EvalHook(3, do_test),
            E.hooks.PeriodicWriter([tbx_writer], period=2),
        ]
    )
    t.train(0, 7)
    R.storage(t.storage)


# --- THU-DA-6D-Pose-Group/GDR-Net -----------------------------------------------------------


@pattern("THU-DA-6D-Pose-Group/GDR-Net", "core/utils/my_writer.py: MyJSONWriter, MyPeriodicWriter")
def ws_gdrn_my_writers(E, R):
    """GDR-Net's writers: ``MyPeriodicWriter`` (an ``EventWriter`` check on each writer,
    writes every iteration below ``verbose_iter``, then every ``period``), ``MyJSONWriter``
    dumping ``{"iteration": storage.iter}`` updated with ``latest_with_smoothing_hint``'s
    ``(value, iter)`` pairs as they are, and ``MyCommonMetricPrinter`` reading
    ``history("time").avg(20)``, ``history("total_grad_norm").latest()`` and every loss
    history's ``median(20)`` and ``global_avg()``."""

    class MyPeriodicWriter(E.HookBase):
        def __init__(self, writers, period=20, verbose_iter=100):
            self._writers = writers
            for w in writers:
                assert isinstance(w, E.EventWriter), w
            self._period = period
            self.verbose_iter = verbose_iter

        def after_step(self):
            if (
                (self.trainer.iter + 1) % self._period == 0
                or (self.trainer.iter == self.trainer.max_iter - 1)
                or (self.trainer.iter + 1) < self.verbose_iter
            ):
                for writer in self._writers:
                    writer.write()

        def after_train(self):
            for writer in self._writers:
                writer.close()

    class MyJSONWriter(E.EventWriter):
        def __init__(self, json_file, window_size=20):
            self._file_handle = open(json_file, "a")
            self._window_size = window_size

        def write(self):
            storage = E.get_event_storage()
            to_save = {"iteration": storage.iter}
            to_save.update(storage.latest_with_smoothing_hint(self._window_size))
            self._file_handle.write(json.dumps(to_save, sort_keys=True) + "\n")
            self._file_handle.flush()

        def close(self):
            self._file_handle.close()

    class MyCommonMetricPrinter(E.EventWriter):
        def __init__(self, max_iter):
            self.logger = logging.getLogger("corpus.gdrn.my_writer")
            self._max_iter = max_iter

        def write(self):
            storage = E.get_event_storage()
            iteration = storage.iter
            try:
                total_grad_norm = storage.history("total_grad_norm").latest()
                total_grad_norm = "{:.6f}".format(total_grad_norm)
            except KeyError:
                total_grad_norm = "N/A"
            losses = "  ".join(
                "{}: {:.4e} ({:.4e})".format(k, v.median(20), v.global_avg())
                for k, v in storage.histories().items()
                if "loss" in k
            )
            self.logger.info(
                "iter: {}/{}[{:.1f}%] total_grad_norm: {} {}".format(
                    iteration,
                    self._max_iter,
                    iteration / self._max_iter * 100,
                    total_grad_norm,
                    losses,
                )
            )

    class GradNormTrainer(E.SimpleTrainer):
        def run_step(self):
            super().run_step()
            norm = sum(p.grad.norm() ** 2 for p in self.model.parameters()) ** 0.5
            if self.iter >= 2:
                self.storage.put_scalar("total_grad_norm", float(norm), smoothing_hint=False)

    model = TinyDetector()
    t = GradNormTrainer(model, batches(4), sgd(model))
    writers = [MyCommonMetricPrinter(9), MyJSONWriter(R.path("metrics.jsonl"), window_size=3)]
    t.register_hooks([MyPeriodicWriter(writers, period=4, verbose_iter=3)])
    t.train(0, 9)


@pattern("THU-DA-6D-Pose-Group/GDR-Net", "core/utils/my_writer.py: MyTensorboardXWriter")
def ws_gdrn_tensorboard_writer(E, R):
    """GDR-Net's ``MyTensorboardXWriter`` writes ``v.median(window)`` of every history at
    ``storage.iter``, then passes ``storage._vis_data`` to ``add_image`` and each
    ``storage._histograms`` entry to ``add_histogram_raw(**params)``, clearing both; a
    stand-in for its SummaryWriter records the calls. The model puts a histogram of its
    weights and a grey image from ``forward``."""

    class SummaryWriterStandIn:
        def add_scalar(self, tag, value, step):
            R.rec("add_scalar", {tag: value}, step)

        def add_image(self, tag, img, step):
            R.rec("add_image", tag, tuple(img.shape), str(img.dtype), step)

        def add_histogram_raw(self, **params):
            R.rec("add_histogram_raw", sorted(params.items()))

        def close(self):
            R.rec("closed")

    class MyTensorboardXWriter(E.EventWriter):
        def __init__(self, window_size=20):
            self._window_size = window_size
            self._writer = SummaryWriterStandIn()

        def write(self):
            storage = E.get_event_storage()
            for k, v in storage.histories().items():
                self._writer.add_scalar(k, v.median(self._window_size), storage.iter)
            if len(storage._vis_data) >= 1:
                for img_name, img, step_num in storage._vis_data:
                    self._writer.add_image(img_name, img, step_num)
                storage.clear_images()
            if len(storage._histograms) >= 1:
                for params in storage._histograms:
                    self._writer.add_histogram_raw(**params)
                storage.clear_histograms()

        def close(self):
            if hasattr(self, "_writer"):
                self._writer.close()

    class HistModel(TinyDetector):
        def forward(self, batch):
            out = super().forward(batch)
            storage = E.get_event_storage()
            if storage.iter % 2 == 0:
                storage.put_histogram("backbone/weight", self.backbone.weight.detach(), bins=4)
                storage.put_image("mask", torch.ones(1, 2, 3) * 0.5)
            return out

    t = _trainer(E, HistModel())
    t.register_hooks([E.hooks.PeriodicWriter([MyTensorboardXWriter(window_size=3)], period=3)])
    t.train(0, 6)


# --- Mahsa-Nobakht/maskrcnn_clusternms_DIoU -------------------------------------------------


@pattern("Mahsa-Nobakht/maskrcnn_clusternms_DIoU", "best_model.py: BestCheckpointer(HookBase)")
def ws_best_ap_from_storage(E, R):
    """A best-model hook reading the storage each step: ``storage.latest().get('bbox/AP50',
    0)`` (a ``(value, iter)`` pair once evaluated), a bare ``except`` around
    ``storage.history('max_bbox/AP50')`` to seed the running best, ``history(...)._data[-1][0]``
    for the best so far, and ``put_scalar`` of a new best."""

    class Eval(E.HookBase):
        def after_step(self):
            if (self.trainer.iter + 1) % 2 == 0:
                ap = [30.0, 45.0, 40.0, 50.0][(self.trainer.iter // 2) % 4]
                self.trainer.storage.put_scalar("bbox/AP50", ap, smoothing_hint=False)

    class BestCheckpointer(E.HookBase):
        def after_step(self):
            curr_val = self.trainer.storage.latest().get("bbox/AP50", 0)
            if type(curr_val) != int:  # noqa: E721 (the source's check)
                curr_val = curr_val[0]
            try:
                _ = self.trainer.storage.history("max_bbox/AP50")
            except:  # noqa: E722 (the source's bare except)
                self.trainer.storage.put_scalar("max_bbox/AP50", curr_val)
            max_val = self.trainer.storage.history("max_bbox/AP50")._data[-1][0]
            if curr_val > max_val:
                log.info("%s > %s: saving model_best", curr_val, max_val)
                self.trainer.storage.put_scalar("max_bbox/AP50", curr_val)

    t = _trainer(E)
    t.register_hooks([Eval(), BestCheckpointer()])
    t.train(0, 8)
    R.storage(t.storage)
    R.rec("latest", t.storage.latest())


@pattern(
    "facebookresearch/Detic", "train_net.py: do_train (writers gated on iteration - start_iter > 5)"
)
def ws_detic_do_train_short_runs(E, R):
    """Detic's ``do_train``: builds the three default writers up front, puts ``data_time``
    and then calls ``storage.step()`` before the forward pass (so the losses land one
    iteration later), and calls the writers only when ``iteration - start_iter > 5`` and at
    a multiple of the period or ``max_iter``; it never closes them (here they are closed when
    the run ends, as interpreter exit does). A 5-iteration run never writes; an 8-iteration
    run writes once, at the end."""

    def do_train(out, max_iter, start_iter=0):
        model = TinyDetector()
        optimizer = sgd(model)
        os.makedirs(out, exist_ok=True)
        writers = [
            E.CommonMetricPrinter(max_iter),
            E.JSONWriter(os.path.join(out, "metrics.json")),
            E.TensorboardXWriter(out),
        ]
        data_loader = batches()
        with E.EventStorage(start_iter) as storage:
            for data, iteration in zip(data_loader, range(start_iter, max_iter)):
                storage.put_scalars(data_time=0.001)
                iteration = iteration + 1
                storage.step()
                loss_dict = model(data)
                losses = sum(loss for k, loss in loss_dict.items())
                loss_dict_reduced = {k: v.item() for k, v in loss_dict.items()}
                losses_reduced = sum(loss for loss in loss_dict_reduced.values())
                storage.put_scalars(total_loss=losses_reduced, **loss_dict_reduced)
                optimizer.zero_grad()
                losses.backward()
                optimizer.step()
                storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
                storage.put_scalars(time=0.01)
                if iteration - start_iter > 5 and (iteration % 20 == 0 or iteration == max_iter):
                    for writer in writers:
                        writer.write()
            R.storage(storage, label=os.path.basename(out))
        for writer in writers:
            writer.close()

    do_train(os.path.join(R.out, "short"), 5)
    do_train(os.path.join(R.out, "long"), 8)
    R.rec("files", sorted(os.listdir(os.path.join(R.out, "short"))) != [])


@pattern(
    "ortegatron/c0dad15e49c2b74de8bb09a5615d9f6b (gist)",
    "LossEvalHook with an early-stopping trainer reading histories()['validation_total_loss']",
)
def ws_validation_history_read_before_put(E, R):
    """The widely copied ``LossEvalHook`` (validation losses put as ``validation_<loss>`` every
    ``eval_period``) with a trainer whose ``after_step`` runs the hooks, then an early-stopping
    check that reads ``storage.histories()['validation_total_loss'].values()`` at every
    iteration, from the first one, before any validation loss was put. detectron2's
    ``histories()`` is its ``defaultdict``: the read creates the empty history there, so a
    writer listing ``histories()`` (the repository's ``TrainValJSONWriter``) sees the name at
    that place, empty at first, then filling."""

    class LossEvalHook(E.HookBase):
        def __init__(self, eval_period, model, data):
            self._model = model
            self._period = eval_period
            self._data = data

        def _do_loss_eval(self):
            with torch.no_grad():
                losses = [{k: v.item() for k, v in self._model(b).items()} for b in self._data]
            means = {k: float(np.mean([d[k] for d in losses])) for k in losses[0]}
            means["total_loss"] = sum(means.values())
            for name, value in means.items():
                self.trainer.storage.put_scalar(f"validation_{name}", value)

        def after_step(self):
            next_iter = self.trainer.iter + 1
            if next_iter == self.trainer.max_iter or next_iter % self._period == 0:
                self._do_loss_eval()

    class HistoriesWriter(E.EventWriter):
        def write(self):
            storage = E.get_event_storage()
            R.rec(
                "histories",
                storage.iter,
                [(k, len(v.values())) for k, v in storage.histories().items()],
            )

    class EarlyStoppingTrainer(E.SimpleTrainer):
        def after_step(self):
            super().after_step()
            values = self.storage.histories()["validation_total_loss"].values()
            R.rec("val_values", self.iter, [round(v, 6) for v, _ in values])

    model = TinyDetector()
    t = EarlyStoppingTrainer(model, batches(5), sgd(model))
    val = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in (7, 8)]
    t.register_hooks(
        [LossEvalHook(3, model, val), E.hooks.PeriodicWriter([HistoriesWriter()], period=2)]
    )
    t.train(0, 7)
    R.storage(t.storage)
