"""Epoch-based training as runner-style codebases do it: a finite loader, the next epoch when
it is exhausted, ``set_epoch`` on the sampler, and resume in the middle of an epoch."""

from __future__ import annotations

import copy

import pytest
import torch
from hookloop.engine import HookBase, SimpleTrainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def forward(self, batch):
        (x,) = batch
        self.seen.append(x.tolist())
        return {"loss": ((self.w - x) ** 2).mean()}


class RecordingSampler(DistributedSampler):
    def __init__(self, ds):
        super().__init__(ds, num_replicas=1, rank=0, shuffle=True, seed=7)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)
        super().set_epoch(epoch)


def make():
    ds = TensorDataset(torch.arange(20.0))
    sampler = RecordingSampler(ds)
    loader = DataLoader(ds, batch_size=2, sampler=sampler)  # 10 batches an epoch
    model = Model()
    trainer = SimpleTrainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.01))
    return trainer, model, sampler


def test_finite_loader_runs_three_epochs_calling_set_epoch():
    trainer, model, sampler = make()
    assert trainer.iters_per_epoch == 10
    trainer.train(0, 30)
    assert trainer.epoch == 2
    assert sampler.epochs == [1, 2]
    # each epoch visits every sample once, in that epoch's order
    for e in range(3):
        flat = sorted(v for batch in model.seen[10 * e : 10 * (e + 1)] for v in batch)
        assert flat == [float(i) for i in range(20)]


def test_resume_in_the_middle_of_epoch_two_continues_at_the_right_batch():
    straight, model_a, _ = make()
    straight.train(0, 30)

    first, model_b, _ = make()
    saved = {}

    class Save(HookBase):  # a checkpoint at the end of iteration 13, 4 batches into epoch 1
        def after_step(self):
            if self.trainer.iter == 13:
                saved["state"] = copy.deepcopy(self.trainer.state_dict())
                saved["model"] = copy.deepcopy(self.trainer.model.state_dict())

    first.register_hooks([Save()])
    first.train(0, 20)
    state = saved["state"]
    assert state["data"]["epoch"] == 1 and state["data"]["epoch_batches"] == 4

    second, model_c, sampler = make()
    second.model.load_state_dict(saved["model"])
    second.load_state_dict(state)
    second.train(14, 30)
    assert model_b.seen[:14] + model_c.seen == model_a.seen
    assert second.epoch == 2 and sampler.epochs == [1, 2]


def test_a_loader_with_no_batches_is_a_clear_error():
    model = Model()
    trainer = SimpleTrainer(model, [], torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="yields no batches"):
        trainer.train(0, 1)
