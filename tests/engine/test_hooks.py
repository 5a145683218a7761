"""The hooks of ``hookloop.engine.hooks`` against detectron2's ``hooks.py``."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from hookloop.engine import (
    CallbackHook,
    HookBase,
    IterationTimer,
    LRScheduler,
    PeriodicWriter,
    TrainerBase,
)
from hookloop.utils.events import EventWriter, get_event_storage
from torch import nn

torch.set_num_threads(1)

HOOKS_LOGGER = "hookloop.engine.hooks"


class NoopTrainer(TrainerBase):
    def __init__(self, optimizer=None, scheduler=None):
        super().__init__()
        self.optimizer = optimizer
        if scheduler is not None:
            self.scheduler = scheduler

    def run_step(self):
        if self.optimizer is not None:
            self.optimizer.step()


def history(storage, name):
    return storage.history(name).values()


# ----------------------------------------------------------------------------------------------
# IterationTimer


@pytest.mark.parametrize("start,warmup", [(0, 2), (3, 1), (0, 3)])
def test_iteration_timer_puts_time_after_warmup(start, warmup):
    trainer = NoopTrainer()
    trainer.register_hooks([IterationTimer(warmup_iter=warmup)])
    trainer.train(start, start + 6)
    values = history(trainer.storage, "time")
    # detectron2: put once iter - start_iter + 1 >= warmup_iter.
    assert [it for _, it in values] == list(range(start + max(warmup - 1, 0), start + 6))
    assert all(v >= 0 for v, _ in values)
    assert trainer.storage.smoothing_hints()["time"] is True


def test_iteration_timer_logs_summary(caplog):
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    trainer = NoopTrainer()
    trainer.register_hooks([IterationTimer(warmup_iter=2)])
    trainer.train(0, 5)
    msgs = [r.getMessage() for r in caplog.records if r.name == HOOKS_LOGGER]
    # num_iter = storage.iter + 1 - start_iter - warmup_iter, storage.iter == max_iter.
    assert any(m.startswith("Overall training speed: 4 iterations in 0:00:00 (") for m in msgs)
    assert any(m.startswith("Total training time: 0:00:00 (0:00:00 on hooks)") for m in msgs)


def test_iteration_timer_after_a_resume_counts_this_runs_iterations(caplog):
    """detectron2's summary after a resume counts the iterations of this run, and its trainer
    state holds no IterationTimer entry (detectron2 would warn "Cannot find the hook" loading
    one)."""
    first = NoopTrainer()
    first.register_hooks([IterationTimer(warmup_iter=2)])
    first.train(0, 6)
    state = first.state_dict()
    assert "IterationTimer" not in state.get("hooks", {})
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    resumed = NoopTrainer()
    resumed.register_hooks([IterationTimer(warmup_iter=2)])
    resumed.load_state_dict(state)
    resumed.train(resumed.iter + 1, 15)
    msgs = [r.getMessage() for r in caplog.records if r.name == HOOKS_LOGGER]
    # Iterations 7..14 of this run, counted as detectron2 counts: storage.iter (15 at the
    # end) + 1 - start_iter (7) - warmup (2). The first run's 6 are not counted.
    assert any(m.startswith("Overall training speed: 7 iterations in ") for m in msgs), msgs


def test_iteration_timer_no_speed_line_within_warmup(caplog):
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    trainer = NoopTrainer()
    trainer.register_hooks([IterationTimer(warmup_iter=3)])
    trainer.train(0, 1)
    msgs = [r.getMessage() for r in caplog.records if r.name == HOOKS_LOGGER]
    assert not any("Overall training speed" in m for m in msgs)
    assert any(m.startswith("Total training time") for m in msgs)
    assert "time" not in trainer.storage.histories()


# ----------------------------------------------------------------------------------------------
# LRScheduler


def _sgd(lr=1.0, groups=None):
    if groups is None:
        return torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=lr)
    return torch.optim.SGD(groups, lr=lr)


@pytest.mark.parametrize("from_trainer", [False, True])
def test_lr_scheduler_puts_lr_and_steps(from_trainer):
    opt = _sgd(1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if from_trainer:
        trainer = NoopTrainer(opt, sched)
        hook = LRScheduler()
    else:
        trainer = NoopTrainer(opt)
        hook = LRScheduler(opt, sched)
    trainer.register_hooks([hook])
    trainer.train(0, 5)
    assert history(trainer.storage, "lr") == [
        (1.0, 0),
        (1.0, 1),
        (0.5, 2),
        (0.5, 3),
        (0.25, 4),
    ]
    assert trainer.storage.smoothing_hints()["lr"] is False
    assert sched.last_epoch == 5
    assert opt.param_groups[0]["lr"] == 0.25


def test_lr_scheduler_summarizes_best_param_group():
    small = [nn.Parameter(torch.zeros(1))]
    big = [nn.Parameter(torch.zeros(1)) for _ in range(3)]
    opt = torch.optim.SGD([{"params": small, "lr": 0.1}, {"params": big, "lr": 0.7}], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    trainer = NoopTrainer(opt)
    trainer.register_hooks([LRScheduler(opt, sched)])
    trainer.train(0, 2)
    assert [v for v, _ in history(trainer.storage, "lr")] == [0.7, 0.7]


def _params(n):
    return [nn.Parameter(torch.zeros(1)) for _ in range(n)]


@pytest.mark.parametrize(
    "groups,expected",
    [
        ([(1, 0.1), (3, 0.2)], 1),  # the group with most parameters
        ([(2, 0.1), (2, 0.2), (1, 0.3)], 0),  # first of the largest
        ([(1, 0.1), (1, 0.2), (1, 0.2)], 1),  # all single: most common lr, first group with it
        ([(1, 0.3), (1, 0.1), (1, 0.1), (1, 0.3)], 0),  # tie: first lr counted
        ([(1, 0.5)], 0),
    ],
)
def test_get_best_param_group_id(groups, expected):
    opt = torch.optim.SGD([{"params": _params(n), "lr": lr} for n, lr in groups], lr=1.0)
    assert LRScheduler.get_best_param_group_id(opt) == expected


def test_lr_scheduler_state_dict_round_trip():
    opt = _sgd(1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    trainer = NoopTrainer(opt)
    hook = LRScheduler(opt, sched)
    trainer.register_hooks([hook])
    trainer.train(0, 3)
    sd = hook.state_dict()
    assert sd == sched.state_dict()
    assert sd["last_epoch"] == 3

    opt2 = _sgd(1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    hook2 = LRScheduler(opt2, sched2)
    hook2.load_state_dict(sd)
    assert sched2.last_epoch == 3
    assert sched2.state_dict() == sd
    assert trainer.state_dict()["hooks"] == {"LRScheduler": sd}


def test_lr_scheduler_non_torch_scheduler_is_stateless():
    steps = []

    class MyScheduler:
        def step(self):
            steps.append(1)

    opt = _sgd(0.3)
    trainer = NoopTrainer()
    hook = LRScheduler(opt, MyScheduler())
    trainer.register_hooks([hook])
    trainer.train(0, 3)
    assert steps == [1, 1, 1]
    assert hook.state_dict() == {}
    hook.load_state_dict({"ignored": 1})
    assert "hooks" not in trainer.state_dict()
    assert [v for v, _ in history(trainer.storage, "lr")] == [0.3] * 3


# ----------------------------------------------------------------------------------------------
# CallbackHook


def test_callback_hook_calls_with_trainer():
    log = []
    trainer = NoopTrainer()
    hook = CallbackHook(
        before_train=lambda t: log.append(("before_train", t.iter)),
        before_step=lambda t: log.append(("before_step", t.iter)),
        after_step=lambda t: log.append(("after_step", t.iter)),
        after_train=lambda t: log.append(("after_train", t.iter)),
    )
    trainer.register_hooks([hook])
    trainer.train(1, 3)
    assert log == [
        ("before_train", 1),
        ("before_step", 1),
        ("after_step", 1),
        ("before_step", 2),
        ("after_step", 2),
        ("after_train", 3),
    ]


def test_callback_hook_receives_trainer_proxy():
    seen = []
    trainer = NoopTrainer()
    trainer.register_hooks([CallbackHook(before_train=seen.append)])
    trainer.train(0, 1)
    assert type(seen[0]) in (weakref.ProxyType, weakref.CallableProxyType)
    assert seen[0].max_iter == 1


def test_callback_hook_partial_callbacks():
    log = []
    trainer = NoopTrainer()
    trainer.register_hooks([CallbackHook(after_step=lambda t: log.append(t.iter))])
    trainer.train(0, 3)
    assert log == [0, 1, 2]


def test_callback_hook_releases_callbacks_after_train():
    class Callback:
        def __call__(self, trainer):
            pass

    cb = Callback()
    ref = weakref.ref(cb)
    trainer = NoopTrainer()
    trainer.register_hooks([CallbackHook(before_step=cb, after_train=cb)])
    del cb
    gc.collect()
    assert ref() is not None
    trainer.train(0, 2)
    assert ref() is None


# ----------------------------------------------------------------------------------------------
# PeriodicWriter


class RecordingWriter(EventWriter):
    def __init__(self, log, name="w"):
        self.log = log
        self.name = name

    def write(self):
        self.log.append((self.name, "write", get_event_storage().iter))

    def close(self):
        self.log.append((self.name, "close", get_event_storage().iter))


@pytest.mark.parametrize(
    "start,stop,period,writes",
    [
        (0, 8, 3, [2, 5, 7]),  # periodic and last
        (0, 8, 4, [3, 7]),  # last iteration is also periodic: written once
        (5, 10, 3, [5, 8, 9]),
        (0, 3, 20, [2]),
        (0, 1, 1, [0]),
    ],
)
def test_periodic_writer(start, stop, period, writes):
    log = []
    trainer = NoopTrainer()
    trainer.register_hooks([PeriodicWriter([RecordingWriter(log)], period=period)])
    trainer.train(start, stop)
    assert log == [("w", "write", i) for i in writes] + [
        ("w", "write", stop),
        ("w", "close", stop),
    ]


def test_periodic_writer_several_writers_in_order():
    log = []
    trainer = NoopTrainer()
    writers = [RecordingWriter(log, "a"), RecordingWriter(log, "b")]
    trainer.register_hooks([PeriodicWriter(writers, period=2)])
    trainer.train(0, 2)
    assert log == [
        ("a", "write", 1),
        ("b", "write", 1),
        ("a", "write", 2),
        ("a", "close", 2),
        ("b", "write", 2),
        ("b", "close", 2),
    ]


def test_periodic_writer_sees_metrics_of_the_step():
    seen = []

    class Writer(EventWriter):
        def write(self):
            storage = get_event_storage()
            seen.append(storage.latest().get("x"))

    class Put(HookBase):
        def after_step(self):
            self.trainer.storage.put_scalar("x", float(self.trainer.iter))

    trainer = NoopTrainer()
    trainer.register_hooks([Put(), PeriodicWriter([Writer()], period=2)])
    trainer.train(0, 4)
    assert seen == [(1.0, 1), (3.0, 3), (3.0, 3)]


def test_periodic_writer_rejects_non_writer():
    with pytest.raises(TypeError, match="EventWriter"):
        PeriodicWriter([object()])


def test_periodic_writer_calls_the_writer_protocol_and_takes_duck_typed_writers():
    """The optional methods EventWriter declares are called on a subclass that overrides
    them; a writer that is not an EventWriter (only write() and close()) gets the defaults,
    and a checkpoint of the trainer holds only the states that are not empty."""
    log = []

    class Full(EventWriter):
        def write(self):
            log.append("write")

        def _bind_trainer(self, trainer):
            log.append(("bind", trainer.iter))

        def _resume_from(self, start_iter):
            log.append(("resume", start_iter))

        def _state_dict(self):
            return {"n": len(log)}

        def _load_state_dict(self, state):
            log.append(("load", dict(state)))

    class Duck:
        def write(self):
            log.append("duck write")

        def close(self):
            log.append("duck close")

    trainer = NoopTrainer()
    hook = PeriodicWriter([Full(), Duck()], period=2)
    trainer.register_hooks([hook])
    trainer.train(3, 5)
    assert log[:2] == [("bind", 3), ("resume", 3)]
    assert log.count("duck write") == 3 and log[-1] == "duck close"
    state = trainer.state_dict()["hookloop_hooks"]["PeriodicWriter"]
    assert state == {"writers": {"0:Full": {"n": len(log)}}}
    hook.load_state_dict(state)
    assert log[-1] == ("load", {"n": len(log) - 1})


@pytest.mark.parametrize("period", [0, -2])
def test_periodic_writer_rejects_bad_period(period):
    with pytest.raises(ValueError, match="period"):
        PeriodicWriter([RecordingWriter([])], period=period)


def test_periodic_writer_on_failure_still_writes_and_closes():
    log = []

    class Fail(HookBase):
        def after_step(self):
            if self.trainer.iter == 3:
                raise RuntimeError("x")

    trainer = NoopTrainer()
    trainer.register_hooks([PeriodicWriter([RecordingWriter(log)], period=2), Fail()])
    with pytest.raises(RuntimeError):
        trainer.train(0, 10)
    assert log == [("w", "write", 1), ("w", "write", 3), ("w", "write", 3), ("w", "close", 3)]


def test_native_hooks_can_be_subclassed_with_their_own_constructors():
    # IterationTimer and PeriodicWriter have Rust bases; a subclass with another signature (as
    # research repos write) must still construct and behave like the base.
    class Recorder(EventWriter):
        def __init__(self):
            self.iters = []

        def write(self):
            self.iters.append(get_event_storage().iter)

    class NamedWriter(PeriodicWriter):
        def __init__(self, name, writer):
            self.name = name
            super().__init__([writer], period=5)

    class QuickTimer(IterationTimer):
        def __init__(self, label):
            self.label = label
            super().__init__(warmup_iter=2)

    rec = Recorder()
    timer, writer = QuickTimer("t"), NamedWriter("w", rec)
    trainer = NoopTrainer()
    trainer.register_hooks([timer, writer])
    trainer.train(0, 12)
    assert rec.iters == [4, 9, 11, 12]
    assert (timer.label, writer.name, timer._warmup_iter) == ("t", "w", 2)
    # warmup_iter=2: iteration 0 is warmup (iter_done = 1 < 2), the other 11 are timed.
    assert len(trainer.storage.history("time").values()) == 11
    assert writer._writers == [rec] and writer._period == 5


# LRScheduler with hookloop's LRMultiplier: the hook's steps give the LRs and state of the
# schedule stepped by hand, and whatever step() a subclass, an instance patch or a scheduler
# set mid-run brings is the one that runs.

LR_ITERS = 30


def _lr_multiplier(cls=None):
    from hookloop.solver import LRMultiplier, WarmupParamScheduler
    from hookloop.solver.param_scheduler import MultiStepParamScheduler

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    steps = MultiStepParamScheduler([1.0, 0.1], milestones=[20], num_updates=LR_ITERS)
    return opt, (cls or LRMultiplier)(opt, WarmupParamScheduler(steps, 0.01, 0.2), LR_ITERS)


def _stepped_by_hand():
    """LRs and state of the same schedule stepped by its own step(), without a trainer."""
    opt, sched = _lr_multiplier()
    seen = []
    for _ in range(LR_ITERS):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen, sched.state_dict()


def test_lr_scheduler_steps_an_lr_multiplier_with_the_lrs_and_state_of_stepping_by_hand():
    opt, sched = _lr_multiplier()
    trainer = NoopTrainer(opt)
    trainer.register_hooks([LRScheduler(opt, sched)])
    trainer.train(0, LR_ITERS)
    lrs, state = _stepped_by_hand()
    assert [v for v, _ in history(trainer.storage, "lr")] == lrs
    assert sched.state_dict() == state
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_lr_scheduler_runs_an_overridden_or_patched_step_every_iteration():
    from hookloop.solver import LRMultiplier

    class Counting(LRMultiplier):
        calls = 0

        def step(self, epoch=None):
            type(self).calls += 1
            super().step(epoch)

    opt, sched = _lr_multiplier(Counting)
    trainer = NoopTrainer(opt)
    trainer.register_hooks([LRScheduler(opt, sched)])
    trainer.train(0, LR_ITERS)
    assert Counting.calls == 1 + LR_ITERS  # torch's constructor steps once
    lrs, state = _stepped_by_hand()
    assert [v for v, _ in history(trainer.storage, "lr")] == lrs
    assert sched.state_dict() == state

    # a step() set on the instance, before or during training, is the one that runs
    for when in ("before", "during"):
        opt, sched = _lr_multiplier()
        patched = []

        def step(epoch=None, sched=sched, patched=patched):
            patched.append(sched.last_epoch)
            LRMultiplier.step(sched, epoch)

        class Patch(HookBase):
            def before_step(self, sched=sched, step=step, when=when):
                if when == "during" and self.trainer.iter == 10:
                    sched.step = step

        if when == "before":
            sched.step = step
        trainer = NoopTrainer(opt)
        trainer.register_hooks([Patch(), LRScheduler(opt, sched)])
        trainer.train(0, LR_ITERS)
        assert len(patched) == (LR_ITERS if when == "before" else LR_ITERS - 10), when
        del sched.step  # state_dict() keeps every instance attribute, as torch's does
        assert sched.state_dict() == state


def test_lr_scheduler_steps_a_scheduler_set_during_training_with_its_own_step():
    opt, sched = _lr_multiplier()
    other = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    hook = LRScheduler(opt, sched)

    class Swap(HookBase):
        def after_step(self):
            if self.trainer.iter == 9:
                hook._scheduler = other

    trainer = NoopTrainer(opt)
    trainer.register_hooks([hook, Swap()])
    trainer.train(0, 12)
    assert sched.last_epoch == 10 and other.last_epoch == 2
