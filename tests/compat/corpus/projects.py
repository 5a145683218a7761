"""detectron2's own research projects (DensePose, Panoptic-DeepLab, Rethinking-BatchNorm) and
research repositories built on detectron2 (DiffusionDet): loaders that fill the storage, a
writer added to the default ones, an evaluation registered after the writers, a torch LR
scheduler of the project's own, an EMA trainer that skips ``DefaultTrainer.__init__``, and
PreciseBN over domain-specific BatchNorms outside a trainer."""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections import OrderedDict

import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batch_list, batches, preempted_before, sgd, weights

# --- facebookresearch/detectron2: projects/DensePose -----------------------------------------


class _CombinedLoader:
    """Stands in for DensePose's combined loader (the COCO loader mixed with a bootstrap
    loader of inferred annotations): an endless stream of batches, each a list of per-image
    dicts naming their dataset and holding their instances. Iterable, with no length."""

    def __init__(self, seed=3, size=3):
        self.seed = seed
        self.size = size

    def __iter__(self):
        for k, images in enumerate(batches(self.seed, self.size)):
            batch = []
            for j, image in enumerate(images):
                # Every third batch has no bootstrap images; the others mix both datasets.
                bootstrap = k % 3 != 0 and (j + k) % 2 == 1
                name = "densepose_chimps_bootstrap" if bootstrap else "densepose_coco_2014_train"
                instances = list(range((k * 5 + j * 3) % 4 + 1))
                batch.append({"dataset": name, "instances": instances, "image": image})
            yield batch


class _ListDetector(TinyDetector):
    """Takes a list of per-image dicts, as detectron2's meta-architectures do."""

    def forward(self, batch):
        return super().forward(torch.stack([d["image"] for d in batch]))


@pattern(
    "facebookresearch/detectron2",
    "projects/DensePose/densepose/engine/trainer.py: SampleCountingLoader, "
    "SampleCountMetricPrinter, Trainer.build_writers",
)
def pj_densepose_sample_counting(E, R):
    """DensePose wraps its combined training loader in ``SampleCountingLoader``: a generator
    that asks for ``get_event_storage()`` when its first batch is drawn (inside training) and
    puts ``batch/<dataset>`` with the number of instances of each dataset in every batch, a
    key only for the datasets present. ``Trainer.build_writers`` appends
    ``SampleCountMetricPrinter``, an ``EventWriter`` that walks ``storage.histories()`` and
    logs ``"<key> <buf.avg(20)>"`` for every ``batch/`` key in one line, to the default
    printer, JSON and TensorBoard writers (here in one ``PeriodicWriter``, as
    ``DefaultTrainer.build_hooks`` puts them)."""

    class SampleCountingLoader:
        def __init__(self, loader):
            self.loader = loader

        def __iter__(self):
            it = iter(self.loader)
            storage = E.get_event_storage()
            while True:
                try:
                    batch = next(it)
                    num_inst_per_dataset = {}
                    for data in batch:
                        name = data["dataset"]
                        num_inst_per_dataset.setdefault(name, 0)
                        num_inst_per_dataset[name] += len(data["instances"])
                    for name, count in num_inst_per_dataset.items():
                        storage.put_scalar(f"batch/{name}", count)
                    yield batch
                except StopIteration:
                    break

    class SampleCountMetricPrinter(E.EventWriter):
        def __init__(self):
            self.logger = logging.getLogger("corpus.densepose.engine.trainer")

        def write(self):
            storage = E.get_event_storage()
            stats = []
            for key, buf in storage.histories().items():
                if key.startswith("batch/"):
                    stats.append(f"{key} {buf.avg(20)}")
            self.logger.info(", ".join(stats))

    max_iter = 10
    model = _ListDetector()
    optimizer = sgd(model, lr=0.05)
    trainer = E.SimpleTrainer(model, SampleCountingLoader(_CombinedLoader()), optimizer)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[6], gamma=0.1)

    def build_writers():
        # DefaultTrainer.build_writers (default_writers), then DensePose's printer.
        writers = [
            E.CommonMetricPrinter(max_iter),
            E.JSONWriter(R.path("metrics.json")),
            E.TensorboardXWriter(R.out),
        ]
        writers.append(SampleCountMetricPrinter())
        return writers

    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(optimizer, scheduler),
            E.hooks.PeriodicWriter(build_writers(), period=4),
        ]
    )
    trainer.train(0, max_iter)
    R.storage(trainer.storage)
    R.rec("avg", {k: h.avg(20) for k, h in trainer.storage.histories().items() if "/" in k})


@pattern("facebookresearch/detectron2", "projects/DensePose/train_net.py: main (TEST.AUG)")
def pj_densepose_tta_after_writers(E, R):
    """With test-time augmentation on, DensePose's ``main`` registers
    ``hooks.EvalHook(0, lambda: trainer.test_with_TTA(cfg, trainer.model))`` after the
    trainer's default hooks, so after the ``PeriodicWriter``: period 0 evaluates only in
    ``after_train``, after the writers' last write and close, and its results (the test
    results re-keyed ``<task>_TTA``, nested dicts) reach the storage flattened, unsmoothed, and
    no file. The default ``EvalHook`` before the writer evaluates every few iterations and
    once more at the end, and the writer's last line holds that."""

    max_iter = 9
    model = TinyDetector()
    val = batch_list(2, seed=11)

    def test(model):
        # Trainer.test for one dataset: its evaluator's results dict (task -> metrics).
        model.eval()
        with torch.no_grad():
            out = torch.cat([model(b) for b in val])
        model.train()
        ap = round(100.0 * float(torch.sigmoid(out).mean()), 4)
        return OrderedDict(
            [
                ("bbox", OrderedDict([("AP", ap), ("AP50", ap + 10.0)])),
                ("densepose_gps", OrderedDict([("AP", ap / 2)])),
            ]
        )

    def test_with_TTA(model):
        logging.getLogger("corpus.densepose").info(
            "Running inference with test-time augmentation ..."
        )
        res = test(model)
        return OrderedDict({k + "_TTA": v for k, v in res.items()})

    def test_and_save_results():
        trainer._last_eval_results = test(trainer.model)
        return trainer._last_eval_results

    trainer = E.SimpleTrainer(model, batches(seed=4), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.EvalHook(4, test_and_save_results),
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(max_iter), E.JSONWriter(R.path("metrics.json"))], period=4
            ),
        ]
    )
    trainer.register_hooks([E.hooks.EvalHook(0, lambda: test_with_TTA(trainer.model))])
    trainer.train(0, max_iter)
    R.storage(trainer.storage)
    R.rec("last eval", trainer._last_eval_results)
    R.rec("has func", [hasattr(h, "_func") for h in trainer._hooks[1::2]])


# --- facebookresearch/detectron2: projects/PointRend ------------------------------------------


@pattern(
    "facebookresearch/detectron2",
    "projects/PointRend/point_rend/point_head.py: roi_mask_point_loss",
)
def pj_pointrend_point_accuracy(E, R):
    """PointRend's ``roi_mask_point_loss`` returns ``mask_logits.sum() * 0`` early when a batch
    has no sampled points (no instances), before it logs anything; otherwise it puts
    ``point/accuracy`` (a Python float: the share of non-ignored points whose logit sign
    matches the label) with ``get_event_storage().put_scalar`` from inside the model's loss,
    so the key is missing at the iterations without instances and the writers' smoothed
    median covers only the iterations that have it."""

    def roi_mask_point_loss(mask_logits, point_labels):
        point_ignores = point_labels == -1
        if point_labels.shape[0] == 0:
            return mask_logits.sum() * 0
        accurate = (mask_logits > 0.0) == point_labels.to(dtype=torch.uint8)
        accurate = accurate[~point_ignores]
        accuracy = accurate.nonzero().size(0) / max(accurate.numel(), 1.0)
        E.get_event_storage().put_scalar("point/accuracy", accuracy)
        return torch.nn.functional.binary_cross_entropy_with_logits(
            mask_logits, point_labels.clamp(min=0).float(), weight=(~point_ignores).float()
        )

    class PointRendLike(TinyDetector):
        def forward(self, batch):
            losses = super().forward(batch)
            storage = E.get_event_storage()
            n = 0 if storage.iter % 4 == 2 else 2  # some batches hold no instances
            logits = self.head(torch.tanh(self.backbone(batch[:n]))).expand(n, 5)
            labels = (batch[:n, :1] > 0).long().expand(n, 5).clone()
            if n:
                labels[:, 0] = -1  # points outside the box are ignored
            losses["loss_mask_point"] = roi_mask_point_loss(logits, labels)
            return losses

    max_iter = 11
    model = PointRendLike()
    trainer = E.SimpleTrainer(model, batches(seed=9, size=4), sgd(model))
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(max_iter), E.JSONWriter(R.path("metrics.json"))], period=4
            ),
        ]
    )
    trainer.train(0, max_iter)
    R.storage(trainer.storage)
    R.rec("median", trainer.storage.history("point/accuracy").median(4))


# --- facebookresearch/detectron2: projects/Panoptic-DeepLab, projects/DeepLab ---------------


def _warmup_factor_at_iter(method, it, warmup_iters, warmup_factor):
    """detectron2.solver.lr_scheduler's ``_get_warmup_factor_at_iter`` (solver code, not the
    engine: written out here)."""
    if it >= warmup_iters:
        return 1.0
    if method == "constant":
        return warmup_factor
    if method == "linear":
        alpha = it / warmup_iters
        return warmup_factor * (1 - alpha) + alpha
    raise ValueError("Unknown warmup method: {}".format(method))


@pattern(
    "facebookresearch/detectron2",
    "projects/Panoptic-DeepLab/train_net.py: Trainer.build_optimizer, build_lr_scheduler; "
    "projects/DeepLab/deeplab/lr_scheduler.py: WarmupPolyLR",
)
def pj_panoptic_deeplab_poly_lr(E, R):
    """Panoptic-DeepLab's trainer builds its optimizer from ``get_default_optimizer_params``
    (one param group per parameter: biases at ``BIAS_LR_FACTOR`` times the lr, no weight decay
    on norms) and its scheduler with DeepLab's ``build_lr_scheduler``: ``WarmupPolyLR``, a
    torch LR scheduler subclass of the project's own (linear warmup, then ``(1 -
    it/max_iters) ** power``, held at ``constant_ending`` once the poly factor falls below
    it). ``hooks.LRScheduler`` steps it after every iteration and puts ``lr`` of the group it
    picks: all groups hold one parameter, so the most common initial lr (a tie between
    weights and biases here: the first one seen)."""

    class WarmupPolyLR(torch.optim.lr_scheduler.LRScheduler):
        def __init__(
            self,
            optimizer,
            max_iters,
            warmup_factor=0.001,
            warmup_iters=1000,
            warmup_method="linear",
            last_epoch=-1,
            power=0.9,
            constant_ending=0.0,
        ):
            self.max_iters = max_iters
            self.warmup_factor = warmup_factor
            self.warmup_iters = warmup_iters
            self.warmup_method = warmup_method
            self.power = power
            self.constant_ending = constant_ending
            super().__init__(optimizer, last_epoch)

        def get_lr(self):
            warmup_factor = _warmup_factor_at_iter(
                self.warmup_method, self.last_epoch, self.warmup_iters, self.warmup_factor
            )
            poly = math.pow(1.0 - self.last_epoch / self.max_iters, self.power)
            if self.constant_ending > 0 and warmup_factor == 1.0:
                if poly < self.constant_ending:
                    return [base_lr * self.constant_ending for base_lr in self.base_lrs]
            return [base_lr * warmup_factor * poly for base_lr in self.base_lrs]

        def _compute_values(self):
            return self.get_lr()

    class BNDeepLabHead(TinyDetector):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(3)

        def forward(self, batch):
            feats = torch.tanh(self.norm(self.backbone(batch)))
            out = self.head(feats)
            return {"loss_sem_seg": (out**2).mean(), "loss_center": feats.abs().mean() * 0.5}

    def get_default_optimizer_params(model, base_lr, weight_decay, weight_decay_norm, bias_f):
        params = []
        norm_types = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)
        for module in model.modules():
            for name, value in module.named_parameters(recurse=False):
                hp = {"lr": base_lr, "weight_decay": weight_decay}
                if isinstance(module, norm_types):
                    hp["weight_decay"] = weight_decay_norm
                if name == "bias":
                    hp["lr"] = base_lr * bias_f
                params.append({"params": [value], **hp})
        return params

    max_iter = 12
    model = BNDeepLabHead()
    params = get_default_optimizer_params(model, 0.01, 1e-4, 0.0, 2.0)
    optimizer = torch.optim.SGD(params, 0.01, momentum=0.9)
    scheduler = WarmupPolyLR(
        optimizer, max_iter, warmup_factor=0.1, warmup_iters=3, power=0.9, constant_ending=0.3
    )
    trainer = E.SimpleTrainer(model, batches(seed=6, size=4), optimizer)
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(optimizer, scheduler),
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(max_iter), E.JSONWriter(R.path("metrics.json"))], period=5
            ),
        ]
    )
    trainer.train(0, max_iter)
    R.rec("lr", trainer.storage.history("lr").values())
    R.rec("groups", [g["lr"] for g in optimizer.param_groups])
    R.rec("scheduler", scheduler.last_epoch, scheduler.get_last_lr())
    R.rec("hook state", sorted(trainer.state_dict().get("hooks", {})))


# --- ShoufaChen/DiffusionDet ----------------------------------------------------------------


class _EMAState:
    """DiffusionDet's ``EMAState``: parameters and buffers by name, a checkpointable of its
    own (``state_dict`` returns the dict it keeps)."""

    def __init__(self):
        self.state = {}

    def save_from(self, model, device=""):
        for name, val in self.get_model_state_iterator(model):
            val = val.detach().clone()
            self.state[name] = val.to(device) if device else val

    def apply_to(self, model):
        with torch.no_grad():
            for name, val in self.get_model_state_iterator(model):
                val.copy_(self.state[name])

    @property
    def device(self):
        return next(iter(self.state.values())).device if self.state else None

    def to(self, device):
        for name in self.state:
            self.state[name] = self.state[name].to(device)
        return self

    def has_inited(self):
        return self.state

    def clear(self):
        self.state.clear()
        return self

    def get_model_state_iterator(self, model):
        return list(model.named_parameters()) + list(model.named_buffers())

    def state_dict(self):
        return self.state

    def load_state_dict(self, state_dict, strict=True):
        self.clear()
        for k, v in state_dict.items():
            self.state[k] = v
        return torch.nn.modules.module._IncompatibleKeys(missing_keys=[], unexpected_keys=[])


@pattern(
    "ShoufaChen/DiffusionDet",
    "train_net.py: Trainer (super(DefaultTrainer, self).__init__()); "
    "diffusiondet/util/model_ema.py: EMAHook",
)
def pj_diffusiondet_ema_trainer(E, R):
    """DiffusionDet's ``Trainer`` calls ``super(DefaultTrainer, self).__init__()`` (the
    ``TrainerBase`` constructor) and builds what ``DefaultTrainer`` would by hand: a
    ``SimpleTrainer`` in ``self._trainer``, ``self.scheduler``, and a checkpointer holding
    ``trainer=weakref.proxy(self)`` and the model's EMA state (an ``EMAState``, not a module)
    as a checkpointable. Its ``build_hooks`` list holds ``None`` where a hook is disabled
    (PreciseBN without BN modules); ``EMAHook`` initialises the EMA state in ``before_train``
    (or moves a loaded one) and updates it after every step; ``hooks.LRScheduler()`` reads
    ``trainer.optimizer`` (``DefaultTrainer``'s property) and ``trainer.scheduler``; the
    evaluation runs on the EMA weights and restores the model after. The run is preempted
    (an exception before step 6) and a second trainer resumes from the last checkpoint
    (``resume_or_load``: ``start_iter = iter + 1``), the EMA state loaded from it; the resumed
    run has no writers and its storage is not recorded, since hookloop restores the recent
    scalar history on resume (docs/differences.md), which smoothed values would show."""

    class Cfg:
        OUTPUT_DIR = R.out
        MAX_ITER = 8
        BASE_LR = 0.05
        BACKBONE_MULTIPLIER = 0.5
        EMA_DECAY = 0.7
        CHECKPOINT_PERIOD = 3
        EVAL_PERIOD = 4
        WRITERS = True

    val = batch_list(2, seed=12)

    class EMAHook(E.HookBase):
        def __init__(self, cfg, model):
            assert hasattr(model, "ema_state"), "Call `may_build_model_ema` first"
            self.model = model
            self.ema = model.ema_state
            self.device = "cpu"
            self.decay = cfg.EMA_DECAY
            self.updates = 0

        def before_train(self):
            if self.ema.has_inited():
                self.ema.to(self.device)
            else:
                self.ema.clear()
                self.ema.save_from(self.model, self.device)

        def after_step(self):
            if not self.model.train:  # a bound method: always true, as in the source
                return
            with torch.no_grad():
                self.updates += 1
                for name, val in self.ema.get_model_state_iterator(self.model):
                    ema_val = self.ema.state[name]
                    ema_val.copy_(ema_val * self.decay + val.to(self.device) * (1.0 - self.decay))

    class Trainer(E.TrainerBase):
        def __init__(self, cfg):
            E.TrainerBase.__init__(self)  # super(DefaultTrainer, self).__init__()
            model = self.build_model(cfg)
            optimizer = self.build_optimizer(cfg, model)
            data_loader = batches(seed=8)
            self._trainer = E.SimpleTrainer(model, data_loader, optimizer)
            self.scheduler = self.build_lr_scheduler(cfg, optimizer)
            kwargs = {"trainer": weakref.proxy(self)}
            kwargs.update({"ema_state": model.ema_state})
            self.checkpointer = E.Checkpointer(model, cfg.OUTPUT_DIR, **kwargs)
            self.start_iter = 0
            self.max_iter = cfg.MAX_ITER
            self.cfg = cfg
            self.register_hooks(self.build_hooks())

        @property
        def model(self):
            return self._trainer.model

        @property
        def optimizer(self):
            return self._trainer.optimizer

        @classmethod
        def build_model(cls, cfg):
            model = TinyDetector()
            model.ema_state = _EMAState()  # may_build_model_ema
            return model

        @classmethod
        def build_optimizer(cls, cfg, model):
            params = []
            for key, value in model.named_parameters(recurse=True):
                lr = cfg.BASE_LR
                if "backbone" in key:
                    lr = lr * cfg.BACKBONE_MULTIPLIER
                params += [{"params": [value], "lr": lr, "weight_decay": 1e-4}]
            return torch.optim.SGD(params, cfg.BASE_LR, momentum=0.9)

        @classmethod
        def build_lr_scheduler(cls, cfg, optimizer):
            S = E.solver
            sched = S.WarmupParamScheduler(
                S.MultiStepParamScheduler([1.0, 0.1], milestones=[6], num_updates=cfg.MAX_ITER),
                0.2,
                2 / cfg.MAX_ITER,
                "linear",
            )
            return S.LRMultiplier(optimizer, multiplier=sched, max_iter=cfg.MAX_ITER)

        @classmethod
        def ema_test(cls, cfg, model):
            logging.getLogger("corpus.diffusiondet").info("Run evaluation with EMA.")
            old = _EMAState()
            old.save_from(model)
            model.ema_state.apply_to(model)  # apply_model_ema_and_restore
            model.eval()
            with torch.no_grad():
                out = torch.cat([model(b) for b in val])
            model.train()
            old.apply_to(model)
            return {"bbox": {"AP": round(float(out.abs().mean()) * 100.0, 5)}}

        def build_hooks(self):
            cfg = self.cfg
            ret = [
                E.hooks.IterationTimer(),
                EMAHook(self.cfg, self.model),
                E.hooks.LRScheduler(),
                None,  # PreciseBN: the model has no BN modules
            ]
            ret.append(E.hooks.PeriodicCheckpointer(self.checkpointer, cfg.CHECKPOINT_PERIOD))

            def test_and_save_results():
                self._last_eval_results = self.ema_test(self.cfg, self.model)
                return self._last_eval_results

            ret.append(E.hooks.EvalHook(cfg.EVAL_PERIOD, test_and_save_results))
            if cfg.WRITERS:
                json_file = os.path.join(cfg.OUTPUT_DIR, "metrics.json")
                writers = [E.CommonMetricPrinter(self.max_iter), E.JSONWriter(json_file)]
                ret.append(E.hooks.PeriodicWriter(writers, period=20))
            return ret

        def resume_or_load(self, resume=True):
            self.checkpointer.resume_or_load("", resume=resume)
            if resume and self.checkpointer.has_checkpoint():
                self.start_iter = self.iter + 1

        def train(self):
            super().train(self.start_iter, self.max_iter)
            return self._last_eval_results

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
    trainer.register_hooks([preempted_before(E, 6)])
    R.rec("hooks", [type(h).__name__ for h in trainer._hooks])
    try:
        trainer.train()
    except RuntimeError as e:
        R.rec("stopped", str(e), trainer.iter)
    R.rec("results", trainer._last_eval_results)
    R.storage(trainer.storage)
    R.rec("ema", dict(trainer.model.ema_state.state), "weights", weights(trainer.model))

    cfg.WRITERS = False
    resumed = Trainer(cfg)
    resumed.resume_or_load(resume=True)
    R.rec("resumed at", resumed.start_iter, resumed.iter, resumed.scheduler.last_epoch)
    R.rec("loaded ema", dict(resumed.model.ema_state.state))
    R.rec("results", resumed.train())
    R.rec("ema", dict(resumed.model.ema_state.state), "weights", weights(resumed.model))
    R.rec("lr", [g["lr"] for g in resumed.optimizer.param_groups])


# --- facebookresearch/detectron2: projects/Rethinking-BatchNorm ------------------------------


class _CycleBatchNormList(nn.ModuleList):
    """Stands in for detectron2's ``CycleBatchNormList``: one BatchNorm per domain, each
    forward using the next one in turn."""

    def __init__(self, length, num_features):
        super().__init__([nn.BatchNorm1d(num_features) for _ in range(length)])
        self._pos = 0

    def forward(self, x):
        out = self[self._pos](x)
        self._pos = (self._pos + 1) % len(self)
        return out


class _RetinaHead(nn.Module):
    """A head with domain-specific norms whose training forward, like RetinaNet's losses,
    puts ``num_foreground`` into the current storage."""

    def __init__(self, E, domains):
        super().__init__()
        self.E = E
        self.conv = nn.Linear(4, 3)
        self.norm = _CycleBatchNormList(domains, 3)
        self.cls = nn.Linear(3, 1)

    def forward(self, batch):
        logits = self.cls(torch.relu(self.norm(self.conv(batch))))
        if self.training:
            num_foreground = int((logits > 0).sum())
            self.E.get_event_storage().put_scalar("num_foreground", num_foreground)
            return {"loss_cls": (logits**2).mean()}
        return logits


@pattern(
    "facebookresearch/detectron2",
    "projects/Rethinking-BatchNorm/retinanet-eval-domain-specific.py: __main__",
)
def pj_rethinking_bn_cycle_precise_bn(E, R):
    """Rethinking-BatchNorm's evaluation of domain-specific BN: the head's norm replaced by a
    ``CycleBatchNormList`` (one BN per feature level, used in turn), then ``with
    EventStorage(), torch.no_grad(): update_bn_stats(model, loader, N)``: the storage exists
    only because the model's training forward puts scalars (every put at iteration 0), and
    each BN's statistics are the average over all N batches of what it held after each, also
    the batches that went through the other BNs."""
    model = _RetinaHead(E, domains=3)
    model.train()
    loader = batch_list(7, seed=13, size=5)
    with E.EventStorage() as storage, torch.no_grad():
        E.precise_bn.update_bn_stats(model, loader, 7)
        R.storage(storage)
    R.rec("bn", [[bn.running_mean.tolist(), bn.running_var.tolist()] for bn in model.norm])
    R.rec("momentum", [bn.momentum for bn in model.norm], "pos", model.norm._pos)
    model.eval()
    R.rec("eval", model(loader[0]))
