"""Stopping well: ``trainer.request_stop()``, the ``on_exception`` stage, ``PreemptionHandler``
(a signal becomes a clean stop, a checkpoint and an exit status) and ``EarlyStopping``."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hookloop.checkpoint import Checkpointer
from hookloop.data import TrainingSampler
from hookloop.engine import (
    EarlyStopping,
    EvalHook,
    HookBase,
    PeriodicCheckpointer,
    Preempted,
    PreemptionHandler,
    SimpleTrainer,
    TrainerBase,
)
from hookloop.engine.dispatch import STAGES
from hookloop.utils.events import EventStorage

torch.set_num_threads(1)

CHILD = Path(__file__).with_name("preempt_child.py")
TIMEOUT = 60


class Recorder(HookBase):
    """Records (name, stage, trainer.iter) for every stage, and what after_train sees."""

    def __init__(self, log, name):
        self.log = log
        self.name = name

    def before_train(self):
        self.log.append((self.name, "before_train", self.trainer.iter))

    def before_step(self):
        self.log.append((self.name, "before_step", self.trainer.iter))

    def after_step(self):
        self.log.append((self.name, "after_step", self.trainer.iter))

    def after_train(self):
        t = self.trainer
        self.log.append((self.name, "after_train", t.iter, t.stop_requested, t.stopped_early))


class StopAt(HookBase):
    """Calls request_stop() in ``stage`` of iteration ``at``."""

    def __init__(self, at, stage="after_step"):
        self.at = at
        setattr(self, stage, self._maybe_stop)

    def _maybe_stop(self):
        if self.trainer.iter == self.at:
            self.trainer.request_stop()


class Loop(TrainerBase):
    def __init__(self):
        super().__init__()
        self.steps = []

    def run_step(self):
        self.steps.append(self.iter)


# ----------------------------------------------------------------------------------------------
# request_stop


@pytest.mark.parametrize("stage", ["before_step", "after_step"])
def test_request_stop_ends_after_every_after_step_of_that_iteration(stage):
    log = []
    t = Loop()
    # The stop is asked for by the middle hook: the one after it still runs its after_step.
    t.register_hooks([Recorder(log, "a"), StopAt(4, stage), Recorder(log, "b")])
    t.train(0, 10)
    assert t.steps == [0, 1, 2, 3, 4]
    assert t.iter == 4 and t.stop_requested and t.stopped_early
    assert log[-3:] == [
        ("b", "after_step", 4),
        ("a", "after_train", 4, True, True),
        ("b", "after_train", 4, True, True),
    ]
    assert ("a", "after_step", 4) in log
    assert not any(e[1] == "before_step" and e[2] == 5 for e in log)
    assert len(t._hooks) == 3


def test_the_hook_list_is_the_users_at_every_stage_of_a_stopped_run():
    """A stop is the stop controller's flag: ``trainer._hooks`` holds what the user registered, the
    same list object, at every stage (before the stop, after it, in after_train)."""
    seen = []

    class Watch(HookBase):
        def _look(self, stage):
            hooks = self.trainer._hooks
            seen.append((stage, self.trainer.iter, id(hooks), [type(h).__name__ for h in hooks]))

        def before_train(self):
            self._look("before_train")

        def before_step(self):
            self._look("before_step")

        def after_backward(self):
            self._look("after_backward")

        def after_step(self):
            self._look("after_step")

        def after_train(self):
            self._look("after_train")

    class BackwardLoop(Loop):
        def run_step(self):
            super().run_step()
            self.after_backward()

    t = BackwardLoop()
    t.register_hooks([Watch(), StopAt(2)])
    user_list = t._hooks
    t.train(0, 10)
    assert t.stopped_early and t.iter == 2
    assert {stage for stage, *_ in seen} == set(STAGES)
    assert all(i == id(user_list) and names == ["Watch", "StopAt"] for _, _, i, names in seen)
    assert t._hooks is user_list and [type(h).__name__ for h in t._hooks] == ["Watch", "StopAt"]


def test_request_stop_from_run_step():
    log = []

    class L(Loop):
        def run_step(self):
            super().run_step()
            if self.iter == 2:
                self.request_stop()
                self.request_stop()  # twice is once

    t = L()
    t.register_hooks([Recorder(log, "a")])
    t.train(0, 10)
    assert t.steps == [0, 1, 2] and t.iter == 2
    assert log[-2:] == [("a", "after_step", 2), ("a", "after_train", 2, True, True)]


def test_request_stop_in_before_train_runs_no_step():
    t = Loop()
    t.register_hooks([StopAt(5, "before_train")])
    t.train(5, 10)
    assert t.steps == [] and t.iter == 4 and t.stopped_early


def test_request_stop_in_the_last_step_is_a_normal_end():
    log = []
    t = Loop()
    t.register_hooks([StopAt(9), Recorder(log, "a")])
    t.train(0, 10)
    assert t.iter == 10 and t.stop_requested and not t.stopped_early
    assert log[-1] == ("a", "after_train", 10, True, False)


def test_request_stop_outside_train_is_an_error_and_train_starts_fresh():
    t = Loop()
    with pytest.raises(RuntimeError, match="no training is running"):
        t.request_stop()
    t.register_hooks([StopAt(1)])
    t.train(0, 5)
    assert t.iter == 1
    t._hooks.clear()
    t.train(2, 5)  # a second train() is not stopped by the first one's request
    assert t.iter == 5 and not t.stop_requested and not t.stopped_early


def test_request_stop_raise_after_train_must_be_an_exception():
    class Bad(HookBase):
        def after_step(self):
            self.trainer.request_stop(raise_after_train="no")

    t = Loop()
    t.register_hooks([Bad()])
    with pytest.raises(TypeError, match="raise_after_train"):
        t.train(0, 3)


def test_a_hook_catching_exception_does_not_swallow_the_stop():
    class L(TrainerBase):
        def before_step(self):
            try:
                super().before_step()
            except Exception:  # the stop is not an Exception
                pytest.fail("the stop was caught as an Exception")

        def run_step(self):
            pass

    t = L()
    t.register_hooks([StopAt(3)])
    t.train(0, 10)
    assert t.iter == 3


# ----------------------------------------------------------------------------------------------
# A deterministic SimpleTrainer setup: checkpoint at the stop, resume, equal to a straight run


def _setup(out, max_to_keep=None, extra=()):
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(40, 3, generator=g)
    ys = xs @ torch.tensor([1.0, -2.0, 0.5])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, batch):
            x, y = batch
            return ((self.net(x).squeeze(1) - y) ** 2).mean()

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xs, ys), batch_size=4, sampler=TrainingSampler(40, seed=1)
    )
    trainer = SimpleTrainer(model, loader, opt)
    ckpt = Checkpointer(model, str(out), trainer=trainer)
    trainer.register_hooks([*extra, PeriodicCheckpointer(ckpt, period=10, max_to_keep=max_to_keep)])
    return trainer, ckpt, model


def _resume_and_train(out, max_iter, extra=()):
    trainer, ckpt, model = _setup(out, extra=extra)
    ckpt.resume_or_load("", resume=True)
    start = trainer.iter + 1 if ckpt.has_checkpoint() else 0
    trainer.train(start, max_iter)
    return trainer, model


def test_stop_saves_a_checkpoint_of_the_stop_iteration_and_resume_equals_straight_run(tmp_path):
    straight = tmp_path / "straight"
    _, ref = _resume_and_train(straight, 25)

    out = tmp_path / "stopped"
    trainer, _ = _resume_and_train(out, 25, extra=[StopAt(13)])
    assert trainer.iter == 13
    assert (out / "last_checkpoint").read_text() == "model_0000013.pth"
    saved = torch.load(out / "model_0000013.pth", weights_only=False)
    assert saved["trainer"]["iteration"] == 13

    started = []

    class First(HookBase):
        def before_step(self):
            started.append(self.trainer.iter)

    trainer, resumed = _resume_and_train(out, 25, extra=[First()])
    assert started[0] == 14 and trainer.iter == 25
    for k, v in ref.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_stop_on_a_period_boundary_saves_once(tmp_path):
    trainer, _ = _resume_and_train(tmp_path, 25, extra=[StopAt(9)])
    assert trainer.iter == 9
    assert sorted(p.name for p in tmp_path.glob("*.pth")) == ["model_0000009.pth"]


def test_no_final_checkpoint_after_an_error(tmp_path):
    class Boom(HookBase):
        def after_step(self):
            if self.trainer.iter == 4:
                self.trainer.request_stop()
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _resume_and_train(tmp_path, 25, extra=[Boom()])
    assert list(tmp_path.glob("*.pth")) == []


# ----------------------------------------------------------------------------------------------
# on_exception


def test_on_exception_runs_once_before_after_train_and_the_exception_propagates_unchanged():
    log = []
    error = ValueError("step 3 failed")

    class L(Loop):
        def run_step(self):
            if self.iter == 3:
                raise error

    class Crash(HookBase):
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def on_exception(self, exc):
            log.append((self.name, "on_exception", exc, self.trainer.iter))
            if self.fail:
                raise KeyError("a broken crash hook")

        def after_train(self):
            log.append((self.name, "after_train"))

    t = L()
    t.register_hooks([Crash("a", fail=True), Recorder([], "plain"), Crash("b")])
    with pytest.raises(ValueError) as info:
        t.train(0, 10)
    assert info.value is error
    assert log == [
        ("a", "on_exception", error, 3),
        ("b", "on_exception", error, 3),
        ("a", "after_train"),
        ("b", "after_train"),
    ]


def test_on_exception_is_not_called_on_success_or_stop():
    calls = []

    class Crash(HookBase):
        def on_exception(self, exc):  # pragma: no cover - must not run
            calls.append(exc)

    t = Loop()
    t.register_hooks([Crash(), StopAt(2)])
    t.train(0, 5)
    t.train(0, 5)
    assert calls == []


# ----------------------------------------------------------------------------------------------
# PreemptionHandler


class RaiseSignal(HookBase):
    def __init__(self, at, sig):
        self.at, self.sig = at, sig

    def after_step(self):
        if self.trainer.iter == self.at:
            signal.raise_signal(self.sig)


def test_signal_stops_after_the_step_checkpoints_restores_handlers_and_raises_preempted(
    tmp_path,
):
    previous = []
    old = signal.signal(signal.SIGUSR1, lambda *a: previous.append(a))
    try:
        log = []
        handler = PreemptionHandler(signals=[signal.SIGUSR1])
        with pytest.raises(Preempted) as info:
            _resume_and_train(
                tmp_path, 25, extra=[RaiseSignal(6, signal.SIGUSR1), handler, Recorder(log, "r")]
            )
        assert info.value.code == 128 + signal.SIGUSR1 and info.value.signum == signal.SIGUSR1
        assert isinstance(info.value, SystemExit)
        assert log[-2:] == [("r", "after_step", 6), ("r", "after_train", 6, True, True)]
        assert (tmp_path / "last_checkpoint").read_text() == "model_0000006.pth"
        # The handler that was there before is back.
        signal.raise_signal(signal.SIGUSR1)
        assert len(previous) == 1
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_signal_after_the_last_step_ends_normally():
    class Late(HookBase):
        def after_train(self):
            signal.raise_signal(signal.SIGUSR1)  # the handler is still installed here

    handler = PreemptionHandler([signal.SIGUSR1])
    t = Loop()
    t.register_hooks([Late(), handler])
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        t.train(0, 3)  # no Preempted: training had finished
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert handler.signum == signal.SIGUSR1
    assert t.iter == 3 and not t.stop_requested


@pytest.mark.parametrize(
    "signals, error",
    [
        ("SIGTERM", TypeError),
        ([], ValueError),
        ([signal.SIGKILL], ValueError),
        ([10_000], ValueError),
        ([1.5], TypeError),
    ],
)
def test_preemption_handler_bad_args(signals, error):
    with pytest.raises(error, match="PreemptionHandler signals"):
        PreemptionHandler(signals)


def _load_child():
    spec = importlib.util.spec_from_file_location("preempt_child", CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sigterm_in_a_child_then_resume_equals_an_uninterrupted_run(tmp_path):
    out = tmp_path / "preempted"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[2] / "python"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(out), "30", "--signal-at", "13"],
        capture_output=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr
    assert (out / "last_checkpoint").read_text() == "model_0000013.pth"

    child = _load_child()
    resumed = child.run(str(out), 30)
    straight = child.run(str(tmp_path / "straight"), 30)
    assert (out / "last_checkpoint").read_text() == "model_final.pth"
    for k, v in straight.items():
        assert torch.equal(v, resumed[k]), k


# ----------------------------------------------------------------------------------------------
# EarlyStopping


def _early_stopping_run(values, es, max_iter=40, start=0, state=None, period=2):
    """Evaluates every ``period`` iterations, putting the next of ``values``."""
    it = iter(values)
    t = Loop()
    t.register_hooks([EvalHook(period, lambda: {"acc": next(it)}), es])
    if state is not None:
        es.load_state_dict(state)
    t.train(start, max_iter)
    return t


def test_early_stopping_stops_after_patience_evaluations_without_improvement():
    es = EarlyStopping("acc", patience=3)
    # Evaluations at iterations 1, 3, 5, ...: best 0.5 at 3, then 3 bad ones (5, 7, 9).
    t = _early_stopping_run([0.1, 0.5, 0.5, 0.4, 0.45], es)
    assert t.iter == 9 and t.stopped_early
    assert (es.best, es.best_iter, es.bad_evals) == (0.5, 3, 3)


def test_early_stopping_min_delta_and_min_mode():
    es = EarlyStopping("acc", patience=2, mode="min", min_delta=0.1)
    # 1.0 best; 0.95 is not better by more than 0.1 (bad); 0.8 is (reset); then 2 bad.
    t = _early_stopping_run([1.0, 0.95, 0.8, 0.75, float("nan")], es)
    assert t.iter == 9 and (es.best, es.bad_evals) == (0.8, 2)


def test_early_stopping_does_not_count_an_old_value_twice():
    es = EarlyStopping("acc", patience=1)
    t = _early_stopping_run([0.5], es, max_iter=6, period=100)  # evaluates after train only
    assert t.iter == 6 and es.best is None


def test_early_stopping_state_survives_resume():
    es = EarlyStopping("acc", patience=3)
    # Evaluations at 1 and 3 (the one after training, at 6, is not a step's).
    _early_stopping_run([0.5, 0.4, 0.3], es, max_iter=6)
    state = es.state_dict()
    assert state["bad_evals"] == 1 and state["best"] == 0.5
    es2 = EarlyStopping("acc", patience=3)
    t = _early_stopping_run([0.1, 0.2], es2, start=6, state=state)
    assert t.iter == 9 and es2.bad_evals == 3 and es2.best == 0.5


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"metric": "", "patience": 1}, TypeError, "metric"),
        ({"metric": 3, "patience": 1}, TypeError, "metric"),
        ({"metric": "a", "patience": 0}, ValueError, "patience"),
        ({"metric": "a", "patience": 1.0}, TypeError, "patience"),
        ({"metric": "a", "patience": True}, TypeError, "patience"),
        ({"metric": "a", "patience": 1, "mode": "best"}, ValueError, "mode"),
        ({"metric": "a", "patience": 1, "min_delta": -1}, ValueError, "min_delta"),
        ({"metric": "a", "patience": 1, "min_delta": float("inf")}, ValueError, "min_delta"),
        ({"metric": "a", "patience": 1, "min_delta": "0"}, TypeError, "min_delta"),
    ],
)
def test_early_stopping_bad_args(kwargs, error, name):
    with pytest.raises(error, match=name):
        EarlyStopping(**kwargs)


def test_early_stopping_bad_state():
    with pytest.raises(ValueError, match="EarlyStopping"):
        EarlyStopping("a", 1).load_state_dict({"best": 1.0})


def test_hook_stats_add_up_across_the_stop():
    t = Loop()
    rec = Recorder([], "a")
    t.register_hooks([rec, StopAt(5)])
    t._hookloop.dispatcher.timing = True
    t.train(0, 10)
    calls = {(type(h).__name__, stage): n for h, stage, n, *_ in t.hook_stats()}
    assert calls[("Recorder", "before_step")] == 6
    assert calls[("Recorder", "after_train")] == 1
    # Every call is counted, the one that asked for the stop too (iterations 0 to 5).
    assert calls[("StopAt", "after_step")] == 6
    assert {name for name, _ in calls} == {"Recorder", "StopAt"}


def test_a_subclass_loop_of_its_own_cannot_be_stopped_and_runs_again():
    """A subclass's own loop (detectron2's loop body calling the stages) is not a ``train()``:
    ``request_stop`` there is the documented RuntimeError at every call, never a
    ``StopTraining`` escaping the loop, and a second own run gets its own storage."""

    class Own(TrainerBase):
        def run_step(self):
            pass

        def own_train(self, n):
            self.max_iter = n
            with EventStorage(0) as self.storage:
                self.before_train()
                for self.iter in range(n):
                    self.before_step()
                    self.run_step()
                    self.after_step()
                self.after_train()

    class Asker(HookBase):
        def __init__(self):
            self.errors, self.storages = [], []

        def after_step(self):
            self.storages.append(id(self.trainer.storage))
            with pytest.raises(RuntimeError, match="no training is running"):
                self.trainer.request_stop()
            self.errors.append(self.trainer.iter)

    t = Own()
    asker = Asker()
    t.register_hooks([asker])
    t.own_train(3)
    t.own_train(2)
    assert asker.errors == [0, 1, 2, 0, 1]
    assert len(set(asker.storages)) == 2
