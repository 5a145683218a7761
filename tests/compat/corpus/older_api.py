"""Code written against detectron2 v0.1-v0.6 that still runs (or fails) on today's engine.

These trainers were copied from detectron2's older ``SimpleTrainer``/``DefaultTrainer`` and
``CommonMetricPrinter``: they call engine methods whose shape changed since (``_detect_anomaly``
is gone, ``DefaultTrainer`` wraps a ``SimpleTrainer`` instead of being one) or read the storage
as the old printer did."""

from __future__ import annotations

import datetime
import logging
import time

import numpy as np
import torch

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd


@pattern(
    "ChenhongyiYang/QueryDet-PyTorch",
    "apex_tools/apex_trainer.py: ApexTrainer.run_step",
)
def oa_querydet_apex_trainer_detect_anomaly(E, R):
    """QueryDet's ``ApexTrainer``, written for detectron2 v0.2.1: a ``SimpleTrainer`` subclass
    that calls ``SimpleTrainer.__init__(model, data_loader, optimizer)`` positionally, sets
    ``max_iter`` itself, registers ``IterationTimer``, ``LRScheduler``, ``PeriodicCheckpointer``
    and ``PeriodicWriter(self.build_writers())`` (the default period), and runs its own
    ``train()`` loop inside an ``EventStorage``. Its ``run_step`` (v0.2's body) reads
    ``next(self._data_loader_iter)`` and then calls ``self._detect_anomaly(losses, loss_dict)``,
    which detectron2 removed in v0.3: on today's detectron2 the first step raises
    ``AttributeError`` (the repository's issue #33), and ``after_train`` still runs the
    writers on an empty storage."""

    class ApexTrainer(E.SimpleTrainer):
        def __init__(self, model, data_loader, optimizer, out):
            self.start_iter = 0
            self.iter = self.start_iter
            super().__init__(model, data_loader, optimizer)
            self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            self.checkpointer = E.Checkpointer(model, out, optimizer=optimizer)
            self.out = out
            self.max_iter = 6
            self.register_hooks(self.build_hooks())

        def build_hooks(self):
            return [
                E.hooks.IterationTimer(),
                E.hooks.LRScheduler(self.optimizer, self.scheduler),
                E.hooks.PeriodicCheckpointer(self.checkpointer, 4),
                E.hooks.PeriodicWriter(self.build_writers()),
            ]

        def build_writers(self):
            return [
                E.CommonMetricPrinter(self.max_iter),
                E.JSONWriter(R.path("metrics.json")),
            ]

        def train(self):
            logger = logging.getLogger("corpus.querydet")
            logger.info("Starting training from iteration {}".format(self.start_iter))
            start_iter, max_iter = self.start_iter, self.max_iter
            self.iter = start_iter
            with E.EventStorage(start_iter) as self.storage:
                try:
                    self.before_train()
                    for self.iter in range(start_iter, max_iter):
                        self.before_step()
                        self.run_step()
                        self.after_step()
                finally:
                    self.after_train()

        def run_step(self):
            assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            loss_dict = self.model(data)
            losses = sum(loss for loss in loss_dict.values())
            self._detect_anomaly(losses, loss_dict)
            metrics_dict = loss_dict
            metrics_dict["data_time"] = data_time
            self._write_metrics(metrics_dict)
            self.optimizer.zero_grad()
            losses.backward()
            self.optimizer.step()

    model = TinyDetector()
    trainer = ApexTrainer(model, batches(), sgd(model), R.path("ckpt", "x"))
    try:
        trainer.train()
    finally:
        R.storage(trainer.storage)
        R.rec("iter", trainer.iter, "lr", trainer.optimizer.param_groups[0]["lr"])


@pattern(
    "ubc-vision/UniT",
    "engine/defaults.py: DefaultTrainer.run_step (issue #1; detectron2 issue #3483)",
)
def oa_unit_defaulttrainer_reads_own_loader_iter(E, R):
    """A trainer written when ``DefaultTrainer`` was a ``SimpleTrainer`` subclass (detectron2
    v0.2.1 and older): its ``run_step`` reads ``next(self._data_loader_iter)`` and writes with
    ``self._write_metrics(loss_dict, data_time)`` on itself. Since v0.3 ``DefaultTrainer`` is a
    ``TrainerBase`` that keeps a ``SimpleTrainer`` in ``self._trainer``, so the first step raises
    ``AttributeError: 'Trainer' object has no attribute '_data_loader_iter'`` (UniT's issue #1,
    detectron2's #3483). Modelled with detectron2's own shape: ``TrainerBase.__init__``, a
    ``SimpleTrainer`` in ``self._trainer``, hooks registered on the outer trainer and
    ``train(start_iter, max_iter)``; the writer runs once more in ``after_train``."""

    class Trainer(E.TrainerBase):
        def __init__(self, model, data_loader, optimizer):
            super().__init__()
            self._trainer = E.SimpleTrainer(model, data_loader, optimizer)
            self.register_hooks(
                [
                    E.hooks.IterationTimer(),
                    E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=2),
                ]
            )

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        def run_step(self):
            assert self.model.training, "[Trainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
            self._write_metrics(loss_dict, data_time)
            self.optimizer.zero_grad()
            losses.backward()
            self.optimizer.step()

    model = TinyDetector()
    trainer = Trainer(model, batches(), sgd(model))
    try:
        trainer.train(0, 5)
    finally:
        R.storage(trainer.storage)
        R.rec("iters", trainer.iter, trainer._trainer.iter)


@pattern(
    "facebookresearch/detectron2",
    "v0.1 detectron2/utils/events.py: CommonMetricPrinter.write, kept in printer subclasses",
)
def oa_v01_printer_write_in_subclass(E, R):
    """A ``CommonMetricPrinter(max_iter)`` subclass whose ``write()`` is detectron2 v0.1's:
    ``storage.history("data_time").avg(20)``, ``storage.history("time").global_avg()`` and an
    ETA from ``history("time").median(1000)`` put back as ``eta_seconds`` with
    ``smoothing_hint=False`` (all inside ``except KeyError``, since the first writes come
    before ``IterationTimer`` has a time), ``history("lr").latest()`` and the ``median(20)``
    of every ``loss`` history, logged on the printer's own ``self.logger`` with
    ``self._max_iter``. It is driven by a ``SimpleTrainer(model, data_loader, optimizer)``
    whose hooks are ``IterationTimer``, a hook putting ``lr`` with ``smoothing_hint=False`` and
    ``PeriodicWriter([printer, JSONWriter], period=3)``; a v0.1-style ``run_step`` override puts
    its numpy-float metrics with ``storage.put_scalars(**metrics_dict)``. After training the
    script reads ``trainer.storage.history("total_loss").latest()``."""

    class OldPrinter(E.CommonMetricPrinter):
        def write(self):
            storage = E.get_event_storage()
            iteration = storage.iter
            data_time, iter_time = None, None
            eta_string = "N/A"
            try:
                data_time = storage.history("data_time").avg(20)
                iter_time = storage.history("time").global_avg()
                eta_seconds = storage.history("time").median(1000) * (self._max_iter - iteration)
                storage.put_scalar("eta_seconds", eta_seconds, smoothing_hint=False)
                eta_string = str(datetime.timedelta(seconds=int(eta_seconds)))
            except KeyError:
                pass
            try:
                lr = "{:.6f}".format(storage.history("lr").latest())
            except KeyError:
                lr = "N/A"
            losses = "  ".join(
                "{}: {:.3f}".format(k, v.median(20))
                for k, v in storage.histories().items()
                if "loss" in k
            )
            self.logger.info(
                "eta: {}  iter: {}  {}  {}  {}  lr: {}".format(
                    eta_string,
                    iteration,
                    losses,
                    "time: {:.4f}".format(iter_time) if iter_time is not None else "",
                    "data_time: {:.4f}".format(data_time) if data_time is not None else "",
                    lr,
                )
            )

    class LrWriter(E.HookBase):
        def after_step(self):
            lr = self.trainer.optimizer.param_groups[0]["lr"]
            self.trainer.storage.put_scalar("lr", lr, smoothing_hint=False)

    class OldTrainer(E.SimpleTrainer):
        def run_step(self):
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
            all_metrics_dict = E.comm.gather({k: v.item() for k, v in loss_dict.items()})
            metrics_dict = {
                k: np.mean([x[k] for x in all_metrics_dict]) for k in all_metrics_dict[0]
            }
            self.storage.put_scalar("data_time", data_time)
            self.storage.put_scalar("total_loss", sum(metrics_dict.values()))
            self.storage.put_scalars(**metrics_dict)
            self.optimizer.zero_grad()
            losses.backward()
            self.optimizer.step()

    model = TinyDetector()
    optimizer = sgd(model)
    trainer = OldTrainer(model, batches(), optimizer)
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            LrWriter(),
            E.hooks.PeriodicWriter([OldPrinter(7), E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    trainer.train(0, 7)
    R.storage(trainer.storage)
    R.rec("total_loss", trainer.storage.history("total_loss").latest())
    R.rec("eta_seconds" in trainer.storage.histories(), trainer.storage.history("lr").values())
    log.info("trained to %d", trainer.iter)
