"""The hooks ``PeriodicCheckpointer``, ``BestCheckpointer`` and ``EvalHook`` in a training loop."""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import weakref

import numpy as np
import pytest
import torch
from hookloop.checkpoint import Checkpointer
from hookloop.checkpoint.checkpointer import _save_with
from hookloop.engine import (
    BestCheckpointer,
    EvalHook,
    HookBase,
    PeriodicCheckpointer,
    TrainerBase,
)
from hookloop.engine import hooks as hooks_module
from torch import nn

torch.set_num_threads(1)

HOOKS_LOGGER = "hookloop.engine.hooks"


class Trainer(TrainerBase):
    """Adds 1 to the weight at each step; raises at iteration ``fail_at``."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.model.weight.zero_()
        self.fail_at = fail_at

    def run_step(self):
        if self.iter == self.fail_at:
            raise RuntimeError(f"boom at {self.iter}")
        with torch.no_grad():
            self.model.weight.add_(1)


def _pth(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".pth")) if os.path.isdir(d) else []


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _train(trainer, start, stop):
    if trainer.fail_at is not None and start <= trainer.fail_at < stop:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train(start, stop)
    else:
        trainer.train(start, stop)


# ----------------------------------------------------------------------------------------------
# PeriodicCheckpointer


@pytest.mark.parametrize(
    "period,max_iter,fail_at,expected",
    [
        (1, 3, None, ["model_0000000.pth", "model_0000001.pth", "model_0000002.pth"]),
        (4, 10, None, ["model_0000003.pth", "model_0000007.pth"]),  # period does not divide
        (5, 10, None, ["model_0000004.pth", "model_0000009.pth"]),  # the last is periodic too
        (4, 10, 9, ["model_0000003.pth", "model_0000007.pth"]),  # fails in the last step
        (4, 10, 5, ["model_0000003.pth"]),
    ],
)
def test_periodic_checkpointer_hook(tmp_path, period, max_iter, fail_at, expected):
    trainer = Trainer(fail_at)
    ckpt = Checkpointer(trainer.model, str(tmp_path))
    hook = PeriodicCheckpointer(ckpt, period)
    trainer.register_hooks([hook])
    _train(trainer, 0, max_iter)
    assert hook.max_iter == max_iter
    finished = fail_at is None
    assert _pth(tmp_path) == sorted(expected + (["model_final.pth"] if finished else []))
    last = ckpt.get_checkpoint_file()
    if finished:
        assert last == str(tmp_path / "model_final.pth")
        final = _load(last)
        assert final["iteration"] == max_iter - 1
        assert final["model"]["weight"].item() == max_iter  # after the last step
    else:
        assert last == str(tmp_path / expected[-1])
    for name in expected:
        it = int(name[6:13])
        saved = _load(tmp_path / name)
        assert saved["iteration"] == it
        assert saved["model"]["weight"].item() == it + 1


def test_periodic_checkpointer_hook_resumed_at_max_iter_saves_nothing(tmp_path):
    trainer = Trainer()
    trainer.register_hooks([PeriodicCheckpointer(Checkpointer(trainer.model, str(tmp_path)), 1)])
    trainer.train(5, 5)
    assert _pth(tmp_path) == []


def test_periodic_checkpointer_hook_overrides_only_its_stages(tmp_path):
    hook = PeriodicCheckpointer(Checkpointer(nn.Linear(1, 1), str(tmp_path)), 1)
    cls = type(hook)
    assert cls.before_step is HookBase.before_step
    assert cls.after_backward is HookBase.after_backward
    for hook_cls in (BestCheckpointer, EvalHook):
        assert hook_cls.before_step is HookBase.before_step
        assert hook_cls.before_train is HookBase.before_train
        assert hook_cls.after_backward is HookBase.after_backward


def test_periodic_checkpointer_hook_async_waits_at_end(tmp_path):
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), async_save=True, trainer=trainer)
    trainer.register_hooks([PeriodicCheckpointer(ckpt, 2, max_to_keep=2)])
    trainer.train(0, 7)
    assert ckpt._pending is None  # after_train waited
    assert _pth(tmp_path) == ["model_0000003.pth", "model_0000005.pth", "model_final.pth"]
    assert _load(tmp_path / "model_0000005.pth")["model"]["weight"].item() == 6


def test_periodic_checkpointer_hook_async_error_raised_at_end(tmp_path):
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), async_save=True)
    hook = PeriodicCheckpointer(ckpt, 3)
    trainer.register_hooks([hook])
    state = {"n": 0}

    class Flaky:
        def state_dict(self):
            state["n"] += 1
            return {"fn": (lambda: 0) if state["n"] == 2 else 0}

        def load_state_dict(self, sd):
            pass

    ckpt.add_checkpointable("flaky", Flaky())
    # The second save (the final one) fails to pickle on the background thread.
    with pytest.raises(Exception, match="lambda|pickle"):
        trainer.train(0, 4)
    assert _pth(tmp_path) == ["model_0000002.pth"]


def test_periodic_checkpointer_hook_state_round_trip(tmp_path):
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), trainer=trainer)
    trainer.register_hooks([PeriodicCheckpointer(ckpt, 2, max_to_keep=2)])
    trainer.train(0, 6)
    saved = _load(tmp_path / "model_0000005.pth")
    assert saved["trainer"]["iteration"] == 5
    # Stateless as detectron2's hook (whose trainer would fail to load a state for it).
    assert "PeriodicCheckpointer" not in saved["trainer"].get("hooks", {})

    trainer2 = Trainer()
    ckpt2 = Checkpointer(trainer2.model, str(tmp_path), trainer=trainer2)
    hook2 = PeriodicCheckpointer(ckpt2, 2, max_to_keep=2)
    trainer2.register_hooks([hook2])
    ckpt2.load(str(tmp_path / "model_0000005.pth"))
    assert trainer2.iter == 5
    assert trainer2.model.weight.item() == 6
    # The files of the first run are found on disk: max_to_keep still holds after resuming.
    trainer2.train(6, 10)
    assert _pth(tmp_path) == ["model_0000007.pth", "model_0000009.pth", "model_final.pth"]
    # An older hookloop checkpoint's hook state still loads.
    hook2.load_state_dict({"recent_checkpoints": ["model_0000007.pth"]})
    assert hook2.recent_checkpoints == [str(tmp_path / "model_0000007.pth")]


# ----------------------------------------------------------------------------------------------
# EvalHook


class Scripted:
    """An eval function that returns the next of ``results`` and records the iteration."""

    def __init__(self, trainer, results):
        self.trainer = trainer
        self.results = list(results)
        self.calls = []

    def __call__(self):
        self.calls.append(self.trainer.iter)
        return self.results.pop(0) if self.results else {"m": 0.0}


@pytest.mark.parametrize(
    "period,max_iter,fail_at,after_train,calls",
    [
        (0, 5, None, True, [5]),  # period 0: only after training
        (0, 5, None, False, []),
        (1, 3, None, True, [0, 1, 3]),  # not at the last iteration, then after training
        (4, 10, None, True, [3, 7, 10]),  # period does not divide max_iter
        (5, 10, None, True, [4, 10]),
        (4, 10, 9, True, [3, 7]),  # failed in the last step: no final eval
        (4, 10, 5, True, [3]),
        (3, 10, None, False, [2, 5, 8]),
    ],
)
def test_eval_hook_schedule(period, max_iter, fail_at, after_train, calls):
    trainer = Trainer(fail_at)
    fn = Scripted(trainer, [])
    trainer.register_hooks([EvalHook(period, fn, eval_after_train=after_train)])
    _train(trainer, 0, max_iter)
    assert fn.calls == calls
    if calls:
        assert [it for _, it in trainer.storage.history("m").values()] == calls


def test_a_trainers_own_loop_gets_the_evaluation_after_training(tmp_path):
    """Semi-supervised trainers (Unbiased Teacher and its copies) run their own loop, copied
    from detectron2's without the final ``self.iter += 1``: after training ``iter`` is
    ``max_iter - 1``, and detectron2's hooks still evaluate (``iter + 1 >= max_iter``)."""
    from hookloop.utils.events import EventStorage

    class OwnLoop(Trainer):
        def train_loop(self, start_iter, max_iter):
            self.iter = self.start_iter = start_iter
            self.max_iter = max_iter
            with EventStorage(start_iter) as self.storage:
                try:
                    self.before_train()
                    for self.iter in range(start_iter, max_iter):
                        self.before_step()
                        self.run_step()
                        self.after_step()
                finally:
                    self.after_train()

    trainer = OwnLoop()
    fn = Scripted(trainer, [{"m": 0.5}, {"m": 0.9}])
    best = BestCheckpointer(4, Checkpointer(trainer.model, str(tmp_path)), "m")
    trainer.register_hooks([EvalHook(4, fn), best])
    trainer.train_loop(0, 6)
    assert fn.calls == [3, 5]  # after step 3, and after training (iter 5)
    assert (best.best_metric, best.best_iter) == (0.9, 5)


def test_eval_hook_flattens_and_puts_unsmoothed():
    trainer = Trainer()
    results = {
        "bbox": {"AP": 40.5, "AP50": np.float32(60.25), "per": {"cat": torch.tensor(3.0)}},
        "acc": 1,
    }
    trainer.register_hooks([EvalHook(0, lambda: results)])
    trainer.train(0, 2)
    latest = trainer.storage.latest()
    assert latest["bbox/AP"] == (40.5, 2)
    assert latest["bbox/AP50"] == (60.25, 2)
    assert latest["bbox/per/cat"] == (3.0, 2)
    assert latest["acc"] == (1.0, 2)
    hints = trainer.storage.smoothing_hints()
    assert not any(hints[k] for k in ("bbox/AP", "bbox/AP50", "bbox/per/cat", "acc"))


@pytest.mark.parametrize(
    "result,exc,match",
    [
        ({"a": {"b": "high"}}, ValueError, r"Got 'a/b: high' instead"),
        ({"a": None}, ValueError, r"Got 'a: None' instead"),
        ({"a": [1.0, 2.0]}, ValueError, r"Got 'a: \[1.0, 2.0\]' instead"),
        ({"a": torch.ones(2)}, ValueError, r"Got 'a: tensor"),
        ([("a", 1.0)], TypeError, "must return a dict"),
        ({"a": {3: 1.0}}, TypeError, "not a str: 3 under 'a'"),
    ],
)
def test_eval_hook_bad_results(result, exc, match):
    trainer = Trainer()
    trainer.register_hooks([EvalHook(1, lambda: result)])
    with pytest.raises(exc, match=match):
        trainer.train(0, 3)


def test_eval_hook_empty_result_still_synchronizes(monkeypatch):
    syncs = []
    monkeypatch.setattr(hooks_module.comm, "synchronize", lambda: syncs.append(1))
    trainer = Trainer()
    trainer.register_hooks([EvalHook(2, lambda: None)])
    trainer.train(0, 5)
    assert len(syncs) == 3  # iterations 1, 3 and after training
    assert "m" not in trainer.storage.histories()


@pytest.mark.parametrize("fail_at", [None, 1])
def test_eval_hook_drops_eval_function_after_training(fail_at):
    class Fn:
        def __call__(self):
            return {"m": 1.0}

    fn = Fn()
    ref = weakref.ref(fn)
    trainer = Trainer(fail_at)
    hook = EvalHook(1, fn)
    trainer.register_hooks([hook])
    del fn
    _train(trainer, 0, 3)
    gc.collect()
    assert ref() is None
    assert not hasattr(hook, "_func")


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((-1, lambda: None), ValueError, "eval_period must be >= 0"),
        (("2", lambda: None), TypeError, "eval_period must be an int"),
        ((True, lambda: None), TypeError, "eval_period must be an int"),
        ((1, "not callable"), TypeError, "eval_function must be callable"),
    ],
)
def test_eval_hook_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        EvalHook(*args)


# ----------------------------------------------------------------------------------------------
# BestCheckpointer


def _best_run(tmp_path, values, *, period=2, max_iter=None, mode="max", fail_at=None, hooks=()):
    """Evaluates ``values`` in order (every ``period`` iterations and after training)."""
    trainer = Trainer(fail_at)
    ckpt = Checkpointer(trainer.model, str(tmp_path), trainer=trainer)
    fn = Scripted(trainer, [{"val": {"acc": v}} if v is not None else {} for v in values])
    best = BestCheckpointer(period, ckpt, "val/acc", mode=mode)
    if max_iter is None:
        max_iter = period * len(values)
    trainer.register_hooks([EvalHook(period, fn), best, *hooks])
    _train(trainer, 0, max_iter)
    return trainer, ckpt, best


def _best_file(tmp_path):
    saved = _load(tmp_path / "model_best.pth")
    return saved["iteration"], saved["model"]["weight"].item()


def test_best_checkpointer_saves_first_then_strict_improvements(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    saves = []
    orig = Checkpointer.save

    def spy(self, name, **kw):
        saves.append((name, kw["iteration"]))
        return orig(self, name, **kw)

    Checkpointer.save = spy
    try:
        # evals at iterations 1, 3, 5, 7, 9 and after training (12)
        _, ckpt, best = _best_run(tmp_path, [0.5, 0.5, 0.7, 0.6, 0.6, 0.8])
    finally:
        Checkpointer.save = orig
    assert saves == [("model_best", 1), ("model_best", 5), ("model_best", 12)]
    assert (best.best_metric, best.best_iter) == (0.8, 12)
    assert _best_file(tmp_path) == (12, 12.0)
    assert "Saved first model at 0.50000 @ 1 steps" in caplog.text
    assert "not better than best score 0.70000 @ iteration 5" in caplog.text
    # Saving the best model does not move last_checkpoint.
    assert not ckpt.has_checkpoint()


def test_best_checkpointer_min_mode(tmp_path):
    _, _, best = _best_run(tmp_path, [3.0, 1.0, 2.0], mode="min")
    assert (best.best_metric, best.best_iter) == (1.0, 3)
    assert _best_file(tmp_path) == (3, 4.0)


@pytest.mark.parametrize("mode", ["max", "min"])
def test_best_checkpointer_nan_and_inf_are_never_best(tmp_path, mode, caplog):
    inf = math.inf if mode == "max" else -math.inf
    _, _, best = _best_run(tmp_path, [math.nan, inf, 0.5, math.nan, inf, -inf], mode=mode)
    assert (best.best_metric, best.best_iter) == (0.5, 5)
    assert _best_file(tmp_path) == (5, 6.0)
    assert "which is never the best" in caplog.text


def test_best_checkpointer_only_nan_saves_nothing(tmp_path):
    _, _, best = _best_run(tmp_path, [math.nan, math.nan])
    assert best.best_metric is None and best.best_iter is None
    assert _pth(tmp_path) == []


def test_best_checkpointer_missing_metric_warns(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=HOOKS_LOGGER)
    _, _, best = _best_run(tmp_path, [None, None])
    assert best.best_metric is None
    assert _pth(tmp_path) == []
    assert "Given val metric val/acc does not seem to be computed/stored" in caplog.text


def test_best_checkpointer_stale_metric_is_not_better(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    # The metric is produced at the first evaluation only: the later checks compare that value
    # again, which is not better than itself (detectron2's decision and message).
    _, _, best = _best_run(tmp_path, [0.5, None, None])
    assert (best.best_metric, best.best_iter) == (0.5, 1)
    said = [r.getMessage() for r in caplog.records if "val/acc" in r.getMessage()]
    assert said == 2 * [
        "Not saving as latest eval score for val/acc is 0.50000, not better than best score "
        "0.50000 @ iteration 1."
    ]


def test_best_checkpointer_no_final_check_after_exception(tmp_path):
    # evals at 1, 3; the run fails at iteration 4, so there is no check after training
    _, _, best = _best_run(tmp_path, [0.5, 0.6, 0.9], max_iter=6, fail_at=4)
    assert (best.best_metric, best.best_iter) == (0.6, 3)


def test_best_checkpointer_with_periodic_keeps_last_checkpoint(tmp_path):
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), trainer=trainer)
    fn = Scripted(trainer, [{"acc": v} for v in (0.1, 0.9, 0.2)])
    trainer.register_hooks(
        [EvalHook(2, fn), BestCheckpointer(2, ckpt, "acc"), PeriodicCheckpointer(ckpt, 3)]
    )
    trainer.train(0, 5)  # periodic at 2; evals at 1, 3 and 5; the best is from iteration 3
    assert _pth(tmp_path) == ["model_0000002.pth", "model_best.pth", "model_final.pth"]
    assert ckpt.get_checkpoint_file() == str(tmp_path / "model_final.pth")
    assert _best_file(tmp_path) == (3, 4.0)


def test_best_checkpointer_resumed_does_not_overwrite_a_better_model(tmp_path):
    trainer, _, best = _best_run(tmp_path, [0.5, 0.9, 0.7])
    state = trainer.state_dict()["hookloop_hooks"]["BestCheckpointer"]
    assert state == {"best_metric": 0.9, "best_iter": 3}
    before = (tmp_path / "model_best.pth").read_bytes()

    trainer2 = Trainer()
    ckpt2 = Checkpointer(trainer2.model, str(tmp_path))
    best2 = BestCheckpointer(2, ckpt2, "val/acc")
    best2.load_state_dict(state)
    fn = Scripted(trainer2, [{"val": {"acc": v}} for v in (0.8, 0.85)])
    trainer2.register_hooks([EvalHook(2, fn), best2])
    trainer2.train(7, 10)  # evals at 7 and after training (10)
    assert (best2.best_metric, best2.best_iter) == (0.9, 3)
    assert (tmp_path / "model_best.pth").read_bytes() == before


def test_best_checkpointer_state_round_trip():
    best = BestCheckpointer(1, Checkpointer(nn.Linear(1, 1)), "m")
    assert best.state_dict() == {"best_metric": None, "best_iter": None}
    # A state saved by an earlier build also held the iteration last checked: ignored.
    best.load_state_dict({"best_metric": 0.25, "best_iter": 7, "checked_iter": 9})
    assert best.state_dict() == {"best_metric": 0.25, "best_iter": 7}
    with pytest.raises(ValueError, match="best_metric and best_iter"):
        best.load_state_dict({"best": 1})


class _Foreign:
    """A duck-typed checkpointer (not a hookloop ``Checkpointer``) whose save always moves
    last_checkpoint, as fvcore's does."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, name, **kwargs):
        self._inner.save(name, **kwargs)


def test_best_checkpointer_with_another_checkpointer_class(tmp_path):
    inner = Checkpointer(nn.Linear(1, 1), str(tmp_path))
    foreign = _Foreign(inner)
    _save_with(foreign, "model_best", {"iteration": 0}, tag_last=False)
    assert (tmp_path / "model_best.pth").exists()
    assert not inner.has_checkpoint()  # the pointer it wrote is removed again
    inner.save("model_0000001")
    _save_with(foreign, "model_best", {"iteration": 1}, tag_last=False)
    assert inner.get_checkpoint_file() == str(tmp_path / "model_0000001.pth")


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"mode": "median"}, ValueError, 'Mode "median" to `BestCheckpointer` is unknown'),
        ({"eval_period": -1}, ValueError, "eval_period must be >= 0"),
        ({"eval_period": 1.0}, TypeError, "eval_period must be an int"),
        ({"val_metric": ""}, TypeError, "val_metric"),
        ({"val_metric": 3}, TypeError, "val_metric"),
        ({"checkpointer": object()}, TypeError, "checkpointer with save"),
        ({"file_prefix": ""}, ValueError, "file_prefix"),
    ],
)
def test_best_checkpointer_bad_arguments(kwargs, exc, match):
    args = {
        "eval_period": 1,
        "checkpointer": Checkpointer(nn.Linear(1, 1)),
        "val_metric": "m",
        **kwargs,
    }
    with pytest.raises(exc, match=match):
        BestCheckpointer(**args)


def test_best_checkpointer_async_waits_at_end(tmp_path):
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), async_save=True)
    fn = Scripted(trainer, [{"m": 1.0}, {"m": 2.0}])
    trainer.register_hooks([EvalHook(2, fn), BestCheckpointer(2, ckpt, "m")])
    trainer.train(0, 4)
    assert ckpt._pending is None
    assert _best_file(tmp_path) == (4, 4.0)
    assert not ckpt.has_checkpoint()


def test_async_error_after_failed_training_is_logged_not_raised(tmp_path, caplog):
    trainer = Trainer(fail_at=3)
    ckpt = Checkpointer(trainer.model, str(tmp_path), async_save=True)
    # the save at iteration 2 fails on the background thread, then training fails
    ckpt.add_checkpointable("bad", _Unpicklable())
    trainer.register_hooks([PeriodicCheckpointer(ckpt, 3)])
    with pytest.raises(RuntimeError, match="boom at 3"):
        trainer.train(0, 6)
    assert "Background checkpoint save failed after training stopped" in caplog.text
    assert _pth(tmp_path) == []


class _Unpicklable:
    def state_dict(self):
        return {"fn": lambda: 0}

    def load_state_dict(self, sd):
        pass


def test_checkpoint_resume_as_detectron2_tests_it(tmp_path):
    """detectron2's tests/test_engine.py::test_checkpoint_resume, imports rewritten."""
    from hookloop.engine import LRScheduler, SimpleTrainer

    class SimpleModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return {"loss": x.sum() + sum(p.mean() for p in self.parameters())}

    def data_loader():
        while True:
            yield torch.rand(3, 3)

    model = SimpleModel()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 3)
    d = str(tmp_path)
    trainer = SimpleTrainer(model, data_loader(), opt)
    checkpointer = Checkpointer(model, d, opt=opt, trainer=trainer)
    trainer.register_hooks(
        [
            LRScheduler(scheduler=scheduler),
            # checkpoint after scheduler to properly save the state of scheduler
            PeriodicCheckpointer(checkpointer, 10),
        ]
    )
    trainer.train(0, 12)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)
    assert scheduler.last_epoch == 12
    del trainer

    opt = torch.optim.SGD(model.parameters(), 999)  # lr will be loaded
    trainer = SimpleTrainer(model, data_loader(), opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 3)
    trainer.register_hooks([LRScheduler(scheduler=scheduler)])
    checkpointer = Checkpointer(model, d, opt=opt, trainer=trainer)
    checkpointer.resume_or_load("non_exist.pth")
    assert trainer.iter == 11  # last finished iter number (0-based in Trainer)
    # number of times `scheduler.step()` was called (1-based)
    assert scheduler.last_epoch == 12
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)


@pytest.mark.parametrize(
    "mode,metrics,call_count",
    [
        ("max", [0.3, 0.4, 0.35, 0.5], 3),
        ("min", [1.0, 0.8, 0.9, 0.9], 2),
        ("min", [math.nan, 0.8, 0.9, 0.9], 1),
    ],
)
def test_best_checkpointer_as_detectron2_tests_it(tmp_path, mode, metrics, call_count):
    """detectron2's tests/test_engine.py::test_best_checkpointer, imports rewritten: it mocks
    ``checkpointer.save``."""
    from unittest import mock

    trainer = Trainer()
    values = iter(metrics)
    checkpointer = Checkpointer(trainer.model, str(tmp_path), trainer=trainer)
    trainer.register_hooks(
        [
            EvalHook(10, lambda: {"metric": next(values)}),
            BestCheckpointer(10, checkpointer, "metric", mode=mode),
        ]
    )
    with mock.patch.object(checkpointer, "save") as mock_save_method:
        trainer.train(0, 40)
        assert mock_save_method.call_count == call_count


def test_eval_hook_as_detectron2_tests_it():
    from unittest import mock

    for total_iter, period, eval_count in [(30, 15, 2), (31, 15, 3), (20, 0, 1)]:
        test_func = mock.Mock(return_value={"metric": 3.0})
        trainer = Trainer()
        trainer.register_hooks([EvalHook(period, test_func)])
        trainer.train(0, total_iter)
        assert test_func.call_count == eval_count


def test_best_checkpointer_state_is_where_detectron2_does_not_look(tmp_path):
    """detectron2's BestCheckpointer has no ``load_state_dict``, and detectron2 calls it for
    every entry of the trainer state's ``hooks``: the best value is kept under
    ``hookloop_hooks``, so a detectron2 trainer resumes from the checkpoint, and a hookloop
    trainer restores it from either key (checkpoints of earlier builds kept it in ``hooks``)."""
    trainer, _, best = _best_run(tmp_path, [0.5, 0.9, 0.7])
    state = trainer.state_dict()
    assert "BestCheckpointer" not in state.get("hooks", {})
    saved = state["hookloop_hooks"]["BestCheckpointer"]
    for layout in (
        {"hookloop_hooks": {"BestCheckpointer": saved}},
        {"hooks": {"BestCheckpointer": saved}},
    ):
        trainer2 = Trainer()
        best2 = BestCheckpointer(2, Checkpointer(trainer2.model, str(tmp_path)), "val/acc")
        trainer2.register_hooks([best2])
        trainer2.load_state_dict({"iteration": 6, **layout})
        assert (best2.best_metric, best2.best_iter) == (0.9, 3)


# --- PeriodicCheckpointer where it is registered ---------------------------------------------


class SwapsWeights(HookBase):
    """An EMA-style hook registered after the checkpointer: in the last after_step it copies
    other weights into the model in place, as EMA hooks swap their averaged weights in."""

    def after_step(self):
        if self.trainer.iter == self.trainer.max_iter - 1:
            with torch.no_grad():
                self.trainer.model.weight.fill_(-7.0)


class RecordsEachStep(HookBase):
    """Keeps a count in its state, advanced in after_step (after the checkpointer's place)."""

    def __init__(self):
        self.steps = 0

    def after_step(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


@pytest.mark.parametrize("async_save", [False, True])
def test_periodic_checkpointer_saves_the_weights_of_its_place(tmp_path, async_save):
    """An EMA hook after PeriodicCheckpointer changes the weights in the same after_step:
    model_final.pth holds the weights of the checkpointer's place (detectron2 saves there),
    while the trainer state in it is that of the end of the iteration (every hook's after_step
    counted), so that a resume starts as if the run never stopped."""
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), async_save=async_save, trainer=trainer)
    counter = RecordsEachStep()
    trainer.register_hooks([PeriodicCheckpointer(ckpt, 3), SwapsWeights(), counter])
    trainer.train(0, 5)
    assert trainer.model.weight.item() == -7.0
    final = _load(os.path.join(tmp_path, "model_final.pth"))
    assert final["model"]["weight"].item() == 5.0  # five steps of +1, not the swapped -7
    assert final["trainer"]["iteration"] == 4
    assert final["trainer"]["hooks"]["RecordsEachStep"] == {"steps": 5}
    periodic = _load(os.path.join(tmp_path, "model_0000002.pth"))
    assert periodic["model"]["weight"].item() == 3.0
    assert periodic["trainer"]["hooks"]["RecordsEachStep"] == {"steps": 3}
    assert list(final) == ["model", "trainer", "iteration"]


def test_periodic_checkpointer_logs_before_the_hooks_after_it(tmp_path, caplog):
    """The "Saving checkpoint" record comes at the checkpointer's place in the hook order (a
    writer's line registered after it comes later), as on detectron2."""
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), trainer=trainer)
    says = logging.getLogger("test.after")

    class Says(HookBase):
        def after_step(self):
            says.info(f"after {self.trainer.iter}")

    trainer.register_hooks([PeriodicCheckpointer(ckpt, 2), Says()])
    with caplog.at_level(logging.INFO):
        trainer.train(0, 2)
    lines = [
        r.getMessage()
        for r in caplog.records
        if "Saving" in r.getMessage() or "after" in r.getMessage()
    ]
    assert lines == [
        "after 0",
        f"Saving checkpoint to {tmp_path}/model_0000001.pth",
        f"Saving checkpoint to {tmp_path}/model_final.pth",
        "after 1",
    ]


def test_a_hook_failing_after_the_checkpointer_still_gets_the_file_of_that_iteration(tmp_path):
    """As in detectron2 (which saves before the evaluation "because then if it fails, we can
    use the saved checkpoint to debug"): when a hook after the checkpointer raises in the
    iteration of a save, the save begun at the checkpointer's place is written all the same,
    in after_train, and last_checkpoint names it."""
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), trainer=trainer)

    class FailsAt5(HookBase):
        def after_step(self):
            if self.trainer.iter == 5:
                raise RuntimeError("evaluation failed at 5")

    trainer.register_hooks([PeriodicCheckpointer(ckpt, 3), FailsAt5()])
    with pytest.raises(RuntimeError, match="evaluation failed"):
        trainer.train(0, 10)
    assert _pth(tmp_path) == ["model_0000002.pth", "model_0000005.pth"]
    assert ckpt.get_checkpoint_file().endswith("model_0000005.pth")
    assert _load(os.path.join(tmp_path, "model_0000005.pth"))["model"]["weight"].item() == 6.0


def test_a_nan_loss_is_raised_before_the_periodic_checkpoint_holds_its_weights(tmp_path):
    """Losses are read in batches; a save first reads the ones waiting, so that a non-finite
    loss raises (naming its iteration) before any checkpoint holds the weights it made and
    before max_to_keep deletes a good file."""
    from hookloop.engine import SimpleTrainer

    class NanAt7(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            loss = (self.w * x).sum() ** 2
            return {"loss": loss * float("nan") if self.calls == 8 else loss}

    model = NanAt7()
    data = itertools.repeat(torch.ones(1))
    trainer = SimpleTrainer(model, data, torch.optim.SGD(model.parameters(), lr=0.01))
    # Without the trainer among the checkpointables (whose state would read the storage).
    ckpt = Checkpointer(model, str(tmp_path), optimizer=trainer.optimizer)
    trainer.register_hooks([PeriodicCheckpointer(ckpt, 5, max_to_keep=1)])
    with pytest.raises(FloatingPointError, match="iteration=7!"):
        trainer.train(0, 30)
    assert _pth(tmp_path) == ["model_0000004.pth"]
    assert ckpt.get_checkpoint_file().endswith("model_0000004.pth")


def test_a_stop_checkpoint_holds_the_state_after_every_after_train(tmp_path):
    """request_stop(): the stop checkpoint is begun in after_train at the checkpointer's place
    and written after every hook's after_train."""
    trainer = Trainer()
    ckpt = Checkpointer(trainer.model, str(tmp_path), trainer=trainer)

    class StopsAt3(HookBase):
        def after_step(self):
            if self.trainer.iter == 3:
                self.trainer.request_stop()

    class CountsTrain(RecordsEachStep):
        def after_step(self):
            pass

        def after_train(self):
            self.steps += 100

    trainer.register_hooks([PeriodicCheckpointer(ckpt, 10), StopsAt3(), CountsTrain()])
    trainer.train(0, 20)
    saved = _load(os.path.join(tmp_path, "model_0000003.pth"))
    assert saved["trainer"]["iteration"] == 3
    hooks_state = saved["trainer"]["hooks"]
    assert hooks_state[CountsTrain.__qualname__] == {"steps": 100}
