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


# ----------------------------------------------------------------------------------------------
# PeriodicCheckpointer names files by epoch when the trainer runs epochs


def _pth(d):
    return sorted(p.name for p in d.glob("*.pth"))


def test_periodic_checkpointer_hook_names_files_by_the_trainers_epoch(tmp_path):
    from hookloop.checkpoint import Checkpointer
    from hookloop.engine import hooks

    trainer, model, _ = make()
    ckpt = Checkpointer(model, str(tmp_path), trainer=trainer)
    trainer.register_hooks([hooks.PeriodicCheckpointer(ckpt, 6, max_to_keep=3)])
    trainer.train(0, 30)  # 10 batches an epoch: iteration 9 is the last one of epoch 0
    assert _pth(tmp_path) == [
        "model_Epoch_00001_Iter_0000017.pth",
        "model_Epoch_00002_Iter_0000023.pth",
        "model_Epoch_00002_Iter_0000029.pth",
        "model_final.pth",
    ]
    assert ckpt.get_checkpoint_file() == str(tmp_path / "model_final.pth")


def test_periodic_checkpointer_hook_without_epochs_keeps_detectron2_names(tmp_path):
    from hookloop.checkpoint import Checkpointer
    from hookloop.engine import hooks

    model = Model()

    def forever():
        while True:
            yield (torch.ones(2),)

    trainer = SimpleTrainer(model, forever(), torch.optim.SGD(model.parameters(), lr=0.01))
    assert trainer.iters_per_epoch is None
    ckpt = Checkpointer(model, str(tmp_path), trainer=trainer)
    trainer.register_hooks([hooks.PeriodicCheckpointer(ckpt, 5)])
    trainer.train(0, 10)
    assert _pth(tmp_path) == ["model_0000004.pth", "model_0000009.pth", "model_final.pth"]


def test_stop_checkpoint_named_by_epoch_and_resume_finds_it(tmp_path):
    """request_stop() at iteration 13 (4 batches into epoch 1) saves an epoch-named file;
    a new process resumes from last_checkpoint and ends where an uninterrupted run does."""
    from hookloop.checkpoint import Checkpointer
    from hookloop.engine import hooks

    straight, model_a, _ = make()
    straight.train(0, 30)

    class StopAt(HookBase):
        def after_step(self):
            if self.trainer.iter == 13:
                self.trainer.request_stop()

    first, model_b, _ = make()
    ckpt = Checkpointer(model_b, str(tmp_path), trainer=first)
    first.register_hooks([hooks.PeriodicCheckpointer(ckpt, 10), StopAt()])
    first.train(0, 30)
    assert first.iter == 13 and first.epoch == 1
    assert _pth(tmp_path) == [
        "model_Epoch_00000_Iter_0000009.pth",
        "model_Epoch_00001_Iter_0000013.pth",
    ]

    second, model_c, sampler = make()
    ckpt = Checkpointer(model_c, str(tmp_path), trainer=second)
    second.register_hooks([hooks.PeriodicCheckpointer(ckpt, 10)])
    assert ckpt.get_checkpoint_file() == str(tmp_path / "model_Epoch_00001_Iter_0000013.pth")
    ckpt.resume_or_load("", resume=True)
    assert (second.iter, second.epoch) == (13, 1)
    second.train(second.iter + 1, 30)
    assert model_b.seen + model_c.seen == model_a.seen
    assert torch.equal(model_c.w, model_a.w)
    assert _pth(tmp_path) == [
        "model_Epoch_00000_Iter_0000009.pth",
        "model_Epoch_00001_Iter_0000013.pth",
        "model_Epoch_00001_Iter_0000019.pth",
        "model_Epoch_00002_Iter_0000029.pth",
        "model_final.pth",
    ]
