"""Small public repositories of detectron2 users (course projects, theses, applied
detectors): ``DefaultTrainer`` subclasses whose ``build_hooks`` append, remove or insert
hooks of their own, early-stopping hooks that read ``storage.latest()`` tuples or a
validation loss put by the hook after them, and validation-loss hooks whose averages reach
the metric printer."""

from __future__ import annotations

import logging

import numpy as np
import torch

from compat.harness import pattern

from ._common import TinyDetector, batch_list, batches, sgd


def _default_hooks(E, R, trainer, checkpointer, eval_function, period, writer_period):
    """``DefaultTrainer.build_hooks`` for a stand-in config: timer, LR scheduler, periodic
    checkpointer (left out when ``checkpointer`` is None), evaluation and the writers (the
    printer and metrics.json) last."""
    hooks = [
        E.hooks.IterationTimer(),
        E.hooks.LRScheduler(trainer.optimizer, trainer.scheduler),
        E.hooks.PeriodicCheckpointer(checkpointer, period) if checkpointer else None,
        E.hooks.EvalHook(period, eval_function),
        E.hooks.PeriodicWriter(
            [E.CommonMetricPrinter(trainer.max_iter), E.JSONWriter(R.path("metrics.json"))],
            period=writer_period,
        ),
    ]
    return [h for h in hooks if h is not None]


def _trainer(E, max_iter, lr=0.05):
    model = TinyDetector()
    optimizer = sgd(model, lr=lr)
    trainer = E.SimpleTrainer(model, batches(), optimizer)
    trainer.scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [max_iter - 3], 0.1)
    trainer.max_iter = max_iter  # DefaultTrainer sets it from cfg.SOLVER.MAX_ITER
    return model, trainer


# --- beautifulv0id/Mask2Former ----------------------------------------------------------------


@pattern(
    "beautifulv0id/Mask2Former",
    "train_net.py: Trainer.build_hooks; mask2former/utils/early_stopping_hook.py: "
    "EarlyStoppingHook; mask2former/utils/log_masks_hook.py: LogPredMasksHook",
)
def ur_mask2former_early_stop_raises_after_train(E, R):
    """The fork's ``Trainer.build_hooks`` takes DefaultTrainer's hooks, appends a
    ``LogPredMasksHook`` (every ``period`` iterations it switches the model to eval, predicts
    masks for fixed samples and writes them under ``mask_vis/``, then switches back), drops
    the ``PeriodicCheckpointer`` and appends one with ``max_to_keep``, and appends its
    ``EarlyStoppingHook`` last. That hook checks at ``iter % period == 0`` (one iteration
    after the ``EvalHook``'s ``(iter + 1) % period``): it reads
    ``storage.latest().get("sem_seg/mIoU", -inf)``, skips anything that is not a
    ``(value, iteration)`` tuple or an iteration it already saw, counts evaluations without
    improvement, and once patience runs out only sets ``should_stop`` and prints; training
    goes on to ``max_iter`` and its ``after_train`` (the last hook's) raises
    ``StopIteration``, which leaves ``trainer.train()`` after the writers closed.
    Stand-ins: the mIoU values are scripted, the masks are the sign of the model's output
    written as text (the repo draws them with detectron2's Visualizer and cv2).
    ``PeriodicCheckpointer`` runs after the hooks registered behind it in hookloop
    (docs/differences.md); nothing here observes that order (the early-stopping hook saves
    nothing and prints to stdout, the checkpointer logs)."""

    class LogPredMasksHook(E.HookBase):
        def __init__(self, samples, period):
            self.period = period
            self.samples = samples
            self.model = None  # filled on first call

        def _run_once(self, it):
            was_training = self.model.training
            self.model.eval()
            with torch.no_grad():
                for idx, sample in enumerate(self.samples):
                    pred = (self.model(sample) > 0).int().flatten().tolist()
                    with open(R.path("mask_vis", f"iter{it:07d}_img{idx}.txt"), "w") as f:
                        f.write(" ".join(map(str, pred)) + "\n")
            if was_training:
                self.model.train()

        def after_step(self):
            it = self.trainer.iter
            if it % self.period == 0:
                if self.model is None:
                    self.model = self.trainer.model
                self._run_once(it)

    class EarlyStoppingHook(E.HookBase):
        def __init__(
            self, period=1000, patience=5, min_delta=0.0, metric_name="sem_seg/mIoU", higher=True
        ):
            super().__init__()
            self.period = period
            self.patience = patience
            self.min_delta = min_delta if higher else -min_delta
            self.metric_name = metric_name
            self.best_metric = -np.inf if higher else np.inf
            self.counter = 0
            self.should_stop = False
            self.last_eval_it = -1
            self.higher = higher

        def after_step(self):
            if self.should_stop:
                return
            it = self.trainer.iter
            if it % self.period != 0:  # only on evaluation steps
                return
            output = self.trainer.storage.latest().get(self.metric_name, -np.inf)
            R.rec("early stop reads", it, output)
            if not isinstance(output, tuple):
                return
            current, last_eval_it = output
            if self.last_eval_it == last_eval_it:
                return
            if self.higher:
                improved = current > self.best_metric + self.min_delta
            else:
                improved = current < self.best_metric - self.min_delta
            if improved:
                self.best_metric = current
                self.counter = 0
            else:
                self.counter += 1
                if self.counter >= self.patience:
                    self.should_stop = True
                    print(f"Early stopping triggered! No improvement in {self.metric_name}")
                    print(f"Best {self.metric_name}: {self.best_metric:.4f}")
            self.last_eval_it = last_eval_it

        def after_train(self):
            if self.should_stop:
                raise StopIteration("Early stopping triggered")

    scripted = iter([40.0, 42.0, 41.5, 41.9, 41.0])

    def eval_function():
        return {"sem_seg": {"mIoU": next(scripted), "fwIoU": 30.0}}

    max_iter, period = 9, 2
    model, trainer = _trainer(E, max_iter)
    checkpointer = E.Checkpointer(model, R.out, trainer=trainer)
    trainer.checkpointer = checkpointer
    hooks = _default_hooks(E, R, trainer, checkpointer, eval_function, period, writer_period=4)
    hooks.append(LogPredMasksHook(batch_list(2, seed=11, size=2), period=4))
    hooks = [h for h in hooks if not isinstance(h, E.hooks.PeriodicCheckpointer)]
    hooks.append(E.hooks.PeriodicCheckpointer(checkpointer, 3, max_to_keep=2))
    hooks.append(EarlyStoppingHook(period=period, patience=2, min_delta=0.001))
    trainer.register_hooks(hooks)
    R.rec("order", [type(h).__name__ for h in trainer._hooks])
    try:
        trainer.train(0, max_iter)
    except StopIteration as e:
        R.rec("train() raised StopIteration", str(e), trainer.iter)
    R.storage(trainer.storage)
    R.rec("latest after train", trainer.storage.latest())


# --- NINAnor/reindeerdrone -------------------------------------------------------------------


@pattern(
    "NINAnor/reindeerdrone",
    "src/train.py: ReindeerTrainer.build_hooks; src/hooks/early_stopping.py: "
    "EarlyStoppingHook; src/hooks/loss_eval.py: LossEvalHook",
)
def ur_reindeer_early_stop_before_loss_eval(E, R):
    """``ReindeerTrainer.build_hooks`` inserts, each at ``-1`` (before the writer), first the
    ``EarlyStoppingHook`` and then the ``LossEvalHook``: early stopping runs before the loss
    evaluation of its own iteration and reads the previous one. Every step it reads
    ``history("total_loss").latest()``, returns while ``"validation_loss"`` is not in
    ``storage.histories()``, and otherwise compares the latest validation loss with its best
    (a threshold): an improvement saves ``trainer.checkpointer.save(
    "best_model_iteration_<iter>")``; the same value read again at the next steps counts
    against the patience, so the counter runs up between evaluations. Out of patience it
    logs, saves ``model_iteration_<iter>_early_stopped`` only if no best model was saved,
    and sets ``stop_training``, which only its ``after_epoch`` reads: detectron2 never calls
    it, so training runs to ``max_iter``, logging the stop at every later step. The
    ``LossEvalHook`` puts ``validation_loss`` (numpy's mean over the loader) every
    ``eval_period`` and at the last iteration, and ``timetest=12`` every step.
    Stand-ins: the repo logs on the root logger (here a ``corpus`` logger) and its progress
    line uses ``log_every_n_seconds`` (left out: wall-clock); the checkpoint period is the
    stand-in config's. ``PeriodicCheckpointer`` runs after the other hooks in hookloop
    (docs/differences.md), so no best model is saved in an iteration where it saves:
    ``last_checkpoint`` would name the other file."""
    log = logging.getLogger("corpus.reindeer")

    class EarlyStoppingHook(E.HookBase):
        def __init__(self, patience, threshold=0.001):
            self.patience = patience
            self.threshold = threshold
            self.best_validation_loss = None
            self.counter = 0
            self.stop_training = False
            self.best_model_saved = False

        def after_step(self):
            storage = self.trainer.storage
            total_loss = storage.history("total_loss").latest()
            if "validation_loss" not in storage.histories():
                log.info("Validation loss not available yet. Skipping early stopping check.")
                return
            validation_loss = storage.history("validation_loss").latest()
            log.info(
                f"Training Loss (total_loss): {total_loss}, Validation Loss: {validation_loss}"
            )
            if (
                self.best_validation_loss is None
                or validation_loss < self.best_validation_loss - self.threshold
            ):
                self.best_validation_loss = validation_loss
                self.counter = 0
                self.trainer.checkpointer.save(f"best_model_iteration_{self.trainer.iter}")
                self.best_model_saved = True
            else:
                self.counter += 1
            if self.counter >= self.patience:
                log.info(f"Stopping early at iteration {self.trainer.iter}.")
                if not self.best_model_saved:
                    self.trainer.checkpointer.save(
                        f"model_iteration_{self.trainer.iter}_early_stopped"
                    )
                self.stop_training = True

        def after_epoch(self):  # never called by detectron2's trainers
            if self.stop_training:
                raise StopIteration

    class LossEvalHook(E.HookBase):
        def __init__(self, eval_period, model, data_loader):
            self._model = model
            self._period = eval_period
            self._data_loader = data_loader

        def _get_loss(self, data):
            metrics_dict = self._model(data)
            metrics_dict = {
                k: v.detach().cpu().item() if isinstance(v, torch.Tensor) else float(v)
                for k, v in metrics_dict.items()
            }
            return sum(loss for loss in metrics_dict.values())

        def _do_loss_eval(self):
            losses = [self._get_loss(inputs) for inputs in self._data_loader]
            self.trainer.storage.put_scalar("validation_loss", np.mean(losses))
            E.comm.synchronize()
            return losses

        def after_step(self):
            next_iter = self.trainer.iter + 1
            is_final = next_iter == self.trainer.max_iter
            if is_final or (self._period > 0 and next_iter % self._period == 0):
                self._do_loss_eval()
            self.trainer.storage.put_scalars(timetest=12)

    max_iter = 8
    model, trainer = _trainer(E, max_iter, lr=0.2)
    trainer.checkpointer = E.Checkpointer(model, R.out, trainer=trainer)

    def eval_function():
        return {}

    hooks = _default_hooks(E, R, trainer, None, eval_function, 100, 3)
    hooks.insert(-1, EarlyStoppingHook(patience=2, threshold=0.001))
    hooks.insert(-1, LossEvalHook(3, model, batch_list(2, seed=13)))
    trainer.register_hooks(hooks)
    trainer.train(0, max_iter)
    early = trainer._hooks[-3]
    R.rec("early stopping", early.counter, early.stop_training, early.best_validation_loss)
    R.rec("last_checkpoint", trainer.checkpointer.get_checkpoint_file())
    R.storage(trainer.storage)


# --- geo-stack/geostackai --------------------------------------------------------------------


@pattern("geo-stack/geostackai", "geostackai/trainer.py: ValLossHook, Trainer.build_hooks")
def ur_geostack_val_losses_reach_printer(E, R):
    """``Trainer.build_hooks`` inserts a ``ValLossHook`` before DefaultTrainer's writer. Every
    ``eval_period`` iterations and at the last one it runs the (training-mode) model over
    the whole validation loader under ``no_grad``, reduces each loss dict with
    ``comm.reduce_dict`` into ``val_*`` keys, and puts the column means of those rows, plus
    ``val_total_loss`` (their row sums' mean, last column) with one ``put_scalars``; every
    step it also puts ``timetest=12``. The writers are DefaultTrainer's: the printer (whose
    line takes every name with "loss" in it, so the sparse ``val_*`` losses are printed
    with the median of their recent values), metrics.json and TensorBoard. Stand-in: a
    pandas ``DataFrame`` and ``mean(axis=0).to_dict()`` (Python floats) computed with
    numpy; DefaultTrainer's ``PeriodicCheckpointer`` is left out (hookloop runs it after the
    writer, docs/differences.md, so its last "Saving checkpoint" line would follow the
    printer's instead of preceding it)."""

    class ValLossHook(E.HookBase):
        def __init__(self, eval_period, data_loader):
            super().__init__()
            self._eval_period = eval_period
            self._data_loader = data_loader

        def _do_loss_eval(self):
            with torch.no_grad():
                rows = []
                for data in self._data_loader:
                    loss_dict = self.trainer.model(data)
                    rows.append(
                        {"val_" + k: v.item() for k, v in E.comm.reduce_dict(loss_dict).items()}
                    )
                if E.comm.is_main_process():
                    columns = list(rows[0])
                    table = np.array([[row[c] for c in columns] for row in rows])
                    means = {c: float(m) for c, m in zip(columns, table.mean(axis=0))}
                    means["val_total_loss"] = float(table.sum(axis=1).mean())
                    self.trainer.storage.put_scalars(**means)

        def after_step(self):
            next_iter = self.trainer.iter + 1
            is_final = next_iter == self.trainer.max_iter
            is_period = self._eval_period > 0 and next_iter % self._eval_period == 0
            if is_final or is_period:
                self._do_loss_eval()
            self.trainer.storage.put_scalars(timetest=12)

    max_iter = 9
    model, trainer = _trainer(E, max_iter)
    hooks = [
        E.hooks.IterationTimer(),
        E.hooks.LRScheduler(trainer.optimizer, trainer.scheduler),
        E.hooks.PeriodicWriter(
            [
                E.CommonMetricPrinter(max_iter),
                E.JSONWriter(R.path("metrics.json")),
                E.TensorboardXWriter(R.out),
            ],
            period=4,
        ),
    ]
    hooks.insert(-1, ValLossHook(4, batch_list(3, seed=17, size=2)))
    trainer.register_hooks(hooks)
    trainer.train(0, max_iter)
    R.storage(trainer.storage)


@pattern("geo-stack/geostackai", "geostackai/plots.py: plot_loss (after Trainer.train())")
def ur_geostack_plot_loss_after_train(E, R):
    """``plot_loss(filename)`` reads the run's metrics.json after ``trainer.train()`` has
    returned: every line parsed with ``json.loads``, then ``d['iteration']`` and
    ``d['total_loss']`` of each line as numpy arrays for the loss curve, its y-axis up to
    ``ceil(max(total_loss))``. A run whose evaluation hook puts results after training (the
    ``EvalHook``'s last evaluation, written by the ``PeriodicWriter``'s ``after_train``)
    leaves a last line without ``total_loss``, and the plot fails with ``KeyError``.
    Stand-ins: the plot is the arrays it would draw; the evaluation is a scripted AP."""
    import json

    max_iter = 7
    model, trainer = _trainer(E, max_iter)

    def eval_function():
        return {"bbox": {"AP": 12.5, "AP50": 30.25}}

    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(trainer.optimizer, trainer.scheduler),
            E.hooks.EvalHook(0, eval_function),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    trainer.train(0, max_iter)

    def plot_loss(filename):
        with open(filename) as txtfile:
            lines = txtfile.readlines()
        data = [json.loads(line) for line in lines]
        iters = np.array([d["iteration"] for d in data])
        total_loss = np.array([d["total_loss"] for d in data])
        return iters, total_loss, float(np.ceil(np.max(total_loss)))

    filename = R.path("metrics.json")
    with open(filename) as f:
        R.rec("keys per line", [sorted(json.loads(line)) for line in f])
    try:
        R.rec("plot", plot_loss(filename))
    except KeyError as e:
        R.rec("plot failed", repr(e))
    # The curve of the lines that have a loss, as a fixed script would draw it.
    with open(filename) as f:
        data = [d for d in map(json.loads, f) if "total_loss" in d]
    R.rec("curve", [(d["iteration"], d["total_loss"]) for d in data])
