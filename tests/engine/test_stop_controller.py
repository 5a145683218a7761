"""The stop controller on its own: requests, the hook a stop appends, the codes of the
cross-rank agreement, and what ``train()`` raises after a stop. The trainers' use of it is in
test_stopping.py and test_stop_across_ranks.py."""

from __future__ import annotations

import pytest
from hookloop.engine.stop import Preempted, StopController, StopTraining
from hookloop.utils import comm


class StopHook:
    def before_step(self):
        raise StopTraining


def two_ranks(monkeypatch):
    monkeypatch.setattr(comm, "_initialized", lambda: True)
    monkeypatch.setattr(comm, "get_world_size", lambda: 2)


def test_a_request_outside_a_running_loop_is_refused():
    stop = StopController(StopHook)
    assert not stop.running
    with pytest.raises(RuntimeError, match="no training is running"):
        stop.request()
    stop.begin([])
    with pytest.raises(TypeError, match="raise_after_train must be an exception, got int"):
        stop.request(3)


def test_one_process_appends_one_stop_hook_and_end_removes_it():
    stop, hooks, other = StopController(StopHook), [], object()
    hooks.append(other)
    stop.begin(hooks)
    stop.request(KeyError("first"))
    stop.request(ValueError("second"))  # a second request adds nothing, keeps the first
    assert stop.requested and [type(h) for h in hooks] == [object, StopHook]
    assert stop.outgoing() == 0  # applied: nothing left to send
    stop.end()
    assert hooks == [other] and not stop.running
    exc = stop.take_raise_after_train()
    assert isinstance(exc, KeyError) and stop.take_raise_after_train() is None
    stop.begin(hooks)  # the next train() starts clean
    assert not stop.requested and stop.outgoing() == 0


def test_across_ranks_a_request_waits_for_the_collective(monkeypatch):
    two_ranks(monkeypatch)
    stop, hooks = StopController(StopHook), []
    stop.collective = True
    assert stop.rides_collective()
    stop.begin(hooks)
    stop.request()
    assert hooks == [] and stop.outgoing() == 1  # sent, not taken alone
    stop.agreed(0)
    assert hooks == []
    stop.agreed(1)
    assert [type(h) for h in hooks] == [StopHook] and stop.outgoing() == 0


def test_a_preemption_is_sent_with_its_signal_and_raised_where_it_arrives(monkeypatch):
    two_ranks(monkeypatch)
    here = StopController(StopHook)
    here.collective = True
    here.begin([])
    here.request(Preempted(10))
    assert here.outgoing() == 11  # 1 + signum
    peer, peer_hooks = StopController(StopHook), []
    peer.collective = True
    peer.begin(peer_hooks)
    peer.agreed(11)
    assert peer.requested and len(peer_hooks) == 1
    exc = peer.take_raise_after_train()
    assert isinstance(exc, Preempted) and exc.signum == 10 and exc.code == 138


def test_without_a_collective_a_stop_is_taken_at_once_even_across_ranks(monkeypatch):
    two_ranks(monkeypatch)
    stop, hooks = StopController(StopHook), []
    assert not stop.rides_collective()  # not a trainer that makes the packed collective
    stop.begin(hooks)
    stop.request()
    assert len(hooks) == 1


def test_an_agreement_after_the_loop_ended_is_ignored():
    stop = StopController(StopHook)
    stop.agreed(5)
    assert not stop.requested and stop.take_raise_after_train() is None
