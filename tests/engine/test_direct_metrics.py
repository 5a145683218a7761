"""The trainer's losses through the storage's pending queue, read at every step by a
PeriodicWriter of period 1, write what the per-step path (``check_finite_every_step``, each loss
read at its step) writes: metrics.json byte for byte, and TensorBoard's events, the same tags,
steps and values in the same order."""

from __future__ import annotations

import itertools

import torch
from hookloop.engine import SimpleTrainer
from hookloop.engine.hooks import LRScheduler, PeriodicWriter
from hookloop.utils.events import JSONWriter, TensorboardXWriter
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, batch):
        x, y = batch
        err = self.net(x) - y
        return {"loss_mse": (err * err).mean(), "loss_l1": err.abs().mean()}


class Clock:
    """The data loader's times made deterministic (one fixed step each)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.25
        return self.t


def _run(out, every_step, monkeypatch):
    out.mkdir()
    monkeypatch.setattr("time.perf_counter", Clock())
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [7], gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = itertools.cycle([(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
                            for _ in range(5)])  # fmt: skip
    trainer = SimpleTrainer(model, data, opt, check_finite_every_step=every_step)
    writers = [JSONWriter(out / "metrics.json", window_size=1), TensorboardXWriter(out, 1)]
    write = PeriodicWriter(writers, period=1)
    # (no IterationTimer: its times are the machine's)
    trainer.register_hooks([LRScheduler(opt, sched), write])
    trainer.train(0, 12)
    return trainer


def _events(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_queued_and_per_step_losses_write_the_same_bytes(tmp_path, monkeypatch):
    direct = _run(tmp_path / "direct", True, monkeypatch)
    deferred = _run(tmp_path / "deferred", False, monkeypatch)
    assert not direct._hookloop.metrics.deferring and deferred._hookloop.metrics.deferring
    a = (tmp_path / "direct" / "metrics.json").read_bytes()
    b = (tmp_path / "deferred" / "metrics.json").read_bytes()
    assert a == b and a.count(b"\n") == 12
    assert list(direct.storage.histories()) == list(deferred.storage.histories())  # key order
    assert _events(tmp_path / "direct") == _events(tmp_path / "deferred")
