"""Trainer <-> hook references: a trainer and its hooks are freed by reference counting alone
(hooks hold a weakref.proxy, the Rust dispatch table does not point back at the trainer)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hookloop.engine import (
    AMPTrainer,
    CallbackHook,
    HookBase,
    IterationTimer,
    LRScheduler,
    PeriodicWriter,
    SimpleTrainer,
    TrainerBase,
)
from hookloop.utils.events import EventWriter
from torch import nn

torch.set_num_threads(1)


class HoldingHook(HookBase):
    """Keeps strong references to what the trainer owns (model, optimizer, storage)."""

    def before_train(self):
        self.model = self.trainer.model
        self.optimizer = self.trainer.optimizer

    def after_step(self):
        self.storage = self.trainer.storage

    def after_backward(self):
        self.grad = self.model.weight.grad


class NullWriter(EventWriter):
    def write(self):
        pass


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.weight = inner.weight

    def forward(self, batch):
        return self.inner(batch[0]).pow(2).mean()


class PlainTrainer(TrainerBase):
    def run_step(self):
        self.after_backward()


@pytest.fixture
def no_gc():
    """Automatic collection off, a clean slate, and DEBUG_SAVEALL so anything that needs the
    cycle collector shows up in gc.garbage."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    del gc.garbage[:]
    try:
        yield
    finally:
        gc.set_debug(0)
        del gc.garbage[:]
        if was_enabled:
            gc.enable()


def _assert_freed_without_cycles(refs, make_del):
    """``make_del()`` drops the last strong reference; every weakref must die at once, and the
    cycle collector must then find none of these objects' kind in the garbage."""
    dead = []
    trainer_ref = weakref.ref(refs["trainer"], lambda r: dead.append("trainer"))
    others = {k: weakref.ref(v) for k, v in refs.items() if k != "trainer"}
    refs.clear()
    make_del()
    assert trainer_ref() is None
    assert dead == ["trainer"]
    alive = [k for k, r in others.items() if r() is not None]
    assert alive == []
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    leaked = [
        type(o).__name__
        for o in gc.garbage
        if isinstance(o, (TrainerBase, HookBase, nn.Module, torch.optim.Optimizer, EventWriter))
    ]
    assert leaked == []


def _simple(trainer_cls=SimpleTrainer, **kw):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(2, 4),)] * 100
    trainer = trainer_cls(Wrapper(model), data, opt, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    trainer.scheduler = sched
    hooks = [
        IterationTimer(),
        HoldingHook(),
        LRScheduler(),
        PeriodicWriter([NullWriter()], period=2),
        CallbackHook(after_step=lambda t: None),
    ]
    trainer.register_hooks(hooks)
    refs = {"trainer": trainer, "model": trainer.model, "optimizer": opt}
    refs.update({f"hook{i}": h for i, h in enumerate(hooks)})
    return trainer, refs


def test_plain_trainer_freed_by_refcount(no_gc):
    trainer = PlainTrainer()
    hooks = [HoldingHook(), IterationTimer()]
    hooks[0].before_train = lambda: None  # instance attribute: listed in the dispatch table
    trainer.register_hooks(hooks)
    refs = {"trainer": trainer, "h0": hooks[0], "h1": hooks[1]}
    del hooks

    def drop():
        nonlocal trainer
        del trainer

    _assert_freed_without_cycles(refs, drop)


@pytest.mark.parametrize("trained", [False, True], ids=["registered", "trained"])
@pytest.mark.parametrize("trainer_cls", [SimpleTrainer, AMPTrainer])
def test_simple_trainer_freed_by_refcount(no_gc, trained, trainer_cls):
    trainer, refs = _simple(trainer_cls)
    if trained:
        trainer.train(0, 5)
        assert trainer.storage.history("total_loss")

    def drop():
        nonlocal trainer
        del trainer

    _assert_freed_without_cycles(refs, drop)


def test_async_trainer_freed_by_refcount_after_train(no_gc):
    trainer, refs = _simple(async_write_metrics=True)
    trainer.train(0, 5)

    def drop():
        nonlocal trainer
        del trainer

    _assert_freed_without_cycles(refs, drop)


def test_trainer_with_edited_hook_list_freed_by_refcount(no_gc):
    trainer, refs = _simple()
    extra = HoldingHook()
    extra.trainer = weakref.proxy(trainer)
    trainer._hooks.insert(0, extra)
    trainer._hooks = list(trainer._hooks)[::-1]
    refs["extra"] = extra
    del extra
    trainer.train(0, 3)

    def drop():
        nonlocal trainer
        del trainer

    _assert_freed_without_cycles(refs, drop)


def test_hook_outlives_trainer():
    trainer = PlainTrainer()
    hook = HoldingHook()
    trainer.register_hooks([hook])
    ref = weakref.ref(trainer)
    del trainer
    assert ref() is None
    with pytest.raises(ReferenceError):
        hook.trainer.iter  # noqa: B018
