"""LRScheduler steps torch's MultiStepLR and StepLR between their milestones without their
Python (hookloop.solver.torch_step, which LRScheduler.after_step calls): the
scheduler's state and the LRs must equal torch's own stepping at every step, and anything the
shortcut cannot be sure of runs torch's step()."""

from __future__ import annotations

import warnings

import pytest
import torch
from hookloop.engine import TrainerBase
from hookloop.engine.hooks import LRScheduler
from torch.optim import lr_scheduler as L


def _optimizer(groups=2, lr=0.1):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p], "lr": lr * (i + 1)} for i, p in enumerate(params)])


class _Steps(TrainerBase):
    """Steps the optimizer (as a trainer would) so torch's first-step checks are quiet."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = optimizer

    def run_step(self):
        self.optimizer.step()


MAKERS = {
    "multi_step": lambda opt: L.MultiStepLR(opt, milestones=[3, 7, 7, 12], gamma=0.5),
    "step": lambda opt: L.StepLR(opt, step_size=4, gamma=0.3),
    "multi_step_float_milestones": lambda opt: L.MultiStepLR(opt, milestones=[5.0, 9], gamma=0.1),
}


def _torch_run(make, n):
    """The states and LRs of torch stepping itself, after each of ``n`` steps."""
    opt = _optimizer()
    sched = make(opt)
    out = []
    for _ in range(n):
        opt.step()
        sched.step()
        out.append((sched.state_dict(), [g["lr"] for g in opt.param_groups]))
    return out


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_every_step_equals_torchs_own(name):
    n = 20
    want = _torch_run(MAKERS[name], n)
    opt = _optimizer()
    sched = MAKERS[name](opt)
    got = []

    class Record(LRScheduler):
        def after_step(self):
            super().after_step()
            got.append((sched.state_dict(), [g["lr"] for g in opt.param_groups]))

    trainer = _Steps(opt)
    trainer.register_hooks([Record(opt, sched)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning that torch's stepping would not give
        trainer.train(0, n)
    assert got == want
    assert [type(x) for x in sched.get_last_lr()] == [float, float]
    # lr put into the storage is the LR before each step, as torch's path gives it
    lrs = [v for v, _ in trainer.storage.history("lr").values()]
    assert lrs == [_optimizer().param_groups[0]["lr"]] + [w[1][0] for w in want[:-1]]


def test_a_subclass_a_replaced_step_and_a_tensor_lr_run_torchs_step():
    calls = []

    class Mine(L.MultiStepLR):
        def step(self, epoch=None):
            calls.append("subclass")
            super().step(epoch)

    opt = _optimizer()
    trainer = _Steps(opt)
    trainer.register_hooks([LRScheduler(opt, Mine(opt, milestones=[100]))])
    calls.clear()  # the constructor's own first step
    trainer.train(0, 5)
    assert calls.count("subclass") == 5

    opt = _optimizer()
    sched = L.StepLR(opt, step_size=100)
    real = sched.step
    sched.step = lambda *a, **k: (calls.append("instance"), real(*a, **k))
    trainer = _Steps(opt)
    trainer.register_hooks([LRScheduler(opt, sched)])
    trainer.train(0, 5)
    assert calls.count("instance") == 5

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.1))
    sched = L.MultiStepLR(opt, milestones=[2], gamma=0.5)
    trainer = _Steps(opt)
    trainer.register_hooks([LRScheduler(opt, sched)])
    trainer.train(0, 4)
    assert sched.last_epoch == 4 and torch.equal(opt.param_groups[0]["lr"], torch.tensor(0.05))
    assert isinstance(sched.get_last_lr()[0], torch.Tensor)


def test_torchs_first_step_warning_is_kept():
    """The first step is torch's, with its check that optimizer.step() came first."""
    opt = _optimizer()
    sched = L.MultiStepLR(opt, milestones=[10])

    class NoOptimizerStep(TrainerBase):
        def run_step(self):
            pass

    trainer = NoOptimizerStep()
    trainer.register_hooks([LRScheduler(opt, sched)])
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        trainer.train(0, 3)
    assert sched.last_epoch == 3 and sched._step_count == 4


def test_a_loaded_state_dict_moves_the_milestones():
    """load_state_dict replaces the scheduler's milestones: the next steps follow the loaded
    ones (read at every step, not cached)."""
    opt = _optimizer()
    sched = L.MultiStepLR(opt, milestones=[100], gamma=0.5)
    other = L.MultiStepLR(_optimizer(), milestones=[2], gamma=0.5)
    sched.load_state_dict(other.state_dict())
    trainer = _Steps(opt)
    trainer.register_hooks([LRScheduler(opt, sched)])
    trainer.train(0, 3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
