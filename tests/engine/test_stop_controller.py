"""The stop controller on its own: requests, the dispatcher's stop flag a stop sets, the codes
of the cross-rank agreement, and what ``train()`` raises after a stop. The trainers' use of it is in
test_stopping.py and test_stop_across_ranks.py."""

from __future__ import annotations

import pytest
from hookloop.engine.stop import Preempted, StopController, StopTraining
from hookloop.utils import comm


class Dispatcher:
    """Stands in for the Rust dispatcher: counts the stops requested of it."""

    def __init__(self):
        self.stops = 0

    def request_stop(self):
        self.stops += 1


def test_the_dispatchers_flag_stops_the_loop_before_the_next_iterations_hooks():
    from hookloop import _core

    d = _core.Dispatcher()
    assert d.before_step(0)  # no table, no hooks: runs nothing
    d.request_stop()
    with pytest.raises(StopTraining):
        d.before_step(1)
    assert issubclass(StopTraining, BaseException) and not issubclass(StopTraining, Exception)


def two_ranks(monkeypatch):
    monkeypatch.setattr(comm, "_initialized", lambda: True)
    monkeypatch.setattr(comm, "get_world_size", lambda: 2)


def test_a_request_outside_a_running_loop_is_refused():
    stop = StopController(Dispatcher())
    assert not stop.running
    with pytest.raises(RuntimeError, match="no training is running"):
        stop.request()
    stop.begin()
    with pytest.raises(TypeError, match="raise_after_train must be an exception, got int"):
        stop.request(3)


def test_one_process_sets_the_stop_flag_once():
    d = Dispatcher()
    stop = StopController(d)
    stop.begin()
    stop.request(KeyError("first"))
    stop.request(ValueError("second"))  # a second request adds nothing, keeps the first
    assert stop.requested and d.stops == 1
    assert stop.outgoing() == 0  # applied: nothing left to send
    stop.end()
    assert not stop.running
    exc = stop.take_raise_after_train()
    assert isinstance(exc, KeyError) and stop.take_raise_after_train() is None
    stop.begin()  # the next train() starts clean
    assert not stop.requested and stop.outgoing() == 0


def test_across_ranks_a_request_waits_for_the_collective(monkeypatch):
    two_ranks(monkeypatch)
    d = Dispatcher()
    stop = StopController(d)
    stop.collective = True
    assert stop.rides_collective()
    stop.begin()
    stop.request()
    assert d.stops == 0 and stop.outgoing() == 1  # sent, not taken alone
    stop.agreed(0)
    assert d.stops == 0
    stop.agreed(1)
    assert d.stops == 1 and stop.outgoing() == 0


def test_a_preemption_is_sent_with_its_signal_and_raised_where_it_arrives(monkeypatch):
    two_ranks(monkeypatch)
    here = StopController(Dispatcher())
    here.collective = True
    here.begin()
    here.request(Preempted(10))
    assert here.outgoing() == 11  # 1 + signum
    d = Dispatcher()
    peer = StopController(d)
    peer.collective = True
    peer.begin()
    peer.agreed(11)
    assert peer.requested and d.stops == 1
    exc = peer.take_raise_after_train()
    assert isinstance(exc, Preempted) and exc.signum == 10 and exc.code == 138


def test_without_a_collective_a_stop_is_taken_at_once_even_across_ranks(monkeypatch):
    two_ranks(monkeypatch)
    d = Dispatcher()
    stop = StopController(d)
    assert not stop.rides_collective()  # not a trainer that makes the packed collective
    stop.begin()
    stop.request()
    assert d.stops == 1


def test_an_agreement_after_the_loop_ended_is_ignored():
    stop = StopController(Dispatcher())
    stop.agreed(5)
    assert not stop.requested and stop.take_raise_after_train() is None
