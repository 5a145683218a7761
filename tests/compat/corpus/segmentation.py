"""Segmentation and open-vocabulary repositories built on detectron2 (SAN, MaskDINO), a
lazy-config user's training script, and detectron2's training benchmark: a writer list whose
TensorBoard writer is swapped for a tracker writer that consumes the storage's images and
histograms, a trainer that skips ``DefaultTrainer.__init__`` and builds its checkpointer twice,
a ``BestCheckpointer`` registered before the hook that produces its metric, and the
``TorchProfiler`` hook over a run that starts at iteration 1."""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import shutil
import weakref

import numpy as np
import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batch_list, batches, log, preempted_before, weights


class _PolyLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepLab's ``WarmupPolyLR`` (``detectron2.projects.deeplab``), which the MaskFormer
    family builds in ``build_lr_scheduler``: linear warmup, then ``(1 - it / max) ** power``."""

    def __init__(self, optimizer, max_iters, warmup_iters=2, warmup_factor=0.1, power=0.9):
        self.max_iters = max_iters
        self.warmup_iters = warmup_iters
        self.warmup_factor = warmup_factor
        self.power = power
        super().__init__(optimizer, -1)

    def get_lr(self):
        it = self.last_epoch
        factor = 1.0
        if it < self.warmup_iters:
            alpha = it / self.warmup_iters
            factor = self.warmup_factor * (1 - alpha) + alpha
        poly = math.pow(1.0 - it / self.max_iters, self.power)
        return [base_lr * factor * poly for base_lr in self.base_lrs]


def _full_model_clipping(optim, clip_norm_val, enable=True):
    """The MaskFormer family's ``maybe_add_full_model_gradient_clipping``: a subclass of the
    optimizer class whose ``step`` clips the norm of all groups' gradients together."""

    class FullModelGradientClippingOptimizer(optim):
        def step(self, closure=None):
            all_params = itertools.chain(*[x["params"] for x in self.param_groups])
            torch.nn.utils.clip_grad_norm_(all_params, clip_norm_val)
            super().step(closure=closure)

    return FullModelGradientClippingOptimizer if enable else optim


def _per_param_groups(model, base_lr, multipliers, weight_decay=1e-4, with_name=False):
    """``Trainer.build_optimizer`` of the MaskFormer family: one group per parameter, the lr
    scaled when a module name holds one of ``multipliers``' keys, no decay on norms."""
    params = []
    memo = set()
    norm_types = (nn.BatchNorm1d, nn.LayerNorm, nn.GroupNorm)
    for module_name, module in model.named_modules():
        for param_name, value in module.named_parameters(recurse=False):
            if not value.requires_grad or value in memo:
                continue
            memo.add(value)
            hp = {"lr": base_lr, "weight_decay": weight_decay}
            if with_name:
                hp["param_name"] = ".".join([module_name, param_name])
            for key, mult in multipliers.items():
                if key in module_name:
                    hp["lr"] = hp["lr"] * mult
            if isinstance(module, norm_types):
                hp["weight_decay"] = 0.0
            params.append({"params": [value], **hp})
    return params


# --- MendelXu/SAN ---------------------------------------------------------------------------


class _SideAdapterSeg(nn.Module):
    """SAN's shape in miniature: a frozen-ish ``clip`` branch, a ``side_adapter_network``, a
    norm; in training it puts a mask visualisation every 3 iterations and a histogram of its
    mask logits every 4 (1-d, so that ``num`` is the same under both counting rules)."""

    def __init__(self, E):
        super().__init__()
        self.E = E
        self.clip = nn.Linear(4, 3)
        self.side_adapter_network = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 1)

    def forward(self, batch):
        feats = self.norm(torch.tanh(self.clip(batch)) + self.side_adapter_network(batch))
        logits = self.head(feats)
        storage = self.E.get_event_storage()
        if storage.iter % 3 == 0:
            level = (storage.iter * 41) % 256
            img = np.full((3, 2, 3), level, dtype=np.uint8)
            storage.put_image(f"mask {storage.iter}", img)
        if storage.iter % 4 == 1:
            storage.put_histogram("mask_logits", logits.detach().flatten(), bins=5)
        return {
            "loss_mask": (logits**2).mean(),
            "loss_dice": feats.abs().mean() * 0.25,
            "loss_cls": (feats[:, :1] ** 2).mean(),
        }


@pattern(
    "MendelXu/SAN",
    "train_net.py: Trainer.build_writers, build_optimizer; san/utils/events.py: WandbWriter",
)
def sg_san_wandb_writer_replaces_tensorboard(E, R):
    """SAN's ``Trainer.build_writers`` takes ``DefaultTrainer``'s three writers and replaces
    the last, the ``TensorboardXWriter`` (made, then dropped unwritten and unclosed: no event
    file), with its ``WandbWriter``. That writer logs the *unsmoothed* ``storage.latest()``
    newer than ``_last_write`` (names with "/" kept, names with "loss" moved under
    ``train/``), moves ``_last_write`` to the newest iteration among all latest values, turns
    every ``storage._vis_data`` entry into an image and every ``storage._histograms`` dict
    into a bar chart (``create_bar(**params)``), clears both, and logs at ``storage.iter``.
    ``build_optimizer`` gives each parameter its own group carrying a ``param_name`` string,
    the side adapter at ``BACKBONE_MULTIPLIER`` and clip at ``CLIP_MULTIPLIER`` times the lr,
    in an AdamW with full-model clipping; the scheduler is DeepLab's poly LR; an evaluation
    puts ``sem_seg/mIoU`` every 5 iterations."""

    class Run:
        def log(self, stats, step):
            R.rec("wandb.log", step, stats)

        def finish(self):
            R.rec("wandb.finish")

    run = Run()

    class BaseRule:
        def __call__(self, target):
            return target

    class IsIn(BaseRule):
        def __init__(self, keyword):
            self.keyword = keyword

        def __call__(self, target):
            return self.keyword in target

    class Prefix(BaseRule):
        def __init__(self, keyword):
            self.keyword = keyword

        def __call__(self, target):
            return "/".join([self.keyword, target])

    class WandbWriter(E.EventWriter):
        def __init__(self):
            self._last_write = -1
            self._group_rules = [(IsIn("/"), BaseRule()), (IsIn("loss"), Prefix("train"))]

        def write(self):
            storage = E.get_event_storage()

            def _group_name(scalar_name):
                for rule, op in self._group_rules:
                    if rule(scalar_name):
                        return op(scalar_name)
                return scalar_name

            stats = {
                _group_name(name): scalars[0]
                for name, scalars in storage.latest().items()
                if scalars[1] > self._last_write
            }
            if len(stats) > 0:
                self._last_write = max([v[1] for k, v in storage.latest().items()])
            if len(storage._vis_data) >= 1:
                # wandb.Image(img, caption=img_name)
                stats["image"] = [
                    ("Image", img_name, list(np.asarray(img).shape), int(np.asarray(img).sum()))
                    for img_name, img, step_num in storage._vis_data
                ]
                storage.clear_images()
            if len(storage._histograms) >= 1:

                def create_bar(tag, bucket_limits, bucket_counts, **kwargs):
                    data = [[label, val] for (label, val) in zip(bucket_limits, bucket_counts)]
                    return ("bar", tag, data, sorted(kwargs))

                stats["hist"] = [create_bar(**params) for params in storage._histograms]
                storage.clear_histograms()
            if len(stats) == 0:
                return
            run.log(stats, step=storage.iter)

        def close(self):
            run.finish()

    max_iter = 11
    base_lr = 0.02
    model = _SideAdapterSeg(E)
    params = _per_param_groups(
        model, base_lr, {"side_adapter_network": 0.5, "clip": 0.1}, with_name=True
    )
    optimizer = _full_model_clipping(torch.optim.AdamW, 0.05)(params, base_lr)
    scheduler = _PolyLR(optimizer, max_iter)
    trainer = E.SimpleTrainer(model, batches(seed=21, size=4), optimizer)
    val = batch_list(2, seed=22)

    def test_and_save_results():
        model.eval()
        with torch.no_grad():
            out = torch.cat([model.head(model.norm(model.clip(b))) for b in val])
        model.train()
        return {"sem_seg": {"mIoU": round(float(torch.sigmoid(out).mean()) * 100, 4)}}

    def build_writers():
        writers = [
            E.CommonMetricPrinter(max_iter),
            E.JSONWriter(R.path("metrics.json")),
            E.TensorboardXWriter(R.out),
        ]
        writers[-1] = WandbWriter()  # use wandb writer instead.
        return writers

    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(optimizer, scheduler),
            E.hooks.EvalHook(5, test_and_save_results),
            E.hooks.PeriodicWriter(build_writers(), period=4),
        ]
    )
    trainer.train(0, max_iter)
    R.rec("event files", sorted(glob.glob(os.path.join(R.out, "events.out.tfevents.*"))))
    R.rec("groups", [(g["param_name"], g["lr"]) for g in optimizer.param_groups])
    R.rec("saved groups", [g["param_name"] for g in optimizer.state_dict()["param_groups"]])
    R.rec("lr", trainer.storage.history("lr").values())
    R.rec("left", len(trainer.storage._vis_data), len(trainer.storage._histograms))
    R.storage(trainer.storage)


# --- IDEA-Research/MaskDINO -----------------------------------------------------------------


@pattern(
    "IDEA-Research/MaskDINO",
    "train_net.py: Trainer.__init__ (super(DefaultTrainer, self).__init__(), the "
    "checkpointer built twice), build_optimizer, main",
)
def sg_maskdino_second_checkpointer(E, R):
    """MaskDINO's ``Trainer.__init__`` calls ``super(DefaultTrainer, self).__init__()`` and
    builds what ``DefaultTrainer`` would: ``(AMPTrainer if cfg.SOLVER.AMP.ENABLED else
    SimpleTrainer)(model, data_loader, optimizer)`` (AMP off here), the scheduler, a
    checkpointer with ``trainer=weakref.proxy(self)``, the default hooks, and then a *second*
    checkpointer in ``self.checkpointer``: the ``PeriodicCheckpointer`` hook saves through
    the first, ``resume_or_load`` reads through the second. The optimizer is AdamW with one
    group per parameter (backbone at 0.1 times the lr) wrapped in full-model clipping. The run
    is preempted before iteration 7; ``main`` builds a new trainer and
    ``resume_or_load(resume=True)`` (``start_iter = iter + 1``) continues from the last
    periodic checkpoint, its AdamW moments and the poly scheduler's state loaded. The
    resumed run has no writers and its storage is not recorded (hookloop restores the recent
    scalar history, docs/differences.md), and no checkpoint falls on an evaluation
    iteration (hookloop saves after that iteration's other hooks)."""

    class Cfg:
        OUTPUT_DIR = R.out
        MAX_ITER = 10
        BASE_LR = 0.01
        BACKBONE_MULTIPLIER = 0.1
        CLIP_VALUE = 0.01
        AMP = False
        CHECKPOINT_PERIOD = 3
        EVAL_PERIOD = 4
        WRITERS = True

    val = batch_list(2, seed=31)

    class Trainer(E.TrainerBase):
        def __init__(self, cfg):
            E.TrainerBase.__init__(self)  # super(DefaultTrainer, self).__init__()
            model = self.build_model(cfg)
            optimizer = self.build_optimizer(cfg, model)
            data_loader = batches(seed=32, size=4)
            self._trainer = (E.AMPTrainer if cfg.AMP else E.SimpleTrainer)(
                model, data_loader, optimizer
            )
            self.scheduler = _PolyLR(optimizer, cfg.MAX_ITER)
            kwargs = {"trainer": weakref.proxy(self)}
            self.checkpointer = E.Checkpointer(model, cfg.OUTPUT_DIR, **kwargs)
            self.start_iter = 0
            self.max_iter = cfg.MAX_ITER
            self.cfg = cfg
            self.register_hooks(self.build_hooks())
            self.checkpointer = E.Checkpointer(model, cfg.OUTPUT_DIR, **kwargs)

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        @classmethod
        def build_model(cls, cfg):
            return TinyDetector()

        @classmethod
        def build_optimizer(cls, cfg, model):
            params = _per_param_groups(
                model, cfg.BASE_LR, {"backbone": cfg.BACKBONE_MULTIPLIER}, weight_decay=0.05
            )
            return _full_model_clipping(torch.optim.AdamW, cfg.CLIP_VALUE)(params, cfg.BASE_LR)

        def test(self):
            self.model.eval()
            with torch.no_grad():
                out = torch.cat([self.model(b) for b in val])
            self.model.train()
            ap = round(float(torch.sigmoid(out).mean()) * 100.0, 4)
            log.info("maskdino eval at %d: %.4f", self.iter, ap)
            return {"segm": {"AP": ap}, "bbox": {"AP": ap - 1.0}}

        def build_hooks(self):
            cfg = self.cfg
            ret = [E.hooks.IterationTimer(), E.hooks.LRScheduler(), None]
            ret.append(E.hooks.PeriodicCheckpointer(self.checkpointer, cfg.CHECKPOINT_PERIOD))

            def test_and_save_results():
                self._last_eval_results = self.test()
                return self._last_eval_results

            ret.append(E.hooks.EvalHook(cfg.EVAL_PERIOD, test_and_save_results))
            if cfg.WRITERS:
                writers = [
                    E.CommonMetricPrinter(self.max_iter),
                    E.JSONWriter(os.path.join(cfg.OUTPUT_DIR, "metrics.json")),
                ]
                ret.append(E.hooks.PeriodicWriter(writers, period=20))
            return ret

        def resume_or_load(self, resume=True):
            self.checkpointer.resume_or_load("", resume=resume)
            if resume and self.checkpointer.has_checkpoint():
                self.start_iter = self.iter + 1

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

    cfg = Cfg()
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=False)
    trainer.register_hooks([preempted_before(E, 7)])
    hook_ckpt = trainer._hooks[2].checkpointer
    R.rec("two checkpointers", hook_ckpt is trainer.checkpointer, type(trainer.optimizer).__name__)
    try:
        trainer.train()
    except RuntimeError as e:
        R.rec("stopped", str(e), trainer.iter)
    R.rec("results", trainer._last_eval_results)
    R.storage(trainer.storage)
    R.rec("weights", weights(trainer.model))

    cfg.WRITERS = False
    resumed = Trainer(cfg)
    resumed.resume_or_load(resume=True)
    R.rec("resumed at", resumed.start_iter, resumed.iter, resumed.scheduler.last_epoch)
    state = resumed.optimizer.state_dict()["state"]
    R.rec("adamw step", [float(s["step"]) for s in state.values()])
    R.rec("results", resumed.train())
    R.rec("weights", weights(resumed.model))
    R.rec("lr", [g["lr"] for g in resumed.optimizer.param_groups])


# --- niqbal996/detectron2: tools/lazyconfig_train_net.py ------------------------------------


@pattern(
    "niqbal996/detectron2",
    "tools/lazyconfig_train_net.py: do_train (BestCheckpointer on validation_loss before "
    "EvalHook and LossEvalHook)",
)
def sg_lazy_best_checkpointer_before_loss_eval(E, R):
    """A lazy-config ``do_train`` (ViTDet-style script) that registers ``hooks.BestCheckpointer(
    eval_period=..., checkpointer, val_metric='validation_loss', mode='min',
    file_prefix='model_best_mAP50')`` *before* the ``EvalHook`` and the ``LossEvalHook`` that
    puts ``validation_loss``, with the loss evaluation's period ("TODO Set = 1000 after
    debugging") longer than the best checkpointer's: its first checks find no metric (a
    warning each), later ones see a value that was already checked, and each runs before
    that iteration's loss evaluation (a value checked before is "not better" than itself).
    The fork's newest stored version of the file has this block commented out. The
    validation batches carry the opposite targets of the training ones, so the validation
    loss only rises after the first value: one
    ``model_best_mAP50.pth``, then "Not saving". The writers are ``default_writers``' file
    writers; the periodic checkpoint (period 9 here) falls on no iteration the best
    checkpointer checks (hookloop saves after the other hooks and keeps ``last_checkpoint`` on
    the periodic file)."""

    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, batch):
            x, y = batch
            return {"loss_reg": ((self.fc(x).squeeze(1) - y) ** 2).mean()}

    def stream(seed, sign):
        for x in batches(seed=seed, size=4):
            yield x, sign * x.sum(1)

    val_loader = list(itertools.islice(stream(42, -1.0), 2))

    class LossEvalHook(E.HookBase):
        def __init__(self, eval_period, model, data_loader):
            self._model = model
            self._period = eval_period
            self._data_loader = data_loader

        def _do_loss_eval(self):
            losses = []
            with torch.no_grad():
                for inputs in self._data_loader:
                    loss_dict = self._model(inputs)
                    losses.append(sum(float(v) for v in loss_dict.values()))
            mean_loss = float(np.mean(losses))
            self.trainer.storage.put_scalar("validation_loss", mean_loss)
            E.comm.synchronize()
            return losses

        def after_step(self):
            next_iter = self.trainer.iter + 1
            is_final = next_iter == self.trainer.max_iter
            if is_final or (self._period > 0 and next_iter % self._period == 0):
                self._do_loss_eval()

    max_iter = 16
    model = Regressor()
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    S = E.solver
    lr_multiplier = S.WarmupParamScheduler(
        S.MultiStepParamScheduler(values=[1.0, 0.1], milestones=[12], num_updates=max_iter),
        warmup_length=2 / max_iter,
        warmup_factor=0.1,
    )
    trainer = E.SimpleTrainer(model, stream(41, 1.0), optim)
    checkpointer = E.Checkpointer(model, R.out, trainer=trainer)

    def do_test():
        with torch.no_grad():
            err = float(sum(model(b)["loss_reg"] for b in val_loader))
        return {"bbox": {"AP50": round(100.0 / (1.0 + err), 4)}}

    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(scheduler=lr_multiplier),
            E.hooks.PeriodicCheckpointer(checkpointer, period=9, max_to_keep=2),
            E.hooks.BestCheckpointer(
                eval_period=2,
                checkpointer=checkpointer,
                val_metric="validation_loss",
                mode="min",
                file_prefix="model_best_mAP50",
            ),
            E.hooks.EvalHook(8, do_test),
            LossEvalHook(5, model, val_loader),
            E.hooks.PeriodicWriter(
                [E.JSONWriter(R.path("metrics.json")), E.TensorboardXWriter(R.out)], period=4
            ),
        ]
    )
    checkpointer.resume_or_load("", resume=False)
    start_iter = 0
    trainer.train(start_iter, max_iter)
    R.rec("validation_loss", trainer.storage.history("validation_loss").values())
    best = trainer._hooks[3]
    R.rec("best", best.best_metric, best.best_iter)
    R.storage(trainer.storage)


# --- facebookresearch/detectron2: tools/benchmark.py -----------------------------------------


@pattern("facebookresearch/detectron2", "tools/benchmark.py: benchmark_train")
def sg_d2_benchmark_train_profiler(E, R):
    """detectron2's training benchmark: a few batches drawn once from the loader and
    replayed forever by a generator (``DatasetFromList`` over them), a ``SimpleTrainer``
    with ``IterationTimer``, ``PeriodicWriter([CommonMetricPrinter(max_iter)])`` at its
    default period (20: here only the last iteration writes) and ``hooks.TorchProfiler(lambda
    trainer: trainer.iter == max_iter - 1, OUTPUT_DIR, save_tensorboard=True)``, trained with
    ``trainer.train(1, max_iter)`` (from iteration 1). The profiler's TensorBoard trace of
    the last step lands in ``OUTPUT_DIR/log/profiler-tensorboard-iter<N>/``; the pattern
    records what a reader finds there (the folder, a ``worker0.*.pt.trace.json`` file whose
    events include the model's matmul) and removes it, since its contents are timings."""

    max_iter = 24
    model = TinyDetector()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    dummy_data = list(itertools.islice(batches(seed=51, size=4), 5))

    def f():
        data = list(dummy_data)
        while True:
            yield from data

    trainer = E.SimpleTrainer(model, f(), optimizer)
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter([E.CommonMetricPrinter(max_iter)]),
            E.hooks.TorchProfiler(
                lambda trainer: trainer.iter == max_iter - 1, R.out, save_tensorboard=True
            ),
        ]
    )
    trainer.train(1, max_iter)
    log_dir = os.path.join(R.out, "log")
    R.rec("profiler folders", sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else None)
    traces = sorted(glob.glob(os.path.join(log_dir, "*", "worker0.*.pt.trace.json")))
    R.rec("traces", len(traces))
    for path in traces:
        with open(path) as fh:
            trace = json.load(fh)
        names = {e.get("name", "") for e in trace.get("traceEvents", [])}
        R.rec("trace", "traceEvents" in trace, any("addmm" in n for n in names))
    shutil.rmtree(log_dir, ignore_errors=True)
    R.rec("iter", trainer.iter, trainer.start_iter)
    R.storage(trainer.storage)
