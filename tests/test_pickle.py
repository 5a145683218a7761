"""Everything a checkpoint or a copy needs pickles: HistoryBuffer, EventStorage, the hooks
(native ones included); writers and the dispatcher refuse with a TypeError that says why."""

from __future__ import annotations

import copy
import io
import os
import pickle

import pytest
import torch
from hookloop.engine import SimpleTrainer, TrainerBase, hooks
from hookloop.utils.events import (
    CommonMetricPrinter,
    EventStorage,
    HistoryBuffer,
    JSONWriter,
    TensorboardXWriter,
)


def roundtrips(obj):
    yield pickle.loads(pickle.dumps(obj))
    yield copy.deepcopy(obj)


def test_history_buffer_pickles_with_evicted_global_average():
    h = HistoryBuffer(max_length=4)
    for i in range(10):
        h.update(float(i), iteration=i * 2)
    for back in roundtrips(h):
        assert type(back) is HistoryBuffer
        assert back.values() == h.values()
        assert back.global_avg() == h.global_avg() and back._count == 10
        assert back.max_length == 4 and back.median(3) == h.median(3)
        back.update(100.0)  # still a working buffer
        assert len(back) == 4


def test_history_buffer_view_pickles_as_an_independent_copy():
    s = EventStorage()
    s.put_scalar("loss", 1.0)
    view = s.history("loss")
    back = pickle.loads(pickle.dumps(view))
    back.update(5.0)
    assert len(s.history("loss")) == 1 and len(back) == 2


def test_history_buffer_float_iterations_survive():
    h = HistoryBuffer()
    h.update(1.0, 0.5)
    assert pickle.loads(pickle.dumps(h)).values() == [(1.0, 0.5)]


def test_event_storage_pickles_scalars_hints_latest_and_iteration():
    s = EventStorage(start_iter=3, max_length=50)
    for i in range(3, 40):
        s.iter = i
        s.put_scalars(loss=float(i), acc=0.5)
        s.put_scalar("lr", 0.1 * i, smoothing_hint=False)
    for back in roundtrips(s):
        assert isinstance(back, EventStorage)
        assert back.iter == 39
        assert back.latest() == s.latest()
        assert back.smoothing_hints() == s.smoothing_hints()
        assert back.latest_with_smoothing_hint(20) == s.latest_with_smoothing_hint(20)
        assert back.history("loss").values() == s.history("loss").values()
        assert back.history("loss").max_length == 50
        back.put_scalar("loss", 1.0)  # usable, and independent of the original
        assert s.history("loss").values()[-1] == (39.0, 39)


def test_event_storage_recent_state_keeps_the_smoothing_window():
    s = EventStorage()
    for i in range(100):
        s.iter = i
        s.put_scalar("loss", float(i % 7))
    state = s._state(keep=20)
    back = EventStorage()
    back._load_state(state)
    assert back.latest_with_smoothing_hint(20) == s.latest_with_smoothing_hint(20)
    assert (
        len(back.history("loss")) == 20
        and back.history("loss").global_avg() == s.history("loss").global_avg()
    )


def test_corrupt_storage_state_is_a_value_error():
    s = EventStorage()
    s.put_scalar("loss", 1.0)
    state = s._state()
    state["scalars"][0][4]["values"] = b"\x00" * 7
    with pytest.raises(ValueError, match="multiple of 8"):
        EventStorage()._load_state(state)
    with pytest.raises(ValueError, match="no 'scalars'"):
        EventStorage()._load_state({"iter": 0, "max_length": 10})


class TinyTrainer(TrainerBase):
    def run_step(self):
        pass


def test_hook_list_deep_copies_for_a_second_trainer():
    """Building a second trainer from a deep copy of the first one's hooks."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    first = TinyTrainer()
    first.register_hooks(
        [
            hooks.IterationTimer(warmup_iter=1),
            hooks.LRScheduler(opt, sched),
            hooks.PeriodicWriter([], 7),
        ]
    )
    first.train(0, 3)
    clones = copy.deepcopy(first._hooks)
    timer, lr, writer = clones
    assert timer._warmup_iter == 1 and writer._period == 7
    assert lr._scheduler is not sched and lr._scheduler.step_size == 2
    second = TinyTrainer()
    second.register_hooks(clones)
    second.train(0, 4)
    assert len(second.storage.history("time").values()) == 4  # warmup_iter=1: all timed


def test_trainer_state_dict_saves_with_torch_save(tmp_path):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    def losses(data):
        return {"loss": model(data).sum()}

    class M(torch.nn.Module):
        def forward(self, x):
            return losses(x)

    t = SimpleTrainer(M(), iter(lambda: torch.ones(1, 2), None), opt)
    t.register_hooks([hooks.LRScheduler(scheduler=sched), hooks.IterationTimer()])
    t.train(0, 3)
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    assert state["iteration"] == 3 and state["hooks"]["LRScheduler"]["last_epoch"] == 3


def test_writers_and_dispatcher_refuse_pickling_with_a_reason(tmp_path):
    json_writer = JSONWriter(os.path.join(tmp_path, "m.json"))
    tb = TensorboardXWriter(str(tmp_path))
    for obj in (
        json_writer._native,
        tb._native,
        CommonMetricPrinter()._native,
        TinyTrainer()._hookloop.dispatcher,
    ):
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(obj)
        with pytest.raises(TypeError, match="cannot be pickled"):
            copy.deepcopy(obj)
    json_writer.close()
    tb.close()
