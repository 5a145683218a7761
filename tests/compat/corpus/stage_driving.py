"""Trainers and scripts that call the engine's stage methods themselves."""

from __future__ import annotations

import logging
import weakref

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd


def _writers(E, R, max_iter):
    return [
        E.CommonMetricPrinter(max_iter),
        E.JSONWriter(R.path("metrics.json")),
        E.TensorboardXWriter(R.out),
    ]


@pattern("aim-uofa/AdelaiDet", "tools/train_net.py: Trainer.train_loop")
def adelaidet_train_loop(E, R):
    """AdelaiDet's trainer replaces ``train`` with its own loop over the stages, without a
    ``try``/``finally`` and without the final ``self.iter += 1``."""

    class Trainer(E.SimpleTrainer):
        def train_loop(self, start_iter, max_iter):
            logger = logging.getLogger("corpus.adet.trainer")
            logger.info("Starting training from iteration {}".format(start_iter))
            self.iter = self.start_iter = start_iter
            self.max_iter = max_iter
            with E.EventStorage(start_iter) as self.storage:
                self.before_train()
                for self.iter in range(start_iter, max_iter):
                    self.before_step()
                    self.run_step()
                    self.after_step()
                self.after_train()
                R.storage(self.storage)

    model = TinyDetector()
    t = Trainer(model, batches(), sgd(model))
    t.register_hooks(
        [E.hooks.IterationTimer(), E.hooks.PeriodicWriter(_writers(E, R, 12), period=5)]
    )
    t.train_loop(0, 12)
    R.rec("iter after", t.iter)


@pattern("facebookresearch/unbiased-teacher", "ubteacher/engine/trainer.py: train_loop")
def unbiased_teacher_train_loop(E, R):
    """Unbiased Teacher's ``train_loop``: ``try``/``except`` logging, ``finally:
    after_train()``, and a ``run_step_full_semisup`` that reads ``self.iter`` to switch from
    the burn-in stage to the teacher-student stage, putting its own scalars."""

    class UBTeacherTrainer(E.SimpleTrainer):
        def train_loop(self, start_iter, max_iter):
            logger = logging.getLogger("corpus.ubteacher")
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
            data = next(self._data_loader_iter)
            record_dict = self.model(data)
            if self.iter < 4:  # burn-in
                record_dict = {k + "_sup": v for k, v in record_dict.items()}
            losses = sum(record_dict.values())
            metrics_dict = dict(record_dict)
            metrics_dict["data_time"] = 0.0
            self._write_metrics(metrics_dict)
            self.optimizer.zero_grad()
            losses.backward()
            self.optimizer.step()

        def _write_metrics(self, metrics_dict):
            metrics_dict = {
                k: v.detach().cpu().item() if hasattr(v, "detach") else float(v)
                for k, v in metrics_dict.items()
            }
            storage = E.get_event_storage()
            storage.put_scalar("data_time", metrics_dict.pop("data_time"))
            storage.put_scalars(**metrics_dict)
            storage.put_scalar("total_loss", sum(metrics_dict.values()))

    model = TinyDetector()
    t = UBTeacherTrainer(model, batches(), sgd(model))
    t.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    t.train_loop(0, 8)
    R.storage(t.storage)
    R.rec("iter after", t.iter)


@pattern("gabarit-ml/gabarit", "object detection template: Trainer.train() driving the stages")
def gabarit_train(E, R):
    """A ``train()`` override that calls every stage itself and stores a per-iteration
    visualisation decision from ``get_event_storage().iter`` inside the model."""

    seen = []

    class VisModel(TinyDetector):
        def forward(self, batch):
            out = super().forward(batch)
            if self.training and E.get_event_storage().iter % 3 == 0:
                seen.append(E.get_event_storage().iter)
            return out

    class Trainer(E.SimpleTrainer):
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
                    self.iter += 1
                finally:
                    self.after_train()

    model = VisModel()
    t = Trainer(model, batches(), sgd(model))
    t.register_hooks(
        [E.hooks.IterationTimer(), E.hooks.PeriodicWriter(_writers(E, R, 10), period=4)]
    )
    t.train(0, 10)
    R.rec("visualised at", seen)
    R.storage(t.storage)


@pattern("facebookresearch/detectron2", "tools/lightning_train_net.py: TrainingModule")
def lightning_standalone_hooks(E, R):
    """detectron2's Lightning example drives hooks without a trainer loop: it builds an
    ``IterationTimer`` and a ``PeriodicWriter``, calls ``before_train`` on the timer before
    any trainer is attached, later sets ``hook.trainer = weakref.proxy(module)``, and calls
    ``before_step``/``after_step`` from Lightning's batch callbacks."""

    class Module:  # stands in for the LightningModule
        def __init__(self):
            self.storage = None
            self.iter = 0
            self.start_iter = 0
            self.max_iter = 6

    module = Module()
    timer = E.hooks.IterationTimer()
    writer = E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=2)
    timer.before_train()  # before any trainer (on_train_start)
    with E.EventStorage(0) as storage:
        module.storage = storage
        for hook in (timer, writer):
            hook.trainer = weakref.proxy(module)
        for i in range(module.max_iter):
            module.iter = storage.iter = i
            timer.before_step()
            storage.put_scalar("loss", 1.0 / (i + 1))
            timer.after_step()
            writer.after_step()
            storage.step()
        module.iter = storage.iter
        writer.after_train()
        R.rec("has time", "time" in storage.histories())
        R.rec("latest names", list(storage.latest()))


@pattern("facebookresearch/detectron2", "tools/plain_train_net.py: do_train")
def plain_train_net_loop(E, R):
    """detectron2's plain training loop: no trainer, an ``EventStorage`` opened by hand,
    ``storage.iter = iteration`` each step, ``put_scalars`` of reduced losses and ``lr``, and
    writers called every 20 iterations and at the end."""
    model = TinyDetector()
    optimizer = sgd(model)
    scheduler = torch_multistep(optimizer)
    writers = _writers(E, R, 25)
    data = batches()
    with E.EventStorage(0) as storage:
        for data_batch, iteration in zip(data, range(0, 25)):
            storage.iter = iteration
            loss_dict = model(data_batch)
            losses = sum(loss_dict.values())
            loss_dict_reduced = {k: v.item() for k, v in loss_dict.items()}
            losses_reduced = sum(loss for loss in loss_dict_reduced.values())
            storage.put_scalars(total_loss=losses_reduced, **loss_dict_reduced)
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
            storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
            scheduler.step()
            if iteration - 0 > 5 and ((iteration + 1) % 20 == 0 or iteration == 24):
                for writer in writers:
                    writer.write()
        for writer in writers:
            writer.close()
        R.storage(storage)
    log.info("done")


def torch_multistep(optimizer):
    import torch

    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[10, 20], gamma=0.1)
