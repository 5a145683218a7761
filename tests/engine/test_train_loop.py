"""TrainerBase, SimpleTrainer and AMPTrainer through the public API, against detectron2's
``train_loop.py`` (call order, exceptions, state_dict, metrics) and hookloop's documented
improvements."""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import itertools
import logging
import math
import threading
import time
import types
import weakref

import pytest
import torch
from compat import d2
from hookloop.engine import AMPTrainer, HookBase, LRScheduler, SimpleTrainer, TrainerBase
from hookloop.engine.metrics import LossMetrics
from hookloop.engine.stop import StopController
from hookloop.utils.events import EventStorage, get_event_storage
from torch import nn

torch.set_num_threads(1)

LOGGER = "hookloop.engine.train_loop"
STAGES = ("before_train", "before_step", "after_backward", "after_step", "after_train")


# ----------------------------------------------------------------------------------------------
# Helpers


class RecordingHook(HookBase):
    """Overrides all five stages; each call appends (name, stage, trainer.iter, storage.iter)."""

    def __init__(self, log, name="hook"):
        self.log = log
        self.name = name

    def _record(self, stage):
        t = self.trainer
        if t is None:
            self.log.append((self.name, stage, None, None))
        else:
            self.log.append((self.name, stage, t.iter, t.storage.iter))

    def before_train(self):
        self._record("before_train")

    def before_step(self):
        self._record("before_step")

    def after_backward(self):
        self._record("after_backward")

    def after_step(self):
        self._record("after_step")

    def after_train(self):
        self._record("after_train")


class LoopTrainer(TrainerBase):
    """A TrainerBase whose run_step records itself and calls after_backward like SimpleTrainer."""

    def __init__(self, log=None, fail_at=None, exc=None):
        super().__init__()
        self.log = [] if log is None else log
        self.fail_at = fail_at
        self.exc = exc

    def run_step(self):
        self.log.append(("trainer", "run_step", self.iter, self.storage.iter))
        if self.fail_at == self.iter:
            raise self.exc
        self.after_backward()


def expected_calls(names, start, stop):
    """detectron2's call sequence for hooks ``names`` (each overriding all stages)."""
    out = [(n, "before_train", start, start) for n in names]
    for i in range(start, stop):
        out += [(n, "before_step", i, i) for n in names]
        out.append(("trainer", "run_step", i, i))
        out += [(n, "after_backward", i, i) for n in names]
        out += [(n, "after_step", i, i) for n in names]
    end = stop if start < stop else start + 1  # detectron2's `self.iter += 1` after the loop
    out += [(n, "after_train", end, end) for n in names]
    return out


class RefTrainerBase(d2.TrainerBase):
    """detectron2's TrainerBase loop (``compat.d2``) running hookloop hooks, with hookloop's
    ``iter == max_iter`` at the end; the reference for subclass overrides."""

    hook_types = (HookBase,)
    iter_ends_at_max_iter = True


class LinearModel(nn.Module):
    """nn.Linear(4, 1) whose forward takes ``(x, y)`` and returns losses."""

    def __init__(self, loss_dict=True, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(4, 1)
        self.loss_dict = loss_dict
        self.seen = []
        self.grad_none_at_forward = []

    def forward(self, data):
        x, y = data
        self.seen.append(data)
        self.grad_none_at_forward.append(self.linear.weight.grad is None)
        err = self.linear(x).squeeze(-1) - y
        if self.loss_dict:
            return {"loss_a": (err**2).mean(), "loss_b": err.abs().mean()}
        return (err**2).mean()


def batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(-1) * 0.5 + 1.0


def loader(start=0):
    for i in itertools.count(start):
        yield batch(i)


def simple_trainer(loss_dict=True, lr=0.05, momentum=0.0, data=None, **kw):
    model = LinearModel(loss_dict=loss_dict)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return SimpleTrainer(model, loader() if data is None else data, opt, **kw)


def history_iters(storage, name):
    return [it for _, it in storage.history(name).values()]


class ScalarModel(nn.Module):
    """Loss = the data value (plus a zero term so backward works)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return (self.w * 0).sum() + x


def scalar_trainer(values, **kw):
    model = ScalarModel()
    data = [torch.tensor(float(v)) for v in values]
    return SimpleTrainer(model, data, torch.optim.SGD(model.parameters(), lr=0.1), **kw)


# ----------------------------------------------------------------------------------------------
# Call order


@pytest.mark.parametrize("start,stop", [(0, 3), (5, 7), (4, 4)])
def test_call_order_one_hook(start, stop):
    log = []
    trainer = LoopTrainer(log)
    trainer.register_hooks([RecordingHook(log)])
    trainer.train(start, stop)
    assert log == expected_calls(["hook"], start, stop)
    # A loop with no iteration (a finished run resumed) ends at start_iter + 1, as detectron2's.
    end = stop if start < stop else start + 1
    assert trainer.iter == end
    assert trainer.start_iter == start
    assert trainer.max_iter == stop
    assert trainer.storage.iter == end


def test_call_order_several_hooks_in_registration_order():
    log = []
    trainer = LoopTrainer(log)
    trainer.register_hooks([RecordingHook(log, "a"), RecordingHook(log, "b")])
    trainer.register_hooks([RecordingHook(log, "c")])
    trainer.train(0, 3)
    assert log == expected_calls(["a", "b", "c"], 0, 3)


def test_train_twice_uses_new_storage_and_same_hooks():
    log = []
    trainer = LoopTrainer(log)
    trainer.register_hooks([RecordingHook(log)])
    trainer.train(0, 2)
    first = trainer.storage
    log.clear()
    trainer.train(2, 4)
    assert log == expected_calls(["hook"], 2, 4)
    assert trainer.storage is not first


def test_storage_is_the_current_event_storage_in_hooks():
    seen = []

    class H(HookBase):
        def before_step(self):
            seen.append(get_event_storage() is self.trainer.storage)

    trainer = LoopTrainer()
    trainer.register_hooks([H()])
    trainer.train(0, 2)
    assert seen == [True, True]


def test_hooks_overriding_some_stages():
    log = []

    class StepOnly(HookBase):
        def after_step(self):
            log.append(("step_only", "after_step", self.trainer.iter))

    class TrainOnly(HookBase):
        def before_train(self):
            log.append(("train_only", "before_train", self.trainer.iter))

        def after_train(self):
            log.append(("train_only", "after_train", self.trainer.iter))

    trainer = LoopTrainer([])
    trainer.register_hooks([StepOnly(), TrainOnly()])
    trainer.train(0, 2)
    assert log == [
        ("train_only", "before_train", 0),
        ("step_only", "after_step", 0),
        ("step_only", "after_step", 1),
        ("train_only", "after_train", 2),
    ]


def test_hookbase_stage_not_overridden_is_never_called(monkeypatch):
    """Documented improvement: the dispatcher skips a stage left as HookBase's own (marked
    with ``dispatch.base_stage``), whatever it would do."""
    from hookloop.engine.dispatch import base_stage

    called = []
    for stage in STAGES:
        monkeypatch.setattr(HookBase, stage, base_stage(lambda self, s=stage: called.append(s)))

    class StepOnly(HookBase):
        def after_step(self):
            called.append("StepOnly.after_step")

    trainer = LoopTrainer()
    trainer.register_hooks([StepOnly(), HookBase()])
    trainer.train(0, 2)
    assert called == ["StepOnly.after_step"] * 2


def test_hook_stage_set_on_instance_before_registration_is_called():
    log = []

    class StepOnly(HookBase):
        def after_step(self):
            log.append("after_step")

    h = StepOnly()
    h.before_step = lambda: log.append("before_step")
    trainer = LoopTrainer()
    trainer.register_hooks([h])
    trainer.train(0, 2)
    assert log == ["before_step", "after_step"] * 2


def test_hook_stage_set_on_instance_after_registration_is_called():
    """detectron2 looks ``h.before_step`` up at each call, so a stage method assigned on the hook
    instance after ``register_hooks`` runs too."""
    log = []

    class StepOnly(HookBase):
        def after_step(self):
            log.append("after_step")

    h = StepOnly()
    trainer = LoopTrainer()
    trainer.register_hooks([h])
    h.before_step = lambda: log.append("before_step")
    trainer.train(0, 2)
    assert log == ["before_step", "after_step"] * 2


def test_overridden_stage_replaced_on_instance_after_registration_is_called():
    log = []
    h = RecordingHook([])
    trainer = LoopTrainer()
    trainer.register_hooks([h])
    h.after_step = lambda: log.append(trainer.iter)
    trainer.train(0, 3)
    assert log == [0, 1, 2]


def test_register_same_hook_twice_calls_it_twice():
    log = []
    trainer = LoopTrainer(log)
    h = RecordingHook(log)
    trainer.register_hooks([h])
    trainer.register_hooks([h])
    trainer.train(0, 2)
    assert log == expected_calls(["hook", "hook"], 0, 2)
    assert trainer._hooks == [h, h]


def test_register_hooks_drops_none_and_accepts_any_iterable():
    log = []
    trainer = LoopTrainer(log)
    a, b, c = RecordingHook(log, "a"), RecordingHook(log, "b"), RecordingHook(log, "c")
    trainer.register_hooks([None, a, None, b, None])
    trainer.register_hooks(h for h in (c, None))
    assert list(trainer._hooks) == [a, b, c]
    trainer.train(0, 1)
    assert log == expected_calls(["a", "b", "c"], 0, 1)


def test_hook_trainer_is_weakref_proxy():
    trainer = LoopTrainer()
    h = RecordingHook([])
    assert h.trainer is None
    trainer.register_hooks([h])
    assert type(h.trainer) in (weakref.ProxyType, weakref.CallableProxyType)
    assert h.trainer.iter == trainer.iter
    trainer.iter = 17
    assert h.trainer.iter == 17
    del trainer
    with pytest.raises(ReferenceError):
        h.trainer.iter  # noqa: B018


def _add_hook(trainer, h):
    h.trainer = weakref.proxy(trainer)
    return h


def _edit_append(t, a, b, c):
    t._hooks.append(_add_hook(t, c))
    return ["a", "b", "c"]


def _edit_insert(t, a, b, c):
    t._hooks.insert(1, _add_hook(t, c))
    return ["a", "c", "b"]


def _edit_extend(t, a, b, c):
    t._hooks.extend([_add_hook(t, c)])
    return ["a", "b", "c"]


def _edit_iadd(t, a, b, c):
    t._hooks += [_add_hook(t, c)]
    return ["a", "b", "c"]


def _edit_remove(t, a, b, c):
    t._hooks.remove(a)
    return ["b"]


def _edit_pop(t, a, b, c):
    t._hooks.pop()
    return ["a"]


def _edit_del(t, a, b, c):
    del t._hooks[0]
    return ["b"]


def _edit_setitem(t, a, b, c):
    t._hooks[0] = _add_hook(t, c)
    return ["c", "b"]


def _edit_slice(t, a, b, c):
    t._hooks[1:] = [_add_hook(t, c), b]
    return ["a", "c", "b"]


def _edit_del_slice(t, a, b, c):
    del t._hooks[:]
    return []


def _edit_clear(t, a, b, c):
    t._hooks.clear()
    return []


def _edit_reverse(t, a, b, c):
    t._hooks.reverse()
    return ["b", "a"]


def _edit_sort(t, a, b, c):
    t._hooks.sort(key=lambda h: h.name, reverse=True)
    return ["b", "a"]


def _edit_assign(t, a, b, c):
    t._hooks = [_add_hook(t, c), a]
    return ["c", "a"]


EDITS = [
    _edit_append,
    _edit_insert,
    _edit_extend,
    _edit_iadd,
    _edit_remove,
    _edit_pop,
    _edit_del,
    _edit_setitem,
    _edit_slice,
    _edit_del_slice,
    _edit_clear,
    _edit_reverse,
    _edit_sort,
    _edit_assign,
]


@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__[len("_edit_") :])
def test_editing_hooks_list_in_place_changes_what_is_called(edit):
    log = []
    trainer = LoopTrainer(log)
    a, b, c = RecordingHook(log, "a"), RecordingHook(log, "b"), RecordingHook(log, "c")
    trainer.register_hooks([a, b])
    names = edit(trainer, a, b, c)
    assert [h.name for h in trainer._hooks] == names
    trainer.train(0, 2)
    assert log == expected_calls(names, 0, 2)


def test_editing_hooks_list_between_trainings():
    log = []
    trainer = LoopTrainer(log)
    a, b = RecordingHook(log, "a"), RecordingHook(log, "b")
    trainer.register_hooks([a])
    trainer.train(0, 1)
    trainer._hooks.append(_add_hook(trainer, b))
    trainer._hooks.remove(a)
    log.clear()
    trainer.train(1, 2)
    assert log == expected_calls(["b"], 1, 2)


def test_hook_registered_during_training_runs_from_a_later_iteration():
    log = []
    late = RecordingHook(log, "late")

    class Adder(HookBase):
        def after_step(self):
            if self.trainer.iter == 0:
                self.trainer.register_hooks([late])

    trainer = LoopTrainer([])
    trainer.register_hooks([Adder()])
    trainer.train(0, 3)
    steps = [(stage, it) for _, stage, it, _ in log if stage in ("before_step", "after_step")]
    assert steps[0] == ("before_step", 1)
    assert steps[-2:] == [("before_step", 2), ("after_step", 2)]
    assert log[-1] == ("late", "after_train", 3, 3)


# ----------------------------------------------------------------------------------------------
# Subclasses overriding the stages


def _make_override(stage, call_super):
    def method(self):
        self.log.append(("trainer", "override_" + stage, self.iter, self.storage.iter))
        if call_super:
            getattr(super(type(self).__mro__[1], self), stage)()

    return method


class _Steps:
    def __init__(self):
        super().__init__()
        self.log = []

    def run_step(self):
        self.log.append(("trainer", "run_step", self.iter, self.storage.iter))
        self.after_backward()


def _run_scenario(base, stage, call_super, start=2, stop=5):
    mixin = type("Override", (), {stage: _make_override(stage, call_super)})
    cls = type("T", (mixin, _Steps, base), {})
    trainer = cls()
    trainer.register_hooks([RecordingHook(trainer.log, "a"), RecordingHook(trainer.log, "b")])
    trainer.train(start, stop)
    return trainer


@pytest.mark.parametrize("call_super", [True, False], ids=["super", "no_super"])
@pytest.mark.parametrize("stage", ["before_train", "after_train", "before_step", "after_step"])
def test_subclass_stage_override_matches_detectron2(stage, call_super):
    ours = _run_scenario(TrainerBase, stage, call_super)
    ref = _run_scenario(RefTrainerBase, stage, call_super)
    assert ours.log == ref.log
    assert ours.iter == ref.iter == 5
    overrides = [e for e in ours.log if e[1] == "override_" + stage]
    assert len(overrides) == (1 if stage.endswith("train") else 3)
    hook_calls = [e for e in ours.log if e[0] == "a" and e[1] == stage]
    assert len(hook_calls) == (len(overrides) if call_super else 0)


def test_subclass_before_step_without_super_leaves_storage_iter():
    """detectron2 sets storage.iter only in TrainerBase.before_step/after_train."""
    trainer = _run_scenario(TrainerBase, "before_step", False, start=2, stop=5)
    assert [e[3] for e in trainer.log if e[1] == "run_step"] == [2, 2, 2]


def test_subclass_after_backward_override():
    for base in (TrainerBase, RefTrainerBase):
        trainer = _run_scenario(base, "after_backward", True, 0, 2)
        assert [e[1] for e in trainer.log if e[2] == 0] == [
            "before_train",
            "before_train",
            "before_step",
            "before_step",
            "run_step",
            "override_after_backward",
            "after_backward",
            "after_backward",
            "after_step",
            "after_step",
        ]


@pytest.mark.parametrize(
    "stage", ["before_train", "after_train", "before_step", "after_step", "after_backward"]
)
def test_instance_level_stage_override(stage):
    results = []
    for base in (TrainerBase, RefTrainerBase):
        cls = type("T", (_Steps, base), {})
        trainer = cls()
        trainer.register_hooks([RecordingHook(trainer.log)])
        log = trainer.log
        setattr(
            trainer,
            stage,
            lambda log=log, t=trainer: log.append(("inst", stage, t.iter, t.storage.iter)),
        )
        trainer.train(1, 3)
        results.append(trainer.log)
        assert any(e[0] == "inst" for e in trainer.log)
        assert not any(e[0] == "hook" and e[1] == stage for e in trainer.log)
    assert results[0] == results[1]


# ----------------------------------------------------------------------------------------------
# Exceptions


class MyError(Exception):
    pass


class FailingHook(HookBase):
    def __init__(self, stage, at, exc):
        self.stage, self.at, self.exc = stage, at, exc

    def _maybe(self, stage):
        if stage == self.stage and self.trainer.iter == self.at:
            raise self.exc

    def before_train(self):
        self._maybe("before_train")

    def before_step(self):
        self._maybe("before_step")

    def after_backward(self):
        self._maybe("after_backward")

    def after_step(self):
        self._maybe("after_step")


def _error_records(caplog):
    return [
        r for r in caplog.records if r.name == LOGGER and "Exception during training:" in r.message
    ]


@pytest.mark.parametrize(
    "stage,at",
    [
        ("before_train", 3),
        ("before_step", 5),
        ("run_step", 4),
        ("after_backward", 5),
        ("after_step", 3),
    ],
)
def test_exception_propagates_unchanged_and_after_train_runs(caplog, stage, at):
    caplog.set_level(logging.INFO, logger=LOGGER)
    err = MyError("boom")
    log = []
    if stage == "run_step":
        trainer = LoopTrainer(log, fail_at=at, exc=err)
    else:
        trainer = LoopTrainer(log)
        trainer.register_hooks([FailingHook(stage, at, err)])
    trainer.register_hooks([RecordingHook(log)])
    with pytest.raises(MyError) as info:
        trainer.train(3, 8)
    assert info.value is err
    assert trainer.iter == at
    assert log[-1] == ("hook", "after_train", at, at)
    records = _error_records(caplog)
    assert len(records) == 1
    assert records[0].levelno == logging.ERROR
    assert records[0].exc_info[1] is err
    # Nothing ran after the failing stage except after_train.
    if stage == "after_step":
        assert log[-2] == ("hook", "after_backward", at, at)


def test_exception_in_after_train_propagates_without_training_log(caplog):
    err = MyError("in after_train")

    class H(HookBase):
        def after_train(self):
            raise err

    trainer = LoopTrainer()
    trainer.register_hooks([H()])
    with pytest.raises(MyError) as info:
        trainer.train(0, 2)
    assert info.value is err
    assert trainer.iter == 2
    assert _error_records(caplog) == []


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_base_exception_propagates_and_after_train_runs(caplog, exc_type):
    err = exc_type()
    log = []
    trainer = LoopTrainer(log)
    trainer.register_hooks([FailingHook("after_step", 1, err), RecordingHook(log)])
    with pytest.raises(exc_type) as info:
        trainer.train(0, 5)
    assert info.value is err
    assert trainer.iter == 1
    assert log[-1] == ("hook", "after_train", 1, 1)
    # detectron2 catches only Exception for its log line.
    assert _error_records(caplog) == []


def test_stop_iteration_from_a_one_shot_iterator_propagates(caplog):
    trainer = simple_trainer(data=iter([batch(i) for i in range(3)]))
    with pytest.raises(StopIteration):
        trainer.train(0, 5)
    assert trainer.iter == 3
    assert len(_error_records(caplog)) == 1


def test_a_finite_list_of_batches_starts_its_next_epoch():
    trainer = simple_trainer(data=[batch(i) for i in range(3)])
    trainer.train(0, 5)
    assert trainer.iter == 5 and trainer.epoch == 1


def test_starting_training_is_logged(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    LoopTrainer().train(7, 9)
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "Starting training from iteration 7" in msgs


# ----------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "args,exc,name",
    [
        (("0", 10), TypeError, "start_iter"),
        ((0, 5.0), TypeError, "max_iter"),
        ((None, 5), TypeError, "start_iter"),
    ],
)
def test_train_rejects_bad_iterations(args, exc, name):
    log = []
    trainer = LoopTrainer(log)
    trainer.register_hooks([RecordingHook(log)])
    with pytest.raises(exc, match=name):
        trainer.train(*args)
    assert log == []


def test_train_from_past_max_iter_runs_only_before_and_after_train(caplog):
    """detectron2 runs no iteration, then ``after_train`` with ``iter = start_iter + 1``
    (tests/engine/test_run_extension.py compares the whole run with detectron2's)."""
    log = []
    trainer = LoopTrainer(log)
    trainer.register_hooks([RecordingHook(log)])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train(10, 5)
    assert log == [("hook", "before_train", 10, 10), ("hook", "after_train", 11, 11)]
    assert trainer.iter == 11
    assert ["start_iter (10) is past max_iter (5)" in r.getMessage() for r in caplog.records] == [
        True
    ]


def test_train_accepts_integer_like_iterations():
    """detectron2 runs ``range(start_iter, max_iter)``: any int-like (numpy ints from configs
    or schedules, IntEnum) works."""
    np = pytest.importorskip("numpy")
    log = []
    trainer = LoopTrainer(log)
    trainer.train(np.int64(0), np.int64(2))
    assert trainer.iter == 2
    assert [e[2] for e in log] == [0, 1]


def test_register_hooks_rejects_non_hooks_and_registers_nothing():
    trainer = LoopTrainer()
    ok = RecordingHook([])
    with pytest.raises(TypeError, match="object"):
        trainer.register_hooks([ok, object()])
    assert list(trainer._hooks) == []
    assert ok.trainer is None


def test_register_hooks_rejects_a_single_hook():
    trainer = LoopTrainer()
    with pytest.raises(TypeError, match="list"):
        trainer.register_hooks(RecordingHook([]))
    assert list(trainer._hooks) == []


@pytest.mark.parametrize("period,exc", [(0, ValueError), (-1, ValueError), ("3", TypeError)])
def test_simple_trainer_rejects_bad_gather_metric_period(period, exc):
    with pytest.raises(exc, match="gather_metric_period"):
        simple_trainer(gather_metric_period=period)


# ----------------------------------------------------------------------------------------------
# state_dict


class CounterHook(HookBase):
    def __init__(self, n=0):
        self.n = n

    def after_step(self):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state_dict):
        self.n = state_dict["n"]


class OtherStateHook(HookBase):
    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"x": [1, 2]}

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


def test_state_dict_without_stateful_hooks():
    trainer = LoopTrainer()
    trainer.register_hooks([RecordingHook([])])
    trainer.train(0, 3)
    state = trainer.state_dict()
    assert set(state) == {"iteration", "rng"} and state["iteration"] == 3


def test_state_dict_with_stateful_hooks_and_duplicates():
    trainer = LoopTrainer()
    first, second = CounterHook(0), CounterHook(100)
    trainer.register_hooks([RecordingHook([]), first, OtherStateHook(), second])
    trainer.train(0, 4)
    state = trainer.state_dict()
    # Both hooks of one class are saved (detectron2 keeps only the first): the second under
    # "CounterHook.1".
    assert state["iteration"] == 4
    assert state["hooks"] == {
        "CounterHook": {"n": 4},
        "OtherStateHook": {"x": [1, 2]},
        "CounterHook.1": {"n": 104},
    }


def test_load_state_dict_of_detectron2_keys_restores_the_first_hook_of_a_type():
    trainer = LoopTrainer()
    first, second, other = CounterHook(), CounterHook(), OtherStateHook()
    trainer.register_hooks([first, other, second])
    trainer.load_state_dict(
        {"iteration": 12, "hooks": {"CounterHook": {"n": 7}, "OtherStateHook": {"x": [3]}}}
    )
    assert trainer.iter == 12
    assert first.n == 7
    assert second.n == 0
    assert other.loaded == {"x": [3]}


def test_load_state_dict_unknown_hook_warns(caplog):
    trainer = LoopTrainer()
    h = CounterHook()
    trainer.register_hooks([h])
    trainer.load_state_dict({"iteration": 3, "hooks": {"Nope": {"a": 1}, "CounterHook": {"n": 2}}})
    assert trainer.iter == 3
    assert h.n == 2
    warnings = [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]
    assert warnings == ["Cannot find the hook 'Nope', its state_dict is ignored."]


def _resume_trainer(start):
    model = LinearModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = SimpleTrainer(model, loader(start), opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    trainer.register_hooks([LRScheduler(opt, sched)])
    return trainer


def test_simple_trainer_resume_matches_straight_run():
    straight = _resume_trainer(0)
    straight.train(0, 20)

    first = _resume_trainer(0)
    first.train(0, 10)
    state = copy.deepcopy(first.state_dict())
    weights = copy.deepcopy(first.model.state_dict())
    assert set(state) == {"iteration", "optimizer", "hooks", "rng"}
    assert state["iteration"] == 10
    assert set(state["hooks"]) == {"LRScheduler"}
    assert state["hooks"]["LRScheduler"]["last_epoch"] == 10
    assert state["optimizer"]["state"]  # momentum buffers

    resumed = _resume_trainer(10)
    resumed.model.load_state_dict(weights)
    resumed.load_state_dict(state)
    assert resumed.iter == 10
    resumed.train(resumed.iter, 20)

    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
    # The run without optimizer state differs, so the comparison above can fail.
    fresh = _resume_trainer(10)
    fresh.model.load_state_dict(weights)
    fresh.train(10, 20)
    assert not torch.equal(fresh.model.linear.weight, straight.model.linear.weight)


# ----------------------------------------------------------------------------------------------
# SimpleTrainer metrics


def test_simple_trainer_loss_dict_metrics():
    trainer = simple_trainer(loss_dict=True)
    losses = []

    class Grab(HookBase):
        def after_step(self):
            st = self.trainer.storage
            latest = st.latest()
            losses.append({k: latest[k] for k in ("loss_a", "loss_b", "total_loss")})

    trainer.register_hooks([Grab()])
    trainer.train(2, 6)
    st = trainer.storage
    assert set(st.histories()) == {
        "total_loss",
        "loss_a",
        "loss_b",
        "data_time",
        "rank_data_time",
    }
    for name in st.histories():
        assert history_iters(st, name) == [2, 3, 4, 5]
    for i, entry in enumerate(losses):
        a, b, total = entry["loss_a"], entry["loss_b"], entry["total_loss"]
        assert a[1] == b[1] == total[1] == 2 + i
        assert total[0] == pytest.approx(a[0] + b[0], rel=1e-12)
    assert all(v >= 0 for v, _ in st.history("data_time").values())
    assert all(st.smoothing_hints().values())


def test_simple_trainer_losses_match_model_output():
    model = LinearModel(loss_dict=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = SimpleTrainer(model, loader(), opt)
    trainer.train(0, 3)
    expected = [((model.linear(x).squeeze(-1) - y) ** 2).mean().item() for x, y in model.seen]
    got = [v for v, _ in trainer.storage.history("total_loss").values()]
    assert got == pytest.approx(expected, rel=1e-6)


def test_simple_trainer_single_tensor_loss():
    trainer = simple_trainer(loss_dict=False)
    trainer.train(0, 3)
    st = trainer.storage
    assert set(st.histories()) == {"total_loss", "data_time", "rank_data_time"}
    assert history_iters(st, "total_loss") == [0, 1, 2]


@pytest.mark.parametrize("start", [0, 1])
def test_gather_metric_period(start):
    trainer = simple_trainer(gather_metric_period=3)
    trainer.train(start, 10)
    st = trainer.storage
    for name in ("total_loss", "loss_a", "loss_b", "data_time", "rank_data_time"):
        assert history_iters(st, name) == [2, 5, 8]


def test_training_changes_parameters_and_reduces_loss():
    trainer = simple_trainer(loss_dict=False, lr=0.05)
    before = trainer.model.linear.weight.detach().clone()
    trainer.train(0, 30)
    assert not torch.equal(before, trainer.model.linear.weight)
    vals = [v for v, _ in trainer.storage.history("total_loss").values()]
    assert sum(vals[-5:]) < sum(vals[:5])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_raises_at_its_step_with_the_per_step_check(caplog, bad):
    log = []
    trainer = scalar_trainer([1, 1, 1, bad, 1, 1], check_finite_every_step=True)
    trainer.register_hooks([RecordingHook(log)])
    with pytest.raises(FloatingPointError, match=r"^Loss became infinite or NaN at iteration=3!"):
        trainer.train(0, 6)
    assert trainer.iter == 3
    assert log[-1] == ("hook", "after_train", 3, 3)
    assert history_iters(trainer.storage, "total_loss") == [0, 1, 2]
    assert any("Exception in writing metrics" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_deferred_names_its_iteration(caplog, bad):
    """By default losses are read in batches: the error names the iteration where the
    non-finite loss appeared, raised when the batch is read (here: at the end of training,
    which then fails), and the iterations before it are stored."""
    trainer = scalar_trainer([1, 1, 1, bad, 1, 1])
    with pytest.raises(FloatingPointError, match=r"^Loss became infinite or NaN at iteration=3!"):
        trainer.train(0, 6)
    assert history_iters(trainer.storage, "total_loss") == [0, 1, 2]
    assert any("Exception in writing metrics" in r.getMessage() for r in caplog.records)


def test_non_finite_loss_deferred_surfaces_within_one_read_period():
    n = 20  # the storage's pending queue reads at least every 20 iterations (core pending)
    trainer = scalar_trainer([1.0] * 3 + [float("nan")] + [1.0] * (3 * n))
    with pytest.raises(FloatingPointError, match=r"iteration=3!"):
        trainer.train(0, 3 * n)
    assert trainer.iter == n - 1  # the 20th iteration's losses make the read due


def test_deferred_and_per_step_metrics_store_the_same_values():
    runs = {}
    for every_step in (False, True):
        torch.manual_seed(0)
        trainer = simple_trainer(momentum=0.9, check_finite_every_step=every_step)
        trainer.train(0, 45)
        st = trainer.storage
        runs[every_step] = {k: st.history(k).values() for k in ("total_loss", "loss_a", "loss_b")}
    assert runs[False] == runs[True]


def test_deferred_losses_of_a_model_that_refills_one_dict_are_each_steps_own():
    """A model may return the same dict object every step, refilled in its forward; the
    deferred read must still store each step's losses, as the per-step read does."""

    class Refills(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.losses = {}
            self.steps = 0

        def forward(self, data):
            self.steps += 1
            self.losses["loss_a"] = self.w * self.steps
            self.losses["loss_b"] = self.w * (100 * self.steps)
            return self.losses

    class LateExecutor(concurrent.futures.Executor):
        """Runs what is submitted at shutdown (the end of training): the executor's reads
        come after every later step's refill, deterministically."""

        def __init__(self):
            self.queued = []

        def submit(self, fn, *args, **kwargs):
            future = concurrent.futures.Future()
            self.queued.append((future, fn, args, kwargs))
            return future

        def shutdown(self, wait=True, **kwargs):
            for future, fn, args, kwargs in self.queued:
                future.set_result(fn(*args, **kwargs))
            self.queued = []

    runs = {}
    for mode in ("deferred", "every_step", "async"):
        model = Refills()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        trainer = SimpleTrainer(
            model, loader(), opt, check_finite_every_step=mode == "every_step",
            async_write_metrics=mode == "async",
        )  # fmt: skip
        trainer.concurrent_executor = LateExecutor()
        trainer.train(0, 5)
        runs[mode] = {
            k: trainer.storage.history(k).values() for k in ("total_loss", "loss_a", "loss_b")
        }
    assert runs["deferred"] == runs["every_step"] == runs["async"]
    assert runs["deferred"]["loss_a"] == [(float(i + 1), i) for i in range(5)]


def test_a_hook_reading_the_storage_sees_this_steps_losses():
    seen = []

    class Reader(HookBase):
        def after_step(self):
            seen.append(self.trainer.storage.latest()["total_loss"][1])

    trainer = simple_trainer()
    trainer.register_hooks([Reader()])
    trainer.train(0, 5)
    assert seen == [0, 1, 2, 3, 4]


def test_a_hook_holding_a_history_buffer_sees_this_steps_losses():
    """``storage.history(name)`` is the storage's own buffer, as in detectron2: a hook may keep
    it and read it at later steps, and must see each step's deferred losses there too."""
    seen = []

    class Holder(HookBase):
        buffer = None

        def after_step(self):
            if self.buffer is None:
                self.buffer = self.trainer.storage.history("total_loss")
            seen.append((len(self.buffer), self.buffer.values()[-1][1]))

    trainer = simple_trainer()
    trainer.register_hooks([Holder()])
    trainer.train(0, 5)
    assert seen == [(i + 1, i) for i in range(5)]


def test_a_reader_waits_for_a_settle_under_way_on_another_thread(monkeypatch):
    """Another thread may read the storage while a settle is under way (its device read
    releases the GIL): that reader waits for it, then stores what was recorded since, so no
    read ever sees the storage without values a settle already took. Made deterministic with
    events (each wait bounded): the first settle is held inside its read until the second
    reader has started."""
    from hookloop.utils import _tensors

    entered, release = threading.Event(), threading.Event()

    def read_scalars(tensors):
        if not entered.is_set():
            entered.set()
            assert release.wait(10)
        return [1.0] * len(tensors)

    monkeypatch.setattr(_tensors, "read_scalars", read_scalars)
    meta = {"loss": torch.empty((), device="meta")}
    storage = EventStorage(0)
    storage._record_losses(0, 0.0, meta)
    seen = {}

    def read(name):
        seen[name] = storage.latest()["total_loss"]

    first = threading.Thread(target=read, args=("first",))
    first.start()
    assert entered.wait(10)
    storage._record_losses(1, 0.0, meta)  # recorded while the first settle holds iteration 0
    second = threading.Thread(target=read, args=("second",))
    second.start()
    release.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert seen["second"] == (1.0, 1)
    assert [it for _, it in storage.history("total_loss").values()] == [0, 1]


def test_deferred_losses_make_no_torch_call_between_reads(monkeypatch):
    """Between batched reads the trainer keeps the losses as they are: no item(), no copy.
    The read (here after the last step) is one call into the core, which on the CPU reads
    each value with item(): cheaper than stacking many small tensors (docs/performance.md)."""
    calls = []
    real_item = torch.Tensor.item

    def item(self):
        calls.append(trainer.iter)
        return real_item(self)

    class CountAtEachStep(HookBase):
        def after_step(self):
            during.append(len(calls))

    during = []
    trainer = simple_trainer()
    trainer.register_hooks([CountAtEachStep()])
    monkeypatch.setattr(torch.Tensor, "item", item)
    trainer.train(0, 10)
    assert during == [0] * 10  # nothing read while training
    n_losses = len(trainer.storage.latest()) - 3  # total_loss, data_time, rank_data_time
    assert len(calls) == 10 * max(n_losses, 1)  # each loss of each iteration, read once


def test_deferred_losses_on_a_device_are_read_in_one_batch(monkeypatch):
    """Losses that are not on the CPU are read with one stack and one copy (one
    synchronization), not one item() each. Simulated with tensors whose device is not the
    CPU: the meta device, whose values read_scalars is patched to supply."""
    from hookloop.utils import _tensors

    batches = []

    def read_all(tensors):
        batches.append(len(tensors))
        return [0.5] * len(tensors)

    monkeypatch.setattr(_tensors, "read_scalars", read_all)
    _Trainer = functools.partial(types.SimpleNamespace, gather_metric_period=1)
    metrics = LossMetrics(StopController())
    metrics.deferring = True
    with EventStorage(0) as storage:
        meta = {"loss_a": torch.empty((), device="meta"), "loss_b": torch.empty((), device="meta")}
        for i in range(3):
            storage.iter = i
            metrics.write(_Trainer(storage=storage), meta, 0.01, "", i)
        assert batches == []
        storage._settle()
        assert batches == [6]
        assert storage.history("loss_a").values() == [(0.5, 0), (0.5, 1), (0.5, 2)]
        assert storage.history("total_loss").latest() == 1.0


class RecordingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A one-worker executor that records each submitted ``iter`` and the worker thread."""

    def __init__(self):
        super().__init__(max_workers=1)
        self.iters = []
        self.threads = set()

    def submit(self, fn, *args, **kwargs):
        self.iters.append(kwargs.get("iter"))

        def run():
            self.threads.add(threading.get_ident())
            return fn(*args, **kwargs)

        return super().submit(run)


class SleepHook(HookBase):
    """Gives the metric-writer thread time to run between steps."""

    def after_step(self):
        time.sleep(0.001)


def test_async_non_finite_loss_stops_training(caplog):
    log = []
    trainer = scalar_trainer([1, 1, 1, "nan"] + [1] * 96, async_write_metrics=True)
    trainer.register_hooks([SleepHook(), RecordingHook(log)])
    with pytest.raises(FloatingPointError, match=r"^Loss became infinite or NaN at iteration=3!"):
        trainer.train(0, 100)
    assert 3 <= trainer.iter < 99
    assert log[-1] == ("hook", "after_train", trainer.iter, trainer.iter)
    assert len([e for e in log if e[1] == "before_step"]) == trainer.iter + 1


class GatedExecutor(concurrent.futures.ThreadPoolExecutor):
    """Holds every metric write until ``gate`` is set, so several writes are pending at once."""

    def __init__(self):
        super().__init__(max_workers=1)
        self.gate = threading.Event()
        self.futures = []

    def submit(self, fn, *args, **kwargs):
        def run():
            self.gate.wait(10)
            return fn(*args, **kwargs)

        fut = super().submit(run)
        self.futures.append(fut)
        return fut


def test_async_first_non_finite_iteration_is_reported():
    """Every loss from iteration 3 on is NaN and the writes of iterations 0..6 are all pending
    when they fail: train() reports iteration 3, where the loss first became NaN (as the
    synchronous path and detectron2 do), not a later one."""
    trainer = scalar_trainer([1, 1, 1] + ["nan"] * 17, async_write_metrics=True)
    executor = GatedExecutor()
    trainer.concurrent_executor = executor

    class Release(HookBase):
        def after_step(self):
            if self.trainer.iter == 6:
                executor.gate.set()
                concurrent.futures.wait(executor.futures)

    trainer.register_hooks([Release()])
    with pytest.raises(FloatingPointError) as info:
        trainer.train(0, 20)
    assert trainer.iter == 7
    assert str(info.value).startswith("Loss became infinite or NaN at iteration=3!")


def test_async_non_finite_loss_in_last_iteration_raises_from_train():
    trainer = scalar_trainer([1, 1, 1, "inf"], async_write_metrics=True)
    with pytest.raises(FloatingPointError, match="iteration=3!"):
        trainer.train(0, 4)


@pytest.mark.parametrize("trainer_cls", [SimpleTrainer, AMPTrainer])
def test_async_write_metrics_uses_executor(trainer_cls):
    model = LinearModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = trainer_cls(model, loader(), opt, async_write_metrics=True)
    executor = RecordingExecutor()
    trainer.concurrent_executor = executor
    trainer.train(3, 8)
    assert executor.iters == [3, 4, 5, 6, 7]
    assert threading.get_ident() not in executor.threads and len(executor.threads) == 1
    for name in ("total_loss", "loss_a", "loss_b", "data_time", "rank_data_time"):
        assert history_iters(trainer.storage, name) == [3, 4, 5, 6, 7]
    # after_train waited for the writes and left a fresh executor behind.
    assert executor._shutdown
    assert trainer.concurrent_executor is not executor


def test_sync_write_metrics_does_not_use_executor():
    trainer = simple_trainer()
    executor = RecordingExecutor()
    trainer.concurrent_executor = executor
    trainer.train(0, 3)
    assert executor.iters == []
    assert history_iters(trainer.storage, "total_loss") == [0, 1, 2]


def test_write_metrics_static_method():
    with EventStorage(0) as storage:
        SimpleTrainer.write_metrics(
            {"loss_a": torch.tensor(1.0), "loss_b": torch.tensor(2.0)}, 0.5, 7, prefix="val_"
        )
        assert storage.latest() == {
            "rank_data_time": (0.5, 7),
            "data_time": (0.5, 7),
            "val_total_loss": (3.0, 7),
            "loss_a": (1.0, 7),
            "loss_b": (2.0, 7),
        }
        SimpleTrainer.write_metrics({"total_loss": torch.tensor(4.0)}, 0.25, 8)
        assert storage.latest()["total_loss"] == (4.0, 8)
        assert storage.latest()["data_time"] == (0.25, 8)
        with pytest.raises(FloatingPointError, match=r"iteration=9!\nloss_dict = "):
            SimpleTrainer.write_metrics({"a": torch.tensor(math.nan)}, 0.1, 9)
        assert "total_loss" not in [k for k, (_, it) in storage.latest().items() if it == 9]


def test_write_metrics_needs_event_storage():
    with pytest.raises(AssertionError):
        SimpleTrainer.write_metrics({"a": torch.tensor(1.0)}, 0.1, 0)


def test_data_loader_iterator_persists_across_train_calls():
    data = [torch.tensor(float(i)) for i in range(10)]
    model = ScalarModel()
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(args[0].item()))
    trainer = SimpleTrainer(model, data, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.train(0, 2)
    trainer.train(2, 4)
    assert seen == [0.0, 1.0, 2.0, 3.0]


def test_reset_data_loader():
    model = ScalarModel()
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(args[0].item()))
    trainer = SimpleTrainer(
        model, [torch.tensor(1.0)] * 5, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    trainer.train(0, 2)
    calls = []

    new_data = [torch.tensor(7.0)] * 5

    def builder():
        calls.append(1)
        return new_data

    trainer.reset_data_loader(builder)
    assert calls == [1]
    assert trainer.data_loader is new_data
    trainer.train(2, 4)
    assert seen == [1.0, 1.0, 7.0, 7.0]


@pytest.mark.parametrize("zero_first", [False, True])
def test_zero_grad_before_forward(zero_first):
    trainer = simple_trainer(zero_grad_before_forward=zero_first)
    trainer.train(0, 3)
    # zero_grad() sets grads to None: before the forward, or after it (then the forward of
    # iterations > 0 still sees the previous gradient).
    assert trainer.model.grad_none_at_forward == (
        [True] * 3 if zero_first else [True, False, False]
    )


@pytest.mark.parametrize("zero_first", [False, True])
def test_gradients_do_not_accumulate(zero_first):
    data = [batch(0)] * 3
    trainer = simple_trainer(lr=0.0, data=data, zero_grad_before_forward=zero_first)
    grads = []

    class Grab(HookBase):
        def after_backward(self):
            grads.append(self.trainer.model.linear.weight.grad.clone())

    trainer.register_hooks([Grab()])
    trainer.train(0, 3)
    assert len(grads) == 3
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


def test_after_backward_runs_between_backward_and_optimizer_step():
    trainer = simple_trainer()
    checks = []

    class Check(HookBase):
        def before_step(self):
            self.w = self.trainer.model.linear.weight.detach().clone()

        def after_backward(self):
            w = self.trainer.model.linear.weight
            checks.append((w.grad is not None, torch.equal(w.detach(), self.w)))

        def after_step(self):
            w = self.trainer.model.linear.weight
            checks.append(("step", torch.equal(w.detach(), self.w)))

    trainer.register_hooks([Check()])
    trainer.train(0, 2)
    assert checks == [(True, True), ("step", False)] * 2


def test_a_wrapped_trainer_sharing_the_hook_list_calls_its_after_backward():
    """A trainer that wraps a SimpleTrainer (DefaultTrainer-style, skipping its __init__)
    shares its hook list with it, ``self._trainer._hooks = self._hooks``, so that the wrapped
    ``run_step``'s ``after_backward()`` reaches the registered hooks (Lotto98/DL4NLP_project's
    gradient writer). The wrapped trainer never trains: its stages follow the list assigned."""
    calls = []

    class Grads(HookBase):
        def after_backward(self):
            calls.append(self.trainer.iter)

    class Outer(TrainerBase):
        def __init__(self):
            super().__init__()
            self._trainer = simple_trainer()
            self.register_hooks([Grads()])
            self._trainer._hooks = self._hooks

        def run_step(self):
            self._trainer.iter = self.iter
            self._trainer.run_step()

    Outer().train(0, 3)
    assert calls == [0, 1, 2]


def test_sync_metrics_visible_in_after_step():
    trainer = simple_trainer()
    seen = []

    class Grab(HookBase):
        def after_step(self):
            seen.append(self.trainer.storage.latest()["total_loss"][1])

    trainer.register_hooks([Grab()])
    trainer.train(4, 7)
    assert seen == [4, 5, 6]


def test_simple_trainer_puts_model_in_train_mode():
    model = LinearModel()
    model.eval()
    SimpleTrainer(model, loader(), torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.training


@pytest.mark.parametrize("trainer_cls", [SimpleTrainer, AMPTrainer])
def test_model_in_eval_mode_is_an_error(trainer_cls):
    model = LinearModel()
    log = []
    trainer = trainer_cls(model, loader(), torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.register_hooks([RecordingHook(log)])
    model.eval()
    with pytest.raises((AssertionError, RuntimeError), match="eval mode"):
        trainer.train(0, 3)
    assert trainer.iter == 0
    assert log[-1][1] == "after_train"
    assert model.seen == []


def test_simple_trainer_state_dict_has_optimizer():
    trainer = simple_trainer(momentum=0.9)
    trainer.train(0, 2)
    sd = trainer.state_dict()
    assert set(sd) == {"iteration", "optimizer", "rng"}
    assert sd["iteration"] == 2
    assert sd["optimizer"]["param_groups"] == trainer.optimizer.state_dict()["param_groups"]
    other = simple_trainer(momentum=0.9)
    other.load_state_dict(sd)
    assert other.iter == 2
    buf = other.optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf, sd["optimizer"]["state"][0]["momentum_buffer"])


# ----------------------------------------------------------------------------------------------
# AMPTrainer


class AutocastProbe(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 1)
        self.autocast = []

    def forward(self, data):
        x, y = data
        x = x.to(self.linear.weight.device)
        y = y.to(self.linear.weight.device)
        out = self.linear(x)
        dev = x.device.type
        self.autocast.append(
            (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), out.dtype)
        )
        return {"loss": ((out.float().squeeze(-1) - y) ** 2).mean()}


def amp_trainer(**kw):
    model = AutocastProbe()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return AMPTrainer(model, loader(), opt, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
@pytest.mark.parametrize("precision", [torch.float16, torch.bfloat16])
def test_amp_trainer_cpu_uses_bfloat16_autocast(precision):
    trainer = amp_trainer(precision=precision)
    before = trainer.model.linear.weight.detach().clone()
    trainer.train(0, 20)
    assert trainer.model.autocast == [(True, torch.bfloat16, torch.bfloat16)] * 20
    assert not torch.equal(before, trainer.model.linear.weight)
    assert trainer.model.linear.weight.dtype == torch.float32
    vals = [v for v, _ in trainer.storage.history("total_loss").values()]
    assert all(math.isfinite(v) for v in vals)
    assert sum(vals[-5:]) < sum(vals[:5])
    assert history_iters(trainer.storage, "total_loss") == list(range(20))
    assert not torch.is_autocast_enabled("cpu")


def test_amp_trainer_log_grad_scaler():
    trainer = amp_trainer(log_grad_scaler=True)
    trainer.train(0, 3)
    st = trainer.storage
    assert history_iters(st, "[metric]grad_scaler") == [0, 1, 2]
    if not torch.cuda.is_available():
        assert [v for v, _ in st.history("[metric]grad_scaler").values()] == [1.0] * 3


def test_amp_trainer_without_log_grad_scaler():
    trainer = amp_trainer()
    trainer.train(0, 2)
    assert "[metric]grad_scaler" not in trainer.storage.histories()


def test_amp_trainer_state_dict_has_grad_scaler():
    trainer = amp_trainer()
    trainer.train(0, 2)
    sd = trainer.state_dict()
    assert set(sd) == {"iteration", "optimizer", "grad_scaler", "rng"}
    assert sd["grad_scaler"] == trainer.grad_scaler.state_dict()
    other = amp_trainer()
    other.load_state_dict(sd)
    assert other.iter == 2


def test_amp_trainer_custom_grad_scaler_is_used():
    calls = []

    class Scaler:
        def scale(self, loss):
            calls.append("scale")
            return loss

        def step(self, opt):
            calls.append("step")
            opt.step()

        def update(self):
            calls.append("update")

        def get_scale(self):
            return 3.0

    trainer = amp_trainer(grad_scaler=Scaler(), log_grad_scaler=True)
    trainer.train(0, 2)
    assert calls == ["scale", "step", "update"] * 2
    assert [v for v, _ in trainer.storage.history("[metric]grad_scaler").values()] == [3.0, 3.0]


def test_amp_trainer_rejects_data_parallel():
    model = LinearModel()
    with pytest.raises(ValueError, match="multi-device"):
        AMPTrainer(nn.DataParallel(model), loader(), torch.optim.SGD(model.parameters(), lr=0.1))


def test_amp_trainer_non_finite_loss():
    model = ScalarModel()
    data = [torch.tensor(1.0), torch.tensor(float("nan"))]
    trainer = AMPTrainer(model, data, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FloatingPointError, match="iteration=1!"):
        trainer.train(0, 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_amp_trainer_cuda_float16():
    model = AutocastProbe().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = AMPTrainer(model, loader(), opt, log_grad_scaler=True)
    before = model.linear.weight.detach().clone()
    trainer.train(0, 5)
    assert model.autocast == [(True, torch.float16, torch.float16)] * 5
    assert not torch.equal(before, model.linear.weight)
    assert trainer.grad_scaler.is_enabled()
    scales = [v for v, _ in trainer.storage.history("[metric]grad_scaler").values()]
    assert scales[0] == 2.0**16
    assert history_iters(trainer.storage, "total_loss") == list(range(5))
    assert "grad_scaler" in trainer.state_dict()


def test_cuda_losses_start_their_copy_at_the_cap_and_are_read_only_when_needed(monkeypatch):
    """At 20 recorded iterations (the storage's read_every), CUDA losses start a non-blocking
    copy to the host instead of being read (no synchronization on an iteration nothing
    reads); the first read of the storage waits for the copies, in order. Simulated on the
    CPU: the CUDA test is the one below, and benches/gpu_check.py checks it with torch's sync
    debug mode."""
    from hookloop.utils import _tensors

    started, waited = [], []

    class FakeCopy:
        def __init__(self, tensors):
            started.append(len(tensors))
            self._tensors = list(tensors)

        def values(self):
            waited.append(len(self._tensors))
            return [t.item() for t in self._tensors]

    monkeypatch.setattr(_tensors, "start_read", FakeCopy)
    reads = []

    class Reader(HookBase):
        def after_step(self):
            if self.trainer.iter == 44:
                reads.append(len(waited))
                reads.append(history_iters(self.trainer.storage, "total_loss"))
                reads.append(len(waited))

    trainer = simple_trainer()
    trainer.register_hooks([Reader()])
    trainer.train(0, 50)
    assert trainer.storage._pending_counts() == (0, 0)  # nothing left after training
    per_iter = started[0] // 20
    assert started == [20 * per_iter, 20 * per_iter]  # at iterations 19 and 39
    # Nothing waited for until the hook read the storage at 44; then both copies, in order.
    assert reads == [0, list(range(45)), 2]
    # Identical to reading every step.
    reference = simple_trainer(check_finite_every_step=True)
    reference.train(0, 50)
    for name in ("total_loss", "loss_a", "loss_b"):
        assert trainer.storage.history(name).values() == reference.storage.history(name).values()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# torch (2.11 at least) warns once per process, at the first set_sync_debug_mode
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
def test_cuda_steps_make_no_synchronization_until_the_storage_is_read():
    model = LinearModel().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [tuple(t.cuda() for t in batch(i)) for i in range(8)]
    trainer = SimpleTrainer(model, itertools.cycle(data), opt)

    class SyncGuard(HookBase):
        def before_train(self):
            torch.cuda.set_sync_debug_mode("error")

        def after_step(self):
            # The loop ends here; after_train's final read of the losses is the one wait.
            if self.trainer.iter == self.trainer.max_iter - 1:
                torch.cuda.set_sync_debug_mode("default")

    trainer.register_hooks([SyncGuard()])
    try:
        trainer.train(0, 45)  # two copies started at the cap, none waited for in the loop
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert history_iters(trainer.storage, "total_loss") == list(range(45))


@pytest.mark.parametrize("async_write", [False, True])
def test_a_subclass_that_skips_simple_trainers_init_trains(async_write):
    # As trainers that call TrainerBase.__init__ and set detectron2's attributes themselves:
    # hookloop's own state is made when training starts, per instance.
    class Own(SimpleTrainer):
        def __init__(self, model, data, optimizer):
            TrainerBase.__init__(self)
            self.model, self.data_loader, self.optimizer = model, data, optimizer
            self._data_loader_iter_obj = None
            self.gather_metric_period = 1
            self.zero_grad_before_forward = False
            self.async_write_metrics = async_write
            self.concurrent_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 1)

        def forward(self, x):
            return (self.fc(x) ** 2).mean()

    trainers = []
    for _ in range(2):
        model = Loss()
        data = itertools.repeat(torch.ones(3, 2))
        trainers.append(Own(model, data, torch.optim.SGD(model.parameters(), 0.1)))
    for t in trainers:
        t.train(0, 4)
        assert [it for _, it in t.storage.history("total_loss").values()] == [0, 1, 2, 3]
    assert trainers[0]._hookloop.metrics is not trainers[1]._hookloop.metrics
