"""detectron2-based code outside image detection and segmentation: multi-object tracking
(GTR's hand-written loop, resumed), depth estimation under fog (a gradient monitor in
``after_backward`` and an evaluator that returns a tensor), video instance segmentation
(VITA's test over several datasets, with NaN area-range metrics) and tracker integrations
(Aim and MLflow hooks that read ``storage.latest()`` after every step)."""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict

import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batch_list, batches, sgd

# --- xingyizhou/GTR (multi-object tracking) --------------------------------------------------


class _TrackingModel(TinyDetector):
    """Stands in for GTR's tracker: its detector losses, an association loss over the frames
    of the clip, and a statistic of the association head in the same dict (not a loss, so
    left out of the sum)."""

    def forward(self, batch):
        losses = super().forward(batch)
        if not self.training:
            return losses
        feats = torch.tanh(self.backbone(batch))
        sim = feats @ feats.t()
        losses["loss_asso"] = (sim - torch.eye(len(batch))).pow(2).mean() * 0.1
        losses["num_pos_asso"] = (sim.detach() > 0.5).sum().float()
        return losses


def _gtr_do_train(E, R, model, data_loader, resume, max_iter, eval_period=0):
    """GTR's ``do_train`` (train_net.py), as written there, on the stand-ins."""
    logger = logging.getLogger("corpus.gtr")
    model.train()
    optimizer = sgd(model, lr=0.05)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[10], gamma=0.1)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)
    start_iter = checkpointer.resume_or_load("", resume=resume).get("iteration", -1) + 1
    if not resume:
        start_iter = 0
    periodic_checkpointer = E.PeriodicCheckpointer(checkpointer, 4, max_iter=max_iter)
    writers = [
        E.CommonMetricPrinter(max_iter),
        E.JSONWriter(R.path("metrics.json")),
        E.TensorboardXWriter(R.out),
    ]

    def do_test():
        # The MOT evaluator's results for the one test sequence set.
        model.eval()
        with torch.no_grad():
            score = float(torch.sigmoid(model(next(batches(seed=21)))).mean())
        model.train()
        results = OrderedDict(mot17_half_val=OrderedDict(MOTA=round(score * 60, 4), IDF1=50.0))
        logger.info("Evaluation results for mot17_half_val in csv format:")
        return results

    logger.info("Starting training from iteration {}".format(start_iter))
    with E.EventStorage(start_iter) as storage:
        for data, iteration in zip(data_loader, range(start_iter, max_iter)):
            storage.put_scalars(data_time=0.001)
            iteration = iteration + 1
            storage.step()
            loss_dict = model(data)
            losses = sum(loss for k, loss in loss_dict.items() if "loss" in k)
            assert torch.isfinite(losses).all(), loss_dict
            loss_dict_reduced = {k: v.item() for k, v in E.comm.reduce_dict(loss_dict).items()}
            losses_reduced = sum(loss for k, loss in loss_dict_reduced.items() if "loss" in k)
            if E.comm.is_main_process():
                storage.put_scalars(total_loss=losses_reduced, **loss_dict_reduced)
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
            storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
            storage.put_scalars(time=0.01)
            scheduler.step()
            if eval_period > 0 and iteration % eval_period == 0 and iteration != max_iter:
                R.rec("test", iteration, do_test())
            # GTR writes every 20 iterations; the stand-in every 2.
            if iteration - start_iter > 5 and (iteration % 2 == 0 or iteration == max_iter):
                for writer in writers:
                    writer.write()
            periodic_checkpointer.step(iteration)
        R.storage(storage)
    R.rec("start_iter", start_iter, "lr", optimizer.param_groups[0]["lr"])
    # GTR leaves the writers to the process's exit; here the job ends with the function.
    for writer in writers:
        writer.close()


@pattern("xingyizhou/GTR", "train_net.py: do_train, run again with --resume")
def dm_gtr_resume_do_train(E, R):
    """GTR (Global Tracking Transformers) trains with a loop of its own: ``EventStorage(
    start_iter)``, ``data_time`` put before ``storage.step()`` (so at the previous iteration),
    1-based ``iteration`` for the writers and ``PeriodicCheckpointer.step``, a loss sum and a
    ``total_loss`` over the keys that contain "loss" while every key of the loss dict is put,
    evaluations every ``EVAL_PERIOD`` (only logged), and writers called when
    ``iteration - start_iter > 5``. The first job stops after 7 clips (its loader ends: a
    killed job); the job started again with ``--resume`` builds a new model, reads
    ``last_checkpoint`` through ``resume_or_load``, starts at its ``iteration + 1``, and its
    new writers append to the same metrics.json and add an event file next to the first."""
    max_iter = 16
    _gtr_do_train(
        E,
        R,
        _TrackingModel(),
        batch_list(7, seed=5),
        resume=False,
        max_iter=max_iter,
        eval_period=3,
    )
    with open(os.path.join(R.out, "last_checkpoint")) as f:
        R.rec("last_checkpoint", f.read())
    _gtr_do_train(
        E, R, _TrackingModel(), batches(seed=6), resume=True, max_iter=max_iter, eval_period=3
    )
    R.rec("files", sorted(n for n in os.listdir(R.out) if not n.startswith("events.")))


# --- Carlisle345748/object_detection_foggy (depth estimation, foggy domain adaptation) -------


class _FoggyDepthModel(TinyDetector):
    """Stands in for the repo's detector with a depth-estimation block (DEB, a sigmoid depth
    map against the ground-truth depth, its reverse Huber loss) and a domain discriminator
    whose adversarial loss weight is still 0 (its gradients vanish)."""

    def __init__(self):
        super().__init__()
        self.deb = nn.Linear(3, 2)
        self.discriminator = nn.Linear(3, 1)
        self.adv_weight = 0.0

    def forward(self, batch):
        losses = super().forward(batch)
        feats = torch.tanh(self.backbone(batch))
        depth = torch.sigmoid(self.deb(feats))
        if not self.training:
            return depth
        gt_depth = torch.sigmoid(batch[:, 2:])
        abs_diff = (depth - gt_depth).abs()
        c = 0.2 * abs_diff.max()
        rh = torch.where(abs_diff <= c, abs_diff, (depth - gt_depth) ** 2 + c**2) / (2 * c)
        losses["depth_loss"] = rh.mean()
        domain = self.discriminator(feats.detach()).mean()
        losses["loss_domain"] = domain * self.adv_weight
        return losses


@pattern(
    "Carlisle345748/object_detection_foggy",
    "trainer/grad_monitor.py: GradMonitor.after_backward; trainer/depth_trainer.py + "
    "trainer/depth_evaluator.py: DepthEvaluator",
)
def dm_foggy_grad_monitor_depth_eval(E, R):
    """The repo's ``GradMonitor`` hook works in ``after_backward`` (between ``backward()`` and
    the optimizer step, before the trainer puts the losses): it takes every parameter's
    gradient norm (``.item()``), logs each layer whose norm is above 1e5 ("exploding") or
    below 1e-5 ("vanishing": the discriminator, whose loss weight is 0), and puts
    ``min_grad_norm``/``max_grad_norm`` with ``self.trainer.storage.put_scalar``, so those two
    keys come first in the storage. ``DepthTrainer`` evaluates with ``DepthEvaluator``,
    whose ``evaluate()`` returns ``{"Depth MSE": mse / count}``: a 0-d tensor, under a key
    with a space, which ``EvalHook`` checks with ``float()`` and puts as it is. The hooks are
    DefaultTrainer's (timer, LR scheduler, periodic checkpointer, evaluation, writers),
    without ``CommonMetricPrinter``: hookloop runs ``PeriodicCheckpointer.after_step`` after
    the other hooks on purpose (docs/differences.md), which would put the printer's last
    line before "Saving checkpoint to .../model_final.pth" instead of after it."""

    class GradMonitor(E.HookBase):
        def __init__(self, model):
            self.model = model

        def after_backward(self):
            logger = logging.getLogger("corpus.foggy.grad_monitor")
            gradient_norms = {}
            for name, param in self.model.named_parameters():
                if param.grad is not None:
                    gradient_norms[name] = param.grad.data.norm(2).item()
            exploding_threshold = 1e5
            vanishing_threshold = 1e-5
            min_grad, max_grad = None, None
            for name, grad_norm in gradient_norms.items():
                if min_grad is None or grad_norm < min_grad:
                    min_grad = grad_norm
                if max_grad is None or grad_norm > max_grad:
                    max_grad = grad_norm
                if grad_norm > exploding_threshold:
                    logger.info(f"Gradient exploding detected in layer {name}: {grad_norm}")
                elif grad_norm < vanishing_threshold:
                    logger.info(f"Gradient vanishing detected in layer {name}: {grad_norm}")
            self.trainer.storage.put_scalar("min_grad_norm", min_grad)
            self.trainer.storage.put_scalar("max_grad_norm", max_grad)

    val = batch_list(3, seed=13)

    def test(model):
        # DefaultTrainer.test with DepthEvaluator on the one test set: the evaluator keeps
        # the last image's errors (as the repo's does) and divides by the count.
        model.eval()
        mse, count = 0, 0
        with torch.no_grad():
            for data in val:
                pred = model(data)
                mse = nn.functional.mse_loss(pred, torch.sigmoid(data[:, 2:]))
                count += 1
        model.train()
        return {"Depth MSE": mse / count}

    max_iter = 8
    model = _FoggyDepthModel()
    optimizer = sgd(model, lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    trainer = E.SimpleTrainer(model, batches(seed=8), optimizer)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(optimizer, scheduler),
            E.hooks.PeriodicCheckpointer(checkpointer, 5),
            E.hooks.EvalHook(3, lambda: test(trainer.model)),
            # DefaultTrainer's writers but the printer (see the docstring).
            E.hooks.PeriodicWriter(
                [E.JSONWriter(R.path("metrics.json")), E.TensorboardXWriter(R.out)], period=3
            ),
        ]
    )
    trainer.register_hooks([GradMonitor(trainer.model)])
    trainer.train(0, max_iter)
    R.storage(trainer.storage)


# --- sukjunhwang/VITA (video instance segmentation) ------------------------------------------


class _ClipModel(TinyDetector):
    """Stands in for VITA: a clip of frames (T, B, 4) in, frame-level and clip-level
    (object-token) losses out."""

    def forward(self, clip):
        if not self.training:
            return super().forward(clip.flatten(0, 1))
        frame_losses = [super(_ClipModel, self).forward(frame) for frame in clip]
        losses = {
            "loss_ce": sum(f["loss_cls"] for f in frame_losses) / len(frame_losses),
            "loss_mask": sum(f["loss_box_reg"] for f in frame_losses) / len(frame_losses),
        }
        tokens = torch.tanh(self.backbone(clip.mean(0)))
        losses["loss_vita_ce"] = tokens.pow(2).mean() * 0.5
        return losses


def _combined_clips(ratio=(1, 2), frames=2, seed=17):
    """VITA's combined loader: pseudo-clips made from COCO images and YouTube-VIS clips,
    drawn by ``DATASET_RATIO``. Endless."""
    coco = batches(seed)
    ytvis = batches(seed + 1)
    k = 0
    while True:
        source = coco if k % sum(ratio) < ratio[0] else ytvis
        yield torch.stack([next(source) for _ in range(frames)])
        k += 1


@pattern("sukjunhwang/VITA", "train_net_vita.py: Trainer.test over YTVIS and OVIS")
def dm_vita_test_nan_area_metrics(E, R):
    """VITA's ``Trainer.test`` loops over ``cfg.DATASETS.TEST``; a dataset whose
    ``build_evaluator`` raises ``NotImplementedError`` is logged and gets ``{}``; with two
    datasets the results stay keyed by dataset. The YouTube-VIS evaluator returns
    ``{"segm": {...}}`` whose area-range APs are NaN when the split has no object of that
    size (as COCO-style evaluation gives them). ``EvalHook`` flattens that to
    ``<dataset>/segm/<metric>`` (the empty dict of the second dataset adds nothing), float()
    accepts NaN, and the NaN metrics go unsmoothed to metrics.json and TensorBoard."""
    logger = logging.getLogger("corpus.vita")

    def build_evaluator(dataset_name):
        if dataset_name.startswith("ytvis"):
            return "ytvis"
        raise NotImplementedError(
            "no Evaluator for the dataset {} with the type {}".format(dataset_name, "ovis")
        )

    def test(model):
        results = OrderedDict()
        for dataset_name in ("ytvis_2019_val", "ovis_val"):
            try:
                build_evaluator(dataset_name)
            except NotImplementedError:
                logger.warning(
                    "No evaluator found. Use `DefaultTrainer.test(evaluators=)`, "
                    "or implement its `build_evaluator` method."
                )
                results[dataset_name] = {}
                continue
            model.eval()
            with torch.no_grad():
                out = model(torch.stack(batch_list(2, seed=23)))
            model.train()
            ap = round(100.0 * float(torch.sigmoid(out).mean()), 4)
            results[dataset_name] = OrderedDict(
                segm=OrderedDict(
                    [
                        ("AP", ap),
                        ("AP50", ap + 12.5),
                        ("APs", math.nan),
                        ("APm", ap - 3.0),
                        ("APl", ap + 1.0),
                        ("AR1", ap / 2),
                    ]
                )
            )
            logger.info("Evaluation results for {} in csv format:".format(dataset_name))
        if len(results) == 1:
            results = list(results.values())[0]
        return results

    max_iter = 7
    model = _ClipModel()
    optimizer = sgd(model, lr=0.05)
    trainer = E.SimpleTrainer(model, _combined_clips(), optimizer)
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.EvalHook(3, lambda: test(trainer.model)),
            E.hooks.PeriodicWriter(
                [
                    E.CommonMetricPrinter(max_iter),
                    E.JSONWriter(R.path("metrics.json")),
                    E.TensorboardXWriter(R.out),
                ],
                period=3,
            ),
        ]
    )
    trainer.train(0, max_iter)
    R.storage(trainer.storage)


# --- GeorgePearse/unofficial-detectron2-docs (Aim and MLflow hooks) --------------------------


class _Cfg(dict):
    """Stands in for the yacs config the hooks take: ``clone()``, ``items()``, ``dump()``."""

    def clone(self):
        return _Cfg(self)

    def dump(self):
        return "".join("{}: {}\n".format(k, v) for k, v in self.items())

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _AimRun:
    """Stands in for ``aim.Run``: records the hparams and every tracked value."""

    def __init__(self, R, experiment):
        self.R = R
        self.R.rec("aim.Run", experiment)

    def __setitem__(self, key, value):
        self.R.rec("aim.run[]", key, sorted(value.items()))

    def track(self, value, name, step):
        self.R.rec("aim.track", {name: value}, step)


class _Mlflow:
    """Stands in for the ``mlflow`` module: records each call."""

    def __init__(self, R):
        self.R = R

    def set_tracking_uri(self, uri):
        self.R.rec("mlflow.set_tracking_uri", uri)

    def set_experiment(self, name):
        self.R.rec("mlflow.set_experiment", name)

    def start_run(self, run_name=None):
        self.R.rec("mlflow.start_run", run_name)

    def set_tag(self, key, value):
        self.R.rec("mlflow.set_tag", key, value)

    def log_param(self, key, value):
        self.R.rec("mlflow.log_param", key, value)

    def log_metric(self, key, value, step=None):
        self.R.rec("mlflow.log_metric", {key: value}, step)

    def log_artifacts(self, local_dir):
        names = sorted(
            "<events>" if n.startswith("events.out.tfevents.") else n for n in os.listdir(local_dir)
        )
        self.R.rec("mlflow.log_artifacts", local_dir, names)


@pattern(
    "GeorgePearse/unofficial-detectron2-docs",
    "docs/experiment-tracking/aim.md: AimHook; docs/experiment-tracking/mlflow.md: MLflowHook",
)
def dm_aim_mlflow_hooks_read_latest(E, R):
    """Two tracker hooks registered after DefaultTrainer's hooks (so after the writer):
    ``AimHook`` opens a run in ``before_train`` and stores the config as hparams; after
    every step it reads ``self.trainer.storage.latest()`` and tracks every value at
    ``storage.iter``, ``MLflowHook`` (philenius's) logs the same values at their own
    iterations (``v[1]``), so the evaluation metrics and ``time`` are logged again at
    every later step with their old iteration. In ``after_train`` both write
    model-config.yaml into OUTPUT_DIR, and MLflowHook uploads the whole folder
    (``log_artifacts``) after the writers have closed and the final checkpoint is saved."""
    mlflow = _Mlflow(R)

    class AimHook(E.HookBase):
        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg.clone()

        def before_train(self):
            if E.comm.is_main_process():
                self.run = _AimRun(R, experiment="<datetime>")
                self.run["hparams"] = self.cfg

        def after_step(self):
            if E.comm.is_main_process():
                with torch.no_grad():
                    latest_metrics = self.trainer.storage.latest()
                    for k, v in latest_metrics.items():
                        self.run.track(name=k, value=v[0], step=self.trainer.storage.iter)

        def after_train(self):
            if E.comm.is_main_process():
                with torch.no_grad():
                    with open(os.path.join(self.cfg.OUTPUT_DIR, "model-config.yaml"), "w") as f:
                        f.write(self.cfg.dump())

    class MLflowHook(E.HookBase):
        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg.clone()

        def before_train(self):
            if E.comm.is_main_process():
                with torch.no_grad():
                    mlflow.set_tracking_uri(self.cfg.MLFLOW_TRACKING_URI)
                    mlflow.set_experiment(self.cfg.MLFLOW_EXPERIMENT_NAME)
                    mlflow.start_run(run_name=self.cfg.MLFLOW_RUN_NAME)
                    mlflow.set_tag("mlflow.note.content", self.cfg.MLFLOW_RUN_DESCRIPTION)
                    for k, v in self.cfg.items():
                        mlflow.log_param(k, v)

        def after_step(self):
            if E.comm.is_main_process():
                with torch.no_grad():
                    latest_metrics = self.trainer.storage.latest()
                    for k, v in latest_metrics.items():
                        mlflow.log_metric(key=k, value=v[0], step=v[1])

        def after_train(self):
            if E.comm.is_main_process():
                with torch.no_grad():
                    with open(os.path.join(self.cfg.OUTPUT_DIR, "model-config.yaml"), "w") as f:
                        f.write(self.cfg.dump())
                    mlflow.log_artifacts(self.cfg.OUTPUT_DIR)

    cfg = _Cfg(
        OUTPUT_DIR=R.out,
        SOLVER_MAX_ITER=6,
        SOLVER_BASE_LR=0.05,
        MLFLOW_TRACKING_URI="http://localhost:5000",
        MLFLOW_EXPERIMENT_NAME="balloons",
        MLFLOW_RUN_NAME="r50-fpn",
        MLFLOW_RUN_DESCRIPTION="mask r-cnn on the balloon set",
    )
    max_iter = cfg.SOLVER_MAX_ITER
    model = TinyDetector()
    optimizer = sgd(model, lr=cfg.SOLVER_BASE_LR)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[4], gamma=0.1)
    trainer = E.SimpleTrainer(model, batches(seed=19), optimizer)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)

    def test():
        model.eval()
        with torch.no_grad():
            ap = round(float(torch.sigmoid(model(next(batches(seed=29)))).mean()) * 100, 4)
        model.train()
        return {"bbox": {"AP": ap, "AP50": ap + 5.0}}

    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(optimizer, scheduler),
            E.hooks.PeriodicCheckpointer(checkpointer, 4),
            E.hooks.EvalHook(3, test),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=4),
        ]
    )
    trainer.register_hooks(hooks=[AimHook(cfg), MLflowHook(cfg)])
    trainer.train(0, max_iter)
