"""The hook API at its edges: hooks registered on one trainer and called by another, callback
hooks for ``before_train``/``before_step``, hooks without ``super().__init__()``, a failure in
``before_train``, detectron2's profiler hooks."""

from __future__ import annotations

import logging
import types
import weakref

import torch

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd

# --- DL4NLP_project (DiffusionDet on audio) --------------------------------------------------


@pattern(
    "Lotto98/DL4NLP_project",
    "train_net.py: Trainer.__init__ (self._trainer._hooks = self._hooks), GradientWriter",
)
def ha_dl4nlp_shared_hook_list_after_backward(E, R):
    """The repo's DiffusionDet ``Trainer`` (a ``DefaultTrainer`` subclass) skips
    ``DefaultTrainer.__init__`` (``super(DefaultTrainer, self).__init__()``, i.e.
    ``TrainerBase``'s), builds the wrapped ``SimpleTrainer(..., zero_grad_before_forward=True)``,
    a checkpointer holding ``trainer=weakref.proxy(self)``, registers its ``build_hooks()``, and
    then makes the wrapped trainer share the hook list: ``self._trainer._hooks = self._hooks``,
    so that the wrapped trainer's ``after_backward()`` (called from its ``run_step``) reaches
    the registered hooks. Among them, ``GradientWriter`` (a ``HookBase`` whose ``__init__``
    does not call ``super().__init__()``) reads every trainable parameter's mean in
    ``after_backward`` at ``get_event_storage().iter`` and logs parameters whose mean did not
    change. Stand-ins: the values go to a list instead of its own ``SummaryWriter`` (which the
    repo never closes); the evaluation returns a scripted metric; no ``CommonMetricPrinter``
    (whose lines would interleave with the ``PeriodicCheckpointer``'s, which runs last in
    hookloop, docs/differences.md)."""

    cfg = types.SimpleNamespace(MAX_ITER=6, CHECKPOINT_PERIOD=3, EVAL_PERIOD=3, OUTPUT_DIR=R.out)
    written = []

    class GradientWriter(E.HookBase):
        def __init__(self, output_dir, model):
            self.logger = logging.getLogger("corpus.dl4nlp.gradients")
            self.model = model
            self.output_dir = output_dir
            self.prev_weights = {}

        def _do_gradient_norm(self):
            threshold = 0
            it = E.get_event_storage().iter
            for name, param in self.model.named_parameters():
                if not param.requires_grad:
                    continue
                mean = param.mean().item()
                written.append((f"weights/{name}", mean, it))
                if name in self.prev_weights:
                    if abs(mean - self.prev_weights[name]) <= threshold:
                        self.logger.info(f"{name} has constant weights.")
                        self.prev_weights[name] = mean
                else:
                    self.prev_weights[name] = mean

        def after_backward(self):
            self._do_gradient_norm()

        def close(self):
            pass

    evaluations = iter([0.25, 0.5, 0.4])

    class Trainer(E.TrainerBase):
        def __init__(self, cfg):
            super().__init__()  # the grandfather's __init__, not DefaultTrainer's
            model = TinyDetector()
            optimizer = sgd(model)
            data_loader = batches(seed=11)
            self._trainer = E.SimpleTrainer(
                model, data_loader, optimizer, zero_grad_before_forward=True
            )
            self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            self.checkpointer = E.Checkpointer(model, cfg.OUTPUT_DIR, trainer=weakref.proxy(self))
            self.start_iter = 0
            self.max_iter = cfg.MAX_ITER
            self.cfg = cfg
            self._last_eval_results = None
            self.register_hooks(self.build_hooks())
            self._trainer._hooks = self._hooks

        # DefaultTrainer forwards these to the wrapped trainer.
        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        @property
        def data_loader(self):
            return self._trainer.data_loader

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

        def build_hooks(self):
            ret = [
                E.hooks.IterationTimer(),
                E.hooks.LRScheduler(),
                E.hooks.PeriodicCheckpointer(self.checkpointer, self.cfg.CHECKPOINT_PERIOD),
                GradientWriter(self.cfg.OUTPUT_DIR, self.model),
            ]

            def test_and_save_results():
                self._last_eval_results = {"AP@0.75": next(evaluations)}
                return self._last_eval_results

            ret.append(E.hooks.EvalHook(self.cfg.EVAL_PERIOD, test_and_save_results))
            ret.append(E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=1))
            return ret

    trainer = Trainer(cfg)
    R.rec("shared", trainer._trainer._hooks is trainer._hooks)
    trainer.train(trainer.start_iter, trainer.max_iter)
    R.rec("written", written)
    R.rec("iters", trainer.iter, trainer._trainer.iter, trainer._last_eval_results)
    R.storage(trainer.storage)


# --- d2go: do_train's hook list -------------------------------------------------------------


class _KMeansDetector(TinyDetector):
    """A detector whose anchors start as a placeholder of infinities, which training refuses
    (d2go's ``KMeansAnchorGenerator``) until a ``before_train`` hook computes them."""

    def __init__(self, num_clusters=2):
        super().__init__()
        self.register_buffer("cell_anchors", torch.full((num_clusters, 4), float("inf")))

    def update_cell_anchors(self, computed):
        self.cell_anchors.data = torch.tensor(computed, dtype=torch.float32)
        log.info("Updated cell anchors")

    def forward(self, batch):
        assert torch.isfinite(self.cell_anchors).all(), "The anchors are not initialized yet"
        losses = super().forward(batch)
        if self.training:
            losses["loss_anchor"] = (self.cell_anchors.mean() - 1.0).abs() * 0.01
        return losses


def _d2go_do_train(E, R, model):
    """d2go's ``Detectron2GoRunner.do_train`` hook list with ``MODEL_EMA`` (``AFTER_BACKWARD``),
    ``KMEANS_ANCHORS`` and ``QUANTIZATION.QAT`` on, and a registry function adding a
    ``D2GoGpuMemorySnapshot``."""

    cfg = types.SimpleNamespace(
        MAX_ITER=8,
        EVAL_PERIOD=4,
        KMEANS_ON=True,
        KMEANS_NUM_TRAINING_IMG=6,
        EMA_DECAY=0.5,
        EMA_AFTER_BACKWARD=True,
        QAT_START_ITER=2,
        QAT_ENABLE_OBSERVER_ITER=3,
        QAT_DISABLE_OBSERVER_ITER=5,
        QAT_FREEZE_BN_ITER=4,
        QAT_UPDATE_OBSERVER_STATS_PERIOD=3,
    )
    logger = logging.getLogger("corpus.d2go.runner")
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[5], gamma=0.1)
    trainer = E.SimpleTrainer(model, batches(seed=21), optimizer)

    # d2go/modeling/ema.py: EMAHook (the EMA state lives on the model, no super().__init__()).
    class EMAHook(E.HookBase):
        def __init__(self, cfg, model):
            self.model = model
            self.decay = cfg.EMA_DECAY
            self.is_after_backward = cfg.EMA_AFTER_BACKWARD
            model.ema_state = {}

        def before_train(self):
            if not self.model.ema_state:
                self.model.ema_state.update(
                    {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                )

        def after_backward(self):
            if not self.is_after_backward:
                return
            self._update()

        def after_step(self):
            if self.is_after_backward:
                return
            self._update()

        def _update(self):
            if not self.model.train:  # a bound method: always true, as in d2go
                return
            with torch.no_grad():
                for k, v in self.model.state_dict().items():
                    ema = self.model.ema_state[k]
                    ema.copy_(ema * self.decay + v * (1.0 - self.decay))

    # d2go/modeling/kmeans_anchors.py: compute_kmeans_anchors_hook
    def compute_kmeans_anchors_hook(cfg):
        def before_train_callback(trainer):
            if not cfg.KMEANS_ON:
                return
            loader = batches(seed=5)
            sizes = torch.cat([next(loader) for _ in range(cfg.KMEANS_NUM_TRAINING_IMG // 3)])
            logger.info("Collected {} boxes from {} images".format(len(sizes), 6))
            centers = sizes.abs().mean(0)
            widths = (float(centers[0]), float(centers[1]))
            anchors = [[-0.5 * c, -0.5 * c, 0.5 * c, 0.5 * c] for c in widths]
            assert isinstance(trainer.model, _KMeansDetector)
            trainer.model.update_cell_anchors(anchors)

        return E.hooks.CallbackHook(before_train=before_train_callback)

    def after_step_callback(trainer):
        trainer.storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
        scheduler.step()

    # default_runner.py: _create_qat_hook (the fake-quant switches as module attributes)
    def create_qat_hook(cfg):
        applied = {
            "enable_fake_quant": False,
            "enable_observer": False,
            "disable_observer": False,
            "freeze_bn_stats": False,
        }

        def switch(name, value):
            def fn(module):
                setattr(module, name, value)

            return fn

        def qat_before_step_callback(trainer):
            if not applied["enable_fake_quant"] and trainer.iter >= cfg.QAT_START_ITER:
                logger.info("[QAT] enable fake quant to start QAT, iter = {}".format(trainer.iter))
                trainer.model.apply(switch("fake_quant", True))
                applied["enable_fake_quant"] = True
            if (
                not applied["enable_observer"]
                and trainer.iter >= cfg.QAT_ENABLE_OBSERVER_ITER
                and trainer.iter < cfg.QAT_DISABLE_OBSERVER_ITER
            ):
                logger.info("[QAT] enable observer, iter = {}".format(trainer.iter))
                trainer.model.apply(switch("observer", True))
                applied["enable_observer"] = True
            if not applied["disable_observer"] and trainer.iter >= cfg.QAT_DISABLE_OBSERVER_ITER:
                logger.info(
                    "[QAT] disabling observer for sub seq iters, iter = {}".format(trainer.iter)
                )
                trainer.model.apply(switch("observer", False))
                applied["disable_observer"] = True
            if not applied["freeze_bn_stats"] and trainer.iter >= cfg.QAT_FREEZE_BN_ITER:
                logger.info("[QAT] freezing BN for subseq iters, iter = {}".format(trainer.iter))
                applied["freeze_bn_stats"] = True
            if (
                applied["enable_fake_quant"]
                and trainer.iter % cfg.QAT_UPDATE_OBSERVER_STATS_PERIOD == 0
            ):
                logger.info(f"[QAT] updating observers, iter = {trainer.iter}")

        return E.hooks.CallbackHook(before_step=qat_before_step_callback)

    # d2go/runner/training_hooks.py: D2GoGpuMemorySnapshot (no super().__init__(); its own
    # step counter next to trainer.iter). The snapshot functions write a line each.
    class D2GoGpuMemorySnapshot(E.HookBase):
        def __init__(self, output_dir, log_n_steps=3, log_during_train_at=550):
            self.output_dir = output_dir
            self.step = 0
            self.log_n_steps = log_n_steps
            self.log_during_train_at = log_during_train_at

        def before_step(self):
            if self.trainer.iter == self.log_during_train_at:
                logger.info(f"record memory history at iter {self.trainer.iter}")

        def after_step(self):
            if self.step == self.log_n_steps - 1:
                self._snapshot(f"iter{self.trainer.iter}")
            if self.trainer.iter == self.log_during_train_at + self.log_n_steps - 1:
                self._snapshot(f"iter{self.trainer.iter}")
            self.step += 1

        def _snapshot(self, prefix):
            with open(R.path(self.output_dir, f"{prefix}_snapshot.txt"), "w") as f:
                f.write(f"step {self.step} iter {self.trainer.iter}\n")

    def add_memory_snapshot(hooks, cfg):
        hooks.append(D2GoGpuMemorySnapshot("memory", log_n_steps=2, log_during_train_at=4))

    trainer_hooks_registry = [("memory_snapshot", add_memory_snapshot)]

    def update_hooks_from_registry(hooks, cfg):
        for name, hook_func in trainer_hooks_registry:
            logger.info(f"Update trainer hooks from {name}...")
            hook_func(hooks, cfg)

    def do_test():
        ema_norm = float(sum(v.norm() for v in model.ema_state.values()))
        return {"bbox": {"AP": round(ema_norm, 6)}, "iter": trainer.iter}

    trainer_hooks = [
        E.hooks.IterationTimer(),
        EMAHook(cfg, model),
        None,  # _create_data_loader_hook
        E.hooks.CallbackHook(after_step=after_step_callback),
        E.hooks.EvalHook(cfg.EVAL_PERIOD, do_test),
        compute_kmeans_anchors_hook(cfg),
        create_qat_hook(cfg),
    ]
    writers = [E.CommonMetricPrinter(cfg.MAX_ITER), E.JSONWriter(R.path("metrics.json"))]
    trainer_hooks.append(E.hooks.PeriodicWriter(writers))
    update_hooks_from_registry(trainer_hooks, cfg)
    trainer.register_hooks(trainer_hooks)
    R.rec("registered", [type(h).__name__ for h in trainer._hooks])
    try:
        trainer.train(0, cfg.MAX_ITER)
    finally:
        R.rec("anchors", model.cell_anchors if hasattr(model, "cell_anchors") else None)
        R.rec("ema", sorted(model.ema_state), [v for v in model.ema_state.values()][:2])
        R.rec("qat", [getattr(m, "fake_quant", None) for m in model.modules()])
        R.rec("observer", [getattr(m, "observer", None) for m in model.modules()])
        R.rec("iter", trainer.iter, "lr", optimizer.param_groups[0]["lr"])
        R.storage(trainer.storage)


@pattern(
    "facebookresearch/d2go",
    "d2go/runner/default_runner.py: do_train; kmeans_anchors.py; training_hooks.py",
)
def ha_d2go_callbacks_and_registry_hooks(E, R):
    """d2go's ``do_train`` builds its hook list with ``None`` where a feature is off, an
    ``EMAHook`` that updates in ``after_backward`` (``MODEL_EMA.AFTER_BACKWARD``), a
    ``CallbackHook(after_step=...)`` for the LR, an ``EvalHook``, the k-means anchors hook (a
    ``CallbackHook(before_train=...)`` that reads ``trainer.model`` and replaces the anchors
    the model refuses to train with), the QAT hook (a ``CallbackHook(before_step=...)`` that
    switches fake quantization and observers by ``trainer.iter``), then passes the list to the
    registry functions, one of which appends ``D2GoGpuMemorySnapshot`` (no
    ``super().__init__()``, ``before_step`` reading ``trainer.iter``, its own step count).
    Stand-ins: k-means is the mean of the sampled sizes, the QAT switches are module
    attributes, memory snapshots are text files."""
    _d2go_do_train(E, R, _KMeansDetector())


@pattern(
    "facebookresearch/d2go",
    "d2go/modeling/kmeans_anchors.py: compute_kmeans_anchors_hook (assert in before_train)",
)
def ha_d2go_kmeans_assert_in_before_train(E, R):
    """The same ``do_train`` with ``KMEANS_ANCHORS_ON`` and a model without the k-means
    anchor generator: the hook's ``before_train`` callback fails its
    ``assert isinstance(...)`` after ``EMAHook.before_train`` ran. detectron2 logs the
    exception, runs every hook's ``after_train`` (the writers write and close, the timer
    logs), and the ``AssertionError`` reaches the caller; no step ran."""
    _d2go_do_train(E, R, TinyDetector())
