"""Trainer subclasses: ``run_step`` overrides, extra state, trainers wrapping a SimpleTrainer."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import numpy as np
import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, TinyRegressor, batches, log, sgd, weights


class _Cycle:
    """An endless loader that also reports a length (the size of one pass over its data), as
    loaders built on a map-style dataset with an infinite sampler do."""

    def __init__(self, data, length):
        self.data = data
        self.length = length

    def __len__(self):
        return self.length

    def __iter__(self):
        while True:
            yield from self.data


class _TwoDomains(nn.Module):
    """A student detector with a domain discriminator: source losses, target losses and the
    discriminator's losses on both."""

    def __init__(self):
        super().__init__()
        self.det = TinyDetector()
        self.disc = nn.Linear(4, 1)

    def forward(self, batch, branch="supervised"):
        losses = self.det(batch)
        if branch == "supervised":
            return losses
        d = torch.sigmoid(self.disc(batch)).mean()
        if branch == "domain_source":
            return {"loss_D_img_s": (d - 1.0) ** 2}
        return {"loss_D_img_t": d**2}


# --- adaptive_teacher -----------------------------------------------------------------------


@pattern("facebookresearch/adaptive_teacher", "adapteacher/engine/trainer.py: BaselineTrainer")
def tr_at_baseline_trainer(E, R):
    """Adaptive Teacher's supervised trainer: a ``TrainerBase`` subclass that calls
    ``TrainerBase.__init__`` itself and keeps a ``SimpleTrainer`` in ``self._trainer``; its
    own ``train_loop``; a ``run_step`` that sets ``self._trainer.iter``, reads
    ``self._trainer._data_loader_iter``, adds a non-loss entry to the record dict and writes it
    with its own ``_write_metrics`` (``total_loss`` from the ``loss*`` keys only)."""

    class BaselineTrainer(E.TrainerBase):
        def __init__(self, model, data_loader, optimizer, scheduler):
            E.TrainerBase.__init__(self)
            self._trainer = E.SimpleTrainer(model, data_loader, optimizer)
            self.scheduler = scheduler
            self.start_iter = 0
            self.max_iter = 9
            self.register_hooks(
                [
                    E.hooks.IterationTimer(),
                    E.hooks.LRScheduler(optimizer, scheduler),
                    E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=4),
                ]
            )

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        def train_loop(self, start_iter, max_iter):
            logger = logging.getLogger("corpus.adapteacher")
            logger.info("Starting training from iteration {}".format(start_iter))
            self.iter = self.start_iter = start_iter
            self.max_iter = max_iter
            with E.EventStorage(start_iter) as self.storage:
                try:
                    self.before_train()
                    for self.iter in range(start_iter, max_iter):
                        self.before_step()
                        self.run_step()
                        self.after_step()
                except Exception:
                    logger.exception("Exception during training:")
                    raise
                finally:
                    self.after_train()

        def run_step(self):
            self._trainer.iter = self.iter
            assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._trainer._data_loader_iter)
            data_time = time.perf_counter() - start
            record_dict = self.model(data)
            record_dict["bbox_num/gt_bboxes"] = float(data.shape[0])
            loss_dict = {k: v for k, v in record_dict.items() if k.startswith("loss")}
            losses = sum(loss_dict.values())
            metrics_dict = record_dict
            metrics_dict["data_time"] = data_time
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
                data_time = np.max([x.pop("data_time") for x in all_metrics_dict])
                self.storage.put_scalar("data_time", data_time)
                metrics_dict = {
                    k: np.mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0]
                }
                total = sum(v for k, v in metrics_dict.items() if k.startswith("loss"))
                self.storage.put_scalar("total_loss", total)
                if len(metrics_dict) > 1:
                    self.storage.put_scalars(**metrics_dict)

    model = TinyDetector()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    t = BaselineTrainer(model, batches(), optimizer, scheduler)
    t.train_loop(t.start_iter, t.max_iter)
    R.storage(t.storage)
    R.rec("iters", t.iter, t._trainer.iter, "lr", optimizer.param_groups[0]["lr"])


@pattern("facebookresearch/adaptive_teacher", "adapteacher/engine/trainer.py: ATeacherTrainer")
def tr_at_teacher_student(E, R):
    """Adaptive Teacher's teacher-student trainer: a burn-in stage on the source domain, then
    an EMA copy of the student as teacher (``_update_teacher_model(keep_rate)``), the student
    trained on source and target with the discriminator's losses weighted, and every entry
    put with ``storage.put_scalars``; the burn-in switch and the EMA read ``self.iter``."""

    class ATeacherTrainer(E.TrainerBase):
        def __init__(self, model, teacher, data_loader, optimizer):
            E.TrainerBase.__init__(self)
            self._trainer = E.SimpleTrainer(model, data_loader, optimizer)
            self.model_teacher = teacher
            self.burn_up_step = 3

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        def train_loop(self, start_iter, max_iter):
            self.iter = self.start_iter = start_iter
            self.max_iter = max_iter
            with E.EventStorage(start_iter) as self.storage:
                try:
                    self.before_train()
                    for self.iter in range(start_iter, max_iter):
                        self.before_step()
                        self.run_step_full_semisup()
                        self.after_step()
                finally:
                    self.after_train()

        @torch.no_grad()
        def _update_teacher_model(self, keep_rate=0.9):
            student = self.model.state_dict()
            new = {
                k: student[k] * (1 - keep_rate) + v * keep_rate
                for k, v in self.model_teacher.state_dict().items()
            }
            self.model_teacher.load_state_dict(new)

        def run_step_full_semisup(self):
            self._trainer.iter = self.iter
            start = time.perf_counter()
            source, target = next(self._trainer._data_loader_iter)
            data_time = time.perf_counter() - start
            record_dict = self.model(source, branch="supervised")
            if self.iter >= self.burn_up_step:
                if self.iter == self.burn_up_step:
                    self._update_teacher_model(keep_rate=0.0)
                elif (self.iter - self.burn_up_step) % 2 == 0:
                    self._update_teacher_model(keep_rate=0.9)
                record_dict.update(self.model(source, branch="domain_source"))
                record_dict.update(self.model(target, branch="domain_target"))
            loss_dict = {}
            for key, value in record_dict.items():
                if key.startswith("loss"):
                    weight = 0.1 if "_D_" in key else 1.0
                    loss_dict[key] = value * weight
            losses = sum(loss_dict.values())
            metrics_dict = {k: v.item() for k, v in record_dict.items()}
            metrics_dict["data_time"] = data_time
            self.storage.put_scalar("data_time", metrics_dict.pop("data_time"))
            self.storage.put_scalars(**metrics_dict)
            self.storage.put_scalar("total_loss", sum(metrics_dict.values()))
            self.optimizer.zero_grad()
            losses.backward()
            self.optimizer.step()

    def pairs():
        src, tgt = batches(1), batches(2)
        while True:
            yield next(src), next(tgt)

    model = _TwoDomains()
    teacher = _TwoDomains()
    teacher.load_state_dict(model.state_dict())
    t = ATeacherTrainer(model, teacher, pairs(), sgd(model))
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter(
                [E.JSONWriter(R.path("metrics.json")), E.CommonMetricPrinter(8)], period=3
            ),
        ]
    )
    t.train_loop(0, 8)
    R.storage(t.storage)
    R.rec("teacher", weights(teacher))


# --- d2go -----------------------------------------------------------------------------------


def _d2go_train(E, R, max_iter, async_write):
    """d2go's ``do_train`` around a SimpleTrainer built from its config (shared by two
    patterns): a loss-checking model wrapper, a ``CallbackHook`` that puts ``lr``, steps the
    scheduler (not after the last iteration) and the periodic checkpointer, and writers with
    the writer period as window."""

    class AbnormalLossCheckerWrapper(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.checked = 0

        def forward(self, x):
            losses = self.model(x)
            assert all(torch.isfinite(v) for v in losses.values())
            self.checked += 1
            return losses

    writer_period = 4
    model = TinyDetector()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[5], gamma=0.1)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)
    periodic_checkpointer = E.PeriodicCheckpointer(checkpointer, 5, max_iter=max_iter)
    wrapped = AbnormalLossCheckerWrapper(model)
    trainer = E.SimpleTrainer(
        wrapped,
        batches(),
        optimizer,
        gather_metric_period=2,
        zero_grad_before_forward=True,
        async_write_metrics=async_write,
    )

    def after_step_callback(trainer):
        trainer.storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
        if trainer.iter < max_iter - 1:
            scheduler.step()
        periodic_checkpointer.step(trainer.iter)

    trainer_hooks = [E.hooks.IterationTimer(), E.hooks.CallbackHook(after_step=after_step_callback)]
    if not async_write:
        writers = [
            E.CommonMetricPrinter(max_iter, window_size=writer_period),
            E.JSONWriter(R.path("metrics.json"), window_size=writer_period),
            E.TensorboardXWriter(R.out),
        ]
        trainer_hooks.append(E.hooks.PeriodicWriter(writers, writer_period))
    trainer.register_hooks(trainer_hooks)
    trainer.train(0, max_iter)
    if async_write:
        # The executor thread creates its scalars while the timer puts "time": the order in
        # which names first appear depends on the threads, in detectron2 too.
        storage = trainer.storage
        R.rec({k: storage.history(k).values() for k in sorted(storage.histories())})
    else:
        R.storage(trainer.storage)
    R.rec("checked", wrapped.checked, "lr", optimizer.param_groups[0]["lr"])


@pattern("facebookresearch/d2go", "d2go/runner/default_runner.py: Detectron2GoRunner.do_train")
def tr_d2go_do_train(E, R):
    """d2go's ``do_train``: ``SimpleTrainer(..., gather_metric_period=cfg.GATHER_METRIC_PERIOD,
    zero_grad_before_forward=cfg.ZERO_GRAD_BEFORE_FORWARD)`` with its after-step callback
    hook and ``PeriodicWriter(writers, cfg.WRITER_PERIOD)``; losses are put every second
    iteration only."""
    _d2go_train(E, R, 10, async_write=False)


@pattern("facebookresearch/d2go", "d2go/runner/default_runner.py: ASYNC_WRITE_METRICS")
def tr_d2go_async_write(E, R):
    """d2go's ``do_train`` with ``cfg.ASYNC_WRITE_METRICS`` on: the metric writes run on the
    trainer's executor; the user reads the storage once ``train()`` returned (after
    ``after_train`` shut the executor down)."""
    _d2go_train(E, R, 7, async_write=True)


# --- cvpods / YOLOF -------------------------------------------------------------------------


@pattern("Megvii-BaseDetection/cvpods", "cvpods/engine/base_runner.py: SimpleRunner")
def tr_cvpods_simple_runner(E, R):
    """cvpods' runner (which YOLOF trains with), on detectron2's ``TrainerBase``: the
    constructor sets ``model``, ``data_loader``, ``_data_loader_iter`` and ``optimizer``
    itself; ``run_step`` only computes the losses (a new ``iter(...)`` and ``epoch += 1`` when
    the loader runs out), writes them with ``get_event_storage()`` and leaves
    ``step_outputs``; the backward and the optimizer step are a hook's ``after_step``."""

    class SimpleRunner(E.TrainerBase):
        def __init__(self, model, data_loader, optimizer):
            super().__init__()
            model.train()
            self.model = model
            self.data_loader = data_loader
            self._data_loader_iter = iter(data_loader)
            self.optimizer = optimizer
            self.epoch = 0

        def run_step(self):
            assert self.model.training
            start = time.perf_counter()
            try:
                data = next(self._data_loader_iter)
            except StopIteration:
                self.epoch += 1
                self._data_loader_iter = iter(self.data_loader)
                data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            loss_dict = self.model(data)
            losses = sum(v for v in loss_dict.values() if v.requires_grad)
            if not torch.isfinite(losses).all():
                raise FloatingPointError("Loss became infinite or NaN")
            self._write_metrics(loss_dict, data_time)
            self.step_outputs = {"loss_for_backward": losses}

        def _write_metrics(self, loss_dict, data_time, prefix=""):
            metrics_dict = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
            metrics_dict["data_time"] = data_time
            all_metrics_dict = E.comm.gather(metrics_dict)
            if E.comm.is_main_process():
                storage = E.get_event_storage()
                storage.put_scalar(
                    "data_time", np.max([x.pop("data_time") for x in all_metrics_dict])
                )
                metrics_dict = {
                    k: np.mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0]
                }
                total = sum(v for k, v in metrics_dict.items() if "loss" in k)
                storage.put_scalar("{}total_loss".format(prefix), total)
                if len(metrics_dict) > 1:
                    storage.put_scalars(**metrics_dict)

    class OptimizationHook(E.HookBase):
        def after_step(self):
            losses = self.trainer.step_outputs["loss_for_backward"]
            self.trainer.optimizer.zero_grad()
            losses.backward()
            self.trainer.optimizer.step()

    class EpochLogger(E.HookBase):
        def after_step(self):
            if self.trainer.iter % 4 == 3:
                log.info("epoch %d iter %d", self.trainer.epoch, self.trainer.iter)

    model = TinyDetector()
    runner = SimpleRunner(model, [b for b, _ in zip(batches(), range(4))], sgd(model))
    runner.register_hooks(
        [
            E.hooks.IterationTimer(),
            OptimizationHook(),
            EpochLogger(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=5),
        ]
    )
    runner.train(0, 10)
    R.storage(runner.storage)
    R.rec("epoch", runner.epoch, "iter", runner.iter)


# --- CutLER ---------------------------------------------------------------------------------


class _SometimesNaN(TinyDetector):
    """A detector whose classification loss is NaN at the given forward calls."""

    def __init__(self, nan_at):
        super().__init__()
        self.nan_at = set(nan_at)
        self.calls = 0

    def forward(self, batch):
        losses = super().forward(batch)
        if self.calls in self.nan_at:
            losses["loss_cls"] = losses["loss_cls"] * float("nan")
        self.calls += 1
        return losses


@pattern("facebookresearch/CutLER", "cutler/engine/train_loop.py: CustomSimpleTrainer.run_step")
def tr_cutler_nan_skip(E, R):
    """CutLER's ``run_step`` skips the backward of a NaN loss (printing "Nan loss. Skipped.")
    but still calls ``self._write_metrics(loss_dict, data_time)``: detectron2 then raises
    ``FloatingPointError`` naming the iteration and the numpy means, the exception is logged,
    and ``after_train`` runs the writers."""

    class CustomSimpleTrainer(E.SimpleTrainer):
        def __init__(self, model, data_loader, optimizer, cfg=None):
            super().__init__(model, data_loader, optimizer)
            self.cfg = cfg

        def run_step(self):
            assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            loss_dict = self.model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())
            if not torch.isnan(losses):
                self.optimizer.zero_grad()
                losses.backward()
            else:
                print("Nan loss. Skipped.")
            self._write_metrics(loss_dict, data_time)
            self.optimizer.step()

    model = _SometimesNaN(nan_at=[5])
    t = CustomSimpleTrainer(model, batches(), sgd(model))
    t.register_hooks(
        [
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=2),
        ]
    )
    try:
        t.train(0, 9)
    finally:
        # What the user inspects after the failure: the losses recorded and the iteration.
        # (No IterationTimer and not the weights: with hookloop's deferred loss reads the
        # error surfaces at the writer's read in after_step, after that iteration's optimizer
        # step and timer, as its README says.)
        names = ("total_loss", "loss_cls", "loss_box_reg")
        R.rec({k: t.storage.history(k).values() for k in names}, "iter", t.iter)


@pattern("facebookresearch/CutLER", "cutler/engine/train_loop.py: CustomSimpleTrainer NaN")
def tr_cutler_nan_single_loss(E, R):
    """The same trainer with a model returning one loss tensor (named ``total_loss`` by the
    trainer) that becomes infinite: the ``FloatingPointError`` message holds the dict of numpy
    means; the user catches it and reads the storage and the iteration."""

    class Blowup(TinyRegressor):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, batch):
            loss = super().forward(batch)
            self.calls += 1
            return loss * float("inf") if self.calls == 4 else loss

    class CustomSimpleTrainer(E.SimpleTrainer):
        def run_step(self):
            data = next(self._data_loader_iter)
            loss_dict = self.model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())
            if torch.isfinite(losses):
                self.optimizer.zero_grad()
                losses.backward()
            self._write_metrics(loss_dict, 0.0)
            self.optimizer.step()

    model = Blowup()
    t = CustomSimpleTrainer(model, batches(), sgd(model))
    t.register_hooks([E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=1)])
    try:
        t.train(0, 6)
    except FloatingPointError as e:
        R.rec("caught", str(e))
    R.storage(t.storage)
    R.rec("iter", t.iter)


# --- trainers that write the metrics themselves ---------------------------------------------


def _unregistered_epoch_mixin_write_metrics(E, R):
    """An epoch mixin over ``SimpleTrainer`` (Mask2Former-based plugins): ``epoch``,
    ``epoch_iter`` and ``epoch_float`` are *methods* of the trainer, ``_write_metrics``
    checks ``gather_metric_period`` and calls its own static ``write_metrics`` that puts
    ``rank_data_time``, the losses and the epoch scalars with ``cur_iter``.

    Not registered: the code was found in the index (``detectron2_plugin``-style
    ``train_loop.py``, ``EpochTrainerMixin``) without the name of its repository. It passes
    on all three engines (hookloop's ``PeriodicCheckpointer`` no longer reads a method
    ``epoch`` as a number)."""

    class EpochTrainerMixin:
        def __init__(self, steps_per_epoch, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._steps_per_epoch = steps_per_epoch

        def epoch(self, iter=None):
            iter = self.iter if iter is None else iter
            return int(iter / self._steps_per_epoch)

        def epoch_iter(self, iter=None):
            iter = self.iter if iter is None else iter
            return int(iter - self.epoch(iter) * self._steps_per_epoch)

        def epoch_float(self, iter=None):
            return self.epoch(iter) + self.epoch_iter(iter) / self._steps_per_epoch

        def _write_metrics(self, loss_dict, data_time, prefix="", iter=None):
            iter = self.iter if iter is None else iter
            if (iter + 1) % self.gather_metric_period == 0:
                EpochTrainerMixin.write_metrics(
                    loss_dict,
                    data_time,
                    iter,
                    self.epoch(iter),
                    self.epoch_iter(iter),
                    self.epoch_float(iter),
                    prefix,
                )

        @staticmethod
        def write_metrics(
            loss_dict, data_time, cur_iter, epoch, epoch_iter, epoch_float, prefix=""
        ):
            metrics_dict = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
            storage = E.get_event_storage()
            storage.put_scalar("rank_data_time", data_time, cur_iter=cur_iter)
            storage.put_scalar("data_time", data_time, cur_iter=cur_iter)
            total = sum(metrics_dict.values())
            storage.put_scalar("{}total_loss".format(prefix), total, cur_iter=cur_iter)
            if len(metrics_dict) > 1:
                storage.put_scalars(cur_iter=cur_iter, **metrics_dict)
            storage.put_scalars(
                cur_iter=cur_iter, epoch=epoch, epoch_iter=epoch_iter, epoch_float=epoch_float
            )

    class CustomSimpleTrainer(EpochTrainerMixin, E.SimpleTrainer):
        pass

    model = TinyDetector()
    loader = _Cycle([b for b, _ in zip(batches(), range(3))], 3)
    t = CustomSimpleTrainer(3, model=model, data_loader=loader, optimizer=sgd(model))
    t.gather_metric_period = 2
    checkpointer = E.Checkpointer(model, R.out)
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(8), E.JSONWriter(R.path("metrics.json"))], period=4
            ),
            # Last: hookloop runs PeriodicCheckpointer's after_step after the others' anyway.
            E.hooks.PeriodicCheckpointer(checkpointer, 4),
        ]
    )
    t.train(0, 8)
    R.storage(t.storage)
    R.rec("epoch", t.epoch(), t.epoch_float())


# --- extra state assigned by subclasses -----------------------------------------------------


@pattern("YehLi/xmodaler", "xmodaler/engine/defaults.py: iters_per_epoch, ScheduledSampling")
def tr_xmodaler_iters_per_epoch(E, R):
    """xmodaler's trainer sets ``self.iters_per_epoch = len(train_data_loader)`` and its
    own ``_train_data_loader_iter``, and hooks read ``trainer.iters_per_epoch`` (scheduled
    sampling raises ``ss_prob`` every epoch); written here as a ``SimpleTrainer`` subclass,
    as trainers built on it do."""

    class Trainer(E.SimpleTrainer):
        def __init__(self, model, loader, optimizer):
            super().__init__(model, loader, optimizer)
            self.iters_per_epoch = len(loader)
            self._train_data_loader_iter = iter(loader)
            self.ss_prob = 0.0

        def run_step(self):
            start = time.perf_counter()
            try:
                data = next(self._train_data_loader_iter)
            except StopIteration:
                self._train_data_loader_iter = iter(self.data_loader)
                data = next(self._train_data_loader_iter)
            data_time = time.perf_counter() - start
            losses_dict = self.model(data)
            losses = sum(losses_dict.values())
            self.optimizer.zero_grad()
            losses.backward()
            self._write_metrics(losses_dict, data_time)
            self.optimizer.step()

    class ScheduledSampling(E.HookBase):
        def __init__(self, inc_every_epoch, inc_prob, max_prob):
            self.inc_every_epoch = inc_every_epoch
            self.inc_prob = inc_prob
            self.max_prob = max_prob

        def after_step(self):
            t = self.trainer
            if (t.iter + 1) % (self.inc_every_epoch * t.iters_per_epoch) == 0:
                t.ss_prob = min(t.ss_prob + self.inc_prob, self.max_prob)
                t.storage.put_scalar("ss_prob", t.ss_prob, smoothing_hint=False)

    model = TinyDetector()
    loader = [b for b, _ in zip(batches(), range(3))]
    t = Trainer(model, loader, sgd(model))
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            ScheduledSampling(1, 0.05, 0.1),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    t.train(0, 10)
    R.storage(t.storage)
    R.rec("ss_prob", t.ss_prob, "iters_per_epoch", t.iters_per_epoch)


@pattern(
    "facebookresearch/adaptive_teacher",
    "adapteacher/engine/trainer.py: TrainerBase.__init__(self) in place of the base's",
)
def tr_own_stop_flag(E, R):
    """Adaptive Teacher's trainers call ``TrainerBase.__init__(self)`` instead of their base
    class's constructor and set its attributes themselves; here a ``SimpleTrainer`` subclass
    does so (``model``, ``data_loader``, ``_data_loader_iter_obj``, ``optimizer`` and the rest
    of detectron2's constructor), keeps an early-stopping flag of its own named
    ``stop_requested``, which a hook raises, and ends its own loop on it."""

    class Trainer(E.SimpleTrainer):
        def __init__(self, model, data_loader, optimizer):
            E.TrainerBase.__init__(self)
            model.train()
            self.model = model
            self.data_loader = data_loader
            self._data_loader_iter_obj = iter(data_loader)
            self.optimizer = optimizer
            self.gather_metric_period = 1
            self.zero_grad_before_forward = False
            self.async_write_metrics = False
            self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
            self.stop_requested = False

        def train(self, start_iter, max_iter):
            self.iter = self.start_iter = start_iter
            self.max_iter = max_iter
            with E.EventStorage(start_iter) as self.storage:
                try:
                    self.before_train()
                    for self.iter in range(start_iter, max_iter):
                        self.before_step()
                        self.run_step()
                        self.after_step()
                        if self.stop_requested:
                            break
                finally:
                    self.after_train()

    class EarlyStop(E.HookBase):
        def after_step(self):
            loss = self.trainer.storage.history("total_loss").latest()
            if self.trainer.iter >= 4 and loss < 10.0:
                log.info("stopping at %d", self.trainer.iter)
                self.trainer.stop_requested = True

    model = TinyDetector()
    t = Trainer(model, batches(), sgd(model))
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            EarlyStop(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    t.train(0, 20)
    R.storage(t.storage)
    R.rec("stopped", t.stop_requested, t.iter)


# --- optimizers and loops of the repositories' own --------------------------------------


@pattern("hustvl/SparseInst", "train_net.py: Trainer.build_optimizer (full-model clipping)")
def tr_sparseinst_clipping_optimizer(E, R):
    """SparseInst's ``build_optimizer``: one param group per parameter (a lower lr for the
    backbone, no weight decay on norms) and a subclass of the optimizer class whose ``step``
    clips the gradient norm of the whole model first; the trainer and ``LRScheduler`` see
    only an optimizer, and the hook records the lr of the group it picks."""

    def maybe_add_full_model_gradient_clipping(optim, clip_norm_val=0.05):
        class FullModelGradientClippingOptimizer(optim):
            def step(self, closure=None):
                all_params = [p for g in self.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(all_params, clip_norm_val)
                super().step(closure=closure)

        return FullModelGradientClippingOptimizer

    model = TinyDetector()
    params = []
    for key, value in model.named_parameters(recurse=True):
        lr = 0.1 * (0.5 if "backbone" in key else 1.0)
        weight_decay = 0.0 if "bias" in key else 1e-4
        params.append({"params": [value], "lr": lr, "weight_decay": weight_decay})
    optimizer = maybe_add_full_model_gradient_clipping(torch.optim.SGD)(params, 0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[4, 7], gamma=0.1)
    t = E.SimpleTrainer(model, batches(), optimizer)
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(),
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(9), E.JSONWriter(R.path("metrics.json"))], period=3
            ),
        ]
    )
    t.scheduler = scheduler
    t.train(0, 9)
    R.storage(t.storage)
    R.rec("lrs", [g["lr"] for g in optimizer.param_groups], weights(model))


@pattern("xingyizhou/CenterNet2", "projects/CenterNet2/train_net.py: do_train")
def tr_centernet2_do_train(E, R):
    """CenterNet2's training loop: no trainer; ``storage.step()`` at the start of each
    iteration (after putting ``data_time`` for the previous one), ``iteration + 1`` for the
    writers and the periodic checkpointer, ``put_scalars(time=...)`` of its own, and writers
    called when ``iteration - start_iter > 5`` at every period and at ``max_iter``."""
    model = TinyDetector()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[6], gamma=0.1)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)
    start_iter = checkpointer.resume_or_load("", resume=False).get("iteration", -1) + 1
    max_iter = 12
    periodic_checkpointer = E.PeriodicCheckpointer(checkpointer, 5, max_iter=max_iter)
    writers = [
        E.CommonMetricPrinter(max_iter),
        E.JSONWriter(R.path("metrics.json")),
        E.TensorboardXWriter(R.out),
    ]
    logging.getLogger("corpus.centernet").info(
        "Starting training from iteration {}".format(start_iter)
    )
    with E.EventStorage(start_iter) as storage:
        for data, iteration in zip(batches(), range(start_iter, max_iter)):
            storage.put_scalars(data_time=0.001 * iteration)
            iteration = iteration + 1
            storage.step()
            loss_dict = model(data)
            losses = sum(loss for k, loss in loss_dict.items())
            assert torch.isfinite(losses).all(), loss_dict
            loss_dict_reduced = {k: v.item() for k, v in E.comm.reduce_dict(loss_dict).items()}
            losses_reduced = sum(loss for loss in loss_dict_reduced.values())
            if E.comm.is_main_process():
                storage.put_scalars(total_loss=losses_reduced, **loss_dict_reduced)
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
            storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
            storage.put_scalars(time=0.01)
            scheduler.step()
            if iteration - start_iter > 5 and (iteration % 4 == 0 or iteration == max_iter):
                for writer in writers:
                    writer.write()
            periodic_checkpointer.step(iteration)
        R.storage(storage)
    for writer in writers:
        writer.close()


# --- hooks with their own attributes --------------------------------------------------------


@pattern("asdlei99/iMIX", "imix/engine/hooks/base_hook.py: hooks carrying an ordering attribute")
def tr_hook_own_priority(E, R):
    """iMIX's detectron2-derived hooks carry an ordering attribute of their own
    (``PriorityStatus``); ported onto detectron2's ``HookBase`` such an attribute (here
    ``priority``: a float, a string) is the hook's own data: detectron2 runs hooks in
    registration order and the hook reads the attribute itself."""

    order = []

    class EMAIterHook(E.HookBase):
        priority = 0.5

        def __init__(self, model, momentum=0.5):
            self.model = model
            self.momentum = momentum
            self.shadow = weights(model)

        def after_step(self):
            order.append(("ema", self.trainer.iter, self.priority))
            with torch.no_grad():
                for k, v in self.model.state_dict().items():
                    self.shadow[k] = self.shadow[k] * self.momentum + v * (1 - self.momentum)

    class LogHook(E.HookBase):
        def __init__(self):
            self.priority = "after-ema"

        def after_step(self):
            order.append(("log", self.trainer.iter, self.priority))
            norm = float(sum(v.norm() for v in ema.shadow.values()))
            self.trainer.storage.put_scalar("ema_norm", norm)

    model = TinyDetector()
    ema = EMAIterHook(model)
    t = E.SimpleTrainer(model, batches(), sgd(model))
    t.register_hooks(
        [ema, LogHook(), E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=2)]
    )
    t.train(0, 4)
    R.rec("order", order)
    R.rec("ema", ema.shadow)
    R.storage(t.storage)


# --- trainer state --------------------------------------------------------------------------


@pattern("Megvii-BaseDetection/cvpods", "cvpods/engine/runner.py: resume from trainer state")
def tr_state_dict_resume(E, R):
    """A trainer's ``state_dict()`` taken after training (``iteration``, the stateful hooks,
    the optimizer) and loaded into a new trainer with ``load_state_dict``, whose ``train``
    then continues from ``iter + 1``, as a runner's resume does; the user reads back the
    iteration, the hook's state and the optimizer's momentum buffers."""

    class Counter(E.HookBase):
        def __init__(self):
            self.steps = 0

        def after_step(self):
            self.steps += 1

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    model = TinyDetector()
    t = E.SimpleTrainer(model, batches(), sgd(model))
    t.register_hooks([Counter(), E.hooks.IterationTimer()])
    t.train(0, 4)
    state = t.state_dict()
    R.rec("saved", state["iteration"], state.get("hooks"), "optimizer" in state)
    momentum = state["optimizer"]["state"][0]["momentum_buffer"]

    model2 = TinyDetector()
    model2.load_state_dict(model.state_dict())
    t2 = E.SimpleTrainer(model2, batches(3), sgd(model2))
    counter = Counter()
    t2.register_hooks([counter])
    t2.load_state_dict(state)
    R.rec("loaded", t2.iter, counter.steps)
    R.rec(
        "momentum",
        torch.equal(t2.optimizer.state_dict()["state"][0]["momentum_buffer"], momentum),
    )
    t2.train(t2.iter + 1, 7)
    R.rec("after", t2.iter, counter.steps, weights(model2))
    R.storage(t2.storage)


@pattern(
    "Shuntw6096/SAPNetV2",
    "detection/trainer.py: _DATrainer(SimpleTrainer) calling super(SimpleTrainer).__init__()",
)
def tr_da_trainer_skips_every_init(E, R):
    """SAPNetV2's domain-adaptation trainer (copied into several forks): ``_DATrainer`` subclasses
    ``SimpleTrainer`` but calls ``super(SimpleTrainer).__init__()`` (an unbound ``super``
    object: no ``__init__`` of the trainers runs at all), then sets detectron2's attributes by
    hand, keeps a source and a target loader, weights the losses, and writes them with
    ``self._write_metrics``. It is trained directly, with hooks."""

    class _DATrainer(E.SimpleTrainer):
        def __init__(self, model, source, target, loss_weight, optimizer):
            super(E.SimpleTrainer).__init__()
            model.train()
            self._hooks = []
            self.iter = 0
            self.start_iter = 0
            self.model = model
            self.data_loader = source
            self._data_loader_iter_obj = None
            self._source_iter = iter(source)
            self._target_iter = iter(target)
            self.loss_weight = loss_weight
            self.optimizer = optimizer
            self.gather_metric_period = 1
            self.zero_grad_before_forward = False
            self.async_write_metrics = False
            self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)

        def run_step(self):
            assert self.model.training, "[_DATrainer] model was changed to eval mode!"
            start = time.perf_counter()
            s_data = next(self._source_iter)
            t_data = next(self._target_iter)
            data_time = time.perf_counter() - start
            loss_dict = self.model(s_data)
            loss_dict.update(self.model(t_data, branch="domain_target"))
            loss_dict = {k: self.loss_weight[k] * loss_dict[k] for k in self.loss_weight}
            losses = sum(loss_dict.values())
            self.optimizer.zero_grad()
            losses.backward()
            self._write_metrics(loss_dict, data_time)
            self.optimizer.step()

    model = _TwoDomains()
    weight = {"loss_cls": 1.0, "loss_box_reg": 1.0, "loss_D_img_t": 0.1}
    t = _DATrainer(model, batches(1), batches(2), weight, sgd(model))
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    t.train(0, 7)
    R.rec("iter", t.iter)
    R.storage(t.storage)
    R.rec("weights", weights(model))


@pattern(
    "hookloop/issue-33",
    "a SimpleTrainer subclass's own METRICS_READ_EVERY and MAX_IN_FLIGHT (constructed)",
)
def tr_subclass_names_like_hookloop_knobs(E, R):
    """Constructed from issue 33 (no repository found uses these names; research trainers add
    class constants of their own the same way): a subclass that uses ``METRICS_READ_EVERY``
    (its own label) and ``MAX_IN_FLIGHT`` for its own purposes. Neither is detectron2's name,
    so both are the subclass's to use."""

    class Mine(E.SimpleTrainer):
        METRICS_READ_EVERY = "every 3 iterations"
        MAX_IN_FLIGHT = None

        def run_step(self):
            super().run_step()
            if (self.iter + 1) % 3 == 0:
                self.storage.put_scalar("val_marker", float(self.iter), smoothing_hint=False)

    model = TinyDetector()
    t = Mine(model, batches(3), sgd(model))
    t.register_hooks([E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=2)])
    t.train(0, 6)
    R.storage(t.storage)


@pattern("ChHanXiao/D2", "projects/NanoDet/engine/train_loop.py: SimpleTrainer_Iter in a wrapper")
def tr_nanodet_wrapped_trainer_sets_model_iter(E, R):
    """NanoDet's port: ``DefaultTrainer_Iter`` wraps ``SimpleTrainer_Iter``, a ``SimpleTrainer``
    subclass whose own ``run_step`` hands the iteration to the model (``self.model.iter =
    self.iter``, for its warm-up-dependent losses) and never calls ``after_backward``. The
    wrapper's ``run_step`` is detectron2 ``DefaultTrainer``'s: the wrapped trainer's ``iter``
    set, then its ``run_step``. The model sees each iteration once, in order; the losses it
    makes from them reach metrics.json at their iterations."""

    class IterAware(TinyDetector):
        def __init__(self):
            super().__init__()
            self.iter = -1
            self.seen = []

        def forward(self, batch):
            self.seen.append(self.iter)
            losses = super().forward(batch)
            warm = min(1.0, (self.iter + 1) / 4.0)  # a loss weight warming up over 4 iterations
            return {k: v * warm for k, v in losses.items()}

    class SimpleTrainerIter(E.SimpleTrainer):
        def run_step(self):
            assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            self.model.iter = self.iter
            loss_dict = self.model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())
            self.optimizer.zero_grad()
            losses.backward()
            self._write_metrics(loss_dict, data_time)
            self.optimizer.step()

    class DefaultTrainerIter(E.TrainerBase):
        def __init__(self, model, optimizer):
            E.TrainerBase.__init__(self)
            self._trainer = SimpleTrainerIter(model, batches(5), optimizer)
            self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
            self.start_iter = 0
            self.max_iter = 10
            self.register_hooks(
                [
                    E.hooks.IterationTimer(),
                    E.hooks.LRScheduler(optimizer, self.scheduler),
                    E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=4),
                ]
            )

        def train(self):
            super().train(self.start_iter, self.max_iter)

        def run_step(self):
            self._trainer.iter = self.iter
            self._trainer.run_step()

    model = IterAware()
    t = DefaultTrainerIter(model, sgd(model))
    t.train()
    R.storage(t.storage)
    R.rec("seen", model.seen, "iters", t.iter, t._trainer.iter)
    R.rec("weights", weights(model))
