"""The loss metrics on their own: when losses are read in a batch and when at once, what a
storage read settles, the period of the writes, the asynchronous writes' queue and its errors.
SimpleTrainer's use of them is in test_train_loop.py."""

from __future__ import annotations

import concurrent.futures
import math
import threading
import types

import numpy as np
import pytest
import torch
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
        _hookloop=types.SimpleNamespace(stop=StopController()),
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
    m = LossMetrics(StopController())
    m.configure(trainer(None, **kw))
    assert m.deferring is deferring


def test_several_processes_read_at_every_step(monkeypatch):
    monkeypatch.setattr(comm, "_initialized", lambda: True)
    monkeypatch.setattr(comm, "get_world_size", lambda: 2)
    m = LossMetrics(StopController())
    m.configure(trainer(None))
    assert not m.deferring


def test_deferred_losses_wait_until_the_storage_is_read():
    m = LossMetrics(StopController())
    m.deferring = True
    with EventStorage(0) as storage:
        t = trainer(storage)
        for i in range(3):
            storage.iter = i
            m.write(t, losses(i), 0.01, "", i)
        assert storage._pending_counts() == (6, 0)  # two losses of 3 iterations, unread
        assert storage.latest()["total_loss"] == (2.0, 2)  # the read settles every one
        assert storage._pending_counts() == (0, 0)
        assert iters(storage) == [0, 1, 2]
        assert [v for v, _ in storage.history("total_loss").values()] == [1.0, 1.5, 2.0]


def test_at_the_bound_the_pending_losses_are_read_without_a_storage_read():
    m = LossMetrics(StopController())
    m.deferring = True
    with EventStorage(0) as storage:
        t = trainer(storage)
        storage._set_pending_limits(read_every=4, max_started=50, max_values=1024)
        for i in range(6):
            m.write(t, losses(i), 0.0, "", i)
            assert storage._pending_counts() == (2 * ((i + 1) % 4), 0)  # CPU: read, not started
        storage._settle()
        assert iters(storage) == list(range(6))


def test_only_iterations_of_the_gather_period_are_written():
    for deferring in (False, True):
        m = LossMetrics(StopController())
        m.deferring = deferring
        with EventStorage(0) as storage:
            t = trainer(storage, gather_metric_period=3)
            for i in range(9):
                storage.iter = i
                m.write(t, losses(i), 0.0, "", i)
            storage._settle()
            assert iters(storage) == [2, 5, 8], deferring


def test_a_non_finite_loss_names_its_iteration_on_either_path():
    for deferring in (False, True):
        m = LossMetrics(StopController())
        m.deferring = deferring
        with EventStorage(0) as storage:
            t = trainer(storage)
            with pytest.raises(FloatingPointError, match="iteration=4"):
                for i in range(6):
                    storage.iter = i
                    bad = {"loss_a": torch.tensor(math.inf if i == 4 else 1.0)}
                    m.write(t, bad, 0.0, "", i)
                storage._settle()


def test_asynchronous_writes_run_in_order_and_their_errors_reach_the_training_thread():
    m = LossMetrics(StopController())
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
    m = LossMetrics(StopController())
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


def test_the_pending_limits_are_checked():
    storage = EventStorage(0)
    for bad in ({"read_every": 0}, {"max_started": -1}, {"max_values": 0}):
        kw = {"read_every": 20, "max_started": 50, "max_values": 1024, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            storage._set_pending_limits(**kw)


def test_at_the_value_bound_what_waits_is_read_whatever_it_is(monkeypatch):
    """A storage that is never read holds a bounded number of tensors: at max_values waiting
    values, one batched read, before read_every iterations (device losses simulated with meta
    tensors and a patched read)."""
    from hookloop.utils import _tensors

    reads = []

    def read_scalars(tensors):
        reads.append(len(tensors))
        return [1.0] * len(tensors)

    monkeypatch.setattr(_tensors, "read_scalars", read_scalars)
    storage = EventStorage(0)
    storage._set_pending_limits(read_every=20, max_started=50, max_values=5)
    meta = {"a": torch.empty((), device="meta"), "b": torch.empty((), device="meta")}
    counts = []
    for i in range(4):
        storage._record_losses(i, 0.0, meta)
        counts.append(storage._pending_counts())
    assert counts == [(2, 0), (4, 0), (0, 0), (2, 0)] and reads == [6]
    assert iters(storage) == [0, 1, 2, 3] and reads == [6, 2]


def test_a_loss_that_can_change_later_is_recorded_with_its_value_of_now():
    """A deferred loss is read up to 20 iterations later: a leaf tensor (an nn.Parameter, a
    tensor given as it is) is copied when recorded, a computed loss is not (no copy per step)."""
    m = LossMetrics(StopController())
    m.configure(trainer(None))
    assert m.deferring and m.snapshot
    weight = torch.nn.Parameter(torch.tensor(0.59))
    plain = torch.tensor(1.0)
    with EventStorage(0) as storage:
        t = trainer(storage)
        for i in range(3):
            computed = weight * 2
            m.write(t, {"w": weight, "plain": plain, "computed": computed}, 0.0, "", i)
            with torch.no_grad():
                weight.sub_(0.1)
                plain.add_(1.0)
        values = {k: [v for v, _ in storage.history(k).values()] for k in ("w", "plain")}
    assert values["w"] == pytest.approx([0.59, 0.49, 0.39])
    assert values["plain"] == [1.0, 2.0, 3.0]


def test_only_values_that_can_change_are_copied():
    from hookloop.utils._tensors import snapshot_losses

    w = torch.nn.Parameter(torch.tensor(1.0))
    computed = {"a": w * 2, "b": w + 1}
    assert snapshot_losses(computed) is computed  # the per-step case: nothing copied
    arr = np.ones(())
    given = {"a": computed["a"], "w": w, "t": torch.tensor(2.0), "n": arr, "f": 3.0}
    out = snapshot_losses(given)
    assert out["a"] is given["a"] and out["f"] == 3.0
    for k in ("w", "t", "n"):
        assert out[k] is not given[k] and out[k].item() == given[k].item(), k
    assert not out["w"].requires_grad and type(out["w"]) is torch.Tensor


def test_a_cuda_graphs_ring_slots_are_not_copied():
    """CUDAGraphTrainer hands over views of its ring, which stay until read."""
    m = LossMetrics(StopController())
    graph_trainer = trainer(None)
    graph_trainer._hookloop.graph = object()
    m.configure(graph_trainer)
    assert not m.snapshot


def test_a_parameter_is_copied_before_an_asynchronous_write():
    m = LossMetrics(StopController())
    seen = []
    with EventStorage(0) as storage:
        queued = []
        executor = types.SimpleNamespace(submit=lambda f, *a, **k: queued.append((f, a, k)))
        t = trainer(
            storage,
            concurrent_executor=executor,
            _write_metrics=lambda d, *a, **k: seen.append(float(d["w"])),
        )
        w = torch.nn.Parameter(torch.tensor(0.5))
        m.submit(t, {"w": w}, 0.0)
        with torch.no_grad():
            w.mul_(3)  # the optimizer step, before the executor's write
        f, a, k = queued.pop()
        f(*a, **k)
    assert seen == [0.5]


@pytest.mark.parametrize("then", ["read", "record"])
def test_a_non_finite_loss_read_on_another_thread_is_raised_on_the_recording_thread(then):
    """The thread that records the losses owns their errors: another thread's read gets the
    finite values before it; the recording thread's next read or record raises it, once;
    every save after it is refused."""
    with EventStorage(0) as storage:
        for i in range(5):
            storage._record_losses(i, 0.0, {"a": torch.tensor(math.nan if i == 2 else 1.0)})
        got = {}
        poller = threading.Thread(target=lambda: got.update(latest=storage.latest()))
        poller.start()
        poller.join(30)
        assert got["latest"]["total_loss"] == (1.0, 1)
        with pytest.raises(
            FloatingPointError, match=r"^Loss became infinite or NaN at iteration=2!"
        ):
            if then == "read":
                storage.latest()
            else:
                storage._record_losses(5, 0.0, {"a": torch.tensor(1.0)})
        storage._record_losses(6, 0.0, {"a": torch.tensor(1.0)})
        assert storage.latest()["total_loss"] == (1.0, 6)
        with pytest.raises(FloatingPointError, match="iteration=2!"):
            storage._settle_before_save()
