"""Training scripts and test suites that drive the engine: ``do_train`` functions of
``train_net.py``-style scripts, and detectron2's and fvcore's own tests of the engine."""

from __future__ import annotations

import json
import logging
import types

import numpy as np
import torch

from compat.harness import pattern

from ._common import TinyDetector, TinyRegressor, batches, log, sgd


def _default_writers(E, R, max_iter):
    """What ``detectron2.engine.default_writers(output_dir, max_iter)`` builds."""
    return [
        E.CommonMetricPrinter(max_iter),
        E.JSONWriter(R.path("metrics.json")),
        E.TensorboardXWriter(R.out),
    ]


def _file_writers(E, R):
    """``default_writers`` without its ``CommonMetricPrinter``: hookloop runs
    ``PeriodicCheckpointer.after_step`` after the other hooks' (README, "Training loop"), so
    at the last iteration the printer's line would come before "Saving checkpoint to
    model_final" instead of after it."""
    return [E.JSONWriter(R.path("metrics.json")), E.TensorboardXWriter(R.out)]


def _json(R, name="metrics.json"):
    with open(R.path(name)) as f:
        return [json.loads(line) for line in f if line.strip()]


class _SumModel(torch.nn.Module):
    """detectron2's tests' ``_SimpleModel``: one loss, the input's sum plus the parameters'
    means."""

    def __init__(self):
        super().__init__()
        self.mod = torch.nn.Linear(3, 2)

    def forward(self, x):
        return {"loss": x.sum() + sum(p.mean() for p in self.parameters())}


def _rand_loader():
    g = torch.Generator().manual_seed(3)
    while True:
        yield torch.rand(3, 3, generator=g)


def _lazy_cfg(out, max_iter, eval_period, log_period, period):
    """The ``train`` node of detectron2's ``configs/common/train.py``, shrunk."""
    train = types.SimpleNamespace(
        output_dir=out,
        init_checkpoint="",
        max_iter=max_iter,
        amp=types.SimpleNamespace(enabled=False),
        checkpointer=dict(period=period, max_to_keep=100),
        eval_period=eval_period,
        log_period=log_period,
    )
    return types.SimpleNamespace(train=train)


@pattern("facebookresearch/detectron2", "tools/lazyconfig_train_net.py: do_train")
def ts_lazyconfig_do_train(E, R):
    """``do_train`` of detectron2's LazyConfig script: a ``SimpleTrainer`` (``AMPTrainer``
    when ``amp.enabled``), the hook list IterationTimer, LRScheduler over an fvcore
    multiplier (``WarmupParamScheduler``), PeriodicCheckpointer with ``max_to_keep``, EvalHook
    calling ``do_test`` (nested results, flattened into the storage) and PeriodicWriter
    over ``default_writers``' file writers; then ``resume_or_load(init_checkpoint,
    resume=False)`` and ``train(start_iter, max_iter)``."""
    cfg = _lazy_cfg(R.out, max_iter=12, eval_period=6, log_period=4, period=5)
    model = TinyDetector()
    optim = sgd(model)

    def do_test():
        model.eval()
        with torch.no_grad():
            score = float(model(torch.ones(2, 4)).sum())
        model.train()
        log.info("do_test score %.5f", score)
        return {"bbox": {"AP": score}}

    S = E.solver
    lr_multiplier = S.WarmupParamScheduler(
        S.MultiStepParamScheduler(values=[1.0, 0.1], milestones=[8], num_updates=12),
        warmup_length=3 / 12,
        warmup_factor=0.01,
    )
    trainer = (E.AMPTrainer if cfg.train.amp.enabled else E.SimpleTrainer)(model, batches(), optim)
    checkpointer = E.Checkpointer(model, cfg.train.output_dir, trainer=trainer)
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(scheduler=lr_multiplier),
            E.hooks.PeriodicCheckpointer(checkpointer, **cfg.train.checkpointer),
            E.hooks.EvalHook(cfg.train.eval_period, do_test),
            E.hooks.PeriodicWriter(_file_writers(E, R), period=cfg.train.log_period),
        ]
    )
    checkpointer.resume_or_load(cfg.train.init_checkpoint, resume=False)
    start_iter = 0
    trainer.train(start_iter, cfg.train.max_iter)
    R.rec("lr", [round(g["lr"], 8) for g in optim.param_groups])
    R.storage(trainer.storage)
    R.rec("iter", trainer.iter)


@pattern("SZUHvern/MaCo", "detectron2/tools/lazyconfig_train_net_rsna.py: do_train with --resume")
def ts_maco_do_train_resume(E, R):
    """MaCo's copy of the LazyConfig ``do_train``, run twice: the second run passes
    ``resume=True`` and, when ``checkpointer.has_checkpoint()``, starts at
    ``trainer.iter + 1`` (the checkpoint holds the iteration that just finished)."""

    def do_train(resume, max_iter):
        cfg = _lazy_cfg(R.out, max_iter=max_iter, eval_period=0, log_period=3, period=4)
        model = TinyRegressor()
        optim = sgd(model, lr=0.05)
        trainer = E.SimpleTrainer(model, batches(seed=5), optim)
        checkpointer = E.Checkpointer(model, cfg.train.output_dir, trainer=trainer, optimizer=optim)
        trainer.register_hooks(
            [
                E.hooks.IterationTimer(),
                E.hooks.LRScheduler(scheduler=E.solver.CosineParamScheduler(1.0, 0.0)),
                E.hooks.PeriodicCheckpointer(checkpointer, **cfg.train.checkpointer),
                E.hooks.EvalHook(cfg.train.eval_period, lambda: {}),
                # window_size=1: a resumed hookloop run smooths over the history restored
                # from the checkpoint (README, "exact resume"), detectron2's starts empty.
                E.hooks.PeriodicWriter(
                    [E.JSONWriter(R.path("metrics.json"), window_size=1)],
                    period=cfg.train.log_period,
                ),
            ]
        )
        checkpointer.resume_or_load(cfg.train.init_checkpoint, resume=resume)
        if resume and checkpointer.has_checkpoint():
            start_iter = trainer.iter + 1
        else:
            start_iter = 0
        R.rec("start_iter", resume, start_iter)
        trainer.train(start_iter, cfg.train.max_iter)
        R.rec("end", trainer.iter, [round(g["lr"], 8) for g in optim.param_groups])
        R.rec("latest", trainer.storage.latest())

    do_train(False, 9)
    do_train(True, 14)
    R.rec("last_checkpoint", open(R.path("last_checkpoint")).read())


@pattern("zkyntu/UnLanedet", "tools/train_net.py: do_train with BestCheckpointer")
def ts_unlanedet_do_train(E, R):
    """UnLanedet's ``do_train``: the LazyConfig hook list with ``None`` entries for hooks
    that only the main process runs, and a ``BestCheckpointer`` after the ``EvalHook`` that
    saves ``model_best`` when the evaluator's metric improves."""
    model = TinyDetector()
    optim = sgd(model)
    # The last score is not the best: hookloop's BestCheckpointer does not move
    # last_checkpoint (README, "Checkpoints and resume"), detectron2's does.
    scores = iter([0.2, 0.5, 0.4, 0.3])

    def do_test():
        return {"F1": next(scores)}

    trainer = E.SimpleTrainer(model, batches(seed=2), optim)
    checkpointer = E.Checkpointer(model, R.out, trainer=trainer)
    main = E.comm.is_main_process()
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(scheduler=E.solver.LinearParamScheduler(1.0, 0.1)),
            E.hooks.PeriodicCheckpointer(checkpointer, period=100) if main else None,
            E.hooks.EvalHook(4, do_test),
            E.hooks.BestCheckpointer(checkpointer=checkpointer, eval_period=4, val_metric="F1")
            if main
            else None,
            E.hooks.PeriodicWriter(_file_writers(E, R), period=4) if main else None,
        ]
    )
    checkpointer.resume_or_load("", resume=False)
    trainer.train(0, 16)
    R.rec("hooks", [type(h).__name__ for h in trainer._hooks])
    R.storage(trainer.storage)


@pattern(
    "thuml/Transfer-Learning-Library",
    "examples/domain_adaptation/object_detection/source_only.py: train",
)
def ts_tllib_source_only_train(E, R):
    """Transfer-Learning-Library's source-only detection training: no trainer; an
    ``EventStorage(start_iter)`` opened by hand, ``start_iter`` from
    ``resume_or_load(...).get("iteration", -1) + 1``, ``put_scalars`` of ``_s``-suffixed
    losses, ``lr`` unsmoothed, writers after iteration 5 every 20 iterations and at the end,
    and fvcore's ``PeriodicCheckpointer.step(iteration)`` with ``max_iter``."""
    model = TinyDetector()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)
    start_iter = checkpointer.resume_or_load("", resume=True).get("iteration", -1) + 1
    max_iter = 24
    periodic_checkpointer = E.PeriodicCheckpointer(checkpointer, 10, max_iter=max_iter)
    writers = _default_writers(E, R, max_iter)
    logger = logging.getLogger("corpus.tllib")
    logger.info("Starting training from iteration {}".format(start_iter))
    with E.EventStorage(start_iter) as storage:
        for data_s, iteration in zip(batches(seed=4), range(start_iter, max_iter)):
            storage.iter = iteration
            loss_dict_s = model(data_s)
            losses_s = sum(loss_dict_s.values())
            loss_dict_reduced_s = {"{}_s".format(k): v.item() for k, v in loss_dict_s.items()}
            losses_reduced_s = sum(loss for loss in loss_dict_reduced_s.values())
            storage.put_scalars(total_loss_s=losses_reduced_s, **loss_dict_reduced_s)
            optimizer.zero_grad()
            losses_s.backward()
            optimizer.step()
            storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
            scheduler.step()
            if iteration - start_iter > 5 and (
                (iteration + 1) % 20 == 0 or iteration == max_iter - 1
            ):
                for writer in writers:
                    writer.write()
            periodic_checkpointer.step(iteration)
        R.storage(storage)
    for writer in writers:
        writer.close()
    R.rec("json", _json(R))


@pattern("facebookresearch/detectron2", "tests/test_engine.py: test_writer_hooks")
def ts_d2_test_writer_hooks(E, R):
    """detectron2's writer-hook test: an ``EvalHook(0, ...)`` (evaluates only after the last
    iteration) before a ``PeriodicWriter`` of a ``CommonMetricPrinter`` and a ``JSONWriter``;
    metrics.json has iterations 19, 39, 49 and 50 (the eval metric in the last line), and the
    printer logs three lines, the last with ``eta: 0:00:00``."""
    model = _SumModel()
    trainer = E.SimpleTrainer(model, _rand_loader(), torch.optim.SGD(model.parameters(), 0.1))
    max_iter = 50
    writers = [E.CommonMetricPrinter(max_iter), E.JSONWriter(R.path("metrics.json"))]
    trainer.register_hooks(
        [E.hooks.EvalHook(0, lambda: {"metric": 100}), E.hooks.PeriodicWriter(writers)]
    )
    trainer.train(0, max_iter)
    data = _json(R)
    R.rec("iterations", [x["iteration"] for x in data])
    R.rec("metric in last", "metric" in data[-1])
    R.rec("printer logger", writers[0].logger.name.split(".")[-2:])


@pattern("facebookresearch/detectron2", "tests/test_engine.py: test_eval_hook")
def ts_d2_test_eval_hook_counts(E, R):
    """detectron2's EvalHook test: for (total_iter, period) of (30, 15), (31, 15), (20, 0) a
    new trainer over the same model and loader calls the eval function 2, 3 and 1 times."""
    model = _SumModel()
    dataloader = _rand_loader()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    for total_iter, period in [(30, 15), (31, 15), (20, 0)]:
        calls = []

        def test_func(calls=calls):
            calls.append(E.get_event_storage().iter)
            return {"metric": 3.0}

        trainer = E.SimpleTrainer(model, dataloader, opt)
        trainer.register_hooks([E.hooks.EvalHook(period, test_func)])
        trainer.train(0, total_iter)
        R.rec(total_iter, period, calls, trainer.storage.latest().get("metric"))


@pattern("facebookresearch/detectron2", "tests/test_engine.py: test_best_checkpointer")
def ts_d2_test_best_checkpointer(E, R):
    """detectron2's BestCheckpointer test: ``EvalHook`` and ``BestCheckpointer`` with the same
    period, ``mode`` max and min, a NaN first metric, and ``checkpointer.save`` patched with
    ``mock.patch.object`` to count the saves."""
    from unittest import mock

    model = _SumModel()
    dataloader = _rand_loader()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    cases = [
        ("max", [0.3, 0.4, 0.35, 0.5]),
        ("min", [1.0, 0.8, 0.9, 0.9]),
        ("min", [float("nan"), 0.8, 0.9, 0.9]),
    ]
    for mode, values in cases:
        metrics = iter(values)
        trainer = E.SimpleTrainer(model, dataloader, opt)
        checkpointer = E.Checkpointer(model, R.out, opt=opt, trainer=trainer)
        trainer.register_hooks(
            [
                E.hooks.EvalHook(5, lambda metrics=metrics: {"metric": next(metrics)}),
                E.hooks.BestCheckpointer(5, checkpointer, "metric", mode=mode),
            ]
        )
        with mock.patch.object(checkpointer, "save") as mock_save_method:
            trainer.train(0, 20)
            R.rec(mode, mock_save_method.call_count, [c.args for c in mock_save_method.mock_calls])


@pattern(
    "facebookresearch/detectron2", "tests/test_events.py: testScalar, testScalarMismatchedPeriod"
)
def ts_d2_test_events_json(E, R):
    """detectron2's JSONWriter tests: unsmoothed scalars written every 20 steps, and a second
    scalar put every 17 steps, so metrics.json gets lines for iterations 17, 19, 34, 39, 51
    and 59 with only the scalars new since the last write."""
    with E.EventStorage() as storage:
        writer = E.JSONWriter(R.path("a.jsonl"))
        for k in range(60):
            storage.put_scalar("key", k, smoothing_hint=False)
            if (k + 1) % 20 == 0:
                writer.write()
            storage.step()
        writer.close()
    with E.EventStorage() as storage:
        writer = E.JSONWriter(R.path("b.jsonl"))
        for k in range(60):
            if k % 17 == 0:
                storage.put_scalar("key2", k, smoothing_hint=False)
            storage.put_scalar("key", k, smoothing_hint=False)
            if (k + 1) % 20 == 0:
                writer.write()
            storage.step()
        writer.close()
        R.rec([int(d["iteration"]) for d in _json(R, "b.jsonl")])


@pattern("facebookresearch/detectron2", "tests/test_events.py: testPrintETA, testPrintNonLosses")
def ts_d2_test_events_printer(E, R):
    """detectron2's printer tests: two steps of ``time`` (and a ``[metric]`` scalar) in a bare
    storage; a printer with ``max_iter`` logs an ETA, one without does not, and ``[metric]``
    names are printed beside the losses."""
    with E.EventStorage() as s:
        p1 = E.CommonMetricPrinter(10)
        p2 = E.CommonMetricPrinter()
        for _ in range(2):
            s.put_scalar("time", 1.0)
            s.put_scalar("[metric]bn_stat", 1.0)
            s.put_scalar("loss_x", 0.25)
            s.step()
        p1.write()
        p2.write()
        R.rec("eta_seconds", s.latest().get("eta_seconds"))
        R.storage(s)


class MockHistory:
    """A test double for a ``HistoryBuffer``: fixed (value, iteration) pairs, with the
    statistics the writers read computed from them."""

    def __init__(self, pairs):
        self._pairs = list(pairs)

    def values(self):
        return list(self._pairs)

    def latest(self):
        return self._pairs[-1][0]

    def median(self, window_size):
        return float(np.median([v for v, _ in self._pairs[-window_size:]]))

    def avg(self, window_size):
        return float(np.mean([v for v, _ in self._pairs[-window_size:]]))

    def global_avg(self):
        return float(np.mean([v for v, _ in self._pairs]))


@pattern(
    "facebookresearch/detectron2",
    "tests/test_events.py style: CommonMetricPrinter over histories that are test doubles",
)
def ts_d2_printer_mock_history(E, R):
    """A printer test in the style of detectron2's ``tests/test_events.py`` that fixes the
    timing instead of sleeping: after real puts of ``time``/``data_time``/``loss``,
    ``storage.histories()[name] = MockHistory(...)`` (and the same through the private
    ``storage._history``) replaces their histories with test doubles, so the printer's times
    and ETA, and the JSONWriter's smoothed values, come from the doubles."""
    with E.EventStorage(0) as s:
        for i in range(3):
            s.put_scalars(time=0.5, data_time=0.1, loss=1.0 / (i + 1))
            s.step()
        s.iter = 2
        s.histories()["time"] = MockHistory([(2.0, 0), (2.0, 1), (2.0, 2)])
        s._history["data_time"] = MockHistory([(0.25, 0), (0.75, 1), (0.5, 2)])
        s.histories()["loss"] = MockHistory([(4.0, 0), (3.0, 1), (1.0, 2)])
        printer = E.CommonMetricPrinter(10)
        writer = E.JSONWriter(R.path("metrics.json"), window_size=2)
        printer.write()
        writer.write()
        writer.close()
        R.rec("time", s.history("time").global_avg(), s.history("time").latest())
        R.rec("eta_seconds", s.latest()["eta_seconds"])
        R.rec("loss median", s.history("loss").median(2))


@pattern("facebookresearch/fvcore", "tests/test_common.py: TestHistoryBuffer.test_buffer")
def ts_fvcore_history_buffer(E, R):
    """fvcore's HistoryBuffer test: buffers of random lengths filled with random ints keep
    the last ``buffer_len`` values with iterations counted from 0, and their ``global_avg``
    covers every value while ``median``/``avg`` cover the last ``w``."""
    rng = np.random.RandomState(42)
    gt_len = 200
    for _ in range(6):
        buffer_len = int(rng.randint(1, gt_len))
        values = rng.randint(1000, size=gt_len)
        buf = E.HistoryBuffer(buffer_len)
        for v in values:
            buf.update(v)
        vals, iterations = zip(*buf.values())
        R.rec(
            buffer_len,
            len(vals),
            bool((np.array(vals) == values[-buffer_len:]).all()),
            [int(i) for i in iterations[:3]],
            round(buf.global_avg() - float(values.mean()), 9),
            buf.median(100),
            buf.avg(100),
        )


@pattern("jojo23333/LatetHOI", "projects/mdm_hand/engine/default_vae.py: CustomTrainingHooks")
def ts_latethoi_epoch_hooks(E, R):
    """LatetHOI's training hook: it skips ``HookBase.__init__``, reads ``iter`` through a
    property of its own (``self.trainer.iter``) and derives epoch boundaries from
    ``len(self.trainer.train_loader)``: at the first step of an epoch it puts a coefficient
    and logs it, at the last it puts epoch metrics unsmoothed. The trainer's ``run_step``
    copies ``self.iter`` onto the trainer that does the step, as its wrapper does."""

    class CustomTrainingHooks(E.HookBase):
        def __init__(self):
            pass

        @property
        def iter(self):
            return self.trainer.iter

        @property
        def end_of_epoch(self):
            return (self.iter + 1) % len(self.trainer.train_loader) == 0

        @property
        def begin_of_epoch(self):
            return self.iter % len(self.trainer.train_loader) == 0

        @property
        def epoch_num(self):
            return self.iter // len(self.trainer.train_loader)

        def before_step(self):
            if self.begin_of_epoch:
                kl_coef = min(0.5 * (self.epoch_num + 1) / 2, 0.5)
                self.trainer.storage.put_scalar("KL Coeficient", kl_coef)
                logging.getLogger("corpus.latethoi").info("KL Coeficient: {}".format(kl_coef))

        def after_step(self):
            if self.end_of_epoch:
                self.trainer.storage.put_scalars(
                    train_roc_auc=0.5 + 0.1 * self.epoch_num,
                    epoch=float(self.epoch_num),
                    smoothing_hint=False,
                )

    train_loader = [b for b, _ in zip(batches(seed=6), range(4))]

    def cycle():
        while True:
            yield from train_loader

    model = TinyDetector()
    inner = E.SimpleTrainer(model, cycle(), sgd(model))

    class VaeTrainer(E.TrainerBase):
        def __init__(self):
            super().__init__()
            self.train_loader = train_loader
            self._trainer = inner

        def run_step(self):
            self._trainer.iter = self.iter
            self._trainer.run_step()

    trainer = VaeTrainer()
    trainer.register_hooks(
        [
            CustomTrainingHooks(),
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=4),
        ]
    )
    trainer.train(0, 12)
    R.storage(trainer.storage)
    R.rec("inner iter", inner.iter)


@pattern(
    "JulietteMoreau/Medical_Segmentation_Benchmark",
    "MRCNN/detectron2/engine/val_loss_hook.py + MRCNN/evaluation/plot_loss_curve.py",
)
def ts_medseg_val_loss_curve(E, R):
    """A Mask R-CNN benchmark's ``ValLossHook``: after every step it runs the model on a
    validation batch under ``no_grad`` and puts ``val_``-prefixed losses and their sum into
    ``self.trainer.storage``; the repository's plotting script then reads metrics.json and
    averages ``total_loss`` and the validation loss per epoch of a fixed number of
    iterations."""

    class ValLossHook(E.HookBase):
        def __init__(self):
            super().__init__()
            self._loader = batches(seed=9)

        def after_step(self):
            data = next(self._loader)
            with torch.no_grad():
                loss_dict = self.trainer.model(data)
                losses = sum(loss_dict.values())
                assert torch.isfinite(losses).all(), loss_dict
                loss_dict_reduced = {"val_" + k: v.item() for k, v in loss_dict.items()}
                losses_reduced = sum(loss for loss in loss_dict_reduced.values())
                if E.comm.is_main_process():
                    self.trainer.storage.put_scalars(
                        val_total_loss=losses_reduced, **loss_dict_reduced
                    )

    model = TinyDetector()
    trainer = E.SimpleTrainer(model, batches(seed=8), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            ValLossHook(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    trainer.train(0, 15)

    rows = sorted(_json(R), key=lambda d: d["iteration"])
    per_epoch = 6
    curves = {}
    for key in ("total_loss", "val_total_loss"):
        points = [(d["iteration"], d[key]) for d in rows if key in d]
        epochs = {}
        for it, v in points:
            epochs.setdefault(it // per_epoch, []).append(v)
        curves[key] = [round(float(np.mean(v)), 9) for _, v in sorted(epochs.items())]
    R.rec("curves", curves)
