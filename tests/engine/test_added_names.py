"""The names hookloop adds to detectron2's classes, and the names detectron2's instances hold:
a subclass may assign any of them, and a user's value wins.

Real subclasses assign names of their own (cvpods-style runners set ``iters_per_epoch``, a
trainer its own ``stop_requested`` flag); a name that hookloop adds must never be read-only or
break when assigned. The lists below are every name beyond detectron2's (the reference engine,
``compat.d2``): a new one fails the first test until it is listed here, and so gets the
assignment tests too.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from compat import d2
from hookloop.engine import hooks
from hookloop.engine import train_loop as tl
from hookloop.utils import events as tl_events

ADDED = {
    "TrainerBase": {"hook_stats", "hooks_table", "request_stop", "stop_requested", "stopped_early"},
    "SimpleTrainer": {
        "check_finite_every_step", "epoch", "iters_per_epoch", "step_optimizer",
    },
    "HookBase": {"_dispatch_period", "load_state_dict", "on_exception"},
}  # fmt: skip

# The private names hookloop adds to a trainer's instances: one slot, holding the collaborators
# (the dispatcher, the stop controller, the data cursor, the loss metrics). At most 8, and
# named so that a user's attribute cannot plausibly collide with them.
PRIVATE_SLOTS = {"_hookloop"}


def _added(cls_name):
    names = set(dir(getattr(tl, cls_name))) - set(dir(getattr(d2, cls_name)))
    return {n for n in names if not n.startswith("__")} - PRIVATE_SLOTS - {"_parts_class"}


def test_every_added_name_is_listed():
    assert _added("TrainerBase") == ADDED["TrainerBase"]
    assert _added("SimpleTrainer") == ADDED["SimpleTrainer"] | ADDED["TrainerBase"]
    assert _added("AMPTrainer") == _added("SimpleTrainer")
    assert _added("HookBase") == ADDED["HookBase"]


def _instance_names(trainer):
    return set(vars(trainer))


@pytest.mark.parametrize("engine", ["SimpleTrainer", "AMPTrainer"])
def test_a_trainers_instance_adds_one_private_slot(engine):
    """Beyond detectron2's instance attributes, a hookloop trainer holds its public additions
    (assignable, listed above) and one private slot, made on first use (a class attribute
    until then)."""
    model = _Model()

    def make(mod):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # AMP's grad scaler without CUDA
            return getattr(mod, engine)(model, _data(), torch.optim.SGD(model.parameters(), 0.1))

    ours, theirs = make(tl), make(d2)
    added = _instance_names(ours) - _instance_names(theirs)
    private = {n for n in added if n.startswith("_")}
    assert private <= PRIVATE_SLOTS and len(PRIVATE_SLOTS) <= 8
    assert added - private <= ADDED["SimpleTrainer"] | ADDED["TrainerBase"]
    ours.train(0, 3)
    # Training adds no attribute beyond detectron2's own (storage, max_iter) and the slot.
    trained = _instance_names(ours) - _instance_names(theirs) - {"storage", "max_iter"}
    assert trained == added | PRIVATE_SLOTS


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


# hookloop's documented knobs take a value of their kind; any other added name is the user's to
# hold whatever they like.
_KNOB_VALUES = {
    "check_finite_every_step": True,
    "step_optimizer": True,
}


@pytest.mark.parametrize("name", sorted(ADDED["TrainerBase"] | ADDED["SimpleTrainer"]))
def test_a_subclass_that_assigns_an_added_name_trains_as_without_it(name, tmp_path):
    """The user's value is kept through training, and training records the same iterations
    and losses as a trainer without the assignment (timer, writer and checkpointer hooks,
    which read the trainer, included)."""
    value = _KNOB_VALUES.get(name, _SENTINEL)

    def run(assign):
        class Mine(tl.SimpleTrainer):
            def __init__(self, *args):
                super().__init__(*args)
                if assign:
                    setattr(self, name, value)

        torch.manual_seed(0)
        model = _Model()
        t = Mine(model, _data(), torch.optim.SGD(model.parameters(), lr=0.1))
        out = tmp_path / ("assigned" if assign else "plain")
        out.mkdir()
        t.register_hooks(
            [
                hooks.IterationTimer(),
                hooks.PeriodicWriter([tl_events.JSONWriter(str(out / "metrics.json"))], 2),
            ]
        )
        t.train(0, 5)
        return t, t.storage.history("total_loss").values()

    t, assigned = run(True)
    _, plain = run(False)
    assert getattr(t, name) is value or getattr(t, name) == value
    assert assigned == plain and [it for _, it in assigned] == list(range(5))
    lines = (tmp_path / "assigned" / "metrics.json").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 3, 4]


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
