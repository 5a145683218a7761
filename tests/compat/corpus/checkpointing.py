"""How real code checkpoints and resumes: ``Checkpointer``/``DetectionCheckpointer`` with extra
checkpointables, ``resume_or_load``, ``PeriodicCheckpointer`` driven by hand or as a hook,
checkpointer subclasses, and resuming a trainer mid-run."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd, weights


def _multistep(optimizer):
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[4, 8], gamma=0.5)


class _WithPixelStats(TinyDetector):
    """A detector with the ``pixel_mean``/``pixel_std`` buffers of detectron2's models."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pixel_mean", torch.zeros(4))
        self.register_buffer("pixel_std", torch.ones(4))


def _plain_loop(E, R, model, optimizer, scheduler, periodic, start_iter, max_iter, writers):
    """A plain_train_net-style loop as omni3d's ``do_train`` writes it (no trainer)."""
    data = batches(seed=start_iter + 1)
    with E.EventStorage(start_iter) as storage:
        for iteration in range(start_iter, max_iter):
            storage.iter = iteration
            loss_dict = model(next(data))
            losses = sum(loss_dict.values())
            reduced = {k: v.item() for k, v in loss_dict.items()}
            storage.put_scalars(total_loss=sum(reduced.values()), **reduced)
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
            storage.put_scalar("lr", optimizer.param_groups[0]["lr"], smoothing_hint=False)
            scheduler.step()
            if iteration - start_iter > 1 and (
                (iteration + 1) % 4 == 0 or iteration == max_iter - 1
            ):
                for w in writers:
                    w.write()
            periodic.step(iteration)
        R.storage(storage)


@pattern("facebookresearch/omni3d", "tools/train_net.py: do_train with PeriodicCheckpointerOnlyOne")
def ck_omni3d_only_one_recent(E, R):
    """Cube R-CNN's ``do_train``: a ``DetectionCheckpointer`` with optimizer and scheduler, a
    ``PeriodicCheckpointer`` subclass (cubercnn/solver/checkpoint.py) whose ``step`` always
    writes ``model_recent`` instead of numbered files plus ``model_final``, ``resume_or_load``
    deciding the start iteration, and ``periodic_checkpointer.step(iteration)`` each step."""

    class PeriodicCheckpointerOnlyOne(E.PeriodicCheckpointer):
        def step(self, iteration, **kwargs):
            iteration = int(iteration)
            state = {"iteration": iteration}
            state.update(kwargs)
            if (iteration + 1) % self.period == 0:
                self.checkpointer.save("{}_recent".format(self.file_prefix), **state)
            if self.max_iter is not None and iteration >= self.max_iter - 1:
                self.checkpointer.save(f"{self.file_prefix}_final", **state)

    model = TinyDetector()
    optimizer = sgd(model)
    scheduler = _multistep(optimizer)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)
    periodic = PeriodicCheckpointerOnlyOne(checkpointer, 3, max_iter=10)
    start_iter = checkpointer.resume_or_load("", resume=True).get("iteration", -1) + 1
    log.info("Starting training from iteration {}".format(start_iter))
    writers = [E.JSONWriter(R.path("metrics.json"))]
    _plain_loop(E, R, model, optimizer, scheduler, periodic, start_iter, 10, writers)
    for w in writers:
        w.close()
    R.rec("last", checkpointer.get_checkpoint_file(), sorted(os.listdir(R.out)))


@pattern("facebookresearch/omni3d", "tools/train_net.py: main's retry loop after a diverging run")
def ck_omni3d_retry_resumes_last(E, R):
    """When training diverges, omni3d's ``do_train`` returns False and ``main`` builds a new
    model and calls ``do_train(..., resume=True)`` again: the new ``DetectionCheckpointer``
    finds ``last_checkpoint``, loads model, optimizer and scheduler, and the loop restarts at
    the saved iteration + 1."""

    def do_train(resume, stop_at):
        model = TinyDetector()
        optimizer = sgd(model)
        scheduler = _multistep(optimizer)
        checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, scheduler=scheduler)
        periodic = E.PeriodicCheckpointer(checkpointer, 4, max_iter=12)
        start_iter = checkpointer.resume_or_load("", resume=resume).get("iteration", -1) + 1
        R.rec("start", start_iter, optimizer.param_groups[0]["lr"], scheduler.last_epoch)
        _plain_loop(E, R, model, optimizer, scheduler, periodic, start_iter, stop_at, [])
        return model

    do_train(resume=False, stop_at=6)  # "diverged" after iteration 5: model_0000003 saved
    log.info("!! Restarting training !!")
    model = do_train(resume=True, stop_at=12)
    R.rec("weights", weights(model))
    R.rec("files", sorted(os.listdir(R.out)))


@pattern("facebookresearch/omni3d", "tools/train_net.py: WEIGHTS_PRETRAIN then resume_or_load")
def ck_omni3d_pretrain_then_resume(E, R):
    """omni3d first loads ``MODEL.WEIGHTS_PRETRAIN`` with ``checkpointables=[]`` (model only,
    the pretrained file's optimizer state ignored), then ``resume_or_load(MODEL.WEIGHTS)``
    on an empty output folder: it loads the given weights (again model only) and returns
    their extra data, whose ``iteration`` then sets the start."""
    pre_dir = R.path("pretrain", "x")[:-2]
    donor = TinyDetector()
    donor_opt = sgd(donor)
    donor(next(batches()))["loss_cls"].backward()
    donor_opt.step()
    E.Checkpointer(donor, pre_dir, optimizer=donor_opt).save("pretrain", iteration=99, note="x")

    model = TinyDetector()
    optimizer = sgd(model)
    out = R.path("run", "x")[:-2]
    checkpointer = E.Checkpointer(model, out, optimizer=optimizer)
    extra = checkpointer.load(os.path.join(pre_dir, "pretrain.pth"), checkpointables=[])
    R.rec("pretrain extra", sorted(extra), extra.get("iteration"))
    R.rec("optimizer state", len(optimizer.state_dict()["state"]))
    R.rec("has checkpoint", checkpointer.has_checkpoint())
    loaded = checkpointer.resume_or_load(os.path.join(pre_dir, "pretrain.pth"), resume=True)
    start_iter = loaded.get("iteration", -1) + 1
    R.rec("start", start_iter, sorted(loaded))
    R.rec(
        "weights equal",
        all(torch.equal(a, b) for a, b in zip(weights(model).values(), weights(donor).values())),
    )
    R.rec("empty path", checkpointer.resume_or_load("", resume=False))


class _IterativeSGHook:
    """ubc-vision/IterativeSG's ``PeriodicCheckpointerWithEval``, built on ``E``."""

    @staticmethod
    def make(E):
        class PeriodicCheckpointerWithEval(E.HookBase):
            def __init__(
                self, eval_period, eval_function, checkpointer, checkpoint_period, max_to_keep=5
            ):
                self.eval = E.hooks.EvalHook(eval_period, eval_function)
                self.checkpointer = E.hooks.PeriodicCheckpointer(
                    checkpointer, checkpoint_period, max_to_keep=max_to_keep
                )
                self.best_ap = 0.0
                best_path = os.path.join(checkpointer.save_dir, "best_model_final.pth.pth")
                if os.path.isfile(best_path):
                    self.best_ap = torch.load(best_path, map_location="cpu", weights_only=False)[
                        "AP50"
                    ]
                    print("BEST AP: ", self.best_ap)

            def before_train(self):
                self.max_iter = self.trainer.max_iter
                self.checkpointer.max_iter = self.trainer.max_iter

            def after_step(self):
                next_iter = self.trainer.iter + 1
                is_final = next_iter == self.trainer.max_iter
                if is_final or (self.eval._period > 0 and next_iter % self.eval._period == 0):
                    results = self.eval._func()
                    current = results["bbox"]["AP50"]
                    if current > self.best_ap:
                        self.best_ap = current
                        state = {"iteration": self.trainer.iter, "AP50": self.best_ap}
                        self.checkpointer.checkpointer.save("best_model_final.pth", **state)
                self.checkpointer.step(self.trainer.iter)

            def after_train(self):
                del self.eval._func

        return PeriodicCheckpointerWithEval


def _iterativesg_run(E, R, start_iter, max_iter, resume, max_to_keep=1):
    model = TinyDetector()
    optimizer = sgd(model)
    trainer = E.SimpleTrainer(model, batches(seed=3), optimizer)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer, trainer=trainer)
    scores = iter([0.3, 0.5, 0.4, 0.6, 0.2, 0.7])

    def test_and_save_results():
        return {"bbox": {"AP50": next(scores)}}

    hook_cls = _IterativeSGHook.make(E)
    hooks = [
        E.hooks.IterationTimer(),
        hook_cls(3, test_and_save_results, checkpointer, 4, max_to_keep=max_to_keep),
    ]
    if not resume:  # a resumed run's smoothed metrics differ by design (see the report)
        hooks.append(E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=4))
    trainer.register_hooks(hooks)
    if resume:
        checkpointer.resume_or_load("", resume=True)
        if checkpointer.has_checkpoint():
            start_iter = trainer.iter + 1
    trainer.train(start_iter, max_iter)
    return trainer, checkpointer


@pattern(
    "ubc-vision/IterativeSG", "checkpoint/periodic_checkpointer.py: PeriodicCheckpointerWithEval"
)
def ck_iterativesg_eval_checkpointer(E, R):
    """IterativeSG wraps ``hooks.EvalHook`` and ``hooks.PeriodicCheckpointer(max_to_keep=1)``
    in one hook: it sets the inner hook's ``max_iter`` itself, saves
    ``best_model_final.pth.pth`` through ``self.checkpointer.checkpointer.save`` with the
    score as extra data when the score improves (which also moves ``last_checkpoint``), and
    steps the periodic checkpointer by hand after every iteration."""
    trainer, checkpointer = _iterativesg_run(E, R, 0, 12, resume=False)
    R.rec("last", checkpointer.get_checkpoint_file())
    R.rec("files", sorted(os.listdir(R.out)))
    R.rec("iter", trainer.iter)


@pattern("ubc-vision/IterativeSG", "train_iterative_model.py: --resume after the best-model save")
def ck_iterativesg_resume_after_best(E, R):
    """Resuming IterativeSG (DefaultTrainer.resume_or_load): ``last_checkpoint`` names the
    best-model file when the best score came last, so the resume loads that file's trainer
    state (its iteration) and the new hook reads the best AP back from the file."""
    _iterativesg_run(E, R, 0, 9, resume=False, max_to_keep=5)
    R.rec(
        "last after first run",
        os.path.basename(E.Checkpointer(nn.Linear(1, 1), R.out).get_checkpoint_file()),
    )
    trainer, checkpointer = _iterativesg_run(E, R, 0, 14, resume=True, max_to_keep=5)
    R.rec("start", trainer.start_iter, "end", trainer.iter)
    R.rec("files", sorted(os.listdir(R.out)))
    R.rec("weights", weights(trainer.model))


@pattern("iYuqinL/imcls", "imcls/checkpoint/cls_checkpoint.py: ClsCheckpointer._load_file")
def ck_imcls_raw_state_dict(E, R):
    """imcls's ``ClsCheckpointer`` wraps a file that holds a bare ``state_dict`` (a
    torchvision backbone) as ``{"model": loaded}``; loading one saved from a model with other
    module names logs fvcore's missing and unexpected keys and loads the rest."""

    class ClsCheckpointer(E.Checkpointer):
        def _load_file(self, filename):
            loaded = super()._load_file(filename)
            if "model" not in loaded:
                loaded = {"model": loaded}
            return loaded

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Linear(4, 3)
            self.fc = nn.Linear(3, 2)
            self.extra = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))

    src = TinyDetector()
    torch.save(src.state_dict(), R.path("backbone.pth"))
    model = Classifier()
    ck = ClsCheckpointer(model, R.path("out", "x")[:-2])
    extra = ck.load(R.path("backbone.pth"))
    R.rec("extra", extra)
    R.rec("backbone loaded", torch.equal(model.backbone.weight, src.backbone.weight))
    R.rec("fc kept", model.fc.weight.shape)


@pattern("iYuqinL/imcls", "imcls/engine/hooks.py + engine/defaults.py: PeriodicCheckpointer hook")
def ck_imcls_periodic_hook(E, R):
    """imcls's trainer registers detectron2's hooks (timer, LR scheduler, the
    ``PeriodicCheckpointer`` hook with ``max_to_keep``, a writer) and a checkpointer holding
    the optimizer, the scheduler and the trainer itself: every periodic file carries the
    trainer's state (its iteration) and old files are deleted."""
    model = TinyDetector()
    optimizer = sgd(model)
    scheduler = _multistep(optimizer)
    trainer = E.SimpleTrainer(model, batches(seed=5), optimizer)
    checkpointer = E.Checkpointer(
        model, R.out, optimizer=optimizer, scheduler=scheduler, trainer=trainer
    )
    trainer.register_hooks(
        [
            E.hooks.IterationTimer(),
            E.hooks.LRScheduler(optimizer, scheduler),
            E.hooks.PeriodicCheckpointer(checkpointer, 3, max_to_keep=2),
            E.hooks.PeriodicWriter([E.JSONWriter(R.path("metrics.json"))], period=3),
        ]
    )
    trainer.train(0, 11)
    R.rec("files", sorted(os.listdir(R.out)))
    R.rec("all", [os.path.basename(f) for f in sorted(checkpointer.get_all_checkpoint_files())])
    R.rec("lr", optimizer.param_groups[0]["lr"])


@pattern("jojo23333/LatetHOI", "d2/engine/checkpoints.py: GeneralCheckpointer._load_model")
def ck_latethoi_general_checkpointer(E, R):
    """LatetHOI's ``GeneralCheckpointer`` (detectron2's ``DetectionCheckpointer`` trimmed):
    ``load`` logs its own line first and fills in ``{"model": ...}`` for bare state dicts;
    ``_load_model`` calls fvcore's and then drops ``pixel_mean``/``pixel_std`` from the
    missing keys and ``anchor_generator.cell_anchors`` from the unexpected ones, before
    fvcore logs what remains."""

    class GeneralCheckpointer(E.Checkpointer):
        def load(self, path, *args, **kwargs):
            logging.getLogger("corpus.latethoi").info(
                "[DetectionCheckpointer] Loading from {} ...".format(path)
            )
            return super().load(path, *args, **kwargs)

        def _load_file(self, filename):
            loaded = super()._load_file(filename)
            if "model" not in loaded:
                loaded = {"model": loaded}
            return loaded

        def _load_model(self, checkpoint):
            incompatible = super()._load_model(checkpoint)
            model_buffers = dict(self.model.named_buffers(recurse=False))
            for k in ["pixel_mean", "pixel_std"]:
                if k in model_buffers:
                    try:
                        incompatible.missing_keys.remove(k)
                    except ValueError:
                        pass
            for k in incompatible.unexpected_keys[:]:
                if "anchor_generator.cell_anchors" in k:
                    incompatible.unexpected_keys.remove(k)
            return incompatible

    old = TinyDetector().state_dict()
    old["anchor_generator.cell_anchors.0"] = torch.ones(2)
    old["roi_heads.box_predictor.weight"] = torch.ones(2, 2)
    old["head.weight"] = torch.ones(2, 3)  # wrong shape: skipped with a warning
    torch.save({"model": old, "iteration": 5}, R.path("old.pth"))
    model = _WithPixelStats()
    ck = GeneralCheckpointer(model, R.path("out", "x")[:-2])
    R.rec("extra", ck.load(R.path("old.pth")))
    torch.save(TinyDetector().state_dict(), R.path("bare.pth"))
    R.rec("bare extra", ck.load(R.path("bare.pth")))
    R.rec("weights", weights(model))


def _vfmseg_trainer(E, R, max_iter, out=None, write=True):
    out = out or R.out
    model = TinyDetector()
    optimizer = sgd(model)
    trainer = E.SimpleTrainer(model, batches(seed=7), optimizer)
    checkpointer = E.Checkpointer(model, out, optimizer=optimizer, trainer=trainer)
    hooks = [
        E.hooks.IterationTimer(),
        E.hooks.PeriodicCheckpointer(checkpointer, 5, max_iter=max_iter),
    ]
    if write:
        hooks.append(
            E.hooks.PeriodicWriter([E.JSONWriter(os.path.join(out, "metrics.json"))], period=5)
        )
    trainer.register_hooks(hooks)
    return trainer, checkpointer


@pattern("A1ex-Chen/DL_project_log", "VFMSeg/VFM/detectron2/engine/defaults_resume_or_load.py")
def ck_vfmseg_trainer_resume_or_load(E, R):
    """VFMSeg's copy of ``DefaultTrainer.resume_or_load``: the checkpointer holds the trainer,
    ``resume_or_load(WEIGHTS, resume=True)`` restores its iteration, and ``if resume and
    has_checkpoint(): start_iter = iter + 1``. A run stopped after its iteration-9 checkpoint
    (an exception in a hook before step 10) resumes there and ends with the weights of a run
    that never stopped (its data stream restarts, as a new data loader's would)."""

    class Crash(E.HookBase):
        def before_step(self):
            if self.trainer.iter == 10:
                raise RuntimeError("preempted at iteration 10")

    # The uninterrupted run first: hookloop's resume also restores torch's RNG (see the report).
    straight, _ = _vfmseg_trainer(E, R, 15, out=R.path("straight", "x")[:-2])
    straight.train(0, 15)

    trainer, _ = _vfmseg_trainer(E, R, 15)
    trainer.register_hooks([Crash()])
    try:
        trainer.train(0, 15)
    except RuntimeError as e:
        R.rec("stopped", str(e), trainer.iter)

    trainer, checkpointer = _vfmseg_trainer(E, R, 15, write=False)
    checkpointer.resume_or_load("unused.pth", resume=True)
    start_iter = 0
    if checkpointer.has_checkpoint():
        start_iter = trainer.iter + 1
    R.rec("resume at", start_iter, checkpointer.get_checkpoint_file())
    trainer.train(start_iter, 15)
    R.rec("weights", weights(trainer.model))
    R.rec("latest names", sorted(trainer.storage.latest()))
    R.rec(
        "same as uninterrupted",
        [
            torch.equal(a, b)
            for a, b in zip(weights(straight.model).values(), weights(trainer.model).values())
        ],
    )


@pattern(
    "A1ex-Chen/DL_project_log",
    "VFMSeg/VFM/detectron2/engine/defaults_resume_or_load.py: resume=False",
)
def ck_vfmseg_fresh_load(E, R):
    """``resume_or_load(WEIGHTS, resume=False)`` with a checkpoint in the output folder loads
    only the model from WEIGHTS: the trainer's iteration and the optimizer stay as built, and
    training starts at 0 (the extra data comes back with the file's iteration)."""
    trainer, checkpointer = _vfmseg_trainer(E, R, 5)
    trainer.train(0, 5)
    weights_file = checkpointer.get_checkpoint_file()

    model = TinyDetector()
    optimizer = sgd(model, lr=0.05)
    trainer2 = E.SimpleTrainer(model, batches(seed=8), optimizer)
    ck2 = E.Checkpointer(model, R.out, optimizer=optimizer, trainer=trainer2)
    extra = ck2.resume_or_load(weights_file, resume=False)
    R.rec("extra", sorted(extra), trainer2.iter, optimizer.param_groups[0]["lr"])
    R.rec("optimizer state", len(optimizer.state_dict()["state"]))
    R.rec(
        "same weights",
        all(
            torch.equal(a, b)
            for a, b in zip(weights(model).values(), weights(trainer.model).values())
        ),
    )


@pattern(
    "daixinghome/Distill_GID_detectron2", "RetinaNet_Res50/train.sh: resume if last_checkpoint"
)
def ck_distill_gid_resume_if_last_checkpoint(E, R):
    """Distill_GID's train.sh resumes (``--resume``) only when ``<output>/last_checkpoint``
    exists; the training script then calls ``resume_or_load``. Two launches: the first finds no
    checkpoint and starts from scratch, the second resumes from the file that
    ``last_checkpoint`` names and trains to the end."""

    def launch(max_iter):
        resume = os.path.isfile(os.path.join(R.out, "last_checkpoint"))
        log.info("Resume training" if resume else "Train from beginning")
        trainer, checkpointer = _vfmseg_trainer(E, R, max_iter, write=not resume)
        R.rec("has checkpoint", checkpointer.has_checkpoint(), checkpointer.get_checkpoint_file())
        checkpointer.resume_or_load("", resume=resume)
        start = trainer.iter + 1 if resume and checkpointer.has_checkpoint() else 0
        trainer.train(start, max_iter)
        return trainer

    launch(7)  # stops at 7: model_0000004 and model_final (iteration 6)
    trainer = launch(12)
    R.rec("start", trainer.start_iter, trainer.iter)
    R.rec("files", sorted(os.listdir(R.out)))
    with open(os.path.join(R.out, "last_checkpoint")) as f:
        R.rec("last_checkpoint", f.read())


@pattern("jojo23333/LatetHOI", "d2/engine/checkpoints.py: best model tagged by hand")
def ck_latethoi_tag_last_checkpoint(E, R):
    """A ``GeneralCheckpointer`` user that saves a best model and then points
    ``last_checkpoint`` back at the latest periodic file with ``tag_last_checkpoint``, so a
    resume continues from the newest state rather than the best one."""
    model = TinyDetector()
    optimizer = sgd(model)
    checkpointer = E.Checkpointer(model, R.out, optimizer=optimizer)
    periodic = E.PeriodicCheckpointer(
        checkpointer, 2, max_iter=6, max_to_keep=2, file_prefix="ckpt"
    )
    data = batches(seed=9)
    best = None
    with E.EventStorage(0) as storage:
        for it in range(6):
            storage.iter = it
            loss = sum(model(next(data)).values())
            storage.put_scalar("total_loss", loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            periodic.step(it)
            if best is None or loss.item() < best:
                best = loss.item()
                latest = checkpointer.get_checkpoint_file()
                checkpointer.save("model_best", iteration=it, best=best)
                if latest:
                    checkpointer.tag_last_checkpoint(os.path.basename(latest))
            R.rec(it, os.path.basename(checkpointer.get_checkpoint_file()))
        R.storage(storage)
    R.rec("files", sorted(os.listdir(R.out)))
    fresh = E.Checkpointer(TinyDetector(), R.out)
    R.rec("resume extra", sorted(fresh.resume_or_load("", resume=True)))
