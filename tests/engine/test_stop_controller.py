"""The stop controller on its own: requests, the ``applied`` state a stop takes (which
``TrainerBase.before_step`` reads), the codes of the cross-rank agreement, and what
``train()`` raises after a stop. The trainers' use of it is in test_stopping.py and
test_stop_across_ranks.py."""

from __future__ import annotations

import pytest
from hookloop.engine.stop import Preempted, StopController, StopTraining
from hookloop.utils import comm


def test_an_applied_stop_raises_in_the_next_before_step_before_any_hook():
    from hookloop.engine import HookBase, TrainerBase
    from hookloop.utils.events import EventStorage

    calls = []

    class Hook(HookBase):
        def before_step(self):
            calls.append(self.trainer.iter)

    t = TrainerBase()
    t.register_hooks([Hook()])
    with EventStorage(0) as t.storage:
        t.before_train()
        t.before_step()
        t._hookloop.stop.begin()
        t._hookloop.stop.request()
        assert t._hookloop.stop.applied
        t.iter = 1
        with pytest.raises(StopTraining):
            t.before_step()
    assert calls == [0]  # not the hook of iteration 1
    assert issubclass(StopTraining, BaseException) and not issubclass(StopTraining, Exception)


def two_ranks(monkeypatch):
    monkeypatch.setattr(comm, "_initialized", lambda: True)
    monkeypatch.setattr(comm, "get_world_size", lambda: 2)


def test_a_request_outside_a_running_loop_is_refused():
    stop = StopController()
    assert not stop.running
    with pytest.raises(RuntimeError, match="no training is running"):
        stop.request()
    stop.begin()
    with pytest.raises(TypeError, match="raise_after_train must be an exception, got int"):
        stop.request(3)


def test_one_process_sets_the_stop_flag_once():
    stop = StopController()
    stop.begin()
    stop.request(KeyError("first"))
    stop.request(ValueError("second"))  # a second request adds nothing, keeps the first
    assert stop.requested and stop.applied
    assert stop.outgoing() == 0  # applied: nothing left to send
    stop.end()
    assert not stop.running and not stop.applied
    exc = stop.take_raise_after_train()
    assert isinstance(exc, KeyError) and stop.take_raise_after_train() is None
    stop.begin()  # the next train() starts clean
    assert not stop.requested and stop.outgoing() == 0


def test_across_ranks_a_request_waits_for_the_collective(monkeypatch):
    two_ranks(monkeypatch)
    stop = StopController()
    stop.collective = True
    assert stop.rides_collective()
    stop.begin()
    stop.request()
    assert not stop.applied and stop.outgoing() == 1  # sent, not taken alone
    stop.agreed(0)
    assert not stop.applied
    stop.agreed(1)
    assert stop.applied and stop.outgoing() == 0


def test_a_preemption_is_sent_with_its_signal_and_raised_where_it_arrives(monkeypatch):
    two_ranks(monkeypatch)
    here = StopController()
    here.collective = True
    here.begin()
    here.request(Preempted(10))
    assert here.outgoing() == 11  # 1 + signum
    peer = StopController()
    peer.collective = True
    peer.begin()
    peer.agreed(11)
    assert peer.requested and peer.applied
    exc = peer.take_raise_after_train()
    assert isinstance(exc, Preempted) and exc.signum == 10 and exc.code == 138


def test_without_a_collective_a_stop_is_taken_at_once_even_across_ranks(monkeypatch):
    two_ranks(monkeypatch)
    stop = StopController()
    assert not stop.rides_collective()  # not a trainer that makes the packed collective
    stop.begin()
    stop.request()
    assert stop.applied


def test_an_agreement_after_the_loop_ended_is_ignored():
    stop = StopController()
    stop.agreed(5)
    assert not stop.requested and stop.take_raise_after_train() is None
