"""``train_net.py`` scripts around ``DetectionCheckpointer`` (issue 41): model-zoo and Caffe2
``.pkl`` files read with matching heuristics into nested models, checkpointer subclasses that
load a teacher/student pair, checkpoint surgery before fine-tuning, a finished run relaunched
with a longer or a shorter schedule, EMA states kept as checkpointables, and the evaluation
modes of the scripts (``--eval-only``, ``--eval-iter``, ``--eval-all``).

The engine calls are the scripts'; the models are tiny stand-ins whose parameter names follow
detectron2's R-CNN (``backbone.bottom_up.stem.conv1``, ``roi_heads.box_predictor.cls_score``)
so that the name-matching rules see what they see on real models."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import pickle
import time
import types
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batches, log, preempted_before, weights

# --- stand-ins shared by the patterns --------------------------------------------------------


class _ConvNorm(nn.Linear):
    """A "conv" with a ``norm`` child, as detectron2's ``Conv2d(norm=...)``: its keys are
    ``weight``, ``bias``, ``norm.weight``, ``norm.bias``."""

    def __init__(self, i, o):
        super().__init__(i, o)
        self.norm = nn.LayerNorm(o)


class _RCNN(nn.Module):
    """A detector named like detectron2's ``GeneralizedRCNN`` (``pixel_mean``/``pixel_std``
    buffers, ``backbone.bottom_up.stem.conv1``, ``backbone.bottom_up.res2.0.conv{1,2}``,
    ``roi_heads.box_predictor.{cls_score,bbox_pred}`` for ``num_classes`` plus background)."""

    def __init__(self, num_classes=2):
        super().__init__()
        self.register_buffer("pixel_mean", torch.zeros(4))
        self.register_buffer("pixel_std", torch.ones(4))
        self.backbone = nn.Module()
        self.backbone.bottom_up = nn.Module()
        self.backbone.bottom_up.stem = nn.Module()
        self.backbone.bottom_up.stem.conv1 = _ConvNorm(4, 3)
        block = nn.Module()
        block.conv1 = nn.Linear(3, 3)
        block.conv2 = nn.Linear(3, 3)
        self.backbone.bottom_up.res2 = nn.Sequential(block)
        self.roi_heads = nn.Module()
        self.roi_heads.box_predictor = nn.Module()
        self.roi_heads.box_predictor.cls_score = nn.Linear(3, num_classes + 1)
        self.roi_heads.box_predictor.bbox_pred = nn.Linear(3, num_classes * 4)

    def scores(self, batch):
        x = (batch - self.pixel_mean) / self.pixel_std
        bu = self.backbone.bottom_up
        x = bu.stem.conv1.norm(torch.tanh(bu.stem.conv1(x)))
        block = bu.res2[0]
        x = x + block.conv2(torch.relu(block.conv1(x)))
        predictor = self.roi_heads.box_predictor
        return predictor.cls_score(x), predictor.bbox_pred(x)

    def forward(self, batch):
        scores, deltas = self.scores(batch)
        if not self.training:
            return scores
        return {"loss_cls": (scores**2).mean(), "loss_box_reg": deltas.abs().mean() * 0.1}


def _ap(model, seed=77):
    """An "AP" for the model: a number that moves with its weights (the evaluator's stand-in)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
        score = float(torch.sigmoid(model(x)).mean())
    model.train(was_training)
    return round(score * 100, 6)


def _cfg(**kw):
    return types.SimpleNamespace(**kw)


def _build_lr_scheduler(E, cfg, optimizer):
    """``detectron2.solver.build_lr_scheduler`` for ``WarmupMultiStepLR``."""
    S = E.solver
    steps = [x for x in cfg.STEPS if x <= cfg.MAX_ITER]
    if len(steps) != len(cfg.STEPS):
        log.warning(
            "SOLVER.STEPS contains values larger than SOLVER.MAX_ITER. "
            "These values will be ignored."
        )
    sched = S.MultiStepParamScheduler(
        values=[cfg.GAMMA**k for k in range(len(steps) + 1)],
        milestones=steps,
        num_updates=cfg.MAX_ITER,
    )
    sched = S.WarmupParamScheduler(
        sched, cfg.WARMUP_FACTOR, min(cfg.WARMUP_ITERS / cfg.MAX_ITER, 1.0), "linear", False
    )
    return S.LRMultiplier(optimizer, multiplier=sched, max_iter=cfg.MAX_ITER)


def _build_optimizer(model, lr):
    """``build_optimizer``: SGD over the parameters that require a gradient."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)


def _default_trainer(E):
    """detectron2's ``DefaultTrainer`` (``engine/defaults.py``) over ``E``'s pieces: a
    ``TrainerBase`` holding a ``SimpleTrainer`` in ``_trainer``, a ``DetectionCheckpointer``
    with ``trainer=weakref.proxy(self)``, its ``resume_or_load`` and ``build_hooks``. Its
    writers are a ``JSONWriter`` with ``window_size=1`` (a resumed hookloop run smooths over
    the history restored from the checkpoint, detectron2's starts empty, README), without
    the console printer (these patterns look at files, checkpoints and records)."""

    class DefaultTrainer(E.TrainerBase):
        def __init__(self, cfg):
            super().__init__()
            model = self.build_model(cfg)
            optimizer = self.build_optimizer(cfg, model)
            data_loader = self.build_train_loader(cfg)
            self._trainer = self._create_trainer(cfg, model, data_loader, optimizer)
            self.scheduler = self.build_lr_scheduler(cfg, optimizer)
            self.checkpointer = self._create_checkpointer(model, cfg)
            self.start_iter = 0
            self.max_iter = cfg.MAX_ITER
            self.cfg = cfg
            self.register_hooks(self.build_hooks())

        def _create_trainer(self, cfg, model, data_loader, optimizer):
            return E.SimpleTrainer(model, data_loader, optimizer)

        def _create_checkpointer(self, model, cfg):
            return E.DetectionCheckpointer(model, cfg.OUTPUT_DIR, trainer=weakref.proxy(self))

        def resume_or_load(self, resume=True):
            self.checkpointer.resume_or_load(self.cfg.WEIGHTS, resume=resume)
            if resume and self.checkpointer.has_checkpoint():
                self.start_iter = self.iter + 1

        def build_hooks(self):
            cfg = self.cfg
            ret = [E.hooks.IterationTimer(), E.hooks.LRScheduler(), None]
            ret.append(E.hooks.PeriodicCheckpointer(self.checkpointer, cfg.CHECKPOINT_PERIOD))

            def test_and_save_results():
                self._last_eval_results = self.test(self.cfg, self.model)
                return self._last_eval_results

            ret.append(E.hooks.EvalHook(cfg.EVAL_PERIOD, test_and_save_results))
            ret.append(E.hooks.PeriodicWriter(self.build_writers(), period=20))
            return ret

        def build_writers(self):
            return [E.JSONWriter(os.path.join(self.cfg.OUTPUT_DIR, "metrics.json"), window_size=1)]

        def train(self):
            super().train(self.start_iter, self.max_iter)
            return getattr(self, "_last_eval_results", None)

        def run_step(self):
            self._trainer.iter = self.iter
            self._trainer.run_step()

        def state_dict(self):
            ret = super().state_dict()
            ret["_trainer"] = self._trainer.state_dict()
            return ret

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            self._trainer.load_state_dict(state_dict["_trainer"])

        @classmethod
        def build_model(cls, cfg):
            return _RCNN(cfg.NUM_CLASSES)

        @classmethod
        def build_optimizer(cls, cfg, model):
            return _build_optimizer(model, cfg.BASE_LR)

        @classmethod
        def build_train_loader(cls, cfg):
            return batches(seed=cfg.SEED)

        @classmethod
        def build_lr_scheduler(cls, cfg, optimizer):
            return _build_lr_scheduler(E, cfg, optimizer)

        @classmethod
        def test(cls, cfg, model, evaluators=None):
            ap = _ap(model)
            log.info("Evaluation results for bbox: AP %.6f", ap)
            return OrderedDict(bbox={"AP": ap, "AP50": ap * 1.5})

        @property
        def data_loader(self):
            return self._trainer.data_loader

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

    return DefaultTrainer


def _solver_cfg(out, **kw):
    cfg = dict(
        OUTPUT_DIR=out,
        WEIGHTS="",
        NUM_CLASSES=2,
        SEED=1,
        BASE_LR=0.05,
        STEPS=(4,),
        GAMMA=0.1,
        WARMUP_FACTOR=0.1,
        WARMUP_ITERS=2,
        MAX_ITER=6,
        CHECKPOINT_PERIOD=4,
        EVAL_PERIOD=3,
    )
    cfg.update(kw)
    return _cfg(**cfg)


def _dir(R, *parts):
    """A folder under the pattern's (created)."""
    d = os.path.join(R.out, *parts)
    os.makedirs(d, exist_ok=True)
    return d


def _same(a, b):
    """Whether two modules hold the same state."""
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _files(d):
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _lrs(optimizer):
    return [round(g["lr"], 8) for g in optimizer.param_groups]


def _history(storage, key, since=0):
    """``storage.history(key)``'s (value, iteration) pairs from iteration ``since`` on."""
    return [(round(float(v), 8), it) for v, it in storage.history(key).values() if it >= since]


# --- facebookresearch/unbiased-teacher copies: the teacher/student checkpointer ----------------


def _c2_pkl(path, seed):
    """A Caffe2 / Detectron1 model-zoo file: ``{"blobs": {...}}`` of numpy arrays under C2
    names, with a ``_momentum`` blob, an ImageNet classifier (``fc1000``), box predictors
    that hold the background class, and one blob of the wrong shape."""
    g = np.random.RandomState(seed)

    def f(*shape):
        return g.standard_normal(shape).astype(np.float32)

    blobs = {
        "conv1_w": f(3, 4),
        "conv1_b": f(3),
        "conv1_w_momentum": f(3, 4),
        "res_conv1_bn_s": f(3),
        "res_conv1_bn_b": f(3),
        "res2_0_branch2a_w": f(3, 3),
        "res2_0_branch2a_b": f(3),
        "res2_0_branch2b_w": f(2, 3),
        "res2_0_branch2b_b": f(3),
        "cls_score_w": f(3, 3),
        "cls_score_b": f(3),
        "bbox_pred_w": f(12, 3),
        "bbox_pred_b": f(12),
        "fc1000_w": f(5, 3),
        "fc1000_b": f(5),
    }
    with open(path, "wb") as fh:
        pickle.dump({"blobs": blobs}, fh)


class _EnsembleTSModel(nn.Module):
    """``ubteacher/modeling/meta_arch/ts_ensemble.py``: the pair saved and loaded together."""

    def __init__(self, modelTeacher, modelStudent):  # noqa: N803 - the source's names
        super().__init__()
        self.modelTeacher = modelTeacher
        self.modelStudent = modelStudent


def _ts_checkpointer(E):
    """``ubteacher/checkpoint/detection_checkpoint.py``: ``DetectionTSCheckpointer``, with
    ``from fvcore.common.checkpoint import _strip_prefix_if_present, _IncompatibleKeys`` read
    from ``E.checkpoint_module`` and ``align_and_update_state_dicts`` from
    ``E.c2_model_loading`` (``detectron2.checkpoint.c2_model_loading``)."""
    ck = E.checkpoint_module
    _strip_prefix_if_present = ck._strip_prefix_if_present
    _IncompatibleKeys = ck._IncompatibleKeys
    align_and_update_state_dicts = E.c2_model_loading.align_and_update_state_dicts

    class DetectionTSCheckpointer(E.DetectionCheckpointer):
        def _load_model(self, checkpoint):
            if checkpoint.get("__author__", None) == "Caffe2":
                # pretrained model weight: only update student model
                if checkpoint.get("matching_heuristics", False):
                    self._convert_ndarray_to_tensor(checkpoint["model"])
                    checkpoint["model"] = align_and_update_state_dicts(
                        self.model.modelStudent.state_dict(),
                        checkpoint["model"],
                        c2_conversion=checkpoint.get("__author__", None) == "Caffe2",
                    )
                incompatible = self._load_student_model(checkpoint)
                model_buffers = dict(self.model.modelStudent.named_buffers(recurse=False))
                for k in ["pixel_mean", "pixel_std"]:
                    if k in model_buffers:
                        try:
                            incompatible.missing_keys.remove(k)
                        except ValueError:
                            pass
                return incompatible
            else:  # whole model
                if checkpoint.get("matching_heuristics", False):
                    self._convert_ndarray_to_tensor(checkpoint["model"])
                    checkpoint["model"] = align_and_update_state_dicts(
                        self.model.state_dict(),
                        checkpoint["model"],
                        c2_conversion=checkpoint.get("__author__", None) == "Caffe2",
                    )
                incompatible = super()._load_model(checkpoint)
                model_buffers = dict(self.model.named_buffers(recurse=False))
                for k in ["pixel_mean", "pixel_std"]:
                    if k in model_buffers:
                        try:
                            incompatible.missing_keys.remove(k)
                        except ValueError:
                            pass
                return incompatible

        def _load_student_model(self, checkpoint):
            checkpoint_state_dict = checkpoint.pop("model")
            self._convert_ndarray_to_tensor(checkpoint_state_dict)
            _strip_prefix_if_present(checkpoint_state_dict, "module.")
            model_state_dict = self.model.modelStudent.state_dict()
            incorrect_shapes = []
            for k in list(checkpoint_state_dict.keys()):
                if k in model_state_dict:
                    shape_model = tuple(model_state_dict[k].shape)
                    shape_checkpoint = tuple(checkpoint_state_dict[k].shape)
                    if shape_model != shape_checkpoint:
                        incorrect_shapes.append((k, shape_checkpoint, shape_model))
                        checkpoint_state_dict.pop(k)
            incompatible = self.model.modelStudent.load_state_dict(
                checkpoint_state_dict, strict=False
            )
            return _IncompatibleKeys(
                missing_keys=incompatible.missing_keys,
                unexpected_keys=incompatible.unexpected_keys,
                incorrect_shapes=incorrect_shapes,
            )

        def _load_optimizer_scheduler(self, checkpoint, checkpointables=None):
            for key in self.checkpointables if checkpointables is None else checkpointables:
                if key in checkpoint:
                    self.logger.info("Loading {} ...".format(key))
                    obj = self.checkpointables[key]
                    obj.load_state_dict(checkpoint.pop(key))
            return checkpoint

    return DetectionTSCheckpointer


def _ubteacher_trainer(E, TSCheckpointer):
    """``ubteacher/engine/trainer.py``: ``UBTeacherTrainer`` (a ``DefaultTrainer`` built by
    hand: ``TrainerBase.__init__``, a ``SimpleTrainer`` in ``_trainer``, the teacher kept
    beside it and both saved through ``EnsembleTSModel``), its own ``train_loop`` and
    ``run_step_full_semisup``: burn-in on the student, then the teacher copied from the
    student and updated by EMA, a pseudo-label loss, and metrics put through its own
    ``_write_metrics``."""

    class UBTeacherTrainer(E.TrainerBase):
        def __init__(self, cfg):
            data_loader = batches(seed=cfg.SEED)
            model = _RCNN()
            optimizer = _build_optimizer(model, cfg.BASE_LR)
            model_teacher = _RCNN()
            self.model_teacher = model_teacher
            E.TrainerBase.__init__(self)
            self._trainer = E.SimpleTrainer(model, data_loader, optimizer)
            self.scheduler = _build_lr_scheduler(E, cfg, optimizer)
            ensem_ts_model = _EnsembleTSModel(model_teacher, model)
            self.checkpointer = TSCheckpointer(
                ensem_ts_model, cfg.OUTPUT_DIR, optimizer=optimizer, scheduler=self.scheduler
            )
            self.start_iter = 0
            self.max_iter = cfg.MAX_ITER
            self.cfg = cfg
            self.register_hooks(self.build_hooks())

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        def resume_or_load(self, resume=True):
            checkpoint = self.checkpointer.resume_or_load(self.cfg.WEIGHTS, resume=resume)
            if resume and self.checkpointer.has_checkpoint():
                self.start_iter = checkpoint.get("iteration", -1) + 1
            return checkpoint

        def build_hooks(self):
            cfg = self.cfg
            ret = [
                E.hooks.IterationTimer(),
                E.hooks.LRScheduler(self.optimizer, self.scheduler),
                None,
                E.hooks.PeriodicCheckpointer(self.checkpointer, cfg.CHECKPOINT_PERIOD),
            ]

            def test_and_save_results():
                self._last_eval_results = {
                    "bbox_student": {"AP": _ap(self.model)},
                    "bbox_teacher": {"AP": _ap(self.model_teacher)},
                }
                return self._last_eval_results

            ret.append(E.hooks.EvalHook(cfg.EVAL_PERIOD, test_and_save_results))
            writer = E.JSONWriter(os.path.join(cfg.OUTPUT_DIR, "metrics.json"), window_size=1)
            ret.append(E.hooks.PeriodicWriter([writer], period=2))
            return ret

        def train(self):
            self.train_loop(self.start_iter, self.max_iter)
            return getattr(self, "_last_eval_results", None)

        def train_loop(self, start_iter, max_iter):
            log.info("Starting training from iteration {}".format(start_iter))
            self.iter = self.start_iter = start_iter
            self.max_iter = max_iter
            with E.EventStorage(start_iter) as self.storage:
                try:
                    self.before_train()
                    for self.iter in range(start_iter, max_iter):
                        self.before_step()
                        self.run_step_full_semisup()
                        self.after_step()
                except Exception:
                    log.exception("Exception during training:")
                    raise
                finally:
                    self.after_train()

        def run_step_full_semisup(self):
            self._trainer.iter = self.iter
            assert self.model.training, "[UBTeacherTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._trainer._data_loader_iter)
            data_time = time.perf_counter() - start
            if self.iter < self.cfg.BURN_UP_STEP:
                record_dict = self.model(data)
            else:
                if self.iter == self.cfg.BURN_UP_STEP:
                    self._update_teacher_model(keep_rate=0.00)
                elif (self.iter - self.cfg.BURN_UP_STEP) % self.cfg.TEACHER_UPDATE_ITER == 0:
                    self._update_teacher_model(keep_rate=self.cfg.EMA_KEEP_RATE)
                with torch.no_grad():
                    pseudo, _ = self.model_teacher.scores(data)
                record_dict = self.model(data)
                scores, _ = self.model.scores(data)
                record_dict["loss_cls_pseudo"] = ((scores - pseudo) ** 2).mean()
            losses = sum(v for k, v in record_dict.items() if k[:4] == "loss")
            metrics_dict = dict(record_dict)
            metrics_dict["data_time"] = data_time
            self._write_metrics(metrics_dict)
            self.optimizer.zero_grad()
            losses.backward()
            self.optimizer.step()

        @torch.no_grad()
        def _update_teacher_model(self, keep_rate=0.996):
            student_model_dict = self.model.state_dict()
            new_teacher_dict = OrderedDict()
            for key, value in self.model_teacher.state_dict().items():
                if key in student_model_dict.keys():
                    new_teacher_dict[key] = (
                        student_model_dict[key] * (1 - keep_rate) + value * keep_rate
                    )
                else:
                    raise Exception("{} is not found in student model".format(key))
            self.model_teacher.load_state_dict(new_teacher_dict)

        def _write_metrics(self, metrics_dict):
            metrics_dict = {
                k: v.detach().cpu().item() if isinstance(v, torch.Tensor) else float(v)
                for k, v in metrics_dict.items()
            }
            all_metrics_dict = E.comm.gather(metrics_dict)
            if E.comm.is_main_process():
                if "data_time" in all_metrics_dict[0]:
                    data_time = np.max([x.pop("data_time") for x in all_metrics_dict])
                    self.storage.put_scalar("data_time", data_time)
                metrics_dict = {
                    k: np.mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0]
                }
                loss_dict = {k: v for k, v in metrics_dict.items() if k[:4] == "loss"}
                total_losses_reduced = sum(loss for loss in loss_dict.values())
                self.storage.put_scalar("total_loss", total_losses_reduced)
                if len(metrics_dict) > 1:
                    self.storage.put_scalars(**metrics_dict)

    return UBTeacherTrainer


def _ubt_cfg(R, **kw):
    cfg = _solver_cfg(
        _dir(R, "output"),
        BURN_UP_STEP=3,
        TEACHER_UPDATE_ITER=1,
        EMA_KEEP_RATE=0.5,
        MAX_ITER=6,
        EVAL_PERIOD=3,
        CHECKPOINT_PERIOD=4,
    )
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pattern(
    "honggyuchoi/unbiased-teacher",
    "ubteacher/checkpoint/detection_checkpoint.py: DetectionTSCheckpointer + "
    "ubteacher/engine/trainer.py: UBTeacherTrainer",
)
def tn_ubteacher_caffe2_pkl_into_student(E, R):
    """Unbiased Teacher's ``DetectionTSCheckpointer`` (a ``DetectionCheckpointer`` subclass
    overriding ``_load_model`` and ``_load_optimizer_scheduler``, importing
    ``_strip_prefix_if_present`` and ``_IncompatibleKeys`` from ``fvcore.common.checkpoint``):
    ``MODEL.WEIGHTS`` is a Caffe2 ``.pkl`` (``blobs``, C2 names, a ``_momentum`` blob, box
    predictors with the background class, one blob of the wrong shape), which
    ``DetectionCheckpointer._load_file`` marks ``__author__ = "Caffe2"`` with matching
    heuristics; the subclass renames and matches it against the *student* only
    (``align_and_update_state_dicts(self.model.modelStudent.state_dict(), ...)``) and loads it
    with its own ``_load_student_model``; fvcore logs what stays missing or unexpected. The
    trainer burns in, copies the student into the teacher, updates it by EMA, saves the pair
    through ``EnsembleTSModel``; a relaunch with ``--resume`` loads the whole pair, the
    optimizer and the scheduler from ``model_final.pth`` (a plain ``.pth``: the else-branch,
    the parent's ``_load_model``) and starts at ``iteration + 1 == MAX_ITER``: no step runs,
    the hooks' ``before_train``/``after_train`` do (the final evaluation, the writer)."""
    TS = _ts_checkpointer(E)
    Trainer = _ubteacher_trainer(E, TS)
    weights_path = R.path("R-50.pkl")
    _c2_pkl(weights_path, seed=5)
    cfg = _ubt_cfg(R, WEIGHTS=weights_path)

    trainer = Trainer(cfg)
    teacher_before = copy.deepcopy(trainer.model_teacher)
    ret = trainer.resume_or_load(resume=False)
    R.rec("returned", sorted(ret))
    R.rec("student loaded", weights(trainer.model))
    R.rec("teacher untouched", _same(teacher_before, trainer.model_teacher))
    R.rec("results", trainer.train())
    R.rec("files", _files(cfg.OUTPUT_DIR))
    R.rec("teacher", weights(trainer.model_teacher))
    R.rec("lr", _history(trainer.storage, "lr"))
    R.storage(trainer.storage)

    again = Trainer(cfg)
    ret = again.resume_or_load(resume=True)
    R.rec("resumed", sorted(ret), again.start_iter, _lrs(again.optimizer))
    R.rec("results", again.train())
    R.rec("iter", again.iter, again.storage.iter)
    R.rec("pair", _same(again.model, trainer.model))


@pattern("honggyuchoi/unbiased-teacher", "train_net.py: main (--eval-only, --resume)")
def tn_ubteacher_eval_only_loads(E, R):
    """``train_net.py --eval-only``: ``DetectionCheckpointer(ensem_ts_model,
    save_dir=cfg.OUTPUT_DIR).resume_or_load(cfg.MODEL.WEIGHTS, resume=args.resume)`` on the
    teacher/student pair, then the teacher (or, with ``--eval_student``, the student) is
    tested. With ``--resume`` the run's ``last_checkpoint`` wins over ``MODEL.WEIGHTS``; the
    files of a finished run are written here by ``checkpointer.save`` as its
    ``PeriodicCheckpointer`` would. Without it, ``MODEL.WEIGHTS`` is read: a detectron2
    model-zoo ``.pkl`` of one detector (numpy arrays, ``__author__``) matches no key of the
    pair (no heuristics for such files: everything is missing or unexpected), and a ``.pth``
    of one detector asked for ``?matching_heuristics=True`` matches each of its keys twice
    (``modelTeacher.`` and ``modelStudent.`` both end with it), which detectron2 refuses."""
    out = _dir(R, "output")

    def build():
        return _EnsembleTSModel(_RCNN(), _RCNN())

    trained = build()
    saver = E.DetectionCheckpointer(trained, out)
    saver.save("model_0000003", iteration=3)
    saver.save("model_final", iteration=5)
    R.rec("files", _files(out))

    def main(weights_path, resume, eval_student=False):
        ensem_ts_model = build()
        ret = E.DetectionCheckpointer(ensem_ts_model, save_dir=out).resume_or_load(
            weights_path, resume=resume
        )
        model = ensem_ts_model.modelStudent if eval_student else ensem_ts_model.modelTeacher
        R.rec("eval", weights_path.replace(R.out, "<out>"), resume, sorted(ret), _ap(model))
        return ensem_ts_model

    loaded = main("", resume=True)
    R.rec("same as trained", _same(loaded, trained))
    main("", resume=True, eval_student=True)

    zoo = R.path("zoo", "model_final_280758.pkl")
    single = _RCNN()
    with open(zoo, "wb") as fh:
        pickle.dump(
            {
                "model": {k: v.numpy() for k, v in single.state_dict().items()},
                "__author__": "Detectron2 Model Zoo",
            },
            fh,
        )
    main(zoo, resume=False)
    plain = R.path("zoo", "single.pth")
    torch.save({"model": single.state_dict()}, plain)
    main(plain + "?matching_heuristics=True", resume=False)


# --- ucbdrive/few-shot-object-detection (TFA): surgery, fine-tuning, evaluation -------------


def _fsdet_trainer(E):
    """``fsdet/engine/defaults.py``: FsDet's ``DefaultTrainer``, a ``SimpleTrainer`` subclass
    (detectron2's older design) holding a ``DetectionCheckpointer`` with the optimizer and the
    scheduler, whose ``resume_or_load`` sets ``start_iter`` to the loaded ``iteration + 1``
    whatever ``resume`` was, and whose hooks are IterationTimer, LRScheduler,
    PeriodicCheckpointer, an evaluation hook and a ``PeriodicWriter`` at its default
    period (JSON only: see ``_default_trainer``). ``MODEL.BACKBONE.FREEZE`` freezes the
    backbone before the optimizer is built."""

    class DefaultTrainer(E.SimpleTrainer):
        def __init__(self, cfg):
            model = self.build_model(cfg)
            optimizer = _build_optimizer(model, cfg.BASE_LR)
            data_loader = batches(seed=cfg.SEED)
            super().__init__(model, data_loader, optimizer)
            self.scheduler = _build_lr_scheduler(E, cfg, optimizer)
            self.checkpointer = E.DetectionCheckpointer(
                model, cfg.OUTPUT_DIR, optimizer=optimizer, scheduler=self.scheduler
            )
            self.start_iter = 0
            self.max_iter = cfg.MAX_ITER
            self.cfg = cfg
            self.register_hooks(self.build_hooks())

        def resume_or_load(self, resume=True):
            self.start_iter = (
                self.checkpointer.resume_or_load(self.cfg.WEIGHTS, resume=resume).get(
                    "iteration", -1
                )
                + 1
            )

        def build_hooks(self):
            cfg = self.cfg
            ret = [
                E.hooks.IterationTimer(),
                E.hooks.LRScheduler(self.optimizer, self.scheduler),
                None,
                E.hooks.PeriodicCheckpointer(self.checkpointer, cfg.CHECKPOINT_PERIOD),
            ]

            def test_and_save_results():
                self._last_eval_results = self.test(self.cfg, self.model)
                return self._last_eval_results

            ret.append(E.hooks.EvalHook(cfg.EVAL_PERIOD, test_and_save_results))
            writer = E.JSONWriter(os.path.join(cfg.OUTPUT_DIR, "metrics.json"), window_size=1)
            ret.append(E.hooks.PeriodicWriter([writer]))
            return ret

        def train(self):
            super().train(self.start_iter, self.max_iter)
            return getattr(self, "_last_eval_results", None)

        @classmethod
        def build_model(cls, cfg):
            model = _RCNN(cfg.NUM_CLASSES)
            if cfg.FREEZE:
                for p in model.backbone.parameters():
                    p.requires_grad_(False)
            return model

        @classmethod
        def test(cls, cfg, model):
            return OrderedDict(bbox={"AP": _ap(model)})

    return DefaultTrainer


def _tfa_cfg(out, **kw):
    return _solver_cfg(out, **{"FREEZE": False, "CHECKPOINT_PERIOD": 2, **kw})


def _ckpt_surgery(src1, method, save_dir, tar_size, param_names, tar_name="model_reset"):
    """``tools/ckpt_surgery.py`` (PASCAL VOC branch): ``remove`` deletes the predictor's
    weights, ``randinit`` keeps the base classes' rows, draws the novel ones and keeps the
    background row last; both reset the optimizer, the scheduler and the iteration."""

    def surgery(param_name, is_weight, tar_size, ckpt):
        weight_name = param_name + (".weight" if is_weight else ".bias")
        pretrained_weight = ckpt["model"][weight_name]
        prev_cls = pretrained_weight.size(0)
        if "cls_score" in param_name:
            prev_cls -= 1
        if is_weight:
            feat_size = pretrained_weight.size(1)
            new_weight = torch.rand((tar_size, feat_size))
            torch.nn.init.normal_(new_weight, 0, 0.01)
        else:
            new_weight = torch.zeros(tar_size)
        new_weight[:prev_cls] = pretrained_weight[:prev_cls]
        if "cls_score" in param_name:
            new_weight[-1] = pretrained_weight[-1]  # bg class
        ckpt["model"][weight_name] = new_weight

    ckpt = torch.load(src1)
    save_name = tar_name + "_" + ("remove" if method == "remove" else "surgery") + ".pth"
    save_path = os.path.join(save_dir, save_name)
    os.makedirs(save_dir, exist_ok=True)
    for key in ("scheduler", "optimizer"):
        if key in ckpt:
            del ckpt[key]
    if "iteration" in ckpt:
        ckpt["iteration"] = 0
    if method == "remove":
        for param_name in param_names:
            del ckpt["model"][param_name + ".weight"]
            if param_name + ".bias" in ckpt["model"]:
                del ckpt["model"][param_name + ".bias"]
    else:
        tar_sizes = [tar_size + 1, tar_size * 4]
        for param_name, size in zip(param_names, tar_sizes):
            surgery(param_name, True, size, ckpt)
            surgery(param_name, False, size, ckpt)
    torch.save(ckpt, save_path)
    print("save changed ckpt to {}".format(save_path))
    return save_path


_PREDICTOR = ["roi_heads.box_predictor.cls_score", "roi_heads.box_predictor.bbox_pred"]


@pattern(
    "ucbdrive/few-shot-object-detection",
    "tools/ckpt_surgery.py --method remove + tools/train_net.py --resume (fine-tuning)",
)
def tn_tfa_surgery_remove_then_finetune(E, R):
    """TFA's two stages. Base training: FsDet's ``DefaultTrainer`` with no ``MODEL.WEIGHTS``
    ("no checkpoint found", ``start_iter`` 0) to ``model_final.pth``. Surgery ``--method
    remove``: ``torch.load`` the final checkpoint, delete the optimizer and scheduler, set
    ``iteration`` to 0, delete the box predictor, save ``model_reset_remove.pth`` next to
    it. Fine-tuning on the novel classes (a different predictor size, the backbone frozen)
    in a new output folder with ``--resume`` (``run_experiments.py`` always passes it): no
    ``last_checkpoint`` there, so ``MODEL.WEIGHTS`` is loaded as weights only
    (``checkpointables=[]``) and the predictor is reported missing; the returned dict still
    holds the reset ``iteration`` 0, so ``start_iter`` is 1 and the fine-tuning's first
    iteration is 1 (recorded: the iterations of ``storage.history("total_loss")``)."""
    Trainer = _fsdet_trainer(E)
    base_dir = _dir(R, "faster_rcnn_R_101_FPN_base1")
    base = Trainer(_tfa_cfg(base_dir, MAX_ITER=5, EVAL_PERIOD=0))
    base.resume_or_load(resume=False)
    R.rec("base start", base.start_iter)
    R.rec("base results", base.train())
    R.rec("base files", _files(base_dir))

    reset = _ckpt_surgery(
        os.path.join(base_dir, "model_final.pth"), "remove", base_dir, 1, _PREDICTOR
    )
    ft_dir = _dir(R, "faster_rcnn_R_101_FPN_ft_novel1_1shot")
    cfg = _tfa_cfg(
        ft_dir, WEIGHTS=reset, NUM_CLASSES=1, FREEZE=True, MAX_ITER=6, STEPS=(4,), SEED=3
    )
    ft = Trainer(cfg)
    frozen = copy.deepcopy(ft.model.backbone)
    ft.resume_or_load(resume=True)
    R.rec("fine-tune start", ft.start_iter, _same(frozen, ft.model.backbone))
    R.rec("fine-tune results", ft.train())
    R.rec("total_loss", _history(ft.storage, "total_loss"))
    R.rec("lr", _history(ft.storage, "lr"))
    R.rec("backbone", _same(ft.model.backbone, base.model.backbone))
    R.rec("fine-tune files", _files(ft_dir))


@pattern(
    "ucbdrive/few-shot-object-detection",
    "tools/ckpt_surgery.py --method randinit + tools/run_experiments.py: run_exp",
)
def tn_tfa_randinit_run_experiments(E, R):
    """``run_experiments.py`` runs ``train_net.py --resume`` for a shot unless the output
    folder already holds ``model_final.pth``, then ``test_net.py --resume --eval-only`` unless
    ``inference/res_final.json`` exists. The fine-tuning starts from a ``randinit`` surgery
    (base classes' predictor rows kept, novel rows drawn, background last) and is preempted
    before iteration 4; the relaunched ``run_exp`` resumes from ``last_checkpoint``
    (``model_0000003.pth``: weights, optimizer, scheduler, ``start_iter`` 4) and finishes; a
    third ``run_exp`` trains nothing and evaluates ``model_final`` (``--resume``: the last
    checkpoint over ``MODEL.WEIGHTS``), writing ``res_final.json``; a fourth does nothing."""
    Trainer = _fsdet_trainer(E)
    base_dir = _dir(R, "base")
    base = Trainer(_tfa_cfg(base_dir, MAX_ITER=4, EVAL_PERIOD=0, NUM_CLASSES=2))
    base.resume_or_load(resume=False)
    base.train()
    torch.manual_seed(11)
    surgery = _ckpt_surgery(
        os.path.join(base_dir, "model_final.pth"), "randinit", base_dir, 3, _PREDICTOR
    )
    out = _dir(R, "ft_all1_1shot")
    cfg = _tfa_cfg(out, WEIGHTS=surgery, NUM_CLASSES=3, MAX_ITER=8, STEPS=(6,), EVAL_PERIOD=0)

    def train_net(preempt_at=None):
        trainer = Trainer(cfg)
        if preempt_at is not None:
            trainer.register_hooks([preempted_before(E, preempt_at)])
        trainer.resume_or_load(resume=True)
        R.rec("train_net start", trainer.start_iter, _lrs(trainer.optimizer))
        try:
            trainer.train()
        except RuntimeError as e:
            R.rec("killed", str(e), _files(out))
            return
        R.rec("trained", _ap(trainer.model), _history(trainer.storage, "lr"))

    def test_net():
        model = Trainer.build_model(cfg)
        E.DetectionCheckpointer(model, save_dir=cfg.OUTPUT_DIR).resume_or_load(
            cfg.WEIGHTS, resume=True
        )
        res = Trainer.test(cfg, model)
        os.makedirs(os.path.join(cfg.OUTPUT_DIR, "inference"), exist_ok=True)
        with open(os.path.join(cfg.OUTPUT_DIR, "inference", "res_final.json"), "w") as fp:
            json.dump(res, fp)

    def run_exp(preempt_at=None):
        if not os.path.exists(os.path.join(out, "model_final.pth")):
            train_net(preempt_at)
            if preempt_at is not None:
                return
        if not os.path.exists(os.path.join(out, "inference", "res_final.json")):
            test_net()
        R.rec("run_exp done", _files(out))

    run_exp(preempt_at=4)
    run_exp()
    run_exp()


@pattern("ucbdrive/few-shot-object-detection", "tools/test_net.py: main, Tester")
def tn_tfa_test_net_eval_modes(E, R):
    """``test_net.py``'s three modes after a run that saved every 2 iterations.
    ``--eval-only --eval-iter 4``: ``model_0000003.pth`` with ``resume=False``.
    ``--eval-only``: ``MODEL.WEIGHTS`` with ``resume=True``, so the run's last checkpoint.
    ``--eval-all``: a ``Tester`` lists ``get_all_checkpoint_files()`` and calls
    ``check_pointer._load_model(check_pointer._load_file(ckpt))`` itself, outside ``load``:
    detectron2's ``_load_file`` asserts that it runs inside ``load`` (it reads the query of
    the path being loaded), so the first checkpoint stops the evaluation, where hookloop's
    reads the file as ``load`` does (docs/differences.md; tested in
    tests/checkpoint/test_detection_checkpointer.py): the pattern lists the checkpoints and
    stops before that call."""
    Trainer = _fsdet_trainer(E)
    out = _dir(R, "run")
    cfg = _tfa_cfg(out, MAX_ITER=6, EVAL_PERIOD=0)
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=False)
    trainer.train()
    R.rec("files", _files(out))

    def eval_only(eval_iter=-1):
        model = Trainer.build_model(cfg)
        if eval_iter != -1:
            ckpt_file = os.path.join(cfg.OUTPUT_DIR, "model_{:07d}.pth".format(eval_iter - 1))
            resume = False
        else:
            ckpt_file = cfg.WEIGHTS
            resume = True
        ret = E.DetectionCheckpointer(model, save_dir=cfg.OUTPUT_DIR).resume_or_load(
            ckpt_file, resume=resume
        )
        res = Trainer.test(cfg, model)
        R.rec("eval-only", eval_iter, sorted(ret), ret.get("iteration"), res)

    eval_only(eval_iter=4)
    eval_only()

    class Tester:
        def __init__(self, cfg):
            self.cfg = cfg
            self.model = Trainer.build_model(cfg)
            self.check_pointer = E.DetectionCheckpointer(self.model, save_dir=cfg.OUTPUT_DIR)
            self.best_res = None
            self.best_file = None
            self.all_res = {}

        def test(self, ckpt):
            self.check_pointer._load_model(self.check_pointer._load_file(ckpt))
            print("evaluating checkpoint {}".format(ckpt))
            res = Trainer.test(self.cfg, self.model)
            if self.best_res is None or self.best_res["bbox"]["AP"] < res["bbox"]["AP"]:
                self.best_res = res
                self.best_file = ckpt
            self.all_res[ckpt] = res

    tester = Tester(cfg)
    all_ckpts = sorted(tester.check_pointer.get_all_checkpoint_files())
    R.rec("all checkpoints", [os.path.basename(c) for c in all_ckpts])


# --- hustvl/SparseTrack: LazyConfig do_train with detrex's model EMA -----------------------


class _EMAState:
    """``utils/ema.py`` (from d2go/detrex): ``EMAState``, a checkpointable that is not a
    module (``state_dict``/``load_state_dict`` over a dict of tensors)."""

    def __init__(self):
        self.state = {}

    @classmethod
    def FromModel(cls, model, device=""):  # noqa: N802 - the source's name
        ret = cls()
        ret.save_from(model, device)
        return ret

    def save_from(self, model, device=""):
        for name, val in self.get_model_state_iterator(model):
            val = val.detach().clone()
            self.state[name] = val.to(device) if device else val

    def apply_to(self, model):
        with torch.no_grad():
            for name, val in self.get_model_state_iterator(model):
                assert name in self.state, (
                    f"Name {name} not existed, available names {self.state.keys()}"
                )
                val.copy_(self.state[name])

    @property
    def device(self):
        if not self.has_inited():
            return None
        return next(iter(self.state.values())).device

    def to(self, device):
        for name in self.state:
            self.state[name] = self.state[name].to(device)
        return self

    def has_inited(self):
        return self.state

    def clear(self):
        self.state.clear()
        return self

    def get_model_state_iterator(self, model):
        return itertools.chain(model.named_parameters(), model.named_buffers())

    def state_dict(self):
        return self.state

    def load_state_dict(self, state_dict, strict=True):
        self.clear()
        for x, y in state_dict.items():
            self.state[x] = y
        return torch.nn.modules.module._IncompatibleKeys(missing_keys=[], unexpected_keys=[])


class _EMAUpdater:
    """SparseTrack's ``EMAUpdater``: YOLOX's decay ramp ``decay * (1 - exp(-updates / 2000))``
    from ``updates`` (set at construction), averaged with ``torch._foreach_*``."""

    def __init__(self, state, decay=0.999, device="", updates=0):
        self.decay_func = lambda x: decay * (1 - math.exp(-x / 2000))
        self.device = device
        self.updates = updates
        self.state = state
        self.decay = 0.0

    def init_state(self, model):
        self.state.clear()
        self.state.save_from(model, self.device)

    def update(self, model):
        with torch.no_grad():
            ema_param_list, param_list = [], []
            self.updates += 1
            self.decay = self.decay_func(self.updates)
            for name, val in self.state.get_model_state_iterator(model):
                ema_val = self.state.state[name]
                if val.dtype in [torch.float32, torch.float16]:
                    ema_param_list.append(ema_val)
                    param_list.append(val)
                else:
                    ema_val.copy_(ema_val * self.decay + val * (1.0 - self.decay))
            torch._foreach_mul_(ema_param_list, self.decay)
            torch._foreach_add_(ema_param_list, param_list, alpha=1 - self.decay)


def _ema_module(E):
    """``utils/ema.py``'s functions and its ``EMAHook`` (updates after each step, or after
    the backward pass with ``model_ema.after_backward``; ``updates_iter`` feeds the updater
    only at construction)."""

    def may_build_model_ema(cfg, model):
        if not cfg.train.model_ema.enabled:
            return
        assert not hasattr(model, "ema_state"), "Name `ema_state` is reserved for model ema."
        model.ema_state = _EMAState()
        log.info("Using Model EMA.")

    def may_get_ema_checkpointer(cfg, model):
        if not cfg.train.model_ema.enabled:
            return {}
        return {"ema_state": model.ema_state}

    def apply_model_ema(model, state=None, save_current=False):
        if state is None:
            state = model.ema_state
        if save_current:
            old_state = _EMAState.FromModel(model, state.device)
        state.apply_to(model)
        if save_current:
            return old_state
        return None

    @contextmanager
    def apply_model_ema_and_restore(model, state=None):
        if state is None:
            state = model.ema_state
        old_state = _EMAState.FromModel(model, state.device)
        state.apply_to(model)
        yield old_state
        old_state.apply_to(model)

    class EMAHook(E.HookBase):
        def __init__(self, cfg, model):
            assert cfg.train.model_ema.enabled
            assert hasattr(model, "ema_state"), "Call `may_build_model_ema` first"
            self.model = model
            self.ema = self.model.ema_state
            self.device = cfg.train.model_ema.device or cfg.model.device
            self.is_after_backward = cfg.train.model_ema.after_backward
            self.updates_iter = cfg.train.start_iter
            self.ema_updater = _EMAUpdater(
                self.model.ema_state,
                decay=cfg.train.model_ema.decay,
                device=self.device,
                updates=self.updates_iter,
            )

        def before_train(self):
            if self.ema.has_inited():
                self.ema.to(self.device)
            else:
                self.ema_updater.init_state(self.model)

        def after_train(self):
            pass

        def before_step(self):
            pass

        def after_backward(self):
            if not self.is_after_backward:
                return
            self._update()

        def after_step(self):
            if self.is_after_backward:
                return
            self._update()

        def _update(self):
            if not self.model.train:
                return
            self.ema_updater.update(self.model)

    return types.SimpleNamespace(
        may_build_model_ema=may_build_model_ema,
        may_get_ema_checkpointer=may_get_ema_checkpointer,
        apply_model_ema=apply_model_ema,
        apply_model_ema_and_restore=apply_model_ema_and_restore,
        EMAHook=EMAHook,
    )


def _yolox_warm_cos_lr(
    lr, min_lr_ratio, total_iters, warmup_total_iters, warmup_lr_start, no_aug_iter, iters
):
    min_lr = lr * min_lr_ratio
    if iters <= warmup_total_iters:
        lr = (lr - warmup_lr_start) * pow(iters / float(warmup_total_iters), 2) + warmup_lr_start
    elif iters >= total_iters - no_aug_iter:
        lr = min_lr
    else:
        lr = min_lr + 0.5 * (lr - min_lr) * (
            1.0
            + math.cos(
                math.pi
                * (iters - warmup_total_iters)
                / (total_iters - warmup_total_iters - no_aug_iter)
            )
        )
    return lr


def _sparsetrack_hooks(E):
    """``utils/lr_scheduler.py``'s ``LRHook`` (YOLOX's ``yoloxwarmcos`` set by hand after
    each step, built in ``before_train``, ``lr`` put unsmoothed) and
    ``utils/mosaic_close.py``'s ``MosaicClose`` (switches the loader's mosaic off and the
    head's L1 loss on ``no_aug_eps`` epochs before the end, logging to
    ``detectron2.utils.events``' logger: here the pattern's)."""

    class LRHook(E.HookBase):
        def __init__(
            self,
            trainer,
            train_batch_size,
            basic_lr_per_img,
            scheduler_name,
            iters_per_epoch,
            max_eps,
            num_warmup_eps,
            warmup_lr_start,
            no_aug_eps,
            min_lr_ratio,
        ):
            self._trainer = trainer
            self.train_batch_size = train_batch_size
            self.basic_lr_per_img = basic_lr_per_img
            self.scheduler_name = scheduler_name
            self.iters_per_epoch = iters_per_epoch
            self.max_eps = max_eps
            self.num_warmup_eps = num_warmup_eps
            self.warmup_lr_start = warmup_lr_start
            self.no_aug_eps = no_aug_eps
            self.min_lr_ratio = min_lr_ratio

        def after_step(self):
            lr = self.lr_func(self._trainer.iter + 1)
            for param_group in self._trainer.optimizer.param_groups:
                param_group["lr"] = lr
            self._trainer.storage.put_scalar("lr", lr, smoothing_hint=False)

        def before_train(self):
            assert self.scheduler_name == "yoloxwarmcos"
            self.lr_func = partial(
                _yolox_warm_cos_lr,
                self.basic_lr_per_img * self.train_batch_size,
                self.min_lr_ratio,
                self.iters_per_epoch * self.max_eps,
                self.iters_per_epoch * self.num_warmup_eps,
                self.warmup_lr_start,
                self.iters_per_epoch * self.no_aug_eps,
            )

    class MosaicClose(E.HookBase):
        def __init__(self, trainer, iters_per_eps, no_aug_eps, is_distributed):
            self._trainer = trainer
            self.iters_per_eps = iters_per_eps
            self.no_aug_eps = no_aug_eps
            self.is_distributed = is_distributed
            self._logger = log

        def before_step(self):
            if (
                self._trainer.iter + 1
                == self._trainer.max_iter - self.no_aug_eps * self.iters_per_eps
            ):
                self._logger.info("--->No mosaic aug now!")
                self._trainer.data_loader.dataset.enable_mosaic = False
                self._trainer.data_loader.close_mosaic()
                self._logger.info("--->Add additional L1 loss now!")
                self._trainer.model.head.use_l1 = True

    return LRHook, MosaicClose


class _MosaicLoader:
    """A loader with YOLOX's mosaic switch: ``dataset.enable_mosaic`` and ``close_mosaic()``
    (mosaic batches are scaled up)."""

    def __init__(self, seed):
        self.dataset = types.SimpleNamespace(enable_mosaic=True)
        self._stream = batches(seed=seed, size=4)
        self.closed = False

    def close_mosaic(self):
        self.closed = True

    def __iter__(self):
        for batch in self._stream:
            yield batch * 2.0 if self.dataset.enable_mosaic else batch


class _YoloxLike(TinyDetector):
    """YOLOX's head grows an L1 loss once ``head.use_l1`` is set."""

    def forward(self, batch):
        losses = super().forward(batch)
        if self.training and getattr(self.head, "use_l1", False):
            losses["loss_l1"] = self.head.weight.abs().mean() * 0.01
        return losses


def _sparsetrack_cfg(out, writers=True):
    train = _cfg(
        output_dir=out,
        init_checkpoint="",
        max_iter=8,
        start_iter=0,
        eval_period=4,
        log_period=2,
        checkpointer=dict(period=3, max_to_keep=100),
        amp=_cfg(enabled=False),
        model_ema=_cfg(
            enabled=True,
            decay=0.9998,
            device="cpu",
            after_backward=False,
            use_ema_weights_for_eval_only=True,
        ),
        writers=writers,
    )
    lr_cfg = _cfg(
        train_batch_size=8,
        basic_lr_per_img=0.05 / 8,
        scheduler_name="yoloxwarmcos",
        iters_per_epoch=2,
        max_eps=4,
        num_warmup_eps=1,
        warmup_lr_start=0,
        no_aug_eps=1,
        min_lr_ratio=0.05,
    )
    return _cfg(train=train, lr_cfg=lr_cfg, model=_cfg(device="cpu"))


def _sparsetrack_do_train(E, R, cfg, resume=False):
    """SparseTrack's ``train.py: do_train`` (see the patterns)."""
    ema = _ema_module(E)
    LRHook, MosaicClose = _sparsetrack_hooks(E)
    model = _YoloxLike()
    log.info("Model:\n{}".format(model))
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    train_loader = _MosaicLoader(seed=21)
    ema.may_build_model_ema(cfg, model)
    trainer = E.SimpleTrainer(model, train_loader, optim)
    checkpointer = E.DetectionCheckpointer(
        model, cfg.train.output_dir, trainer=trainer, **ema.may_get_ema_checkpointer(cfg, model)
    )

    def do_test():
        log.info("Run evaluation without EMA.")
        ret = {"bbox": {"AP": _ap(model)}}
        if cfg.train.model_ema.enabled:
            log.info("Run evaluation with EMA.")
            with ema.apply_model_ema_and_restore(model):
                ret.update({"bbox_ema": {"AP": _ap(model)}})
        return ret

    writers = (
        [
            E.CommonMetricPrinter(cfg.train.max_iter),
            E.JSONWriter(os.path.join(cfg.train.output_dir, "metrics.json")),
            E.TensorboardXWriter(cfg.train.output_dir),
        ]
        if cfg.train.writers
        else []
    )
    c = cfg.lr_cfg
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            ema.EMAHook(cfg, model) if cfg.train.model_ema.enabled else None,
            LRHook(
                trainer,
                c.train_batch_size,
                c.basic_lr_per_img,
                c.scheduler_name,
                c.iters_per_epoch,
                c.max_eps,
                c.num_warmup_eps,
                c.warmup_lr_start,
                c.no_aug_eps,
                c.min_lr_ratio,
            ),
            MosaicClose(trainer, c.iters_per_epoch, c.no_aug_eps, False),
            E.hooks.PeriodicCheckpointer(checkpointer, **cfg.train.checkpointer),
            E.hooks.EvalHook(cfg.train.eval_period, do_test),
            E.hooks.PeriodicWriter(writers, period=cfg.train.log_period),
        ]
    )
    checkpointer.resume_or_load(cfg.train.init_checkpoint, resume=resume)
    if resume and checkpointer.has_checkpoint():
        start_iter = trainer.iter + 1
    else:
        start_iter = 0
    trainer._hooks[1].updates_iter = cfg.train.start_iter = start_iter
    trainer.train(start_iter, cfg.train.max_iter)
    return trainer, model


@pattern(
    "hustvl/SparseTrack", "train.py: do_train + utils/ema.py, lr_scheduler.py, mosaic_close.py"
)
def tn_sparsetrack_ema_yolox_hooks(E, R):
    """SparseTrack's LazyConfig ``do_train``: detrex's model EMA (``may_build_model_ema`` puts
    an ``EMAState`` on the model, ``may_get_ema_checkpointer`` adds it to the
    ``DetectionCheckpointer(model, output_dir, trainer=trainer, ema_state=...)``,
    ``EMAHook`` second in the list, before the checkpointer), YOLOX's ``LRHook`` and
    ``MosaicClose`` hooks, ``PeriodicCheckpointer(period, max_to_keep)``, an ``EvalHook``
    whose ``do_test`` evaluates the raw weights, then the EMA ones inside
    ``apply_model_ema_and_restore``, and ``default_writers`` (printer, JSON,
    TensorBoard); after ``resume_or_load`` it writes the start iteration into the EMA
    hook by index (``trainer._hooks[1].updates_iter = ...``), after the updater was built.
    ``model_final.pth`` holds the raw weights and the EMA state (recorded)."""
    cfg = _sparsetrack_cfg(_dir(R, "output"))
    trainer, model = _sparsetrack_do_train(E, R, cfg)
    R.rec("hooks", [type(h).__name__ for h in trainer._hooks])
    R.rec("updates", trainer._hooks[1].updates_iter, trainer._hooks[1].ema_updater.updates)
    R.rec("loader", trainer.data_loader.closed, model.head.use_l1)
    R.rec("lr", _history(trainer.storage, "lr"))
    R.rec("ema", dict(model.ema_state.state))
    final = torch.load(os.path.join(cfg.train.output_dir, "model_final.pth"), weights_only=False)
    R.rec(
        "final model is raw",
        all(torch.equal(v, final["model"][k]) for k, v in weights(model).items()),
    )
    R.rec("final ema", dict(final["ema_state"]))
    R.storage(trainer.storage)


@pattern("hustvl/SparseTrack", "train.py: main (--eval-only) with MODEL_EMA")
def tn_sparsetrack_eval_only_applies_ema(E, R):
    """``train.py --eval-only``: a new model, ``may_build_model_ema``, then
    ``DetectionCheckpointer(model, **ema.may_get_ema_checkpointer(cfg, model)).load(
    cfg.train.init_checkpoint)`` (no save folder; ``load`` with every checkpointable, so the
    EMA state comes back too; the trainer state stays in the returned dict) and, with
    ``use_ema_weights_for_eval_only``, ``apply_model_ema(model)`` puts the EMA weights into
    the model before ``do_test``. The checkpoint is the final one of a short run without
    writers."""
    cfg = _sparsetrack_cfg(_dir(R, "output"), writers=False)
    _, trained_model = _sparsetrack_do_train(E, R, cfg)
    ema = _ema_module(E)
    cfg.train.init_checkpoint = os.path.join(cfg.train.output_dir, "model_final.pth")

    model = _YoloxLike()
    ema.may_build_model_ema(cfg, model)
    ret = E.DetectionCheckpointer(model, **ema.may_get_ema_checkpointer(cfg, model)).load(
        cfg.train.init_checkpoint
    )
    R.rec("returned", sorted(ret))
    R.rec("raw loaded", _same(model, trained_model))
    if cfg.train.model_ema.enabled and cfg.train.model_ema.use_ema_weights_for_eval_only:
        ema.apply_model_ema(model)
    R.rec("ema applied", weights(model))
    R.rec(
        "ema == state",
        all(torch.equal(v, model.ema_state.state[k]) for k, v in weights(model).items()),
    )
    log.info("Run evaluation under eval-only mode")
    R.rec("eval", _ap(model))


# --- levan92/det2_clearml: model-zoo files, relaunches with another SOLVER.MAX_ITER ---------


def _clearml_trainer(E, save_first=False):
    """``trainer.py``'s ``Trainer(DefaultTrainer)``: its ``build_hooks`` (PeriodicCheckpointer
    behind ``SOLVER.PERIODIC_CHECKPOINTER.ENABLED``, EvalHook, a ``BestCheckpointer`` behind
    ``if cfg.SOLVER.BEST_CHECKPOINTER`` (a ``CfgNode``, always true: it is registered even
    with ``ENABLED: False``), PeriodicWriter at period 20). The fork it was written against
    passes ``save_first=True`` to ``BestCheckpointer``, which detectron2's does not take;
    ``save_first`` says whether the pattern passes it."""
    Base = _default_trainer(E)

    class Trainer(Base):
        def build_hooks(self):
            cfg = self.cfg
            ret = [E.hooks.IterationTimer(), E.hooks.LRScheduler(), None]
            if cfg.PERIODIC_CHECKPOINTER_ENABLED:
                ret.append(E.hooks.PeriodicCheckpointer(self.checkpointer, cfg.CHECKPOINT_PERIOD))

            def test_and_save_results():
                self._last_eval_results = self.test(self.cfg, self.model)
                return self._last_eval_results

            ret.append(E.hooks.EvalHook(cfg.EVAL_PERIOD, test_and_save_results))
            if cfg.BEST_CHECKPOINTER:
                kwargs = {"save_first": True} if save_first else {}
                ret.append(
                    E.hooks.BestCheckpointer(
                        cfg.EVAL_PERIOD,
                        self.checkpointer,
                        cfg.BEST_CHECKPOINTER.METRIC,
                        mode=cfg.BEST_CHECKPOINTER.MODE,
                        **kwargs,
                    )
                )
            ret.append(E.hooks.PeriodicWriter(self.build_writers(), period=20))
            return ret

        @classmethod
        def test_with_TTA(cls, cfg, model):  # noqa: N802 - the source's name
            log.info("Running inference with test-time augmentation ...")
            res = cls.test(cfg, model)
            return OrderedDict({k + "_TTA": v for k, v in res.items()})

    return Trainer


class _CfgNode(dict):
    """A ``CfgNode`` stand-in: a dict with attribute access (truthy when it has keys)."""

    __getattr__ = dict.__getitem__


def _clearml_cfg(out, **kw):
    """The run's config. ``BEST_CHECKPOINTER.METRIC`` is ``segm/AP50``, which the box
    evaluator does not produce: the ``BestCheckpointer`` then warns instead of saving, since
    hookloop's does not move ``last_checkpoint`` (README) and a relaunch would resume from
    another file."""
    return _solver_cfg(
        out,
        **{
            "PERIODIC_CHECKPOINTER_ENABLED": True,
            "BEST_CHECKPOINTER": _CfgNode(ENABLED=False, METRIC="segm/AP50", MODE="max"),
            "TEST_AUG_ENABLED": True,
            "EVAL_PERIOD": 2,
            "CHECKPOINT_PERIOD": 2,
            **kw,
        },
    )


def _clearml_main(E, cfg, resume, record):
    """``trainer.py: main`` (training branch): ``Trainer(cfg)``, ``resume_or_load``, the TTA
    ``EvalHook(0, ...)`` registered after the trainer's own hooks, ``trainer.train()``."""
    trainer = _clearml_trainer(E)(cfg)
    trainer.resume_or_load(resume=resume)
    if cfg.TEST_AUG_ENABLED:
        trainer.register_hooks(
            [E.hooks.EvalHook(0, lambda: trainer.test_with_TTA(cfg, trainer.model))]
        )
    record("start", trainer.start_iter, trainer.max_iter, _lrs(trainer.optimizer))
    res = trainer.train()
    record("end", trainer.iter, res, _lrs(trainer.optimizer))
    return trainer


@pattern(
    "levan92/det2_clearml",
    "tools/remove_stored_anchors.py + trainer.py: Trainer.resume_or_load(resume=False)",
)
def tn_det2clearml_zoo_pkl_without_anchors(E, R):
    """A detectron2 model-zoo ``.pkl`` (``{"model": numpy arrays, "__author__": ...}``) with
    the ``cell_anchors`` buffers old models stored, a COCO-sized box predictor and a box
    head the small model lacks; ``remove_stored_anchors.py`` unpickles it, deletes every key
    with ``anchor`` in it and pickles ``<name>_anchor-removed.pkl``. Training from either
    file (``MODEL.WEIGHTS``, ``resume=False``): "Reading a file from 'Detectron2 Model
    Zoo'", the numpy arrays converted, the predictor skipped for its shape, and the
    unexpected ``cell_anchors`` keys left out of what is reported (so are the missing
    ``pixel_mean``/``pixel_std``)."""
    g = np.random.RandomState(7)
    donor = _RCNN(num_classes=2)
    model = {k: v.numpy() for k, v in donor.state_dict().items() if not k.startswith("pixel")}
    model["roi_heads.box_predictor.cls_score.weight"] = g.randn(81, 3).astype(np.float32)
    model["roi_heads.box_head.fc1.weight"] = g.randn(3, 3).astype(np.float32)
    model["proposal_generator.anchor_generator.cell_anchors.0"] = g.randn(3, 4).astype(np.float32)
    model["proposal_generator.rpn_head.anchor_deltas.weight"] = g.randn(12, 3).astype(np.float32)
    pkl = R.path("weights", "model_final_f10217.pkl")
    with open(pkl, "wb") as fh:
        pickle.dump({"model": model, "__author__": "Detectron2 Model Zoo"}, fh)

    def remove_anchors(pthfile, keep_wts=None):
        if keep_wts is None:
            keep_wts = False
        with open(pthfile, "rb") as f:
            data = pickle.load(f, encoding="latin1")
        anchorkeys = []
        for k in data["model"].keys():
            if "anchor" in k:
                if keep_wts and ("weight" in k or "bias" in k):
                    continue
                anchorkeys.append(k)
        for k in anchorkeys:
            del data["model"][k]
            print("deleted {}!".format(k))
        if len(anchorkeys) > 0:
            stem, ext = os.path.splitext(pthfile)
            new_path = "{}{}{}".format(stem, "_anchor-removed", ext)
            print("Writing new state dict to {}".format(new_path))
            with open(new_path, "wb") as f:
                pickle.dump(data, f)
            return new_path
        print("No anchor values stored in here!")
        return pthfile

    removed = remove_anchors(pkl, keep_wts=True)
    for i, weights_path in enumerate([pkl, removed]):
        out = _dir(R, f"run{i}")
        trainer = _clearml_trainer(E)(
            _clearml_cfg(out, WEIGHTS=weights_path, MAX_ITER=3, TEST_AUG_ENABLED=False)
        )
        trainer.resume_or_load(resume=False)
        R.rec("loaded", i, weights(trainer.model))
        R.rec("trained", trainer.train())


def _keep_apart(R, out, launch):
    """Moves a launch's ``metrics.json`` aside (the patterns look at each launch's lines): a
    relaunch from iteration s on hookloop removes the earlier run's lines at s and later
    (README: here the final evaluation's line at ``max_iter``), where detectron2 appends a
    second line for that iteration."""
    os.replace(
        os.path.join(out, "metrics.json"), os.path.join(_dir(R, f"launch{launch}"), "metrics.json")
    )


@pattern("levan92/det2_clearml", "train_net_clearml.py --resume --solver-max-iter (longer)")
def tn_det2clearml_extend_finished_run(E, R):
    """A finished run relaunched (a re-queued ClearML task: same output folder, ``--resume``)
    with ``--solver-max-iter`` and ``--solver-steps`` raised: the new ``LRMultiplier`` is
    built over the new length; ``resume_or_load`` restores the trainer state, the
    ``LRScheduler`` hook loads the saved scheduler state (``base_lrs``, ``last_epoch``) into
    it, and training continues from ``iteration + 1`` with the new multiplier (the learning
    rates recorded, from the relaunch's first iteration on: hookloop also restores the
    earlier history)."""
    out = _dir(R, "output")
    _clearml_main(E, _clearml_cfg(out, MAX_ITER=6, STEPS=(4,)), False, R.rec)
    _keep_apart(R, out, 0)
    R.rec("files", _files(out))
    cfg = _clearml_cfg(out, MAX_ITER=10, STEPS=(8,))
    trainer = _clearml_main(E, cfg, True, R.rec)
    R.rec("lr", _history(trainer.storage, "lr", since=6))
    R.rec("scheduler", trainer.scheduler.base_lrs, trainer.scheduler.last_epoch)
    R.rec("files", _files(out))


@pattern("levan92/det2_clearml", "train_net_clearml.py --resume --solver-max-iter (shorter)")
def tn_det2clearml_relaunch_shorter(E, R):
    """The same relaunch with ``--solver-max-iter`` lowered below the finished run's: the
    checkpoint's ``iteration + 1`` is past ``max_iter``, so ``train(start_iter, max_iter)``
    runs no step, while every hook's ``before_train`` and ``after_train`` run: the final
    evaluation, the always-registered ``BestCheckpointer`` (which saves ``model_best``), the
    TTA ``EvalHook(0)`` registered after the others, the writer's last write and close."""
    out = _dir(R, "output")
    _clearml_main(E, _clearml_cfg(out, MAX_ITER=6, STEPS=(4,)), False, R.rec)
    _keep_apart(R, out, 0)
    trainer = _clearml_main(E, _clearml_cfg(out, MAX_ITER=4, STEPS=(3,)), True, R.rec)
    R.rec("iter", trainer.iter, trainer.storage.iter, trainer.start_iter)
    R.rec("latest", sorted(trainer.storage.latest()))
    R.rec("files", _files(out))


@pattern("levan92/det2_clearml", "trainer.py: Trainer.build_hooks (BestCheckpointer save_first)")
def tn_det2clearml_best_checkpointer_save_first(E, R):
    """``Trainer.build_hooks`` as written: ``hooks.BestCheckpointer(..., save_first=True)``,
    registered whatever ``SOLVER.BEST_CHECKPOINTER.ENABLED`` says. detectron2's
    ``BestCheckpointer`` takes no ``save_first``: building the trainer raises."""
    out = _dir(R, "output")
    _clearml_trainer(E, save_first=True)(_clearml_cfg(out, MAX_ITER=2))


# --- Megumin1124/ALDI: a DefaultTrainer with an EMA teacher as a checkpointable -----------


class _TeacherEMA(nn.Module):
    """ALDI's ``aldi/ema.py`` ``EMA``: the teacher model, set from the student at iteration
    0 and averaged into it after (``alpha`` capped by ``1 - 1 / (iter + 1)``)."""

    def __init__(self, model, alpha):
        super().__init__()
        self.model = model
        self.alpha = alpha

    @torch.no_grad()
    def update_weights(self, model, iter):
        if iter == 0:
            self.model.load_state_dict(model.state_dict())
            return
        alpha = min(1 - 1 / (iter + 1), self.alpha)
        student = model.state_dict()
        for k, v in self.model.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(alpha).add_(student[k], alpha=1 - alpha)


@pattern("Megumin1124/ALDI", "aldi/trainer.py: ALDITrainer + aldi/dropin.py: DefaultTrainer")
def tn_aldi_fork_ema_checkpointable(E, R):
    """This ALDI fork's ``ALDITrainer``: ``dropin.DefaultTrainer`` builds the trainer and the
    checkpointer through ``_create_trainer``/``_create_checkpointer`` (a
    ``DetectionCheckpointer(model, OUTPUT_DIR, trainer=weakref.proxy(self))``), to which
    ``ALDITrainer`` adds the EMA teacher with ``checkpointer.add_checkpointable("ema",
    self.ema)``; ``before_step`` (overridden on the trainer) updates the EMA before the
    hooks' ``before_step``; ``build_hooks`` inserts, before the ``PeriodicWriter``
    (``ret.insert(-1, ...)``), an ``EvalHook`` on the teacher and a
    ``BestCheckpointer(..., "bbox/AP50", "max", file_prefix=f"{test_set}_model_best")``.
    Checkpoints carry ``ema``, which a fresh checkpointer with the same checkpointable loads
    back."""
    Base = _default_trainer(E)

    class ALDITrainer(Base):
        def _create_trainer(self, cfg, model, data_loader, optimizer):
            self.ema = _TeacherEMA(_RCNN(cfg.NUM_CLASSES), cfg.EMA_ALPHA) if cfg.EMA else None
            return E.SimpleTrainer(model, data_loader, optimizer)

        def _create_checkpointer(self, model, cfg):
            checkpointer = super()._create_checkpointer(model, cfg)
            if cfg.EMA:
                checkpointer.add_checkpointable("ema", self.ema)
            return checkpointer

        def build_hooks(self):
            ret = super().build_hooks()
            if self.cfg.EMA:

                def test_and_save_results_ema():
                    self._last_eval_results = self.test(self.cfg, self.ema.model)
                    return self._last_eval_results

                ret.insert(-1, E.hooks.EvalHook(self.cfg.EVAL_PERIOD, test_and_save_results_ema))
            ret.insert(
                -1,
                E.hooks.BestCheckpointer(
                    self.cfg.EVAL_PERIOD,
                    self.checkpointer,
                    "bbox/AP50",
                    "max",
                    file_prefix=f"{self.cfg.TEST[0]}_model_best",
                ),
            )
            return ret

        @classmethod
        def test(cls, cfg, model, evaluators=None):
            # A score that falls as this model trains: the best model stays the first one,
            # so BestCheckpointer saves nothing after model_final (hookloop's does not move
            # last_checkpoint, README).
            ap = round(100 - _ap(model), 6)
            log.info("Evaluation results for bbox: AP %.6f", ap)
            return OrderedDict(bbox={"AP": ap, "AP50": ap * 1.5})

        def before_step(self):
            super().before_step()
            if self.cfg.EMA:
                self.ema.update_weights(self._trainer.model, self.iter)

    out = _dir(R, "output")
    cfg = _solver_cfg(
        out,
        EMA=True,
        EMA_ALPHA=0.9,
        TEST=("cityscapes_val",),
        MAX_ITER=6,
        EVAL_PERIOD=2,
        CHECKPOINT_PERIOD=3,
    )
    trainer = ALDITrainer(cfg)
    trainer.resume_or_load(resume=False)
    R.rec("hooks", [type(h).__name__ for h in trainer._hooks])
    R.rec("results", trainer.train())
    R.rec("teacher", weights(trainer.ema.model))
    R.rec("files", _files(out))
    R.storage(trainer.storage)

    # Read back from model_final.pth by name: the last_checkpoint of a detectron2 run is the
    # model_best that BestCheckpointer saved after training, hookloop's does not move it.
    model = _RCNN(cfg.NUM_CLASSES)
    teacher = _TeacherEMA(_RCNN(cfg.NUM_CLASSES), cfg.EMA_ALPHA)
    checkpointer = E.DetectionCheckpointer(model, out)
    checkpointer.add_checkpointable("ema", teacher)
    ret = checkpointer.load(os.path.join(out, "model_final.pth"))
    R.rec("loaded", sorted(ret), _same(teacher.model, trainer.ema.model))


# --- burke86/deepdisc: a trainer that loads its weights in __init__, trained in two stages ----


@pattern(
    "burke86/deepdisc",
    "src/deepdisc/training/trainers.py: LazyAstroTrainer + astrodet/detectron.py: SaveHook",
)
def tn_deepdisc_two_stage_load_then_train(E, R):
    """DeepDISC's ``LazyAstroTrainer(SimpleTrainer)`` builds a
    ``DetectionCheckpointer(model, cfg.OUTPUT_DIR)`` and calls
    ``checkpointer.load(cfg.train.init_checkpoint)`` in ``__init__``; its ``run_step`` keeps
    its own loss list (``_write_metrics`` commented out), its hooks are a validation-loss
    hook (puts ``validation_loss`` and ``timetest``), a ``CustomLRScheduler`` (puts ``lr``,
    steps ``trainer.scheduler``, detectron2's ``build_lr_scheduler`` with no steps and no
    warmup) and a ``SaveHook`` that saves ``<run_name>.pth`` in ``after_train``. Stage 1
    trains the head from ``init_checkpoint = None`` ("Loading from None", from scratch)
    with ``train(0, e1)``; stage 2 is a new trainer whose ``init_checkpoint`` is the stage-1
    file (a finished run's weights: ``load`` with every checkpointable, here the model
    only), trained with ``train(0, efinal)``: its storage's ``validation_loss`` and ``lr``
    start again at iteration 0."""

    class LazyAstroTrainer(E.SimpleTrainer):
        def __init__(self, model, data_loader, optimizer, cfg, cfg_loader):
            super().__init__(model, data_loader, optimizer)
            self.checkpointer = E.DetectionCheckpointer(model, cfg_loader.OUTPUT_DIR)
            self.checkpointer.load(cfg.train.init_checkpoint)
            self.lossList = []
            self.vallossList = []
            self.period = 20
            self.iterCount = 0
            self.scheduler = _build_lr_scheduler(E, cfg_loader, optimizer)
            self.valloss = 0

        def set_period(self, p):
            self.period = p

        def run_step(self):
            self.iterCount = self.iterCount + 1
            assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
            data = next(self._data_loader_iter)
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
            all_losses = [v.cpu().detach().item() for v in loss_dict.values()]
            self.optimizer.zero_grad()
            losses.backward()
            self.optimizer.step()
            self.lossList.append(losses.cpu().detach().numpy())
            if self.iterCount % self.period == 0 and E.comm.is_main_process():
                print(
                    "Iteration: ",
                    self.iterCount,
                    loss_dict.keys(),
                    [round(x, 6) for x in all_losses],
                    "val loss: ",
                    round(float(self.valloss), 6),
                    "lr: ",
                    [round(x, 8) for x in self.scheduler.get_last_lr()],
                )

        def add_val_loss(self, val_loss):
            self.vallossList.append(val_loss)

    class SaveHook(E.HookBase):
        output_name = "model_temp"

        def set_output_name(self, name):
            self.output_name = name

        def after_train(self):
            print("saving", self.output_name)
            self.trainer.checkpointer.save(self.output_name)

    val = [b for b, _ in zip(batches(seed=31), range(3))]

    class LossEvalHook(E.HookBase):
        def __init__(self, eval_period, model, data_loader):
            self._model = model
            self._period = eval_period
            self._data_loader = data_loader

        def _do_loss_eval(self):
            losses = []
            with torch.no_grad():
                for inputs in self._data_loader:
                    metrics_dict = self._model(inputs)
                    losses.append(sum(float(v) for v in metrics_dict.values()))
            mean_loss = np.mean(losses)
            self.trainer.storage.put_scalar("validation_loss", mean_loss)
            self.trainer.add_val_loss(mean_loss)
            self.trainer.valloss = mean_loss
            return losses

        def after_step(self):
            next_iter = self.trainer.iter + 1
            is_final = next_iter == self.trainer.max_iter
            if is_final or (self._period > 0 and next_iter % self._period == 0):
                self._do_loss_eval()
            self.trainer.storage.put_scalars(timetest=12)

    class CustomLRScheduler(E.HookBase):
        def __init__(self, optimizer=None, scheduler=None):
            self._optimizer = optimizer
            self._scheduler = scheduler

        def before_train(self):
            self._optimizer = self._optimizer or self.trainer.optimizer
            self._best_param_group_id = 0

        def after_step(self):
            lr = self._optimizer.param_groups[self._best_param_group_id]["lr"]
            self.trainer.storage.put_scalar("lr", lr, smoothing_hint=False)
            self.scheduler.step()

        @property
        def scheduler(self):
            return self._scheduler or self.trainer.scheduler

    output_dir = _dir(R, "output") + os.sep
    output_name = "astro_run"
    e1, efinal, val_per = 4, 6, 2

    def stage(init_checkpoint, iterations, seed):
        cfg = _cfg(train=_cfg(init_checkpoint=init_checkpoint))
        cfg_loader = _solver_cfg(
            output_dir, STEPS=(), WARMUP_ITERS=0, MAX_ITER=iterations, BASE_LR=0.001
        )
        model = TinyDetector()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
        saveHook = SaveHook()
        saveHook.set_output_name(output_name)
        hookList = [LossEvalHook(val_per, model, val), CustomLRScheduler(optimizer), saveHook]
        trainer = LazyAstroTrainer(model, batches(seed=seed), optimizer, cfg, cfg_loader)
        trainer.register_hooks(hookList)
        trainer.set_period(2)
        trainer.train(0, iterations)
        R.rec("losses", [round(float(x), 6) for x in trainer.lossList])
        R.rec("validation_loss", _history(trainer.storage, "validation_loss"))
        R.rec("lr", _history(trainer.storage, "lr"))
        R.storage(trainer.storage)
        return trainer

    stage(None, e1, seed=41)
    R.rec("files", _files(output_dir))
    stage(output_dir + output_name + ".pth", efinal, seed=42)


# --- an EMA hook registered after the default hooks ------------------------------------------


@pattern(
    "unidentified/detectron2-ema-hook",
    "ema.py: EMA(HookBase) (a public file of the code index whose repository the index does "
    "not name), appended after DefaultTrainer.build_hooks()",
)
def tn_ema_hook_swaps_weights_after_the_checkpointer(E, R):
    """A model EMA written as a detectron2 hook: ``before_train`` clones every trainable
    parameter as its shadow, ``after_step`` updates the shadow and, at the last iteration
    (``iter >= max_iter - 1``), swaps the shadow into the model with ``param.data =
    shadow`` (keeping the raw weights as a backup). It is appended after the default hooks,
    so the last ``after_step`` runs ``PeriodicCheckpointer`` (``model_final``), the
    evaluation and the writer first, then the swap: ``model_final.pth`` holds the raw
    weights, the model after ``train()`` the EMA ones, and the final evaluation in
    ``after_train`` sees the EMA weights. The log records keep their order ("Saving
    checkpoint to .../model_final.pth" before the evaluation's line)."""

    class EMA(E.HookBase):
        def __init__(self, model, decay, period):
            super().__init__()
            self.model = model
            self.decay = decay
            self.period = period
            self.shadow = {}
            self.backup = {}

        def before_train(self):
            for name, param in self.model.named_parameters():
                if param.requires_grad:
                    self.shadow[name] = param.data.clone()

        def after_step(self):
            for name, param in self.model.named_parameters():
                if param.requires_grad:
                    average = (1.0 - self.decay) * param.data + self.decay * self.shadow[name]
                    self.shadow[name] = average.clone()
            if self.trainer.iter >= self.trainer.max_iter - 1:
                for name, param in self.model.named_parameters():
                    if param.requires_grad:
                        self.backup[name] = param.data
                        param.data = self.shadow[name]

    Base = _default_trainer(E)

    class Trainer(Base):
        def build_hooks(self):
            ret = super().build_hooks()
            ret.append(EMA(self.model, decay=0.5, period=1))
            return ret

    out = _dir(R, "output")
    trainer = Trainer(_solver_cfg(out, MAX_ITER=7, CHECKPOINT_PERIOD=3, EVAL_PERIOD=7))
    trainer.resume_or_load(resume=False)
    R.rec("results", trainer.train())
    ema = trainer._hooks[-1]
    R.rec(
        "model is ema",
        all(torch.equal(p, ema.shadow[n]) for n, p in trainer.model.named_parameters()),
    )
    for name in ("model_0000002.pth", "model_0000005.pth", "model_final.pth"):
        saved = torch.load(os.path.join(out, name), map_location="cpu", weights_only=False)
        R.rec(
            name,
            saved["iteration"],
            all(torch.equal(v, saved["model"][n]) for n, v in ema.backup.items())
            if name == "model_final.pth"
            else sorted(saved),
        )
    R.rec("files", _files(out))
