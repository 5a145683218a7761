"""User hooks (validation loss, EMA, early stopping, logging) and the built-in hooks and
schedules (PreciseBN and fvcore's update_bn_stats, BestCheckpointer, EvalHook, LRScheduler
with fvcore's param schedulers, CallbackHook), as detectron2-based repositories use them."""

from __future__ import annotations

import itertools
import logging
from bisect import bisect_right

import numpy as np
import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batch_list, batches, log, sgd


class BNDetector(nn.Module):
    """A detector stand-in with a BatchNorm layer: losses in training, features otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 1)

    def forward(self, batch: torch.Tensor):
        feats = self.bn(self.fc(batch))
        out = self.head(torch.relu(feats))
        return {"loss_cls": (out**2).mean(), "loss_box_reg": feats.abs().mean() * 0.1}


class TeacherStudent(nn.Module):
    """A student trained by the optimizer and an EMA teacher of the same shape, under
    ``.module`` as a DDP wrapper would hold them."""

    def __init__(self) -> None:
        super().__init__()
        self.student = TinyDetector()
        self.teacher = TinyDetector()
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def forward(self, batch: torch.Tensor):
        return self.student(batch)


class Wrapped(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: torch.Tensor):
        return self.module(batch)


def _stats(bn):
    return [bn.running_mean.tolist(), bn.running_var.tolist(), bn.momentum]


# --- validation-loss hooks -------------------------------------------------------------------


@pattern("Mahsa-Nobakht/maskrcnn_clusternms_DIoU", "validation_loss.py: ValidationLoss")
def hk_validation_loss_every_step(E, R):
    """A ``ValidationLoss`` hook that, after every step, takes the next batch of a validation
    loader, runs the (training-mode) model under ``torch.no_grad()``, reduces the loss dict
    with ``comm.reduce_dict`` and puts ``total_val_loss`` and ``val_*`` losses on the main
    process. The writer sees them in the same rows as the training losses."""

    class ValidationLoss(E.HookBase):
        def __init__(self, loader):
            super().__init__()
            self._loader = iter(loader)

        def after_step(self):
            data = next(self._loader)
            with torch.no_grad():
                loss_dict = self.trainer.model(data)
                losses = sum(loss_dict.values())
                assert torch.isfinite(losses).all(), loss_dict
                reduced = {"val_" + k: v.item() for k, v in E.comm.reduce_dict(loss_dict).items()}
                total = sum(reduced.values())
                if E.comm.is_main_process():
                    self.trainer.storage.put_scalars(total_val_loss=total, **reduced)

    model = TinyDetector()
    trainer = E.SimpleTrainer(model, batches(), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            ValidationLoss(batches(seed=7)),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    trainer.train(0, 7)
    R.storage(trainer.storage)
    R.rec("val history", trainer.storage.history("total_val_loss").values())
    R.rec("median", trainer.storage.history("total_val_loss").median(4))


@pattern("lao19881213/RGC-Mask-Transfiner", "tools/validation.py: ValidationLoss and hook swap")
def hk_transfiner_swap_writer_and_validation(E, R):
    """The script registers a ``ValidationLoss`` hook after the default hooks (whose last one
    is the ``PeriodicWriter``), then swaps the last two entries of ``trainer._hooks`` so that
    the writer runs after the validation loss is put, and trains."""

    class ValidationLoss(E.HookBase):
        def __init__(self, loader):
            super().__init__()
            self._loader = iter(loader)

        def after_step(self):
            data = next(self._loader)
            with torch.no_grad():
                loss_dict = self.trainer.model(data)
                reduced = {"val_" + k: v.item() for k, v in E.comm.reduce_dict(loss_dict).items()}
                if E.comm.is_main_process():
                    self.trainer.storage.put_scalars(
                        total_val_loss=sum(reduced.values()), **reduced
                    )

    model = TinyDetector()
    trainer = E.SimpleTrainer(model, batches(), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter(
                [E.JSONWriter(R.path("metrics.json")), E.TensorboardXWriter(R.out)], period=2
            ),
        ]
    )
    trainer.register_hooks([ValidationLoss(batches(seed=5))])
    trainer._hooks = trainer._hooks[:-2] + trainer._hooks[-2:][::-1]
    R.rec("order", [type(h).__name__ for h in trainer._hooks])
    trainer.train(0, 6)
    R.storage(trainer.storage)


@pattern(
    "GaetanLepage/compound-figure-separator",
    "compfigsep/utils/detectron_utils/loss_eval_hook.py: LossEvalHook",
)
def hk_loss_eval_hook_period(E, R):
    """``LossEvalHook(eval_period, model, data_loader)``: every ``eval_period`` iterations and
    at the last one it runs the model over the whole validation loader under ``no_grad``,
    puts the mean as ``validation_loss``, synchronizes, and logs its progress; an early
    stopping check later reads ``validation_loss`` from ``storage.histories()``."""

    class LossEvalHook(E.HookBase):
        def __init__(self, eval_period, model, data_loader):
            self._model = model
            self._period = eval_period
            self._data_loader = data_loader

        def _do_loss_eval(self):
            losses = []
            for idx, inputs in enumerate(self._data_loader):
                with torch.no_grad():
                    metrics = {k: v.item() for k, v in self._model(inputs).items()}
                losses.append(sum(metrics.values()))
                log.info("Loss on validation done {}/{}".format(idx + 1, len(self._data_loader)))
            mean_loss = np.mean(losses)
            self.trainer.storage.put_scalar("validation_loss", mean_loss)
            E.comm.synchronize()
            return losses

        def after_step(self):
            next_iter = self.trainer.iter + 1
            is_final = next_iter == self.trainer.max_iter
            if is_final or (self._period > 0 and next_iter % self._period == 0):
                self._do_loss_eval()
            self.trainer.storage.put_scalars(timetest=12)

    checks = []

    class EarlyStoppingCheck(E.HookBase):
        def after_step(self):
            storage = self.trainer.storage
            if "validation_loss" not in storage.histories():
                checks.append((self.trainer.iter, None))
                return
            checks.append((self.trainer.iter, storage.history("validation_loss").latest()))

    model = TinyDetector()
    trainer = E.SimpleTrainer(model, batches(), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            LossEvalHook(3, model, batch_list(2, seed=9)),
            EarlyStoppingCheck(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=4),
        ]
    )
    trainer.train(0, 8)
    R.rec("checks", checks)
    R.storage(trainer.storage)


@pattern("SageDevV/ProdutoDetectron2", "loss.py: ValidationLoss, read by an early stop")
def hk_early_stopping_raises(E, R):
    """The repo's ``ValidationLoss`` hook puts the validation losses every step; the
    early-stopping hook next to it stands in for the ones such scripts pair it with (not in
    this repo): it reads ``storage.history("total_val_loss").latest()`` with a patience and, when it
    runs out, saves nothing more and stops training by raising from ``after_step``. The
    writers and ``after_train`` still run (``finally``), and the exception reaches the
    caller."""

    class ValidationLoss(E.HookBase):
        def __init__(self, loader):
            self._loader = iter(loader)

        def after_step(self):
            with torch.no_grad():
                loss_dict = self.trainer.model(next(self._loader))
            reduced = {"val_" + k: v.item() for k, v in E.comm.reduce_dict(loss_dict).items()}
            self.trainer.storage.put_scalars(total_val_loss=sum(reduced.values()), **reduced)

    class EarlyStop(Exception):
        pass

    class EarlyStopping(E.HookBase):
        def __init__(self, patience):
            self.patience = patience
            self.best = None
            self.counter = 0

        def after_step(self):
            value = self.trainer.storage.history("total_val_loss").latest()
            if self.best is None or value < self.best - 1e-3:
                self.best, self.counter = value, 0
            else:
                self.counter += 1
            if self.counter >= self.patience:
                logging.getLogger("corpus.early_stopping").info(
                    "Stopping early at iteration %d", self.trainer.iter
                )
                raise EarlyStop(f"no improvement for {self.patience} iterations")

        def after_train(self):
            R.rec("after_train at", self.trainer.iter, self.trainer.storage.iter)

    model = TinyDetector()
    same = batch_list(1, seed=3) * 20  # a validation set that stops improving
    trainer = E.SimpleTrainer(model, batches(), sgd(model, lr=0.0))
    trainer.register_hooks(
        [
            ValidationLoss(same),
            EarlyStopping(patience=2),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=10),
        ]
    )
    try:
        trainer.train(0, 10)
    except EarlyStop as e:
        R.rec("stopped", str(e), trainer.iter)
    R.storage(trainer.storage)


# --- EMA and logging hooks -------------------------------------------------------------------


@pattern("hustvl/BoxTeacher", "projects/BoxTeacher/boxteacher/ema_hook.py: BoxTeacherEMAHook")
def hk_boxteacher_ema_before_step(E, R):
    """BoxTeacher's EMA hook copies the student into the teacher in ``before_train`` when
    ``trainer.iter == 0``, and in ``before_step`` (every ``interval`` iterations) puts the
    warmed-up ``ema_momentum`` and, after the momentum update, the mean ``param_diff``; its
    ``after_step`` decays the momentum past the ``decay_intervals`` milestones."""
    ema_log = logging.getLogger("corpus.boxteacher.ema")

    class BoxTeacherEMAHook(E.HookBase):
        def __init__(
            self, interval=1, momentum=0.9, warmup=0, decay_factor=0.1, decay_intervals=None
        ):
            super().__init__()
            self.interval = interval
            self.momentum = momentum
            self.warmup = warmup
            self.decay_factor = decay_factor
            self.decay_intervals = decay_intervals

        def before_train(self):
            if self.trainer.iter == 0:
                model = self.trainer.model.module
                with torch.no_grad():
                    for s, t in zip(
                        model.student.state_dict().values(), model.teacher.state_dict().values()
                    ):
                        t.data.copy_(s.data)
                ema_log.info("init teacher with student")
            else:
                ema_log.info("init teacher with loaded checkpoints")

        def before_step(self):
            it = self.trainer.iter
            if it % self.interval != 0:
                return
            model = self.trainer.model.module
            momentum = min(self.momentum, 1 - (1 + self.warmup) / (it + 1 + self.warmup))
            self.trainer.storage.put_scalar("ema_momentum", momentum)
            with torch.no_grad():
                for s, t in zip(model.student.parameters(), model.teacher.parameters()):
                    t.data.mul_(momentum).add_(s.data, alpha=1 - momentum)
                diffs = [
                    torch.norm(s - t)
                    for s, t in zip(model.student.parameters(), model.teacher.parameters())
                ]
            self.trainer.storage.put_scalar("param_diff", torch.stack(diffs).mean().item())

        def after_step(self):
            if self.decay_intervals is None:
                return
            self.momentum = 1 - (1 - self.momentum) * self.decay_factor ** bisect_right(
                self.decay_intervals, self.trainer.iter
            )

    model = Wrapped(TeacherStudent())
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = E.SimpleTrainer(model, batches(), torch.optim.SGD(params, lr=0.1))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            BoxTeacherEMAHook(interval=2, warmup=1, decay_intervals=[5]),
            E.hooks.PeriodicWriter(
                [E.JSONWriter(R.path("metrics.json")), E.CommonMetricPrinter(8)], period=4
            ),
        ]
    )
    trainer.train(0, 8)
    R.storage(trainer.storage)
    R.rec("teacher", [p.tolist() for p in model.module.teacher.parameters()])


@pattern("ChrisAlthaus/master_thesis_impl", "scripts/detectron2/LoggingHook.py: LoggingHook")
def hk_logging_hook_prints_config(E, R):
    """The repo's ``LoggingHook(cfg, period)`` prints the training configuration every
    ``period`` iterations and at the last one; added next to it, a ``CallbackHook`` reads
    ``trainer.iter``/``trainer.max_iter`` and the storage's latest loss in each stage."""

    class LoggingHook(E.HookBase):
        def __init__(self, cfg, period):
            self._cfg = cfg
            self._period = period

        def after_step(self):
            next_iter = self.trainer.iter + 1
            is_final = next_iter == self.trainer.max_iter
            if is_final or (self._period > 0 and next_iter % self._period == 0):
                print("---- CONFIGURATION AT ITER {} ----".format(self.trainer.iter))
                print(self._cfg)

    seen = []

    def stage(name):
        def call(trainer):
            latest = trainer.storage.latest()
            loss = latest.get("total_loss")
            seen.append((name, trainer.iter, trainer.max_iter, trainer.storage.iter, loss))

        return call

    model = TinyDetector()
    trainer = E.SimpleTrainer(model, batches(), sgd(model))
    callback = E.hooks.CallbackHook(
        before_train=stage("before_train"),
        before_step=stage("before_step"),
        after_step=stage("after_step"),
        after_train=stage("after_train"),
    )
    trainer.register_hooks([callback, LoggingHook({"SOLVER": {"MAX_ITER": 5}}, 2)])
    trainer.train(0, 5)
    R.rec("seen", seen)
    R.rec("callback state after train", sorted(k for k in vars(callback) if k.startswith("_")))


# --- PreciseBN and update_bn_stats -----------------------------------------------------------


@pattern("facebookresearch/detectron2", "detectron2/engine/defaults.py: build_hooks PreciseBN")
def hk_d2_precise_bn_then_eval(E, R):
    """DefaultTrainer's hooks: ``PreciseBN(cfg.TEST.EVAL_PERIOD, model, train loader,
    cfg.TEST.PRECISE_BN.NUM_ITER)`` before the ``EvalHook``, so that evaluation sees the
    recomputed statistics; the eval function reads the BN buffers."""
    model = BNDetector()

    def eval_function():
        bn = model.bn
        return {"bn": {"mean0": bn.running_mean[0].item(), "var0": bn.running_var[0].item()}}

    trainer = E.SimpleTrainer(model, batches(), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PreciseBN(3, model, batches(seed=4, size=5), 3),
            E.hooks.EvalHook(3, eval_function),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    trainer.train(0, 7)
    R.rec("bn", _stats(model.bn))
    R.storage(trainer.storage)


@pattern("facebookresearch/detectron2", "detectron2/engine/hooks.py: PreciseBN, short loader")
def hk_d2_precise_bn_loader_runs_out(E, R):
    """A ``PreciseBN`` hook over a finite list of batches: each run continues the same
    iterator, so the second run finds it spent and training stops with the error from
    detectron2's generator; ``after_train`` hooks still run. A model without training BN
    disables the hook (logged)."""
    frozen = TinyDetector()
    E.hooks.PreciseBN(2, frozen, batch_list(2), 2)
    model = BNDetector()
    stats_after_first_run = []

    class BNWatcher(E.HookBase):
        def after_step(self):
            if self.trainer.iter == 1:
                stats_after_first_run.extend(_stats(model.bn))

    trainer = E.SimpleTrainer(model, batches(), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.PreciseBN(2, model, batch_list(3, seed=6, size=4), 2),
            BNWatcher(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=1),
        ]
    )
    try:
        trainer.train(0, 6)
    finally:
        R.rec("iter", trainer.iter, trainer.storage.iter)
        R.rec("bn after first run", stats_after_first_run)


@pattern("facebookresearch/SlowFast", "tools/train_net.py: calculate_and_update_precise_bn")
def hk_slowfast_update_bn_stats(E, R):
    """SlowFast recomputes BN statistics after an epoch with fvcore's ``update_bn_stats``
    over a generator of the loader's inputs, ``min(NUM_BATCHES_PRECISE, len(loader))``
    batches; with a loader shorter than the requested number the call fails. The training
    loop around it is detectron2's ``EventStorage`` with the model's losses."""
    model = BNDetector()
    loader = batch_list(4, seed=2, size=6) + batch_list(1, seed=3, size=2)

    def _gen_loader():
        yield from loader

    opt = sgd(model)
    with E.EventStorage(0) as storage:
        for it, data in zip(range(4), batches()):
            storage.iter = it
            losses = model(data)
            storage.put_scalars(**{k: v.item() for k, v in losses.items()})
            opt.zero_grad()
            sum(losses.values()).backward()
            opt.step()
        R.rec("bn modules", len(E.precise_bn.get_bn_modules(model)))
        E.precise_bn.update_bn_stats(model, _gen_loader(), min(200, len(loader)))
        R.rec("bn", _stats(model.bn))
        storage.put_scalar("bn_mean0", model.bn.running_mean[0].item())
        R.storage(storage)
    try:
        E.precise_bn.update_bn_stats(model, itertools.islice(_gen_loader(), 2), 4)
    except Exception as e:
        R.rec("short loader", type(e).__name__, str(e))


# --- best checkpoint, eval hook, LR schedules ------------------------------------------------


@pattern("facebookresearch/detectron2", "tools/lazyconfig_train_net.py: EvalHook, checkpointer")
def hk_d2_eval_best_checkpointer(E, R):
    """The lazy-config training script's hooks: ``EvalHook(eval_period, lambda:
    do_test(...))``, a ``BestCheckpointer`` on ``bbox/AP50`` inserted before the writer (as
    many ``build_hooks`` overrides do with ``hooks.insert(-1, ...)``) and a periodic
    checkpointer; ``eval_after_train`` evaluates once more at the end. One evaluation gives
    NaN, which is not better than the best."""
    model = TinyDetector()
    scores = iter([30.0, float("nan"), 41.0, 41.0, 12.0])

    def do_test():
        return {"bbox": {"AP50": next(scores), "AP": 1.0}}

    checkpointer = E.Checkpointer(model, R.out)
    trainer = E.SimpleTrainer(model, batches(), sgd(model))
    hooks = [
        E.hooks.IterationTimer(),
        E.hooks.PeriodicCheckpointer(checkpointer, 5),
        E.hooks.EvalHook(2, do_test),
        E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=2),
    ]
    hooks.insert(-1, E.hooks.BestCheckpointer(2, checkpointer, "bbox/AP50", mode="max"))
    trainer.register_hooks(hooks)
    trainer.train(0, 8)
    best = hooks[-2]
    R.rec("best", best.best_metric, best.best_iter)
    R.storage(trainer.storage)


@pattern("facebookresearch/detectron2", "detectron2/solver/build.py: build_lr_scheduler")
def hk_d2_warmup_multistep_lr(E, R):
    """``build_lr_scheduler`` for WarmupMultiStepLR: ``LRMultiplier(WarmupParamScheduler(
    MultiStepParamScheduler(values, milestones=steps, num_updates=max_iter), warmup_factor,
    min(warmup_iters / max_iter, 1.0), method, rescale_interval=False), max_iter)`` stepped by
    the ``LRScheduler`` hook, which puts ``lr`` each iteration, next to an ``EvalHook`` whose
    function sometimes returns NaN."""
    max_iter, steps = 12, (6, 9)
    model = TinyDetector()
    opt = sgd(model, lr=0.2)
    S = E.solver
    sched = S.MultiStepParamScheduler(
        values=[0.1**k for k in range(len(steps) + 1)], milestones=list(steps), num_updates=max_iter
    )
    sched = S.WarmupParamScheduler(
        sched, 0.001, min(3 / max_iter, 1.0), "linear", rescale_interval=False
    )
    scheduler = S.LRMultiplier(opt, multiplier=sched, max_iter=max_iter)
    # Evaluations after iterations 1, 3, 5, 7 and 9, and after training.
    losses = iter([2.0, float("nan"), 1.5, 1.7, 0.5, 0.4])

    trainer = E.SimpleTrainer(model, batches(), opt)
    trainer.register_hooks(
        [
            E.hooks.LRScheduler(opt, scheduler),
            E.hooks.EvalHook(2, lambda: {"val_loss": next(losses)}),
        ]
    )
    trainer.train(0, max_iter)
    R.rec("lr", trainer.storage.history("lr").values())
    # The keys detectron2's state has (hookloop's adds _max_iter, documented).
    state = scheduler.state_dict()
    R.rec("scheduler state", {k: state[k] for k in ("base_lrs", "last_epoch")})
    R.storage(trainer.storage)


@pattern(
    "facebookresearch/detectron2", "configs/common/optim.py: StepWithFixedGamma in LRMultiplier"
)
def hk_step_with_fixed_gamma_to_the_end(E, R):
    """A lazy config's ``LRMultiplier`` over fvcore's ``StepWithFixedGammaParamScheduler``
    for the whole run: the ``LRScheduler`` hook steps the scheduler after every iteration,
    the last step evaluates it at ``where = max_iter / max_iter = 1.0`` and fvcore's list
    indexing fails there; the values up to it are the decayed steps."""
    max_iter = 8
    model = TinyDetector()
    opt = sgd(model, lr=1.0)
    sched = E.solver.StepWithFixedGammaParamScheduler(
        base_value=1.0, num_decays=3, gamma=0.5, num_updates=max_iter
    )
    R.rec("values", [sched(i / max_iter) for i in range(max_iter)])
    trainer = E.SimpleTrainer(model, batches(), opt)
    trainer.register_hooks(
        [
            E.hooks.LRScheduler(opt, E.solver.LRMultiplier(opt, sched, max_iter)),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    try:
        trainer.train(0, max_iter)
    finally:
        R.rec("lr", trainer.storage.history("lr").values())


@pattern(
    "facebookresearch/detectron2", "detectron2/solver/build.py: MultiStep from cfg.SOLVER.STEPS"
)
def hk_multistep_invalid_configs(E, R):
    """Configs that pass ``cfg.SOLVER.STEPS`` and ``cfg.SOLVER.MAX_ITER`` to
    ``MultiStepParamScheduler``: a valid one drives the ``LRScheduler`` hook; the invalid
    ones (a step at or past ``MAX_ITER``, unsorted steps, too few values, no bounds at all,
    a tuple-less step) fail when the config is instantiated, with fvcore's messages."""
    S = E.solver
    configs = [
        dict(values=[1.0, 0.1, 0.01], milestones=[3, 8], num_updates=8),
        dict(values=[1.0, 0.1, 0.01], milestones=[5, 3], num_updates=8),
        dict(values=[1.0, 0.1], milestones=[3, 5], num_updates=8),
        dict(values=[1.0, 0.1, 0.01]),
        dict(values=[1.0, 0.1], milestones=4, num_updates=8),
        dict(values=[1.0, 0.1, 0.01, 0.001, 1e-4], num_updates=3),
        dict(values=[1.0, 0.1, 0.01], milestones=[0, 4, 8]),
    ]
    for cfg in configs:
        try:
            S.MultiStepParamScheduler(**cfg)
            R.rec("built", cfg)
        except Exception as e:
            R.rec("refused", type(e).__name__, str(e))
    model = TinyDetector()
    opt = sgd(model, lr=0.5)
    sched = S.MultiStepParamScheduler(values=[1.0, 0.1, 0.01], milestones=[3, 6, 8])
    trainer = E.SimpleTrainer(model, batches(), opt)
    trainer.register_hooks([E.hooks.LRScheduler(opt, S.LRMultiplier(opt, sched, 8))])
    trainer.train(0, 8)
    R.rec("lr", trainer.storage.history("lr").values())
    R.rec("final lr", opt.param_groups[0]["lr"])
