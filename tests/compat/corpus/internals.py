"""Research code that reaches into the engine's private state: the storage stack pushed by
hand, ``storage._latest_scalars`` read inside a model's forward, a storage entered and
exited by hand next to a vendored call of the static ``SimpleTrainer.write_metrics``."""

from __future__ import annotations

import sys
import time
import weakref

import numpy as np
import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd


def _events_module(E):
    """The module ``E``'s ``EventStorage`` comes from (``detectron2.utils.events``)."""
    return sys.modules[E.EventStorage.__module__]


# --- vincrichard/EfficientPS ------------------------------------------------------------------


class _InstanceHeadDetector(nn.Module):
    """A panoptic model stand-in whose instance head logs detectron2's RPN and ROI-head
    statistics through ``get_event_storage()`` during training, as detectron2's RPN
    (``rpn/num_pos_anchors``...) and ``FastRCNNOutputLayers`` (``fast_rcnn/cls_accuracy``)
    do from inside ``forward``."""

    def __init__(self, E):
        super().__init__()
        self.E = E
        self.backbone = nn.Linear(4, 3)
        self.cls = nn.Linear(3, 2)

    def forward(self, batch):
        feats = torch.tanh(self.backbone(batch))
        logits = self.cls(feats)
        gt = (batch[:, 0] > 0).long()
        storage = self.E.get_event_storage()
        pos = int((batch > 0).sum())
        storage.put_scalar("rpn/num_pos_anchors", pos / len(batch))
        storage.put_scalar("rpn/num_neg_anchors", (batch.numel() - pos) / len(batch))
        accurate = (logits.argmax(dim=1) == gt).sum().item()
        storage.put_scalar("fast_rcnn/cls_accuracy", accurate / len(batch))
        return {
            "loss_cls": nn.functional.cross_entropy(logits, gt),
            "loss_sem": feats.pow(2).mean() * 0.1,
        }


@pattern(
    "vincrichard/EfficientPS",
    "train_net.py: main (_CURRENT_STORAGE_STACK.append(EventStorage()) before Lightning's fit)",
)
def in_efficientps_storage_pushed_by_hand(E, R):
    """EfficientPS trains with PyTorch Lightning, not detectron2's trainer, but its instance
    head is detectron2's RPN and ROI heads, which call ``get_event_storage()``. To keep them
    from failing, ``main`` imports ``_CURRENT_STORAGE_STACK`` from
    ``detectron2.utils.events`` and appends a bare ``EventStorage()`` to it, never entering it
    as a context and never calling ``step()``: every statistic lands at iteration 0. Here
    Lightning's loop is a plain loop of ``training_step`` + backward + ``optimizer.step()``;
    the script never pops the storage (the process ends), here it is popped at the end so that
    the next pattern starts clean."""
    stack = _events_module(E)._CURRENT_STORAGE_STACK
    depth = len(stack)
    stack.append(E.EventStorage())
    try:
        storage = E.get_event_storage()
        R.rec("pushed storage is current", storage is stack[-1], storage.iter)
        model = _InstanceHeadDetector(E)
        optimizer = sgd(model, lr=0.05)
        data = batches(seed=3, size=4)
        for batch_idx in range(5):
            loss_dict = model(next(data))  # training_step
            loss = sum(loss_dict.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            log.info("step %d loss %.6f", batch_idx, loss.item())
        R.storage(storage)
        R.rec("accuracy history", storage.history("fast_rcnn/cls_accuracy").values())
        R.rec("median pos anchors", storage.history("rpn/num_pos_anchors").median(3))
    finally:
        del stack[depth:]
    R.rec("stack depth after", len(stack) - depth)


# --- wusize/raw_ovd ---------------------------------------------------------------------------


class _OVDHead(TinyDetector):
    """The ROI head's ``label_and_sample_proposals`` logs the mean IoU and score of the base
    and novel ground truth each step. When a batch has none of a kind (here: novel boxes on
    every third iteration, base boxes on iteration 4) it repeats the last logged value, read
    from ``storage._latest_scalars[name][0]``, or logs ``np.zeros(1).sum()`` if the name was
    never put."""

    def __init__(self, E):
        super().__init__()
        self.E = E

    def forward(self, batch):
        out = super().forward(batch)
        storage = self.E.get_event_storage()
        it = storage.iter
        num_fg = [int((batch[i] > 0).sum()) for i in range(len(batch))]
        storage.put_scalar("roi_head/num_fg_samples", np.mean(num_fg))
        storage.put_scalar("roi_head/num_bg_samples", np.mean([4 - n for n in num_fg]))
        scores = torch.sigmoid(batch[:, 0]).numpy()
        ious = torch.sigmoid(batch[:, 1]).numpy()
        group = {
            "base_scores": scores[:2] if it != 4 else scores[:0],
            "novel_scores": scores[2:] if it % 3 != 1 else scores[:0],
            "base_ious": ious[:2] if it != 4 else ious[:0],
            "novel_ious": ious[2:] if it % 3 != 1 else ious[:0],
        }
        for k in ["base_scores", "novel_scores", "base_ious", "novel_ious"]:
            values = np.concatenate([group[k]], axis=0)
            if len(values) > 0:
                val = values.mean()
            else:
                if f"gt_ious_scores/{k}" in storage._latest_scalars:
                    val = storage._latest_scalars[f"gt_ious_scores/{k}"][0]
                else:
                    val = np.zeros(1).sum()
            storage.put_scalar(f"gt_ious_scores/{k}", val)
        return out


@pattern(
    "wusize/raw_ovd",
    "detic/modeling/roi_heads/standard_roi_heads.py: label_and_sample_proposals (f966324)",
)
def in_rawovd_latest_scalars_fallback(E, R):
    """An open-vocabulary detector's ROI head (Detic-based) puts per-step statistics from
    inside the model's forward and, when a step has nothing to measure, looks the previous
    value up in the storage's private ``_latest_scalars`` dict (membership test, then
    ``[name][0]``) instead of skipping the put, so the curve stays continuous. Trained by a
    ``SimpleTrainer`` with a ``JSONWriter`` every 3 iterations."""
    model = _OVDHead(E)
    trainer = E.SimpleTrainer(model, batches(seed=4, size=4), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"), window_size=2)], 3),
        ]
    )
    trainer.train(0, 8)
    R.storage(trainer.storage)
    R.rec("novel history", trainer.storage.history("gt_ious_scores/novel_ious").values())
    R.rec("base history", trainer.storage.history("gt_ious_scores/base_scores").values())


@pattern(
    "wusize/raw_ovd",
    "third_party/CenterNet2/tools/lightning_train_net.py: TrainingModule.training_step",
)
def in_rawovd_vendored_lightning_write_metrics(E, R):
    """The repository vendors an older copy of detectron2's Lightning example: the first
    ``training_step`` makes ``EventStorage(0)`` and calls ``__enter__()`` by hand, sets
    ``iteration_timer.trainer = weakref.proxy(self)`` and calls its ``before_step``, then
    runs the model and calls the static ``SimpleTrainer.write_metrics(loss_dict,
    data_time)`` with the two arguments of the detectron2 it was written for; detectron2's
    current signature also takes ``cur_iter``, so the step raises ``TypeError``. The storage
    stays entered (nothing exits it on the error path); here the error is recorded and the
    storage exited by hand, as ``training_epoch_end`` would. The writers of the source
    (``default_writers``) are never written before the error; they are left out here."""

    class TrainingModule:  # stands in for the LightningModule
        def __init__(self):
            self.model = TinyDetector()
            self.storage = None
            self.start_iter = 0
            self.max_iter = 4
            self.iteration_timer = E.hooks.IterationTimer()
            self.iteration_timer.before_train()  # setup()
            self.data_start = time.perf_counter()

        @property
        def iter(self):
            return self.storage.iter

        def training_step(self, batch, batch_idx):
            data_time = time.perf_counter() - self.data_start
            if self.storage is None:
                self.storage = E.EventStorage(0)
                self.storage.__enter__()
                self.iteration_timer.trainer = weakref.proxy(self)
                self.iteration_timer.before_step()
            loss_dict = self.model(batch)
            E.SimpleTrainer.write_metrics(loss_dict, data_time)
            self.storage.put_scalar("lr", 0.1, smoothing_hint=False)
            self.iteration_timer.after_step()
            self.storage.step()
            self.iteration_timer.before_step()
            return sum(loss_dict.values())

    module = TrainingModule()
    data = batches(seed=2)
    try:
        module.training_step(next(data), 0)
    except TypeError as e:
        R.rec("training_step raised", type(e).__name__, str(e))
    storage = module.storage
    R.rec("entered by hand is current", E.get_event_storage() is storage)
    R.storage(storage)
    storage.__exit__(None, None, None)  # training_epoch_end
    try:
        E.get_event_storage()
    except AssertionError:
        R.rec("no storage after exit")
