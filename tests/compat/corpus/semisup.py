"""Semi-supervised, teacher-student, domain-adaptation and distillation trainers on
detectron2 (beyond unbiased-teacher and adaptive_teacher): a drop-in ``SimpleTrainer`` whose
backward runs inside the model call, an EMA teacher saved as a second checkpointable and
loaded back as the starting point, a teacher-student ensemble checkpointed without the
trainer and resumed from an explicit file, a finished job launched again, a plain loop with
two optimizers and two LR schedules, and tagged LR hooks over a dict of optimizers."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batches, sgd, weights

# --- stand-ins ------------------------------------------------------------------------------


def _two_crops(seed=5, size=2):
    """A semi-supervised loader: each batch is (labeled strong, labeled weak, unlabeled
    strong, unlabeled weak), the strong views a perturbed copy of the weak ones."""
    lab, unlab = batches(seed, size), batches(seed + 1, size)
    while True:
        lw, uw = next(lab), next(unlab)
        yield lw * 1.1 + 0.05, lw, uw * 0.9 - 0.05, uw


class _Ensemble(nn.Module):
    """Teacher and student in one module, for saving and loading them together
    (``EnsembleTSModel`` in Unbiased-Teacher descendants)."""

    def __init__(self, teacher, student):
        super().__init__()
        self.modelTeacher = teacher
        self.modelStudent = student


def _scores(model, data):
    """A stand-in for an evaluator's AP: the mean sigmoid of the model's output."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(b) for b in data])
    model.train(was_training)
    ap = round(100.0 * float(torch.sigmoid(out).mean()), 4)
    return OrderedDict([("bbox", OrderedDict([("AP", ap), ("AP50", round(ap + 7.5, 4))]))])


@torch.no_grad()
def _ema_update(teacher, student, keep_rate):
    """Unbiased-Teacher's ``_update_teacher_model``: every teacher entry mixed with the
    student's, by key."""
    student_dict = student.state_dict()
    new = OrderedDict()
    for key, value in teacher.state_dict().items():
        if key not in student_dict:
            raise Exception("{} is not found in student model".format(key))
        new[key] = student_dict[key] * (1 - keep_rate) + value * keep_rate
    teacher.load_state_dict(new)


# --- justinkay/aldi -------------------------------------------------------------------------


class _EMA(nn.Module):
    """ALDI's ``EMA``: a deep copy of the model as an ``nn.Module`` attribute, initialised from
    the student at or before ``start_iter`` and mixed with it (``alpha``) after."""

    def __init__(self, model, alpha, start_iter=0):
        super().__init__()
        self.model = model
        self.alpha = alpha
        self.start_iter = start_iter

    def update_weights(self, model, iter):
        if iter <= self.start_iter:
            self.model.load_state_dict(model.state_dict())
        else:
            _ema_update(self.model, model, self.alpha)


def _aldi_trainer(E, R, out, max_iter, ckpt_cls=None):
    """ALDI's ``ALDITrainer`` on its ``dropin.DefaultTrainer`` (written on ``TrainerBase``, as
    DefaultTrainer is): ``_create_trainer`` and ``_create_checkpointer``, the EMA teacher
    updated in ``before_step``, evaluation of the EMA model inserted before the writer."""

    class DropinSimpleTrainer(E.SimpleTrainer):
        # dropin.SimpleTrainer: detectron2's run_step with run_model/do_backward split out.
        def run_step(self):
            assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            if self.zero_grad_before_forward:
                self.optimizer.zero_grad()
            loss_dict = self.run_model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())
            if not self.zero_grad_before_forward:
                self.optimizer.zero_grad()
            self.do_backward(losses)
            self.after_backward()
            self._write_metrics(loss_dict, data_time)
            self.optimizer.step()

        def run_model(self, data):
            return self.model(data)

        def do_backward(self, losses):
            losses.backward()

    class ALDISimpleTrainer(DropinSimpleTrainer):
        def __init__(self, model, data_loader, optimizer, distiller, backward_at_end, bs):
            super().__init__(
                model, data_loader, optimizer, zero_grad_before_forward=not backward_at_end
            )
            self.distiller = distiller
            self.backward_at_end = backward_at_end
            self.model_batch_size = bs

        def run_model(self, data):
            # run_model_labeled_unlabeled: forward (and, unless backward_at_end, backward)
            # in chunks of model_batch_size; the losses summed per suffix, detached.
            labeled_strong, labeled_weak, unlabeled_strong, unlabeled_weak = data
            total = len(labeled_weak) + len(labeled_strong) + len(unlabeled_weak)
            steps = total // self.model_batch_size
            loss_dict = {}

            def add(losses, suffix):
                for k, v in losses.items():
                    v = v / steps
                    if not self.backward_at_end:
                        v = v.detach()
                    loss_dict[f"{k}_{suffix}"] = loss_dict.get(f"{k}_{suffix}", 0) + v

            def backward_now(losses):
                if not self.backward_at_end:
                    self.do_backward(sum(losses.values()) / steps, override=True)

            bs = self.model_batch_size
            for name, part in (("source_weak", labeled_weak), ("source_strong", labeled_strong)):
                for i in range(0, len(part), bs):
                    losses = self.model(part[i : i + bs])
                    backward_now(losses)
                    add(losses, name)
            for i in range(0, len(unlabeled_weak), bs):
                losses = self.distiller(unlabeled_weak[i : i + bs], unlabeled_strong[i : i + bs])
                backward_now(losses)
                add(losses, "distill")
            return loss_dict

        def do_backward(self, losses, override=False):
            if self.backward_at_end or override:
                super().do_backward(losses)

    class ALDITrainer(E.TrainerBase):
        def __init__(self):
            E.TrainerBase.__init__(self)
            model = TinyDetector()
            optimizer = sgd(model, lr=0.05)
            self._trainer = self._create_trainer(model, _two_crops(), optimizer)
            self.scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [4], gamma=0.5)
            self.checkpointer = self._create_checkpointer(model)
            self.start_iter = 0
            self.max_iter = max_iter
            self.register_hooks(self.build_hooks())

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        def _create_trainer(self, model, data_loader, optimizer):
            self.ema = _EMA(TinyDetector(), alpha=0.6)
            teacher = self.ema.model

            # model(...) in training mode returns losses; the distiller needs outputs.
            def outputs(x):
                return model.head(torch.tanh(model.backbone(x)))

            def teacher_out(x):
                return teacher.head(torch.tanh(teacher.backbone(x)))

            def distill(weak, strong):
                with torch.no_grad():
                    target = torch.sigmoid(teacher_out(weak))
                return {"loss_distill_cls": ((torch.sigmoid(outputs(strong)) - target) ** 2).mean()}

            return ALDISimpleTrainer(
                model, data_loader, optimizer, distill, backward_at_end=False, bs=2
            )

        def _create_checkpointer(self, model):
            cls = ckpt_cls or E.Checkpointer
            checkpointer = cls(model, out, trainer=weakref.proxy(self))
            checkpointer.add_checkpointable("ema", self.ema)
            return checkpointer

        def build_hooks(self):
            val = [b for _, b in zip(range(2), batches(seed=13))]
            ret = [
                E.hooks.IterationTimer(),
                E.hooks.LRScheduler(),
                E.hooks.PeriodicCheckpointer(self.checkpointer, 4),
                E.hooks.EvalHook(3, lambda: _scores(self.model, val)),
                E.hooks.PeriodicWriter(
                    [E.JSONWriter(os.path.join(out, "metrics.json")), E.TensorboardXWriter(out)],
                    period=2,
                ),
            ]

            def test_and_save_results_ema():
                self._last_eval_results = {
                    "ema/" + k: v for k, v in _scores(self.ema.model, val).items()
                }
                return self._last_eval_results

            ret.insert(-1, E.hooks.EvalHook(3, test_and_save_results_ema))
            return ret

        def run_step(self):
            self._trainer.iter = self.iter
            self._trainer.run_step()

        def before_step(self):
            super().before_step()
            self.ema.update_weights(self._trainer.model, self.iter)

        def state_dict(self):
            ret = super().state_dict()
            ret["_trainer"] = self._trainer.state_dict()
            return ret

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            self._trainer.load_state_dict(state_dict["_trainer"])

    return ALDITrainer()


@pattern(
    "justinkay/aldi",
    "aldi/trainer.py: ALDITrainer, _ALDITrainer.do_backward; aldi/dropin.py; aldi/checkpoint.py",
)
def ss_aldi_backward_inside_run_model(E, R):
    """ALDI (Align and Distill, domain-adaptive detection) replaces detectron2's trainers with
    drop-ins whose ``run_step`` calls ``self.run_model(data)`` and ``self.do_backward(losses)``.
    With ``BACKWARD_AT_END`` off it builds the SimpleTrainer with
    ``zero_grad_before_forward=True`` and runs the backward inside ``run_model``, chunk by chunk
    (``do_backward(..., override=True)``), returning detached per-suffix losses
    (``loss_cls_source_weak``, ``loss_distill_cls_distill``, ...) whose final ``do_backward``
    does nothing; ``after_backward()`` is still called on the inner trainer, which holds no
    hooks. The outer DefaultTrainer updates its EMA teacher in ``before_step`` from
    ``self.iter`` (a copy at iteration 0), adds it to the checkpointer with
    ``add_checkpointable("ema", ...)`` and inserts an ``EvalHook`` of the EMA model before the
    writer. A second stage starts from the burn-in output with ``DetectionCheckpointerWithEMA``
    (``resume=False``): ``load(path, checkpointables=["ema"])`` and the EMA's weights copied
    into the model, logged with the checkpointer's own ``self.logger``. Each stage writes to its
    own output folder (a second run into the first's metrics.json is a documented difference)."""

    burn_in = _aldi_trainer(E, R, R.path("burn_in", "x")[:-2], 8)
    burn_in.train(0, 8)
    R.storage(burn_in.storage, "burn-in")
    R.rec("ema", weights(burn_in.ema), "student", weights(burn_in.model))
    R.rec("last eval", burn_in._last_eval_results)

    class DetectionCheckpointerWithEMA(E.Checkpointer):
        def resume_or_load(self, path, *, resume=True):
            keys = torch.load(path, map_location=torch.device("cpu")).keys()
            if resume or "ema" not in keys:
                return super().resume_or_load(path, resume=resume)
            self.load(path, checkpointables=["ema"])
            self.logger.info("Loading EMA weights as model starting point.")
            self.model.load_state_dict(self.checkpointables["ema"].model.state_dict())

    adapt = _aldi_trainer(E, R, R.path("adapt", "x")[:-2], 5, DetectionCheckpointerWithEMA)
    weights_file = os.path.join(R.out, "burn_in", "model_final.pth")
    adapt.checkpointer.resume_or_load(weights_file, resume=False)
    R.rec("start", weights(adapt.model), weights(adapt.ema), adapt.iter)
    adapt.train(0, 5)
    R.storage(adapt.storage, "adapt")
    R.rec("end", weights(adapt.model), weights(adapt.ema))


# --- hikvision-research/ProbabilisticTeacher -------------------------------------------------


def _pt_trainer(E, R, out, weights_file=""):
    """PT's ``PTrainer``: student, teacher and their ensemble in the checkpointer (with the
    optimizer and scheduler, no trainer), two EvalHooks, its own ``train_loop``."""

    class PTrainer(E.TrainerBase):
        burn_up_step = 3
        teacher_update_iter = 2

        def __init__(self):
            data_loader = _two_crops(seed=21)
            model = TinyDetector()
            optimizer = sgd(model, lr=0.05)
            self.model_teacher = TinyDetector()
            E.TrainerBase.__init__(self)
            self._trainer = E.SimpleTrainer(model, data_loader, optimizer)
            self.scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [5], gamma=0.1)
            ensem_ts_model = _Ensemble(self.model_teacher, model)
            self.checkpointer = E.Checkpointer(
                ensem_ts_model, out, optimizer=optimizer, scheduler=self.scheduler
            )
            self.start_iter = 0
            self.max_iter = 8
            self.weights = weights_file
            self.register_hooks(self.build_hooks())

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        def train_loop(self, start_iter, max_iter):
            logger = logging.getLogger("corpus.pt.engine.trainer")
            logger.info("Starting training from iteration {}".format(start_iter))
            self.iter = self.start_iter = start_iter
            self.max_iter = max_iter
            with E.EventStorage(start_iter) as self.storage:
                try:
                    self.before_train()
                    for self.iter in range(start_iter, max_iter):
                        self.before_step()
                        with torch.autograd.set_detect_anomaly(True):
                            self.run_step()
                        self.after_step()
                except Exception:
                    logger.exception("Exception during training:")
                    raise
                finally:
                    self.after_train()

        def run_step(self):
            self._trainer.iter = self.iter
            assert self.model.training, "[PTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            label_q, label_k, unlabel_q, unlabel_k = next(self._trainer._data_loader_iter)
            data_time = time.perf_counter() - start
            if self.iter < self.burn_up_step:
                record_dict = self.model(torch.cat([label_q, label_k]))
                record_dict["loss_box_reg_adv"] = record_dict["loss_box_reg"] * 0.5
                loss_dict = {}
                for key in record_dict:
                    if key.split("_")[-1] == "adv":
                        loss_dict[key] = record_dict[key] * 0.0
                    elif key[:4] == "loss":
                        loss_dict[key] = record_dict[key] * 1.0
                losses = sum(loss_dict.values())
            else:
                if self.iter == self.burn_up_step:
                    _ema_update(self.model_teacher, self.model, keep_rate=0.0)
                elif (self.iter - self.burn_up_step) % self.teacher_update_iter == 0:
                    _ema_update(self.model_teacher, self.model, keep_rate=0.9)
                record_dict = {}
                with torch.no_grad():
                    pseudo = self.model_teacher.head(
                        torch.tanh(self.model_teacher.backbone(unlabel_k))
                    )
                sup = self.model(torch.cat([label_q, label_k]))
                record_dict.update({k + "_sup": v for k, v in sup.items()})
                student = self.model.head(torch.tanh(self.model.backbone(unlabel_q)))
                record_dict["loss_cls_unsup"] = ((student - pseudo) ** 2).mean()
                record_dict["num_pseudo_unsup"] = float((pseudo > 0).sum())
                loss_dict = {}
                for key in record_dict:
                    if key[:4] == "loss":
                        if key.split("_")[-1] == "sup":
                            loss_dict[key] = record_dict[key] * 1.0
                        elif key.split("_")[-1] == "unsup":
                            loss_dict[key] = record_dict[key] * 2.0
                        else:
                            raise NotImplementedError
                losses = sum(loss_dict.values())
            metrics_dict = record_dict
            metrics_dict["data_time"] = data_time
            self._write_metrics(metrics_dict)
            self.optimizer.zero_grad()
            losses.backward()
            self.clip_gradient(self.model, 10.0)
            self.optimizer.step()

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
                    k: np.mean([x[k] if k in x.keys() else 0.0 for x in all_metrics_dict])
                    for k in all_metrics_dict[0].keys()
                }
                loss_dict = {k: v for k, v in metrics_dict.items() if k[:4] == "loss"}
                self.storage.put_scalar("total_loss", sum(loss_dict.values()))
                if len(metrics_dict) > 1:
                    self.storage.put_scalars(**metrics_dict)

        def clip_gradient(self, model, clip_norm):
            totalnorm = 0
            for p in model.parameters():
                if p.requires_grad and p.grad is not None:
                    totalnorm += p.grad.norm() ** 2
            totalnorm = torch.sqrt(totalnorm).item()
            norm = clip_norm / max(totalnorm, clip_norm)
            for p in model.parameters():
                if p.requires_grad and p.grad is not None:
                    p.grad.mul_(norm)

        def resume_or_load(self, resume=False):
            if resume:
                checkpoint = self.checkpointer.load(
                    self.weights, checkpointables=["model", "optimizer", "scheduler"]
                )
            else:
                checkpoint = self.checkpointer.load(self.weights, checkpointables=[])
            if resume:
                self.start_iter = checkpoint.get("iteration", -1) + 1
            return checkpoint

        def build_hooks(self):
            val = [b for _, b in zip(range(2), batches(seed=17))]
            ret = [
                E.hooks.IterationTimer(),
                E.hooks.LRScheduler(self.optimizer, self.scheduler),
                None,  # PreciseBN: the models have no BatchNorm
            ]
            ret.append(E.hooks.PeriodicCheckpointer(self.checkpointer, 3))

            def test_and_save_results_student():
                self._last_eval_results_student = _scores(self.model, val)
                return {k + "_student": v for k, v in self._last_eval_results_student.items()}

            def test_and_save_results_teacher():
                self._last_eval_results_teacher = _scores(self.model_teacher, val)
                return self._last_eval_results_teacher

            ret.append(E.hooks.EvalHook(4, test_and_save_results_student))
            ret.append(E.hooks.EvalHook(4, test_and_save_results_teacher))
            ret.append(
                E.hooks.PeriodicWriter(
                    [E.JSONWriter(os.path.join(out, "metrics.json")), E.TensorboardXWriter(out)],
                    period=4,
                )
            )
            return ret

    return PTrainer()


@pattern(
    "hikvision-research/ProbabilisticTeacher",
    "pt/engine/trainer.py: PTrainer (train_loop, run_step, resume_or_load, build_hooks)",
)
def ss_pt_ensemble_checkpoint_explicit_resume(E, R):
    """Probabilistic Teacher's trainer (on Unbiased Teacher's): the checkpointer saves the
    teacher-student ensemble with the optimizer and the scheduler, no trainer, so the
    ``PeriodicCheckpointer`` hook's files carry ``iteration`` as extra data. ``train_loop``
    runs each step under ``torch.autograd.set_detect_anomaly(True)``; ``run_step`` weights an
    ``*_adv`` loss by 0 in the source-only stage, copies the student into the teacher at the
    burn-up step and mixes them every 2 iterations after, clips the gradient itself, and its
    ``_write_metrics`` averages ``x[k] if k in x else 0.0`` and puts a non-loss count
    (``num_pseudo_unsup``) with the losses. Two ``EvalHook``s (the student's tasks renamed
    ``bbox_student``, then the teacher's) run before the writer. ``resume_or_load(resume=True)``
    loads ``MODEL.WEIGHTS`` (a periodic file, not ``last_checkpoint``) with
    ``checkpointables=['model', 'optimizer', 'scheduler']`` and starts at
    ``checkpoint.get("iteration", -1) + 1``; the resumed run logs to its own folder. No
    printer: its last line and the final save's log swap under hookloop (documented)."""

    first = _pt_trainer(E, R, R.path("run1", "x")[:-2])
    R.rec("fresh load", sorted(first.resume_or_load(resume=False)), first.start_iter)
    first.train_loop(first.start_iter, first.max_iter)
    R.storage(first.storage, "run1")
    R.rec("run1", weights(first.model), weights(first.model_teacher))
    R.rec("run1 lr", first.optimizer.param_groups[0]["lr"], first.scheduler.last_epoch)

    ckpt = os.path.join(R.out, "run1", "model_0000005.pth")
    second = _pt_trainer(E, R, R.path("run2", "x")[:-2], weights_file=ckpt)
    extra = second.resume_or_load(resume=True)
    R.rec("resumed", sorted(extra), second.start_iter, second.scheduler.last_epoch)
    R.rec("resumed lr", second.optimizer.param_groups[0]["lr"])
    R.rec("resumed weights", weights(second.model), weights(second.model_teacher))
    second.train_loop(second.start_iter, second.max_iter)
    R.storage(second.storage, "run2")
    R.rec("run2", weights(second.model), weights(second.model_teacher))
    R.rec("evals", second._last_eval_results_student, second._last_eval_results_teacher)


# --- mecarill/2pcnet ------------------------------------------------------------------------


def _twopc_trainer(E, R, max_iter):
    """2PCNet's ``TwoPCTrainer`` (Adaptive Teacher's layout): its ``resume_or_load`` through
    ``checkpointer.resume_or_load`` with ``resume=True`` by default."""

    class TwoPCTrainer(E.TrainerBase):
        burn_up_step = 3
        scale_list = np.array([0.6, 0.8])
        scale_checkpoints = np.array([5, 7])

        def __init__(self):
            data_loader = _two_crops(seed=31)
            model = TinyDetector()
            optimizer = sgd(model, lr=0.05)
            self.model_teacher = TinyDetector()
            E.TrainerBase.__init__(self)
            self._trainer = E.SimpleTrainer(model, data_loader, optimizer)
            self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 4, gamma=0.5)
            ensem_ts_model = _Ensemble(self.model_teacher, model)
            self.checkpointer = E.Checkpointer(
                ensem_ts_model, R.out, optimizer=optimizer, scheduler=self.scheduler
            )
            self.start_iter = 0
            self.stu_scale = None
            self.max_iter = max_iter
            self.register_hooks(self.build_hooks())

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        def resume_or_load(self, resume=True):
            checkpoint = self.checkpointer.resume_or_load("", resume=resume)
            if resume:
                self.start_iter = checkpoint.get("iteration", -1) + 1
            return checkpoint

        def train(self):
            self.train_loop(self.start_iter, self.max_iter)
            if hasattr(self, "_last_eval_results"):
                return self._last_eval_results

        def train_loop(self, start_iter, max_iter):
            logger = logging.getLogger("corpus.twophase.engine.trainer")
            logger.info("Starting training from iteration {}".format(start_iter))
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
                    logger.exception("Exception during training:")
                    raise
                finally:
                    self.after_train()

        def run_step_full_semisup(self):
            self._trainer.iter = self.iter
            start = time.perf_counter()
            _, label_data, unlabel_strong, unlabel_weak = next(self._trainer._data_loader_iter)
            data_time = time.perf_counter() - start
            if self.iter < self.burn_up_step:
                record_dict = self.model(label_data)
                loss_dict = {k: v * 1 for k, v in record_dict.items() if k[:4] == "loss"}
                losses = sum(loss_dict.values())
            else:
                if self.iter == self.burn_up_step:
                    _ema_update(self.model_teacher, self.model, keep_rate=0.0)
                else:
                    _ema_update(self.model_teacher, self.model, keep_rate=0.9)
                record_dict = dict(self.model(label_data))
                scale_mask = np.where(self.iter < self.scale_checkpoints)[0]
                nstu_scale = self.scale_list[scale_mask[0]] if len(scale_mask) else 1.0
                self.stu_scale = float(np.clip(np.random.normal(nstu_scale, 0.15), 0.4, 1.0))
                with torch.no_grad():
                    teach = self.model_teacher.head(
                        torch.tanh(self.model_teacher.backbone(unlabel_weak))
                    )
                stu = self.model.head(
                    torch.tanh(self.model.backbone(unlabel_strong * self.stu_scale))
                )
                record_dict["loss_cls_pseudo"] = ((stu - teach) ** 2).mean()
                record_dict["loss_rpn_loc_pseudo"] = (stu - teach).abs().mean()
                record_dict["loss_cons"] = (stu.mean() - teach.mean()) ** 2
                loss_dict = {}
                for key in record_dict:
                    if key.startswith("loss"):
                        if key == "loss_rpn_loc_pseudo":
                            loss_dict[key] = record_dict[key] * 0
                        elif key.endswith("loss_cls_pseudo"):
                            loss_dict[key] = record_dict[key] * 4.0
                        else:
                            loss_dict[key] = record_dict[key] * 1
                losses = sum(loss_dict.values())
            metrics_dict = record_dict
            metrics_dict["data_time"] = data_time
            if self.iter >= self.burn_up_step:
                metrics_dict["scale"] = self.stu_scale
            self._write_metrics(metrics_dict)
            self.optimizer.zero_grad()
            losses.backward()
            self.optimizer.step()

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
                self.storage.put_scalar("total_loss", sum(loss for loss in loss_dict.values()))
                if len(metrics_dict) > 1:
                    self.storage.put_scalars(**metrics_dict)

        def build_hooks(self):
            val = [b for _, b in zip(range(2), batches(seed=19))]
            ret = [
                E.hooks.IterationTimer(),
                E.hooks.LRScheduler(self.optimizer, self.scheduler),
                E.hooks.PeriodicCheckpointer(self.checkpointer, 4),
            ]

            def test_and_save_results_student():
                self._last_eval_results_student = _scores(self.model, val)
                return {k + "_student": v for k, v in self._last_eval_results_student.items()}

            def test_and_save_results_teacher():
                self._last_eval_results_teacher = _scores(self.model_teacher, val)
                return self._last_eval_results_teacher

            ret.append(E.hooks.EvalHook(3, test_and_save_results_student))
            ret.append(E.hooks.EvalHook(3, test_and_save_results_teacher))
            ret.append(
                E.hooks.PeriodicWriter(
                    [E.JSONWriter(R.path("metrics.json")), E.TensorboardXWriter(R.out)], period=3
                )
            )
            return ret

    return TwoPCTrainer()


@pattern(
    "mecarill/2pcnet",
    "twophase/engine/trainer.py: TwoPCTrainer (resume_or_load(resume=True), run_step_full_semisup)",
)
def ss_2pcnet_relaunch_finished_job(E, R):
    """2PCNet's teacher-student trainer for night-time adaptation: ``run_step_full_semisup``
    adds a ``scale`` entry (the student's random input scale, from numpy's global generator)
    to the metrics only after the burn-up step, so the key appears mid-run, and puts numpy
    means with ``put_scalars``. Its ``resume_or_load`` defaults to ``resume=True`` and takes
    ``checkpointer.resume_or_load(...).get("iteration", -1) + 1``: launched again on its
    finished output folder, it resumes from ``model_final`` (iteration 7) with
    ``start_iter == max_iter``, runs no step, and its hooks' ``after_train`` still run in the
    relaunched storage: both EvalHooks evaluate (``iter + 1 >= max_iter``), the writer writes
    their results into the first run's metrics.json and event file, and the timer has no
    iteration to report. No printer (the final save's log and its last line swap under
    hookloop, documented)."""

    first = _twopc_trainer(E, R, 8)
    R.rec("first start", sorted(first.resume_or_load()), first.start_iter)
    R.rec("first result", first.train())
    R.storage(first.storage, "first")
    R.rec("first weights", weights(first.model), weights(first.model_teacher))

    again = _twopc_trainer(E, R, 8)
    extra = again.resume_or_load()
    R.rec("again start", sorted(extra), again.start_iter, again.scheduler.last_epoch)
    R.rec("again result", again.train())
    R.rec("again iter", again.iter, again.storage.iter)
    R.storage(again.storage, "again")
    R.rec("again weights", weights(again.model), weights(again.model_teacher))


# --- megvii-research/LGD --------------------------------------------------------------------


class _Distillator(nn.Module):
    """LGD's distillator stand-in: a student detector and a label-guided teacher trained
    together; ``distill_flag`` switches the distillation loss on."""

    def __init__(self):
        super().__init__()
        self.student = TinyDetector()
        self.teacher = nn.Linear(4, 3)
        self.distill_flag = 0

    def forward(self, batch):
        losses = self.student(batch)
        feats = torch.tanh(self.student.backbone(batch))
        t = torch.tanh(self.teacher(batch))
        losses["loss_teacher"] = (t - 0.5).pow(2).mean()
        if self.distill_flag:
            losses["loss_distill"] = (feats - t.detach()).pow(2).mean()
        return losses


@pattern("megvii-research/LGD", "train.py: do_train (two optimizers, two schedulers)")
def ss_lgd_two_optimizers_plain_loop(E, R):
    """LGD (label-guided self-distillation) trains student and teacher together in a plain
    loop: two optimizers and two detectron2 LR schedules, all four given to the
    ``DetectionCheckpointer`` as named checkpointables (``stu_optimizer=``, ``tea_scheduler=``,
    ...); ``start_iter = checkpointer.resume_or_load(WEIGHTS, resume=resume).get("iteration",
    -1) + 1``; a plain ``PeriodicCheckpointer(checkpointer, period, max_iter=max_iter)``;
    ``for data, iteration in zip(data_loader, range(start_iter, max_iter))`` with
    ``storage.iter = iteration`` (no ``step()``); the distillation off before and after a
    range of iterations; ``stu_lr``/``tea_lr`` put unsmoothed after the optimizers step (no
    ``lr`` and no ``time`` for the printer); evaluation results only logged; and the writers
    called only when ``iteration - start_iter > 5`` and every 20 iterations or at the last.
    The first launch dies fetching the batch of iteration 14 (a data error); ``--resume``
    continues from the iteration-9 file and writes at 19 and 21. (Recorded: the schedulers'
    ``last_epoch``, not their ``state_dict()``, whose keys differ on purpose: documented.)"""

    logger = logging.getLogger("corpus.lgd")
    max_iter = 22
    pre_nondistill, post_nondistill, freeze_iters = 4, 3, 6

    def build_loader(fail_at=None):
        for k, b in enumerate(batches(seed=41)):
            if fail_at is not None and k == fail_at:
                raise RuntimeError("corrupt image in batch {}".format(k))
            yield b

    def schedule(optimizer, gamma):
        multiplier = E.solver.WarmupParamScheduler(
            E.solver.MultiStepParamScheduler(
                values=[1.0, gamma, gamma * gamma], milestones=[8, 16], num_updates=max_iter
            ),
            warmup_factor=0.1,
            warmup_length=3 / max_iter,
            warmup_method="linear",
        )
        return E.solver.LRMultiplier(optimizer, multiplier, max_iter)

    def do_test(model):
        val = [b for _, b in zip(range(2), batches(seed=43))]
        with torch.no_grad():
            score = float(sum(torch.tanh(model.student.backbone(b)).mean() for b in val))
        logger.info("Evaluation results for lgd_val in csv format:")
        logger.info("copypaste: AP=%.4f", 50.0 + 10.0 * score)

    def do_train(model, resume, fail_at=None):
        model.train()
        stu_optimizer = torch.optim.SGD(model.student.parameters(), lr=0.05, momentum=0.9)
        tea_optimizer = torch.optim.SGD(model.teacher.parameters(), lr=0.02)
        stu_scheduler = schedule(stu_optimizer, 0.1)
        tea_scheduler = schedule(tea_optimizer, 0.5)
        checkpointer = E.Checkpointer(
            model,
            R.out,
            stu_optimizer=stu_optimizer,
            tea_optimizer=tea_optimizer,
            stu_scheduler=stu_scheduler,
            tea_scheduler=tea_scheduler,
        )
        start_iter = checkpointer.resume_or_load("", resume=resume).get("iteration", -1) + 1
        periodic_checkpointer = E.PeriodicCheckpointer(checkpointer, 5, max_iter=max_iter)
        writers = [
            E.CommonMetricPrinter(max_iter),
            E.JSONWriter(R.path("metrics.json")),
            E.TensorboardXWriter(R.out),
        ]
        never_closed.extend(writers)
        data_loader = build_loader(fail_at)
        logger.info("Starting training from iteration {}".format(start_iter))
        with E.EventStorage(start_iter) as storage:
            for data, iteration in zip(data_loader, range(start_iter, max_iter)):
                storage.iter = iteration
                if iteration < pre_nondistill or iteration > max_iter - post_nondistill:
                    model.distill_flag = 0
                else:
                    model.distill_flag = 1
                loss_dict = model(data)
                losses = sum(loss_dict.values())
                assert torch.isfinite(losses).all(), loss_dict
                loss_dict_reduced = {k: v.item() for k, v in E.comm.reduce_dict(loss_dict).items()}
                losses_reduced = sum(loss for loss in loss_dict_reduced.values())
                if E.comm.is_main_process():
                    storage.put_scalars(total_loss=losses_reduced, **loss_dict_reduced)
                stu_optimizer.zero_grad()
                tea_optimizer.zero_grad()
                losses.backward()
                if iteration < freeze_iters:
                    for p in model.student.backbone.parameters():
                        p.grad = None
                stu_optimizer.step()
                tea_optimizer.step()
                storage.put_scalar(
                    "stu_lr", stu_optimizer.param_groups[0]["lr"], smoothing_hint=False
                )
                storage.put_scalar(
                    "tea_lr", tea_optimizer.param_groups[0]["lr"], smoothing_hint=False
                )
                stu_scheduler.step()
                tea_scheduler.step()
                if (iteration + 1) % 7 == 0 and iteration != max_iter - 1:
                    do_test(model)
                if iteration - start_iter > 5 and (
                    (iteration + 1) % 20 == 0 or iteration == max_iter - 1
                ):
                    for writer in writers:
                        writer.write()
                periodic_checkpointer.step(iteration)
        R.storage(storage, "storage from {}".format(start_iter))
        R.rec("lrs", stu_optimizer.param_groups[0]["lr"], tea_optimizer.param_groups[0]["lr"])
        R.rec("schedulers", stu_scheduler.last_epoch, tea_scheduler.last_epoch)

    # LGD never closes its writers (the process ends after training). Closed here at the end,
    # for the test process: detectron2's JSONWriter would leak its file (a ResourceWarning
    # when collected, which hookloop's writer does not raise).
    never_closed = []
    model = _Distillator()
    try:
        do_train(model, resume=False, fail_at=14)
    except RuntimeError as e:
        R.rec("first launch", str(e))
    model = _Distillator()
    do_train(model, resume=True)
    R.rec("weights", weights(model))
    for writer in never_closed:
        writer.close()


# --- Shuntw6096/sap-da-detectron2 -----------------------------------------------------------


@pattern(
    "Shuntw6096/sap-da-detectron2",
    "detection/hooks.py: LRScheduler_; detection/trainer.py: DATrainer (dict of optimizers)",
)
def ss_sapda_tagged_lr_per_optimizer(E, R):
    """The domain-adaptation trainer of sap-da-detectron2 builds a dict of optimizers (SGD for
    the detector, Adam for the domain heads) and a dict of schedulers, and registers one
    ``LRScheduler_`` per optimizer: a ``hooks.LRScheduler`` subclass whose ``after_step``
    reads the base's private ``self._optimizer`` and ``self._best_param_group_id``, puts
    ``lr_<tag>`` unsmoothed and steps ``self.scheduler``. Its inner ``_DATrainer`` zeroes and
    steps every optimizer of the dict and writes the weighted losses with
    ``self._write_metrics``. The checkpointer holds the trainer
    (``trainer=weakref.proxy(self)``), and the DefaultTrainer-style ``state_dict`` asks the
    inner SimpleTrainer for ``self.optimizer.state_dict()``, which a dict does not have: the
    first periodic save (iteration 2, where no other hook acts) fails with that
    ``AttributeError``, and the hooks' ``after_train`` (the writer's last write) still run."""

    class LRScheduler_(E.hooks.LRScheduler):
        def __init__(self, optimizer=None, scheduler=None, tag=""):
            super().__init__(optimizer=optimizer, scheduler=scheduler)
            self.tag = tag

        def after_step(self):
            lr = self._optimizer.param_groups[self._best_param_group_id]["lr"]
            lr_tag = "lr_" + self.tag if self.tag else "lr"
            self.trainer.storage.put_scalar(lr_tag, lr, smoothing_hint=False)
            self.scheduler.step()

    class SAPRCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.det = TinyDetector()
            self.da_heads = nn.Linear(4, 1)

        def forward(self, s_data, t_data):
            losses = self.det(s_data)
            ds = torch.sigmoid(self.da_heads(s_data)).mean()
            dt = torch.sigmoid(self.da_heads(t_data)).mean()
            losses["loss_sap_source_domain"] = (ds - 1.0) ** 2
            losses["loss_sap_target_domain"] = dt**2
            return losses

    class _DATrainer(E.SimpleTrainer):
        def __init__(self, model, source, target, loss_weight, optimizer):
            super().__init__(model, source, optimizer)
            self._source_domain_data_loader_iter = iter(source)
            self._target_domain_data_loader_iter = iter(target)
            self.loss_weight = loss_weight

        def run_step(self):
            assert self.model.training, "[DASimpleTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            s_data = next(self._source_domain_data_loader_iter)
            t_data = next(self._target_domain_data_loader_iter)
            data_time = time.perf_counter() - start
            loss_dict = self.model(s_data, t_data)
            loss_dict = {k: self.loss_weight[k] * loss_dict[k] for k in self.loss_weight}
            losses = sum(loss_dict.values())
            for optim in self.optimizer:
                self.optimizer[optim].zero_grad()
            losses.backward()
            self._write_metrics(loss_dict, data_time)
            for optim in self.optimizer:
                self.optimizer[optim].step()

    class DATrainer(E.TrainerBase):
        def __init__(self):
            E.TrainerBase.__init__(self)
            model = SAPRCNN()
            optimizer = {
                "rcnn": torch.optim.SGD(
                    [p for n, p in model.named_parameters() if "da_heads" not in n],
                    lr=0.05,
                    momentum=0.9,
                ),
                "sap": torch.optim.Adam(
                    [p for n, p in model.named_parameters() if "da_heads" in n], lr=0.01
                ),
            }
            loss_weight = {
                "loss_cls": 1,
                "loss_box_reg": 1,
                "loss_sap_source_domain": 0.3,
                "loss_sap_target_domain": 0.3,
            }
            self._trainer = _DATrainer(model, batches(51), batches(52), loss_weight, optimizer)
            self.scheduler = {
                k: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                for k, o in optimizer.items()
            }
            self.checkpointer = E.Checkpointer(model, R.out, trainer=weakref.proxy(self))
            self.start_iter = 0
            self.max_iter = 9
            self.register_hooks(self.build_hooks())

        @property
        def model(self):
            return self._trainer.model

        def build_hooks(self):
            val = [b for _, b in zip(range(2), batches(seed=53))]
            ret = [E.hooks.IterationTimer(), None] + [
                LRScheduler_(
                    optimizer=self._trainer.optimizer[k], scheduler=self.scheduler[k], tag=k
                )
                for k in self.scheduler
            ]
            ret.append(E.hooks.PeriodicCheckpointer(self.checkpointer, 3))

            def test_and_save_results():
                self._last_eval_results = _scores(self.model.det, val)
                return self._last_eval_results

            ret.append(E.hooks.EvalHook(5, test_and_save_results))
            ret.append(
                E.hooks.PeriodicWriter(
                    [E.CommonMetricPrinter(self.max_iter), E.JSONWriter(R.path("metrics.json"))],
                    period=4,
                )
            )
            return ret

        def run_step(self):
            self._trainer.iter = self.iter
            self._trainer.run_step()

        def state_dict(self):
            ret = super().state_dict()
            ret["_trainer"] = self._trainer.state_dict()
            return ret

    trainer = DATrainer()
    try:
        trainer.train(trainer.start_iter, trainer.max_iter)
    finally:
        R.rec("iter", trainer.iter, trainer._trainer.iter)
        R.storage(trainer.storage)
        R.rec("lrs", {k: o.param_groups[0]["lr"] for k, o in trainer._trainer.optimizer.items()})
        R.rec("files", sorted(os.listdir(R.out)))
