"""How real code uses the checkpointer API beyond the trainer's hooks: a checkpointer subclass
that writes rank-suffixed files itself (``save``/``has_checkpoint``/``get_checkpoint_file``/
``tag_last_checkpoint`` overridden) under a hand-driven ``PeriodicCheckpointer(max_to_keep=)``,
a running checkpoint saved through ``PeriodicCheckpointer.save`` next to the periodic ones and
resumed by two checkpointers in turn, a best model saved with its metrics as extra data and
found again with ``get_all_checkpoint_files()``, EMA weights taken from a fresh load's extra
data as the starting point (``_load_model``/``_log_incompatible_keys`` called by hand), and
model-zoo files read by a ``_load_file`` override (numpy arrays, bare state dicts)."""

from __future__ import annotations

import copy
import importlib
import math
import os
import pickle

import numpy as np
import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd, weights


def _names(paths):
    return sorted(os.path.basename(p) for p in paths)


# --- facebookresearch/dinov2: FSDPCheckpointer ----------------------------------------------


@pattern(
    "facebookresearch/dinov2",
    "dinov2/fsdp/__init__.py: FSDPCheckpointer + dinov2/train/train.py: do_train",
)
def cu_dinov2_rank_suffixed_checkpointer(E, R):
    """DINOv2's ``FSDPCheckpointer`` overrides ``save`` to write ``<name>.rank_<r>.pth`` itself
    (under FSDP's local state-dict mode, left out here) and keeps one ``last_checkpoint.rank_<r>``
    pointer per rank (``has_checkpoint``/``get_checkpoint_file``/``tag_last_checkpoint``
    overridden). ``do_train`` resumes with ``resume_or_load(WEIGHTS, resume=...)
    .get("iteration", -1) + 1``, sets each iteration's LR and weight decay from precomputed
    cosine schedules, and steps fvcore's ``PeriodicCheckpointer(max_to_keep=3)`` by hand; a
    relaunch after a preemption continues from the newest rank file. ``max_to_keep`` deletes
    the rank files by the names ``get_checkpoint_file()`` gives after each save, as fvcore
    does."""
    rank = E.comm.get_rank()

    def rankstr():
        return f"rank_{rank}"

    class FSDPCheckpointer(E.Checkpointer):
        def save(self, name, **kwargs):
            if not self.save_dir or not self.save_to_disk:
                return
            data = {"model": self.model.state_dict()}
            for key, obj in self.checkpointables.items():
                data[key] = obj.state_dict()
            data.update(kwargs)
            basename = f"{name}.{rankstr()}.pth"
            save_file = os.path.join(self.save_dir, basename)
            self.logger.info("Saving checkpoint to {}".format(save_file))
            with self.path_manager.open(save_file, "wb") as f:
                torch.save(data, f)
            self.tag_last_checkpoint(basename)

        def has_checkpoint(self):
            return self.path_manager.exists(
                os.path.join(self.save_dir, f"last_checkpoint.{rankstr()}")
            )

        def get_checkpoint_file(self):
            pointer = os.path.join(self.save_dir, f"last_checkpoint.{rankstr()}")
            try:
                with self.path_manager.open(pointer, "r") as f:
                    last_saved = f.read().strip()
            except OSError:
                return ""
            return os.path.join(self.save_dir, last_saved)

        def tag_last_checkpoint(self, last_filename_basename):
            pointer = os.path.join(self.save_dir, f"last_checkpoint.{rankstr()}")
            with self.path_manager.open(pointer, "w") as f:
                f.write(last_filename_basename)

    max_iter = 14
    lr_schedule = [0.05 * (1 + math.cos(math.pi * i / max_iter)) / 2 for i in range(max_iter)]
    wd_schedule = [0.04 + 0.01 * i / max_iter for i in range(max_iter)]

    def do_train(resume, preempt_at=None):
        model = TinyDetector()
        optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.99))
        checkpointer = FSDPCheckpointer(model, R.out, optimizer=optimizer, save_to_disk=True)
        start_iter = checkpointer.resume_or_load("", resume=resume).get("iteration", -1) + 1
        periodic_checkpointer = E.PeriodicCheckpointer(
            checkpointer, period=2, max_iter=max_iter, max_to_keep=3
        )
        log.info("Starting training from iteration {}".format(start_iter))
        data = batches(seed=11 + start_iter)
        for iteration in range(start_iter, max_iter):
            if iteration == preempt_at:
                R.rec("preempted", iteration, sorted(os.listdir(R.out)))
                return model
            for group in optimizer.param_groups:
                group["weight_decay"] = wd_schedule[iteration]
                group["lr"] = lr_schedule[iteration]
            optimizer.zero_grad(set_to_none=True)
            loss = sum(model(next(data)).values())
            loss.backward()
            optimizer.step()
            periodic_checkpointer.step(iteration)
        return model

    do_train(resume=True, preempt_at=9)
    R.rec("last", os.path.basename(FSDPCheckpointer(TinyDetector(), R.out).get_checkpoint_file()))
    model = do_train(resume=True)
    R.rec("files", sorted(os.listdir(R.out)))
    R.rec("weights", weights(model))


# --- facebookresearch/dinov2: linear evaluation ---------------------------------------------


class _AllClassifiers(nn.Module):
    """DINOv2's ``AllClassifiers``: a ModuleDict of linear heads, one output per head."""

    def __init__(self, classifiers_dict):
        super().__init__()
        self.classifiers_dict = nn.ModuleDict(classifiers_dict)

    def forward(self, x):
        return {k: v(x) for k, v in self.classifiers_dict.items()}


@pattern("facebookresearch/dinov2", "dinov2/eval/linear.py: run_eval_linear + eval_linear")
def cu_dinov2_linear_running_checkpoint(E, R):
    """DINOv2's linear probe: a ``Checkpointer`` over the classifiers with the SGD optimizer and
    a torch ``CosineAnnealingLR`` as checkpointables is built and resumed twice (once in
    ``run_eval_linear``, again in ``eval_linear``); the loop saves a running checkpoint every
    epoch through ``periodic_checkpointer.save("running_checkpoint_linear_eval",
    iteration=...)`` (it moves ``last_checkpoint`` too) and steps the periodic checkpointer.
    A job preempted mid-epoch resumes from whichever file came last; a relaunch of the
    finished job starts at ``max_iter`` and trains nothing."""
    epoch_length, epochs = 4, 3
    max_iter = epochs * epoch_length
    checkpoint_period = 2 * epoch_length

    def build():
        torch.manual_seed(3)
        heads = {
            "classifier_1_blocks_avgpool_False_lr_0_01000": nn.Linear(4, 2),
            "classifier_4_blocks_avgpool_True_lr_0_10000": nn.Linear(4, 2),
        }
        groups = [
            {
                "params": heads["classifier_1_blocks_avgpool_False_lr_0_01000"].parameters(),
                "lr": 0.01,
            },
            {
                "params": heads["classifier_4_blocks_avgpool_True_lr_0_10000"].parameters(),
                "lr": 0.1,
            },
        ]
        classifiers = _AllClassifiers(heads)
        optimizer = torch.optim.SGD(groups, momentum=0.9, weight_decay=0)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max_iter, eta_min=0)
        return classifiers, optimizer, scheduler

    def run_eval_linear(resume, preempt_at=None):
        classifiers, optimizer, scheduler = build()
        checkpointer = E.Checkpointer(classifiers, R.out, optimizer=optimizer, scheduler=scheduler)
        start_iter = checkpointer.resume_or_load("", resume=resume).get("iteration", -1) + 1
        R.rec("run_eval_linear start", start_iter)
        return eval_linear(classifiers, optimizer, scheduler, resume, preempt_at)

    def eval_linear(classifiers, optimizer, scheduler, resume, preempt_at):
        checkpointer = E.Checkpointer(classifiers, R.out, optimizer=optimizer, scheduler=scheduler)
        start_iter = checkpointer.resume_or_load("", resume=resume).get("iteration", -1) + 1
        periodic_checkpointer = E.PeriodicCheckpointer(
            checkpointer, checkpoint_period, max_iter=max_iter
        )
        iteration = start_iter
        log.info("Starting training from iteration {}".format(start_iter))
        data = batches(seed=21 + start_iter, size=4)
        while iteration < max_iter:
            if iteration == preempt_at:
                return iteration
            x = next(data)
            labels = (x[:, 0] > 0).long()
            outputs = classifiers(x)
            losses = {f"loss_{k}": nn.CrossEntropyLoss()(v, labels) for k, v in outputs.items()}
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if iteration - start_iter > 5:
                if iteration % epoch_length == 0:
                    log.info("Checkpointing running_checkpoint")
                    periodic_checkpointer.save(
                        "running_checkpoint_linear_eval", iteration=iteration
                    )
            periodic_checkpointer.step(iteration)
            iteration = iteration + 1
        R.rec(
            "end",
            iteration,
            [g["lr"] for g in optimizer.param_groups],
            scheduler.last_epoch,
            weights(classifiers),
        )
        return iteration

    R.rec("first", run_eval_linear(resume=True, preempt_at=11))
    with open(os.path.join(R.out, "last_checkpoint")) as f:
        R.rec("last_checkpoint", f.read())
    R.rec("second", run_eval_linear(resume=True))
    R.rec("relaunch", run_eval_linear(resume=True))
    R.rec("files", sorted(os.listdir(R.out)))


# --- qurit/prostate_segmentation ------------------------------------------------------------


class _EarlyStopping:
    """qurit's ``EarlyStopping``: True when the monitored metric improves; ``triggered`` once
    it has not for ``patience`` evaluations."""

    def __init__(self, monitor, patience, mode):
        self.monitor, self.patience, self.mode = monitor, patience, mode
        self.best, self.bad, self.triggered = None, 0, False

    def check_early_stopping(self, metrics):
        value = metrics[self.monitor]
        better = self.best is None or (
            value > self.best if self.mode == "max" else value < self.best
        )
        if better:
            self.best, self.bad = value, 0
            return True
        self.bad += 1
        self.triggered = self.bad >= self.patience
        return False


@pattern("qurit/prostate_segmentation", "seg_3d/train_loop.py: train (fvcore checkpointers)")
def cu_qurit_best_model_final_eval(E, R):
    """qurit's 3D segmentation loop on fvcore's ``Checkpointer``/``PeriodicCheckpointer``:
    ``resume_or_load(WEIGHTS, resume=RESUME).get("iteration", -1) + 1``, scalars put without
    smoothing and written every step, an evaluation every few iterations whose metrics go to
    the storage and, when early stopping sees an improvement, into
    ``periodic_checkpointer.save(name="model_best", iteration=..., **metrics)``; the loop breaks
    once early stopping triggers (no ``model_final``). In ``finally`` it checks
    ``model_best.pth in checkpointer.get_all_checkpoint_files()`` and reloads it with
    ``checkpointables=["model"]`` (the optimizer and scheduler entries come back in the extra
    data). The eval-only entry point loads the weights into a new model the same way. The loss
    tensor is put detached (detectron2's ``float()`` of a tensor that requires grad raises
    torch's warn-once UserWarning, which only the first engine run in a process would show).
    Metrics are Python floats (a numpy scalar in the extra data needs weights_only=False under
    fvcore on torch >= 2.6, where hookloop allows numpy's scalars: a documented difference)."""
    max_iter, eval_period = 30, 3

    def build_model():
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))

    val_gen = batches(seed=31, size=4)
    val = [next(val_gen) for _ in range(3)]

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            preds = [torch.sigmoid(model(x)).squeeze(1) for x in val]
            targets = [(x[:, 1] > 0).float() for x in val]
            inter = sum(float((p * t).sum()) for p, t in zip(preds, targets))
            total = sum(float(p.sum() + t.sum()) for p, t in zip(preds, targets))
            loss = sum(float(((p - t) ** 2).mean()) for p, t in zip(preds, targets)) / len(val)
        model.train()
        return {"metrics": {"dice": round(2 * inter / total, 6), "val_loss": round(loss, 6)}}

    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)
    start_iter = checkpointer.resume_or_load("", resume=False).get("iteration", -1) + 1
    periodic_checkpointer = E.PeriodicCheckpointer(checkpointer, 10, max_iter=max_iter)
    writers = [E.JSONWriter(R.path("metrics.json"), window_size=1)]
    early_stopping = _EarlyStopping(monitor="dice", patience=2, mode="max")
    log.info("Starting training from iteration {}".format(start_iter))
    data = batches(seed=32, size=4)
    with E.EventStorage(start_iter) as storage:
        try:
            for iteration, sample in zip(range(start_iter, max_iter), data):
                storage.iter = iteration
                labels = (sample[:, 1] > 0).float().unsqueeze(1)
                optimizer.zero_grad()
                preds = model(sample)
                training_loss = nn.functional.binary_cross_entropy_with_logits(preds, labels)
                training_loss.backward()
                optimizer.step()
                scalars = {
                    "training_loss": training_loss.detach(),
                    "lr": optimizer.param_groups[0]["lr"],
                }
                for k, v in scalars.items():
                    storage.put_scalar(k, v, smoothing_hint=False)
                scheduler.step()
                if eval_period > 0 and (iteration + 1) % eval_period == 0:
                    results = evaluate(model)
                    for k, v in results["metrics"].items():
                        storage.put_scalar(k, v, smoothing_hint=False)
                    if early_stopping.check_early_stopping(results["metrics"]):
                        periodic_checkpointer.save(
                            name="model_best", iteration=iteration, **results["metrics"]
                        )
                    elif early_stopping.triggered:
                        break
                for writer in writers:
                    writer.write()
                periodic_checkpointer.step(iteration)
        finally:
            log.info("Completed training at iteration {}".format(storage.iter))
            model_checkpoint = os.path.join(R.out, "model_best.pth")
            all_files = checkpointer.get_all_checkpoint_files()
            R.rec("all", _names(all_files))
            if model_checkpoint in all_files:
                log.info("Running final evaluation with best model...")
                extra = checkpointer.load(model_checkpoint, checkpointables=["model"])
                R.rec("best extra", sorted(extra), extra["iteration"], extra["dice"])
                R.rec("final eval", evaluate(model))
        R.storage(storage)
    for writer in writers:
        writer.close()
    R.rec("lr after", optimizer.param_groups[0]["lr"], scheduler.last_epoch)

    fresh = build_model()
    extra = E.Checkpointer(fresh, save_dir=R.out).load(model_checkpoint, checkpointables=["model"])
    R.rec("eval-only extra", sorted(extra))
    R.rec("eval-only", evaluate(fresh), weights(fresh))
    R.rec("files", sorted(os.listdir(R.out)))


# --- ALDI: EMA weights as the starting point ------------------------------------------------


class _EMA(nn.Module):
    """ALDI's ``EMA``: a deep copy of the model (``self.model``) mixed with it after each
    step; a checkpointable as an ``nn.Module``."""

    def __init__(self, model, alpha):
        super().__init__()
        self.model = copy.deepcopy(model)
        self.alpha = alpha

    @torch.no_grad()
    def update(self, model):
        student = model.state_dict()
        for k, v in self.model.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.alpha).add_(student[k], alpha=1 - self.alpha)


class _WithPixelStats(TinyDetector):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pixel_mean", torch.zeros(4))
        self.register_buffer("pixel_std", torch.ones(4))


@pattern("hdoi5324/aldi0107", "aldi/checkpoint.py: DetectionCheckpointerWithEMA.resume_or_load")
def cu_aldi_ema_weights_as_starting_point(E, R):
    """ALDI's ``DetectionCheckpointerWithEMA`` (this fork's version): ``resume_or_load`` calls
    the parent's; on a fresh load (``resume=False``) of a ``.pth`` whose extra data holds
    ``ema`` (the EMA module is a checkpointable, so a model-only load returns its state), it
    logs through ``self.logger``, strips the ``model.`` prefix from the EMA keys, puts them
    back as ``ret["model"]`` and calls ``self._load_model(ret)`` and
    ``self._log_incompatible_keys(_IncompatibleKeys(...))`` itself. The new model has
    ``pixel_mean``/``pixel_std`` buffers the burn-in model lacked: both loads log them as
    missing (fvcore's base class, not DetectionCheckpointer, filters nothing). A later
    ``resume=True`` loads model, EMA and optimizer from the run's own checkpoint."""
    _IncompatibleKeys = importlib.import_module(E.Checkpointer.__module__)._IncompatibleKeys

    class DetectionCheckpointerWithEMA(E.Checkpointer):
        def resume_or_load(self, path, *, resume=True):
            ret = super().resume_or_load(path, resume=resume)
            if (not resume) and path.endswith(".pth") and "ema" in ret.keys():
                self.logger.info("Loading EMA weights as model starting point.")
                ema_dict = {k.replace("model.", ""): v for k, v in ret["ema"].items()}
                ret["model"] = ema_dict
                incompatible = self._load_model(ret)
                if incompatible is not None:
                    self._log_incompatible_keys(
                        _IncompatibleKeys(
                            missing_keys=incompatible.missing_keys,
                            unexpected_keys=incompatible.unexpected_keys,
                            incorrect_shapes=[],
                        )
                    )
            return ret

    def steps(model, optimizer, ema, n, seed):
        data = batches(seed=seed)
        for _ in range(n):
            loss = sum(model(next(data)).values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ema.update(model)

    burn_dir = R.path("burn_in", "x")[:-2]
    model = TinyDetector()
    optimizer = sgd(model)
    ema = _EMA(model, 0.5)
    steps(model, optimizer, ema, 5, seed=41)
    DetectionCheckpointerWithEMA(model, burn_dir, ema=ema).save("model_final", iteration=4)

    out = R.path("adapt", "x")[:-2]
    student = _WithPixelStats()
    student_opt = sgd(student, lr=0.05)
    student_ema = _EMA(student, 0.9)
    checkpointer = DetectionCheckpointerWithEMA(
        student, out, ema=student_ema, optimizer=student_opt
    )
    ret = checkpointer.resume_or_load(os.path.join(burn_dir, "model_final.pth"), resume=False)
    R.rec("fresh extra", sorted(ret), ret.get("iteration"))
    R.rec(
        "student is burn-in EMA",
        [torch.equal(student.state_dict()[k], v) for k, v in ema.model.state_dict().items()],
    )
    R.rec("student EMA untouched", weights(student_ema.model)["backbone.weight"])
    steps(student, student_opt, student_ema, 3, seed=42)
    checkpointer.save("model_0000002", iteration=2)

    again = _WithPixelStats()
    again_ema = _EMA(again, 0.9)
    again_opt = sgd(again, lr=0.05)
    ck = DetectionCheckpointerWithEMA(again, out, ema=again_ema, optimizer=again_opt)
    ret = ck.resume_or_load(os.path.join(burn_dir, "model_final.pth"), resume=True)
    R.rec("resumed extra", sorted(ret), ret.get("iteration"))
    R.rec("resumed", weights(again), weights(again_ema), len(again_opt.state_dict()["state"]))


# --- aim-uofa/AdelaiDet: model-zoo files ----------------------------------------------------


@pattern("aim-uofa/AdelaiDet", "adet/checkpoint/adet_checkpoint.py: AdetCheckpointer._load_file")
def cu_adelaidet_model_zoo_files(E, R):
    """AdelaiDet's ``AdetCheckpointer._load_file`` reads ``.pkl`` files itself: a Detectron2
    model-zoo file (``model`` and ``__author__``, logged through ``self.logger``) is returned
    as it is, a Caffe2/Detectron1 one has its ``blobs`` taken, ``_momentum`` entries dropped
    and is tagged ``matching_heuristics``; a ``.pth`` goes to the parent and a bare state dict
    is wrapped as ``{"model": ...}`` (``lpf`` names tagged too). Both pickles hold numpy
    arrays, which fvcore's ``_convert_ndarray_to_tensor`` turns into tensors (one has the
    wrong shape: skipped with a warning). The weights are loaded as ``train_net.py``'s
    eval-only path does, ``AdetCheckpointer(model, save_dir=OUTPUT_DIR).resume_or_load(WEIGHTS,
    resume=False)``; the tags come back in the extra data (DetectionCheckpointer's heuristic
    matching is left out). The pickles are removed after loading: they stand in for
    downloads, and torch cannot read them back."""

    class AdetCheckpointer(E.Checkpointer):
        def _load_file(self, filename):
            if filename.endswith(".pkl"):
                with open(filename, "rb") as f:
                    data = pickle.load(f, encoding="latin1")
                if "model" in data and "__author__" in data:
                    self.logger.info("Reading a file from '{}'".format(data["__author__"]))
                    return data
                else:
                    if "blobs" in data:
                        data = data["blobs"]
                    data = {k: v for k, v in data.items() if not k.endswith("_momentum")}
                    return {"model": data, "__author__": "Caffe2", "matching_heuristics": True}
            loaded = super()._load_file(filename)
            if "model" not in loaded:
                loaded = {"model": loaded}
            if "lpf" in filename:
                loaded["matching_heuristics"] = True
            return loaded

    donor = TinyDetector()
    arrays = {k: v.numpy() * 2 for k, v in donor.state_dict().items()}
    zoo = R.path("zoo", "R-50.pkl")
    with open(zoo, "wb") as f:
        pickle.dump({"model": arrays, "__author__": "Detectron2 Model Zoo"}, f)
    c2 = R.path("zoo", "X-101-32x8d.pkl")
    blobs = {k: v.astype(np.float64) - 1 for k, v in arrays.items()}
    blobs["backbone.weight_momentum"] = np.zeros((3, 4))
    blobs["head.weight"] = np.ones((2, 3))  # another head: skipped
    with open(c2, "wb") as f:
        pickle.dump({"blobs": blobs, "cfg": "unused"}, f)
    lpf = R.path("zoo", "resnet50_lpf3.pth")
    torch.save({k: v + 3 for k, v in donor.state_dict().items()}, lpf)

    out = R.path("output", "x")[:-2]
    model = TinyDetector()
    for weights_file in (zoo, c2, lpf):
        ret = AdetCheckpointer(model, save_dir=out).resume_or_load(weights_file, resume=False)
        R.rec(os.path.basename(weights_file), sorted(ret), ret.get("__author__"))
        R.rec("weights", weights(model))
    os.remove(zoo)
    os.remove(c2)
    R.rec("has checkpoint", AdetCheckpointer(model, save_dir=out).has_checkpoint())
