"""The loss metrics on their own: when losses are read in a batch and when at once, what a
storage read settles, the period of the writes, the asynchronous writes' queue and its errors.
SimpleTrainer's use of them is in test_train_loop.py."""

from __future__ import annotations

import concurrent.futures
import math
import types

import pytest
import torch
from hookloop import _core
from hookloop.engine.metrics import LossMetrics, metrics_of
from hookloop.engine.stop import StopController
from hookloop.engine.train_loop import SimpleTrainer, TrainerBase
from hookloop.utils import comm
from hookloop.utils.events import EventStorage


def trainer(storage, **kw):
    """What LossMetrics reads of a trainer: SimpleTrainer's names."""
    t = types.SimpleNamespace(
        storage=storage,
        gather_metric_period=1,
        check_finite_every_step=False,
        async_write_metrics=False,
        _hookloop=types.SimpleNamespace(stop=StopController(_core.Dispatcher())),
        iter=0,
    )
    t.__dict__.update(kw)
    return t


def losses(i):
    return {"loss_a": torch.tensor(0.5 * i), "loss_b": torch.tensor(1.0)}


def iters(storage, name="total_loss"):
    return [it for _, it in storage.history(name).values()]


@pytest.mark.parametrize(
    "kw, deferring",
    [
        ({}, True),
        ({"check_finite_every_step": True}, False),
        ({"async_write_metrics": True}, False),
    ],
)
def test_deferred_reads_are_for_one_process_that_did_not_ask_for_every_step(kw, deferring):
    m = LossMetrics()
    m.configure(trainer(None, **kw))
    assert m.deferring is deferring


def test_several_processes_read_at_every_step(monkeypatch):
    monkeypatch.setattr(comm, "_initialized", lambda: True)
    monkeypatch.setattr(comm, "get_world_size", lambda: 2)
    m = LossMetrics()
    m.configure(trainer(None))
    assert not m.deferring


def test_deferred_losses_wait_until_the_storage_is_read():
    m = LossMetrics()
    m.deferring = True
    with EventStorage(0) as storage:
        t = trainer(storage)
        for i in range(3):
            storage.iter = i
            m.write(t, losses(i), 0.01, "", i)
        assert len(m._pending) == 3  # nothing read yet
        assert storage.latest()["total_loss"] == (2.0, 2)  # the read settles every one
        assert m._pending == []
        assert iters(storage) == [0, 1, 2]
        assert [v for v, _ in storage.history("total_loss").values()] == [1.0, 1.5, 2.0]


def test_at_the_bound_the_pending_losses_are_read_without_a_storage_read():
    m = LossMetrics()
    m.deferring = True
    with EventStorage(0) as storage:
        t = trainer(storage)
        m.READ_EVERY = 4
        for i in range(6):
            m.write(t, losses(i), 0.0, "", i)
            assert len(m._pending) == (i + 1) % 4
        m.settle()
        assert iters(storage) == list(range(6))


def test_only_iterations_of_the_gather_period_are_written():
    for deferring in (False, True):
        m = LossMetrics()
        m.deferring = deferring
        with EventStorage(0) as storage:
            t = trainer(storage, gather_metric_period=3)
            for i in range(9):
                storage.iter = i
                m.write(t, losses(i), 0.0, "", i)
            m.settle()
            assert iters(storage) == [2, 5, 8], deferring


def test_a_non_finite_loss_names_its_iteration_on_either_path():
    for deferring in (False, True):
        m = LossMetrics()
        m.deferring = deferring
        with EventStorage(0) as storage:
            t = trainer(storage)
            with pytest.raises(FloatingPointError, match="iteration=4"):
                for i in range(6):
                    storage.iter = i
                    bad = {"loss_a": torch.tensor(math.inf if i == 4 else 1.0)}
                    m.write(t, bad, 0.0, "", i)
                m.settle()


def test_asynchronous_writes_run_in_order_and_their_errors_reach_the_training_thread():
    m = LossMetrics()
    done = []
    with EventStorage(0) as storage, concurrent.futures.ThreadPoolExecutor(1) as pool:

        def write(loss_dict, data_time, iter):
            if iter == 2:
                raise OSError("disk full")
            done.append(iter)

        t = trainer(storage, concurrent_executor=pool, _write_metrics=write)
        for t.iter in range(2):
            m.submit(t, losses(t.iter), 0.0)
        m.wait()
        assert done == [0, 1] and not m._pending_writes
        t.iter = 2
        m.submit(t, losses(2), 0.0)
        with pytest.raises(OSError, match="disk full"):
            m.wait()
        t.iter = 3
        m.submit(t, losses(3), 0.0)
        pool.shutdown(wait=True)
        assert m.take_errors(None) == [] and done == [0, 1, 3]


def test_the_loss_dict_is_copied_before_an_asynchronous_write():
    m = LossMetrics()
    seen = []
    with EventStorage(0) as storage, concurrent.futures.ThreadPoolExecutor(1) as pool:
        t = trainer(
            storage, concurrent_executor=pool, _write_metrics=lambda d, *a, **k: seen.append(d)
        )
        shared = {"loss": torch.tensor(1.0)}
        m.submit(t, shared, 0.0)
        shared["loss"] = torch.tensor(2.0)  # the model refills its dict at the next step
        m.wait()
    assert seen[0]["loss"].item() == 1.0


def test_metrics_of_finds_a_simple_trainers_own_and_none_elsewhere():
    model = torch.nn.Linear(1, 1)
    t = SimpleTrainer(model, [torch.ones(1)], torch.optim.SGD(model.parameters(), 0.1))
    assert isinstance(metrics_of(t), LossMetrics)
    assert metrics_of(types.SimpleNamespace(_trainer=t)) is metrics_of(t)  # DefaultTrainer's
    assert metrics_of(TrainerBase()) is None and metrics_of(object()) is None


def _read_every_step():
    """LossMetrics configured for one process, told that a reader comes at every step."""
    m = LossMetrics()
    m.configure(trainer(None))
    m.read_every_step()
    return m


def test_with_a_reader_at_every_step_cpu_losses_are_put_at_once():
    m = _read_every_step()
    with EventStorage(0) as storage:
        t = trainer(storage)
        for i in range(3):
            storage.iter = i
            m.write(t, losses(i), 0.01, "", i)
            assert m._pending == []  # nothing kept: put now
            assert storage.latest()["total_loss"] == (0.5 * i + 1.0, i)
    assert m._direct is True


def test_with_a_reader_at_every_step_device_losses_stay_deferred():
    m = _read_every_step()
    with EventStorage(0) as storage:
        meta = {"loss_a": torch.tensor(1.0, device="meta")}  # not on the CPU, never read here
        m.write(trainer(storage), meta, 0.0, "", 0)
        assert m._direct is False and len(m._pending) == 1
        m._pending.clear()


def test_a_non_finite_loss_names_its_iteration_on_the_direct_path():
    m = _read_every_step()
    with EventStorage(0) as storage:
        t = trainer(storage)
        with pytest.raises(FloatingPointError, match="iteration=4"):
            for i in range(6):
                storage.iter = i
                m.write(t, {"loss_a": torch.tensor(math.inf if i == 4 else 1.0)}, 0.0, "", i)
        assert iters(storage) == [0, 1, 2, 3]
