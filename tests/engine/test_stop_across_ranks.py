"""How a stop travels between ranks, in one process: the world is faked at two ranks and the
packed collective is replaced by one that returns this rank's row and a peer's, whose stop
code the test chooses. The real thing on two gloo ranks is in test_ddp.py."""

from __future__ import annotations

import logging

import pytest
import torch
from hookloop.engine import (
    DefaultTrainer,
    HookBase,
    Preempted,
    PreemptionHandler,
    SimpleTrainer,
    TrainConfig,
)
from hookloop.utils import comm

engine_metrics = __import__("hookloop.engine.metrics", fromlist=["_"])

torch.set_num_threads(1)


class FakeWorld:
    """Two ranks, this one the main process; ``peer_stop[it]`` is what the peer sends in
    the collective of iteration ``it`` (0 otherwise). ``gathers`` lists the iterations."""

    def __init__(self, monkeypatch, peer_stop=None):
        self.peer_stop = dict(peer_stop or {})
        self.gathers = []
        self.groups = []
        self.sent = []
        monkeypatch.setattr(comm, "_initialized", lambda: True)
        monkeypatch.setattr(comm, "get_world_size", lambda: 2)
        monkeypatch.setattr(comm, "get_rank", lambda: 0)
        monkeypatch.setattr(engine_metrics, "_all_gather_floats", self.gather)
        self.barriers = 0
        monkeypatch.setattr(comm, "synchronize", self.barrier)
        monkeypatch.setattr(comm, "_get_off_thread_group", lambda: "off-thread group")

    def barrier(self):
        self.barriers += 1

    def gather(self, values, n_losses, cur_iter, group=None):
        self.gathers.append(cur_iter)
        self.groups.append(group)
        self.sent.append(int(values[-1]))
        peer = list(values[:-1]) + [float(self.peer_stop.get(cur_iter, 0))]
        return [list(values), peer]


class StopAt(HookBase):
    def __init__(self, at, exc=None):
        self.at, self.exc = at, exc

    def after_step(self):
        if self.trainer.iter == self.at:
            self.trainer.request_stop(self.exc)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return (self.w * x).sum()


def trainer(period, hooks=(), **kw):
    model = Model()
    t = SimpleTrainer(
        model,
        [torch.tensor(1.0)] * 100,
        torch.optim.SGD(model.parameters(), lr=0.0),
        gather_metric_period=period,
        **kw,
    )
    t.register_hooks(list(hooks))
    return t


def test_a_stop_waits_for_the_next_collective_and_is_sent_in_it(monkeypatch):
    world = FakeWorld(monkeypatch)
    t = trainer(5, [StopAt(2)])
    t.train(0, 20)
    # Asked after iteration 2; sent in the collective of iteration 4; stopped after it.
    assert world.gathers == [4]
    assert world.sent == [1]
    assert (t.iter, t.stopped_early, t.stop_requested) == (4, True, True)
    # The ranks leave train() together, after the main process saved the stop's checkpoint.
    assert world.barriers == 1


def test_a_peers_stop_stops_this_rank_at_the_same_iteration(monkeypatch):
    world = FakeWorld(monkeypatch, {9: 1})
    t = trainer(5)
    t.train(0, 20)
    assert world.gathers == [4, 9]
    assert (t.iter, t.stopped_early, t.stop_requested) == (9, True, True)


def test_a_peers_preemption_is_raised_on_every_rank(monkeypatch):
    world = FakeWorld(monkeypatch, {3: 1 + 15})
    t = trainer(2, [PreemptionHandler()])
    with pytest.raises(Preempted) as info:
        t.train(0, 20)
    assert info.value.code == 128 + 15 and info.value.signum == 15
    assert world.gathers == [1, 3] and t.iter == 3


def test_this_ranks_preemption_is_sent_with_its_signal(monkeypatch):
    world = FakeWorld(monkeypatch)
    t = trainer(3, [StopAt(0, Preempted(10))])
    with pytest.raises(Preempted):
        t.train(0, 20)
    assert world.sent == [1 + 10] and t.iter == 2


def test_no_collective_left_training_finishes(monkeypatch):
    world = FakeWorld(monkeypatch)
    t = trainer(5, [StopAt(16)])
    t.train(0, 18)
    assert world.gathers == [4, 9, 14]
    assert (t.iter, t.stopped_early) == (18, False)
    assert world.barriers == 0


def test_async_writes_take_the_agreed_stop_one_period_later(monkeypatch):
    world = FakeWorld(monkeypatch, {4: 1})
    t = trainer(5, async_write_metrics=True)
    t.train(0, 30)
    # Agreed in the collective of iteration 4 (on the writer thread), taken at iteration 9
    # on the training thread, where every rank waits for that collective.
    assert world.gathers == [4, 9]
    assert (t.iter, t.stopped_early) == (9, True)
    # Off the training thread, the collective has a group of its own (not DDP's).
    assert world.groups == ["off-thread group"] * 2


def test_default_trainer_stop_rides_on_its_wrapped_trainer(tmp_path, monkeypatch):
    # DefaultTrainer calls setup_logger() when hookloop's logger would drop INFO records (the
    # logger then stops propagating, which later tests' caplog would miss).
    log = logging.getLogger("hookloop")
    level = log.level
    log.setLevel(logging.INFO)
    try:
        _default_trainer_stop(tmp_path, monkeypatch)
    finally:
        log.setLevel(level)


def _default_trainer_stop(tmp_path, monkeypatch):
    class Toy(DefaultTrainer):
        @classmethod
        def build_model(cls, cfg):
            return Model()

        @classmethod
        def build_train_loader(cls, cfg):
            return [torch.tensor(1.0)] * 100

    cfg = TrainConfig(
        max_iter=20, output_dir=str(tmp_path), gather_metric_period=4, checkpoint_period=100
    )
    t = Toy(cfg)
    t.register_hooks([StopAt(1)])
    world = FakeWorld(monkeypatch)
    t.train()
    assert world.gathers == [3] and world.sent == [1]
    assert (t.iter, t.stopped_early) == (3, True)
    assert (tmp_path / "model_0000003.pth").exists()


def test_one_process_stops_at_once():
    t = trainer(5, [StopAt(2)])
    t.train(0, 20)
    assert (t.iter, t.stopped_early) == (2, True)
