"""The dispatcher as the engine's extension point: the hook list is a plain list whose edits
are seen, the period filter, per-hook timing, and the typed configuration of native hooks."""

from __future__ import annotations

import copy
import gc
import itertools
import os

import pytest
import torch
from hookloop import _core
from hookloop.engine import HookBase, HookStat, TrainerBase, dispatch, hooks
from hookloop.utils.events import EventWriter, get_event_storage


class NoopTrainer(TrainerBase):
    def run_step(self):
        pass


class Counting(HookBase):
    def __init__(self):
        self.calls = []

    def before_step(self):
        self.calls.append(("before_step", self.trainer.iter))

    def after_step(self):
        self.calls.append(("after_step", self.trainer.iter))


class Recorder(EventWriter):
    def __init__(self):
        self.iters = []

    def write(self):
        self.iters.append(get_event_storage().iter)


def test_hook_list_is_a_plain_list_that_prints_compares_and_copies_like_one():
    """detectron2 code prints, compares and copies trainer._hooks as a list."""
    t = NoopTrainer()
    a, b = Counting(), Counting()
    t.register_hooks([a, b])
    assert type(t._hooks) is list
    assert t._hooks == [a, b] and repr(t._hooks) == repr([a, b])
    assert t._hooks[:1] == [a]
    clone = copy.copy(t._hooks)
    clone.pop()  # editing a copy must not change what the trainer calls
    t.train(0, 2)
    assert len(a.calls) == 4 and len(b.calls) == 4


def test_in_place_edit_during_training_applies_from_the_next_stage():
    t = NoopTrainer()
    late = Counting()

    class AddsOne(HookBase):
        def after_step(self):
            if self.trainer.iter == 1:
                late.trainer = self.trainer
                self.trainer._hooks.append(late)

    t.register_hooks([AddsOne()])
    t.train(0, 4)
    assert late.calls == [
        ("before_step", 2),
        ("after_step", 2),
        ("before_step", 3),
        ("after_step", 3),
    ]


def test_rebinding_hooks_between_runs_is_seen_at_the_next_train():
    t = NoopTrainer()
    h = Counting()
    h.trainer = t
    t._hooks = [h]
    t.train(0, 1)
    assert h.calls == [("before_step", 0), ("after_step", 0)]


def test_period_filter_skips_periodic_writer_between_periods():
    rec = Recorder()
    w = hooks.PeriodicWriter([rec], period=5)
    t = NoopTrainer()
    t.register_hooks([w])
    t._hookloop.dispatcher.timing = True
    t.train(0, 12)
    assert rec.iters == [4, 9, 11, 12]
    stats = {(type(h).__name__, stage): calls for h, stage, calls, *_ in t.hook_stats()}
    # Called only at the due iterations (4, 9, 11), not at the other nine.
    assert stats[("PeriodicWriter", "after_step")] == 3


def test_a_period_is_checked_once_on_each_path(monkeypatch):
    """On the dispatcher's path the period is the dispatcher's check alone (it calls
    PeriodicWriter's due write, ``_on_period``); a direct call of ``after_step`` checks it in
    the hook. An ``after_step`` set on the instance is called as it is, at every iteration."""
    asked = []
    rule = hooks._core.periodic_due

    def counted(*args):
        asked.append(args)
        return rule(*args)

    monkeypatch.setattr(hooks._core, "periodic_due", counted)
    rec = Recorder()
    w = hooks.PeriodicWriter([rec], period=5)
    t = NoopTrainer()
    t.register_hooks([w])
    t.train(0, 12)
    assert rec.iters == [4, 9, 11, 12] and asked == []
    t.iter, t.max_iter = 3, 12
    w.after_step()
    assert len(asked) == 1 and rec.iters == [4, 9, 11, 12]

    seen = []
    own = hooks.PeriodicWriter([], period=5)
    own.after_step = lambda: seen.append(own.trainer.iter)
    t = NoopTrainer()
    t.register_hooks([own])
    t.train(0, 3)
    assert seen == [0, 1, 2]


def test_period_filter_does_not_apply_to_a_subclass_that_overrides_after_step():
    seen = []

    class EveryStep(hooks.PeriodicWriter):
        def after_step(self):
            seen.append(self.trainer.iter)

    t = NoopTrainer()
    t.register_hooks([EveryStep([], period=5)])
    t.train(0, 3)
    assert seen == [0, 1, 2]


def test_periodic_writer_called_directly_keeps_its_period():
    rec = Recorder()
    w = hooks.PeriodicWriter([rec], period=5)

    class Manual(TrainerBase):
        def run_step(self):
            w.after_step()  # as code that drives hooks by hand does

    t = Manual()
    w.trainer = t
    t.train(0, 6)
    assert rec.iters == [4, 5]


def test_custom_hook_period_through_dispatch_period():
    class Every3(HookBase):
        def __init__(self):
            self.iters = []

        def _dispatch_period(self, stage):
            return 3 if stage == "after_step" else None

        def after_step(self):
            self.iters.append(self.trainer.iter)

    h = Every3()
    t = NoopTrainer()
    t.register_hooks([h])
    t.train(0, 8)
    assert h.iters == [2, 5, 7]


def test_hook_stats_count_every_call_per_hook_and_stage():
    a, b = Counting(), Counting()
    t = NoopTrainer()
    t.register_hooks([a, b])
    t._hookloop.dispatcher.timing = True
    t.train(0, 5)
    stats = t.hook_stats()
    assert [(h, stage, calls) for h, stage, calls, *_ in stats] == [
        (a, "before_step", 5),
        (b, "before_step", 5),
        (a, "after_step", 5),
        (b, "after_step", 5),
    ]
    for _, _, _, total, longest, share in stats:
        assert total >= longest >= 0.0
        assert 0.0 <= share <= 1.0


def test_timing_is_on_by_default_and_off_records_nothing():
    a = Counting()
    t = NoopTrainer()
    t.register_hooks([a])
    assert t._hookloop.dispatcher.timing
    t.train(0, 3)
    assert [(r.stage, r.calls) for r in t.hook_stats()] == [("before_step", 3), ("after_step", 3)]
    t._hookloop.dispatcher.timing = False
    t.train(0, 3)
    assert all(calls == 0 for _, _, calls, *_ in t.hook_stats())


def test_hook_stats_are_records_whose_shares_add_up_to_at_most_the_training_time():
    class Busy(HookBase):
        def after_step(self):
            sum(range(2000))  # some work, so the hook's time is not all clock resolution

    busy, plain = Busy(), Counting()
    t = NoopTrainer()
    t.register_hooks([busy, plain])
    t.train(0, 20)
    stats = t.hook_stats()
    assert all(isinstance(r, HookStat) for r in stats)
    (row,) = [r for r in stats if r.hook is busy]
    assert (row.stage, row.calls) == ("after_step", 20)
    assert row.total_s > 0.0 and row.max_s > 0.0
    assert row.max_s <= row.total_s
    # Every hook's time lies within train()'s wall time, so the shares sum to at most 1.
    assert 0.0 < row.share <= 1.0
    assert sum(r.share for r in stats) <= 1.0
    # After train() the shares are fixed: the training time stopped with it.
    assert [r.share for r in t.hook_stats()] == [r.share for r in stats]


def test_hooks_for_lists_only_overriding_hooks():
    a = Counting()
    t = NoopTrainer()
    t.register_hooks([a, HookBase()])
    assert t.hooks_table()["after_step"] == [a]
    assert t.hooks_table()["after_train"] == []
    with pytest.raises(ValueError, match="stage 'nope'"):
        t._hookloop.dispatcher.hooks_for("nope")


def test_hookbase_attribute_store_is_a_plain_store():
    """Setting attributes on hooks costs what it costs on any object: no __setattr__ hook."""
    assert "__setattr__" not in vars(HookBase)
    assert "__delattr__" not in vars(HookBase)


def test_native_hook_subclass_without_super_init_gets_a_clear_error():
    class Forgetful(hooks.IterationTimer):
        def __init__(self):
            pass  # no super().__init__()

    t = NoopTrainer()
    t.register_hooks([Forgetful()])
    with pytest.raises(ValueError, match=r"super\(\).__init__\(\)"):
        t.train(0, 2)


def test_native_hook_subclass_without_super_before_train_times_like_detectron2():
    """detectron2's IterationTimer keeps working when a subclass skips
    ``super().before_train()``: its clocks exist from ``__init__`` and each ``after_step``
    puts the step's time into the trainer's storage. hookloop's does the same."""

    class NoStart(hooks.IterationTimer):
        def before_train(self):
            pass  # no super().before_train()

    class Record(HookBase):
        def __init__(self):
            self.seen = []

        def after_step(self):
            self.seen.append(self.trainer.storage.history("time").values()[-1][1])

    t = NoopTrainer()
    record = Record()
    t.register_hooks([NoStart(warmup_iter=0), record])
    t.train(0, 3)
    assert record.seen == [0, 1, 2]


def test_lr_scheduler_private_attributes_are_its_state():
    """Setting _scheduler / _optimizer / _best_param_group_id is honoured at the next step."""
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 1.0}, {"params": [q], "lr": 0.5}], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)

    class T(NoopTrainer):
        pass

    t = T()
    t.optimizer, t.scheduler = opt, sched
    h = hooks.LRScheduler()
    t.register_hooks([h])

    class Switch(HookBase):
        def after_step(self):
            if self.trainer.iter == 1:
                h._best_param_group_id = 1

    t.register_hooks([Switch()])
    t.train(0, 3)
    assert h._scheduler is sched and h._optimizer is opt
    assert [v for v, _ in t.storage.history("lr").values()] == [1.0, 1.0, 0.5]


def test_periodic_due_is_the_core_rule():
    assert [i for i in range(12) if _core.periodic_due(i, 5, 12)] == [4, 9, 11]
    with pytest.raises(ValueError, match="period"):
        _core.periodic_due(0, 0, 10)


def test_dispatcher_holds_no_cycle_with_the_trainer():
    t = NoopTrainer()
    t.register_hooks([Counting(), hooks.IterationTimer()])
    t.train(0, 2)
    gc.collect()
    import weakref

    ref = weakref.ref(t)
    del t
    assert ref() is None


def test_checkpoint_and_eval_hooks_are_skipped_between_periods(tmp_path):
    """They are in every detectron2 hook list: between periods the dispatcher calls none."""
    from hookloop.checkpoint import Checkpointer

    model = torch.nn.Linear(1, 1)
    ckpt = Checkpointer(model, str(tmp_path))
    evals = []
    hook_list = [
        hooks.PeriodicCheckpointer(ckpt, period=4),
        hooks.EvalHook(5, lambda: evals.append(1) or {"acc": 1.0}),
        hooks.BestCheckpointer(5, ckpt, "acc"),
    ]
    t = NoopTrainer()
    t.register_hooks(hook_list)
    t._hookloop.dispatcher.timing = True
    t.train(0, 12)
    calls = {type(h).__name__: n for h, stage, n, *_ in t.hook_stats() if stage == "after_step"}
    # due at (iter + 1) % period == 0 and at the last iteration (11)
    assert calls == {"PeriodicCheckpointer": 3, "EvalHook": 3, "BestCheckpointer": 3}
    assert len(evals) == 3  # at iterations 4 and 9, then after training


@pytest.mark.parametrize("period", [1, 2, 3, 7])
def test_timed_and_untimed_dispatch_call_exactly_what_the_core_rule_says(period):
    """Timing on (the default) and off call the same hooks at the same iterations: the
    core's period rule, in the one dispatch path."""

    class Periodic(HookBase):
        def __init__(self):
            self.iters = []

        def _dispatch_period(self, stage):
            return period if stage == "after_step" else None

        def after_step(self):
            self.iters.append(self.trainer.iter)

    seen = {}
    for timing in (False, True):
        h, plain = Periodic(), Counting()
        t = NoopTrainer()
        t.register_hooks([plain, h])
        t._hookloop.dispatcher.timing = timing
        t.train(3, 20)
        seen[timing] = (h.iters, plain.calls)
    assert seen[False] == seen[True]
    assert seen[False][0] == [i for i in range(3, 20) if _core.periodic_due(i, period, 20)]


def test_periodic_writer_subclass_without_super_init_gets_a_clear_error():
    class Forgetful(hooks.PeriodicWriter):
        def __init__(self):
            pass

    t = NoopTrainer()
    t.register_hooks([Forgetful()])
    with pytest.raises(TypeError, match=r"must call PeriodicWriter.__init__"):
        t.train(0, 1)


def test_iteration_timer_summary_lists_hook_times_by_default(caplog):
    import logging

    t = NoopTrainer()
    t.register_hooks([hooks.IterationTimer(), Counting()])
    with caplog.at_level(logging.INFO, logger="hookloop.engine.hooks"):
        t.train(0, 5)
    messages = [r.getMessage() for r in caplog.records]
    (table,) = [m for m in messages if "Time in hooks" in m]
    # After detectron2's two lines.
    assert messages.index(table) > max(
        i for i, m in enumerate(messages) if m.startswith("Total training time")
    )
    header, *rows = table.splitlines()[1:]
    assert header.split() == ["hook", "stage", "calls", "total", "s", "max", "ms", "share"]
    cells = {(r.split()[0], r.split()[1]): r.split() for r in rows}
    assert cells[("Counting", "after_step")][2] == "5"
    assert cells[("IterationTimer", "before_step")][2] == "5"
    assert all(c[-1].endswith("%") for c in cells.values())


def test_iteration_timer_summary_has_no_table_with_timing_off(caplog):
    import logging

    t = NoopTrainer()
    t.register_hooks([hooks.IterationTimer(), Counting()])
    t._hookloop.dispatcher.timing = False
    with caplog.at_level(logging.INFO, logger="hookloop.engine.hooks"):
        t.train(0, 5)
    assert not [r for r in caplog.records if "Time in hooks" in r.getMessage()]


def test_priority_places_a_hook_between_others_and_hooks_table_shows_it():
    class Named(HookBase):
        def __init__(self, name, priority=None):
            self.name = name
            if priority is not None:
                self.priority = priority

        def after_step(self):
            order.append(self.name)

    order = []
    lr, ckpt = Named("lr", "HIGH"), Named("ckpt", "LOW")
    mine = Named("mine", 60)
    plain = Named("plain")  # NORMAL (50)
    t = NoopTrainer()
    t.register_hooks([ckpt, mine, plain, lr])
    t.train(0, 1)
    assert order == ["lr", "plain", "mine", "ckpt"]
    assert t.hooks_table()["after_step"] == [lr, plain, mine, ckpt]
    assert t.hooks_table()["before_step"] == []


def test_a_priority_that_is_no_int_or_name_is_the_hooks_own_data():
    # detectron2 has no hook priorities: a hook's own `priority` (a float, another string)
    # neither fails nor moves it.
    class Own(HookBase):
        def __init__(self, name, priority):
            self.name, self.priority = name, priority

        def after_step(self):
            order.append(self.name)

    order = []
    hooks_ = [Own("a", 0.5), Own("b", "URGENT"), Own("c", None), Own("d", [1])]
    t = NoopTrainer()
    t.register_hooks(hooks_)
    t.train(0, 1)
    assert order == ["a", "b", "c", "d"]
    assert [h.priority for h in hooks_] == [0.5, "URGENT", None, [1]]


def test_periodic_writer_hook_stats_puts_each_hooks_time_per_call_at_each_write(tmp_path):
    import json

    from hookloop.utils.events import JSONWriter

    class Slow(HookBase):
        def before_step(self):
            sum(range(1000))

    path = tmp_path / "metrics.json"
    t = NoopTrainer()
    t.register_hooks(
        [Slow(), Slow(), hooks.PeriodicWriter([JSONWriter(str(path))], period=5, hook_stats=True)]
    )
    t.train(0, 10)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [4, 9]
    for line in lines:
        # Both hooks of one class, named as in a checkpoint; and the writer itself, whose
        # first call is counted at the next write.
        assert line["hooks/Slow/before_step_ms"] > 0.0
        assert line["hooks/Slow.1/before_step_ms"] > 0.0
    assert "hooks/PeriodicWriter/after_step_ms" not in lines[0]
    assert lines[1]["hooks/PeriodicWriter/after_step_ms"] > 0.0
    # Unsmoothed: the value written is the one put at that iteration.
    storage_free = t.storage.history("hooks/Slow/before_step_ms").values()
    assert [v for v, _ in storage_free] == [line["hooks/Slow/before_step_ms"] for line in lines]


def test_periodic_writer_writes_no_hook_times_by_default(tmp_path):
    from hookloop.utils.events import JSONWriter

    path = tmp_path / "metrics.json"
    t = NoopTrainer()
    t.register_hooks([Counting(), hooks.PeriodicWriter([JSONWriter(str(path))], period=5)])
    t.train(0, 10)
    assert "hooks/" not in path.read_text()
    with pytest.raises(TypeError, match="hook_stats must be a bool"):
        hooks.PeriodicWriter([], period=5, hook_stats=1)


def test_hook_stats_carry_over_an_edit_of_the_hook_list_in_the_middle_of_a_run():
    class AddsOne(HookBase):
        def after_step(self):
            if self.trainer.iter == 49:
                self.trainer._hooks.append(late)

    adds, late = AddsOne(), Counting()
    t = NoopTrainer()
    t.register_hooks([adds])
    late.trainer = t
    t.train(0, 100)
    calls = {(type(r.hook).__name__, r.stage): r.calls for r in t.hook_stats()}
    assert calls[("AddsOne", "after_step")] == 100  # not restarted by the rebuild at 50
    assert calls[("Counting", "before_step")] == 50
    # A new train() starts the counts again.
    t._hooks.remove(late)
    t.train(0, 10)
    assert [(r.stage, r.calls) for r in t.hook_stats()] == [("after_step", 10)]


def test_periodic_checkpointer_runs_where_registered_and_finishes_after_every_hook(tmp_path):
    """PeriodicCheckpointer runs in registration order, as detectron2's; its finishing part
    (the file written with the trainer's state) is an entry of its own after every other hook
    of the stage, hooks of a lower priority included. hooks_table() lists each hook once and
    hook_stats() counts the two parts as one row."""
    import torch
    from hookloop.checkpoint import Checkpointer
    from hookloop.engine import SimpleTrainer, hooks

    class Last(HookBase):
        priority = "LOWEST"

        def after_step(self):
            pass

    model = torch.nn.Linear(2, 1)
    data = itertools.repeat(torch.zeros(1, 2))  # endless: no epochs in the file names
    t = SimpleTrainer(model, data, torch.optim.SGD(model.parameters(), 0.1))
    ckpt = Checkpointer(model, str(tmp_path), trainer=t)
    periodic = hooks.PeriodicCheckpointer(ckpt, period=10)
    t.register_hooks(
        [
            hooks.IterationTimer(),
            periodic,
            hooks.EvalHook(10, lambda: {"val": {"mse": 1.0}}),
            hooks.BestCheckpointer(10, ckpt, "val/mse", mode="min"),
            hooks.PeriodicWriter([], period=5),
            Last(),
        ]
    )
    table = {k: [type(h).__name__ for h in v] for k, v in t.hooks_table().items()}
    assert table["after_step"] == [
        "IterationTimer", "PeriodicCheckpointer", "EvalHook", "BestCheckpointer",
        "PeriodicWriter", "Last",
    ]  # fmt: skip
    assert table["after_train"][:2] == ["IterationTimer", "PeriodicCheckpointer"]
    entries = [
        (type(t._hooks[i]).__name__, f.__name__)
        for i, s, f, _, _ in dispatch.table_for(t._hooks)
        if dispatch.STAGES[s] == "after_step"
    ]
    assert entries[-1] == ("PeriodicCheckpointer", "_finish_step")
    assert entries[1] == ("PeriodicCheckpointer", "after_step")
    t.train(0, 20)
    rows = [(type(r.hook).__name__, r.stage, r.calls) for r in t.hook_stats()]
    assert rows.count(("PeriodicCheckpointer", "after_step", 2)) == 1
    assert sorted(os.listdir(tmp_path)) == [
        "last_checkpoint", "model_0000009.pth", "model_0000019.pth", "model_best.pth",
        "model_final.pth",
    ]  # fmt: skip
