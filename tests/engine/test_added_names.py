"""The names hookloop adds to detectron2's classes, and the names detectron2's instances hold:
a subclass may assign any of them, and a user's value wins.

Real subclasses assign names of their own (cvpods-style runners set ``iters_per_epoch``, a
trainer its own ``stop_requested`` flag); a name that hookloop adds must never be read-only or
break when assigned. The lists below are every name beyond detectron2's (the reference engine,
``compat.d2``): a new one fails the first test until it is listed here, and so gets the
assignment tests too.
"""

from __future__ import annotations

import pytest
import torch
from compat import d2
from hookloop.engine import hooks
from hookloop.engine import train_loop as tl

ADDED = {
    "TrainerBase": {
        "_apply_stop", "_begin_own_loop", "_end_loop", "_loop_hooks", "_on_exception",
        "_outgoing_stop", "_overridden", "_raise_after_train", "_resume_storage",
        "_stop_agreed", "_stop_applied", "_stop_requested", "_stop_rides_collective",
        "_train_time", "hook_stats", "hooks_table", "request_stop", "stop_requested",
        "stopped_early",
    },
    "SimpleTrainer": {
        "MAX_IN_FLIGHT", "METRICS_READ_EVERY", "_async_stop", "_data_start",
        "_data_start_iter", "_data_state", "_deferring", "_epoch_batches_before",
        "_epoch_start_iter", "_init_metric_state", "_load_data_state", "_next_epoch",
        "_raise_async_errors", "_read_pending", "_resume_epoch", "_resumed_rng",
        "_settle_lock", "_settle_metrics", "_stop_owner", "_stop_owner_ref", "_submit_metrics",
        "_take_pending", "_wait_for_metric_writes", "_write_metrics_async",
        "check_finite_every_step", "epoch", "iters_per_epoch", "step_optimizer",
    },
    "HookBase": {"_dispatch_order", "_dispatch_period", "load_state_dict", "on_exception"},
}  # fmt: skip


def _added(cls_name):
    names = set(dir(getattr(tl, cls_name))) - set(dir(getattr(d2, cls_name)))
    return {n for n in names if not n.startswith("__")}


def test_every_added_name_is_listed():
    assert _added("TrainerBase") == ADDED["TrainerBase"]
    assert _added("SimpleTrainer") == ADDED["SimpleTrainer"] | ADDED["TrainerBase"]
    assert _added("AMPTrainer") == _added("SimpleTrainer")
    assert _added("HookBase") == ADDED["HookBase"]


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x):
        return {"loss": (self.fc(x) ** 2).mean()}


def _data():
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(3, 2, generator=g)


_SENTINEL = object()


@pytest.mark.parametrize("name", sorted(ADDED["TrainerBase"] | ADDED["SimpleTrainer"]))
def test_a_subclass_may_assign_each_added_trainer_name(name):
    class Mine(tl.SimpleTrainer):
        def __init__(self, *args):
            super().__init__(*args)
            setattr(self, name, _SENTINEL)

    model = _Model()
    t = Mine(model, _data(), torch.optim.SGD(model.parameters(), lr=0.1))
    assert getattr(t, name) is _SENTINEL


@pytest.mark.parametrize("name", sorted(ADDED["HookBase"]))
def test_a_hook_may_assign_each_added_hook_name(name):
    class Mine(tl.HookBase):
        def __init__(self):
            setattr(self, name, _SENTINEL)

    assert getattr(Mine(), name) is _SENTINEL


def test_the_public_names_a_runner_assigns_keep_the_users_values_and_train():
    """A cvpods/xmodaler-style runner sets its own epoch bookkeeping and stop flag; training
    runs as without them and the values stay the user's."""

    class Runner(tl.SimpleTrainer):
        def __init__(self, *args):
            super().__init__(*args)
            self.iters_per_epoch = 1000
            self.epoch = "mine"
            self.stop_requested = "no"

    model = _Model()
    t = Runner(model, _data(), torch.optim.SGD(model.parameters(), lr=0.1))
    t.register_hooks([hooks.IterationTimer()])
    t.train(0, 4)
    assert (t.iter, t.iters_per_epoch, t.epoch, t.stop_requested) == (4, 1000, "mine", "no")
    assert t.storage.history("total_loss").values()[-1][1] == 3


def _hook_pairs():
    model = _Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    return [
        ("IterationTimer", (3,)),
        ("PeriodicWriter", ([], 5)),
        ("LRScheduler", (opt, sched)),
        ("EvalHook", (5, lambda: {})),
        ("CallbackHook", ()),
    ]


@pytest.mark.parametrize("name, args", _hook_pairs(), ids=lambda x: x if isinstance(x, str) else "")
def test_detectron2s_hook_attributes_stay_assignable(name, args):
    """Every attribute a detectron2 hook instance holds (``self._warmup_iter``,
    ``self._period``, ...) can be assigned on hookloop's, and reads back."""
    theirs = getattr(d2, name)(*args)
    ours = getattr(hooks, name)(*args)
    assert vars(theirs), name
    for attr, value in vars(theirs).items():
        if attr == "trainer":
            continue
        setattr(ours, attr, value)
        assert getattr(ours, attr) is value or getattr(ours, attr) == value, attr
