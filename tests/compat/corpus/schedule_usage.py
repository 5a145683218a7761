"""LR schedules as detectron2-based projects build them and hand them to ``hooks.LRScheduler``:
layer-wise LR decay with merged param groups (the hook reports the largest group's LR), a
nested ``CompositeParamScheduler`` of warmed-up cosine cycles assigned as the trainer's
``scheduler`` and read by ``hooks.LRScheduler()``, and a rescaled warmup-cosine
``LRMultiplier`` whose state the hook saves and loads back across a resume."""

from __future__ import annotations

import copy
import itertools
import types
from collections import defaultdict

import torch
from torch import nn

from compat.harness import pattern

from ._common import batches, log

# --- stand-ins -------------------------------------------------------------------------------


class _TinyViTDet(nn.Module):
    """ViTDet's parameter names in miniature: ``backbone.net.patch_embed``, ``pos_embed``,
    ``blocks.N`` (a linear layer and a LayerNorm each) and a detection head of two layers."""

    def __init__(self, depth=2):
        super().__init__()
        net = nn.Module()
        net.patch_embed = nn.Linear(4, 3)
        net.pos_embed = nn.Parameter(torch.linspace(-0.1, 0.1, 3))
        net.blocks = nn.ModuleList(
            nn.ModuleDict({"fc": nn.Linear(3, 3), "norm": nn.LayerNorm(3)}) for _ in range(depth)
        )
        self.backbone = nn.Module()
        self.backbone.net = net
        self.head = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))

    def forward(self, batch):
        net = self.backbone.net
        x = net.patch_embed(batch) + net.pos_embed
        for blk in net.blocks:
            x = x + torch.tanh(blk["norm"](blk["fc"](x)))
        out = self.head(x)
        return {"loss_cls": (out**2).mean(), "loss_box_reg": x.abs().mean() * 0.2}


def _vit_lr_decay_rate(name, lr_decay_rate=1.0, num_layers=12):
    """``detectron2.modeling.backbone.vit.get_vit_lr_decay_rate`` (model code, written out):
    the patch embedding and position embedding get the deepest decay, block ``i`` the decay
    for layer ``i + 1``, everything outside the backbone none."""
    layer_id = num_layers + 1
    if name.startswith("backbone"):
        if ".pos_embed" in name or ".patch_embed" in name:
            layer_id = 0
        elif ".blocks." in name and ".residual." not in name:
            layer_id = int(name[name.find(".blocks.") :].split(".")[2]) + 1
    return lr_decay_rate ** (num_layers + 1 - layer_id)


def _default_optimizer_params(model, base_lr, weight_decay_norm, lr_factor_func, overrides):
    """``detectron2.solver.build.get_default_optimizer_params`` with ``lr_factor_func`` and
    ``overrides`` (solver code, written out): one group per parameter, then
    ``reduce_param_groups`` merges the groups whose hyper-parameters are equal, in order of
    first appearance."""
    norm_types = (nn.LayerNorm, nn.BatchNorm1d, nn.GroupNorm)
    params = []
    memo = set()
    for module_name, module in model.named_modules():
        for param_name, value in module.named_parameters(recurse=False):
            if not value.requires_grad or value in memo:
                continue
            memo.add(value)
            hp = {"lr": base_lr}
            if isinstance(module, norm_types):
                hp["weight_decay"] = weight_decay_norm
            hp["lr"] *= lr_factor_func(f"{module_name}.{param_name}")
            hp.update(overrides.get(param_name, {}))
            params.append({"params": [value], **hp})
    groups = defaultdict(list)
    for item in params:
        key = tuple((k, v) for k, v in item.items() if k != "params")
        groups[key].append(item["params"])
    return [
        {**dict(key), "params": list(itertools.chain.from_iterable(ps))}
        for key, ps in groups.items()
    ]


class _LrTrace:
    """A hook recording, after each step, the iteration and every group's LR (the hooks'
    ``after_step`` order puts it after ``LRScheduler``'s step)."""

    def __init__(self, E, optimizer, out):
        self.E, self.optimizer, self.out = E, optimizer, out

    def hook(self):
        opt, out = self.optimizer, self.out

        class LrTrace(self.E.HookBase):
            def after_step(self):
                out.append((self.trainer.iter, [g["lr"] for g in opt.param_groups]))

        return LrTrace()


def _common_state(state):
    """What detectron2's ``LRMultiplier.state_dict()`` holds (hookloop's holds more, on
    purpose: docs/differences.md, "LR schedules")."""
    return [(k, state[k]) for k in ("base_lrs", "last_epoch") if k in state]


# --- facebookresearch/detectron2: projects/ViTDet ---------------------------------------------


@pattern(
    "facebookresearch/detectron2",
    "projects/ViTDet/configs/COCO/mask_rcnn_vitdet_b_100ep.py: optimizer.params.lr_factor_func; "
    "detectron2/solver/build.py: get_default_optimizer_params, reduce_param_groups",
)
def su_vitdet_layer_decay_largest_group(E, R):
    """ViTDet's lazy config sets ``optimizer.params.lr_factor_func = partial(
    get_vit_lr_decay_rate, num_layers=..., lr_decay_rate=0.7)`` and ``overrides = {"pos_embed":
    {"weight_decay": 0.0}}``, with ``weight_decay_norm=0.0``: ``get_default_optimizer_params``
    then merges the parameters into one group per (lr, weight decay), several parameters
    each, and the groups' LRs differ by layer. The training script passes the config's
    ``lr_multiplier`` (a ``WarmupParamScheduler`` over a ``MultiStepParamScheduler``) to
    ``hooks.LRScheduler(scheduler=...)``, which wraps it in an ``LRMultiplier`` at
    ``before_train`` and puts the ``lr`` of the group with the most parameters (the head's,
    not the first group's); every group keeps its decayed ratio to it."""
    max_iter = 10
    model = _TinyViTDet(depth=2)
    params = _default_optimizer_params(
        model,
        base_lr=0.02,
        weight_decay_norm=0.0,
        lr_factor_func=lambda name: _vit_lr_decay_rate(name, lr_decay_rate=0.7, num_layers=2),
        overrides={"pos_embed": {"weight_decay": 0.0}},
    )
    optimizer = torch.optim.AdamW(params, lr=0.02, betas=(0.9, 0.999), weight_decay=0.1)
    R.rec(
        "groups",
        [(len(g["params"]), g["lr"], g["weight_decay"]) for g in optimizer.param_groups],
    )
    R.rec("reported group", E.hooks.LRScheduler.get_best_param_group_id(optimizer))
    S = E.solver
    lr_multiplier = S.WarmupParamScheduler(
        scheduler=S.MultiStepParamScheduler(
            values=[1.0, 0.1, 0.01], milestones=[6, 8], num_updates=max_iter
        ),
        warmup_length=2 / max_iter,
        warmup_factor=0.001,
    )
    trace = []
    trainer = E.SimpleTrainer(model, batches(seed=31, size=4), optimizer)
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(scheduler=lr_multiplier),
            _LrTrace(E, optimizer, trace).hook(),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=4),
        ]
    )
    trainer.train(0, max_iter)
    R.rec("lr history", trainer.storage.history("lr").values())
    R.rec("group lrs", trace)
    R.rec("initial_lr", [g["initial_lr"] for g in optimizer.param_groups])


# --- markmno/Sartorius -----------------------------------------------------------------------


@pattern("markmno/Sartorius", "train.py: Trainer.build_lr_scheduler (CompositeParamScheduler)")
def su_sartorius_nested_composite_on_trainer(E, R):
    """The Sartorius trainer overrides ``DefaultTrainer.build_lr_scheduler`` to return a bare
    fvcore schedule, not an LR scheduler: a ``CompositeParamScheduler`` of a linear ramp
    (1.5 -> 0.75) for the first ``step_iter`` iterations and, after it, another
    ``CompositeParamScheduler`` of equal-length cosine cycles, each a
    ``WarmupParamScheduler`` (``warmup_length = 10 / MAX_ITER`` of its own cycle) over a
    cosine whose start and end shrink by 0.75 per cycle; every phase ``'rescaled'``.
    ``DefaultTrainer`` keeps it as ``self.scheduler`` and its ``build_hooks`` registers
    ``hooks.LRScheduler()`` without arguments, which finds a ``ParamScheduler`` on the
    trainer and wraps it in an ``LRMultiplier`` over ``max_iter`` at ``before_train``; the
    trainer's attribute stays the composite. ``EvalHook`` runs the competition metric. The
    repo's ``FoldTrainer`` also appends a ``BestCheckpointer``; it is left out here (hookloop's
    does not move ``last_checkpoint``: docs/differences.md)."""
    cfg = types.SimpleNamespace(MAX_ITER=24, BASE_LR=0.01, EVAL_PERIOD=6)

    def build_lr_scheduler(cfg, optimizer):
        S = E.solver
        step_iter = 4
        warmup_iter = cfg.MAX_ITER - step_iter
        steps = warmup_iter // 5
        step_scheduler = S.LinearParamScheduler(start_value=1.5, end_value=0.75)
        warmup_scheduler = S.CompositeParamScheduler(
            schedulers=[
                S.WarmupParamScheduler(
                    scheduler=S.CosineParamScheduler((0.75**x), 0.05 * (0.75**x)),
                    warmup_length=1 / cfg.MAX_ITER,
                    warmup_method="linear",
                    warmup_factor=0.05,
                )
                for x in range(steps)
            ],
            lengths=[1 / steps for _ in range(steps)],
            interval_scaling=["rescaled" for _ in range(steps)],
        )
        return S.CompositeParamScheduler(
            schedulers=[step_scheduler, warmup_scheduler],
            lengths=[step_iter / cfg.MAX_ITER, warmup_iter / cfg.MAX_ITER],
            interval_scaling=["rescaled", "rescaled"],
        )

    model = _TinyViTDet(depth=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.BASE_LR, momentum=0.9)
    trainer = E.SimpleTrainer(model, batches(seed=33), optimizer)
    trainer.scheduler = build_lr_scheduler(cfg, optimizer)
    R.rec("schedule", [round(trainer.scheduler(i / cfg.MAX_ITER), 12) for i in range(24)])

    val = list(itertools.islice(batches(seed=34), 2))

    def test():
        model.eval()
        with torch.no_grad():
            score = float(sum(model.head(model.backbone.net.patch_embed(b)).mean() for b in val))
        model.train()
        log.info("MaP IoU at %d: %.6f", trainer.iter, score)
        return {"MaP IoU": score}

    lr_hook = E.hooks.LRScheduler()
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            lr_hook,
            E.hooks.EvalHook(cfg.EVAL_PERIOD, test),
            E.hooks.PeriodicWriter(
                [E.CommonMetricPrinter(cfg.MAX_ITER), E.JSONWriter(R.path("metrics.json"))],
                period=8,
            ),
        ]
    )
    trainer.train(0, cfg.MAX_ITER)
    R.rec("lr", trainer.storage.history("lr").values())
    R.rec("final lr", optimizer.param_groups[0]["lr"])
    R.rec("scheduler types", type(trainer.scheduler).__name__, type(lr_hook.scheduler).__name__)
    R.rec("hook state", _common_state(lr_hook.state_dict()))


# --- facebookresearch/detectron2: build_lr_scheduler with RESCALE_INTERVAL -------------------


@pattern(
    "facebookresearch/detectron2",
    "detectron2/solver/build.py: build_lr_scheduler (WarmupCosineLR, SOLVER.RESCALE_INTERVAL); "
    "detectron2/engine/defaults.py: DefaultTrainer.resume_or_load",
)
def su_d2_rescaled_cosine_hook_state_resume(E, R):
    """``build_lr_scheduler`` for ``WarmupCosineLR`` with ``SOLVER.RESCALE_INTERVAL = True``:
    ``CosineParamScheduler(1, BASE_LR_END / BASE_LR)`` under ``WarmupParamScheduler(...,
    rescale_interval=True)`` (the cosine starts over after the warmup), in an
    ``LRMultiplier`` kept as the trainer's ``scheduler``. ``DefaultTrainer``'s hooks read it
    with ``hooks.LRScheduler()``; its state travels in the trainer's checkpoint through the
    hook's ``state_dict``. The job is preempted before step 7; a new trainer (a new optimizer
    and a new, unstepped scheduler) calls ``resume_or_load(resume=True)``, which loads the
    hook's state into its scheduler ("Loading scheduler from state_dict ..."), and trains on
    from ``iter + 1``; the LRs continue where the first run left them. Launched once more,
    the finished job resumes at ``max_iter`` and runs no step. The storage of resumed runs is
    not recorded (hookloop restores the scalar history: docs/differences.md)."""
    solver = types.SimpleNamespace(
        BASE_LR=0.05,
        BASE_LR_END=0.005,
        WARMUP_FACTOR=0.1,
        WARMUP_ITERS=3,
        WARMUP_METHOD="linear",
        MAX_ITER=12,
        RESCALE_INTERVAL=True,
        CHECKPOINT_PERIOD=4,
    )
    cfg = types.SimpleNamespace(SOLVER=solver, OUTPUT_DIR=R.out)

    def build_lr_scheduler(cfg, optimizer):
        S = E.solver
        end_value = cfg.SOLVER.BASE_LR_END / cfg.SOLVER.BASE_LR
        assert end_value >= 0.0 and end_value <= 1.0, end_value
        sched = S.CosineParamScheduler(1, end_value)
        sched = S.WarmupParamScheduler(
            sched,
            cfg.SOLVER.WARMUP_FACTOR,
            min(cfg.SOLVER.WARMUP_ITERS / cfg.SOLVER.MAX_ITER, 1.0),
            cfg.SOLVER.WARMUP_METHOD,
            cfg.SOLVER.RESCALE_INTERVAL,
        )
        return S.LRMultiplier(optimizer, multiplier=sched, max_iter=cfg.SOLVER.MAX_ITER)

    class Preempted(Exception):
        pass

    def launch(resume, preempt_at=None):
        model = _TinyViTDet(depth=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.SOLVER.BASE_LR, momentum=0.9)
        trainer = E.SimpleTrainer(model, batches(seed=35), optimizer)
        trainer.scheduler = build_lr_scheduler(cfg, optimizer)
        checkpointer = E.Checkpointer(model, cfg.OUTPUT_DIR, trainer=trainer)
        trace = []

        def before_step(t):
            if t.iter == preempt_at:
                raise Preempted(f"preempted at {t.iter}")

        lr_hook = E.hooks.LRScheduler()
        trainer.register_hooks(
            [
                E.hooks.IterationTimer(),
                lr_hook,
                E.hooks.PeriodicCheckpointer(checkpointer, cfg.SOLVER.CHECKPOINT_PERIOD),
                E.hooks.CallbackHook(before_step=before_step),
                _LrTrace(E, optimizer, trace).hook(),
            ]
        )
        R.rec("fresh hook state", _common_state(lr_hook.state_dict()))
        checkpointer.resume_or_load("", resume=resume)
        start_iter = trainer.iter + 1 if resume and checkpointer.has_checkpoint() else 0
        R.rec("start_iter", start_iter, trainer.scheduler.last_epoch)
        R.rec("loaded lr", [round(g["lr"], 12) for g in optimizer.param_groups])
        try:
            trainer.train(start_iter, cfg.SOLVER.MAX_ITER)
        except Preempted as e:
            R.rec("stopped", str(e))
        R.rec("lrs", trace)
        R.rec("hook state", _common_state(copy.deepcopy(lr_hook.state_dict())))
        return trainer

    first = launch(resume=False, preempt_at=7)
    R.rec("first run lr history", first.storage.history("lr").values())
    launch(resume=True)
    launch(resume=True)


# --- facebookresearch/detectron2: tests/test_scheduler.py ------------------------------------


@pattern(
    "facebookresearch/detectron2",
    "tests/test_scheduler.py: TestScheduler.test_warmup_stepwithfixedgamma",
)
def su_d2_test_rescaled_step_with_fixed_gamma(E, R):
    """detectron2's scheduler test builds ``WarmupParamScheduler(StepWithFixedGammaParamScheduler(
    base_value=1.0, gamma=0.1, num_decays=4, num_updates=30), 0.001, 5 / 30,
    rescale_interval=True)`` in an ``LRMultiplier`` over 30 iterations and steps it 29 times
    after ``opt.step()``, comparing the LRs (warmup to 5, then a decay every 5). Run here
    under ``hooks.LRScheduler`` for the whole 30 iterations, as a training script would: the
    hook's last step asks the rescaled step schedule for ``where = 1.0`` and the error from
    it reaches the caller; the LRs before it are the test's.

    The scheduler's ``last_epoch`` after the failing step is not recorded: hookloop's
    ``LRMultiplier`` leaves it where it was, torch's ``step()`` has advanced it (documented)."""
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=5)
    S = E.solver
    multiplier = S.WarmupParamScheduler(
        S.StepWithFixedGammaParamScheduler(base_value=1.0, gamma=0.1, num_decays=4, num_updates=30),
        0.001,
        5 / 30,
        rescale_interval=True,
    )
    sched = S.LRMultiplier(opt, multiplier, 30)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = p

        def forward(self, batch):
            return ((batch[:, :3] - self.p) ** 2).mean()

    trainer = E.SimpleTrainer(Model(), batches(seed=36), opt)
    trainer.register_hooks([E.hooks.LRScheduler(opt, sched)])
    try:
        trainer.train(0, 30)
    finally:
        R.rec("lrs", [round(v, 12) for v, _ in trainer.storage.history("lr").values()])
        R.rec("iter", trainer.iter)
