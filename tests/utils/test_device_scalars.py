"""``put_scalar``/``put_scalars`` of a tensor on a device: kept unread (a read would wait for
the device) and read in one batch at the next read of the scalars, with the name and
iteration of the put, the values ``item()`` gives.

Without a GPU the device is simulated by :class:`OnDevice`, a CPU tensor whose ``is_cpu`` says
False; the CUDA test at the end proves the same on a GPU with the sync debug mode.
"""

from __future__ import annotations

import gc
import itertools
import json
import weakref

import pytest
import torch
from hookloop.engine import HookBase, SimpleTrainer
from hookloop.utils import _tensors
from hookloop.utils.events import EventStorage, JSONWriter, get_event_storage


class OnDevice(torch.Tensor):
    """A CPU tensor that reports a device: the storage treats it as it treats a CUDA one."""

    @property
    def is_cpu(self) -> bool:
        return False


def dev(value, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype).as_subclass(OnDevice)


@pytest.fixture
def reads(monkeypatch):
    """The batches read_scalars gets (their lengths), and item() calls on device tensors."""
    seen = {"batches": [], "items": 0}
    real_read, real_item = _tensors.read_scalars, torch.Tensor.item

    def read(tensors):
        seen["batches"].append(len(tensors))
        return real_read(tensors)

    def item(self):
        if isinstance(self, OnDevice):
            seen["items"] += 1
        return real_item(self)

    monkeypatch.setattr(_tensors, "read_scalars", read)
    monkeypatch.setattr(torch.Tensor, "item", item)
    return seen


def test_a_device_tensor_is_read_at_the_next_read_with_the_iteration_of_its_put(reads):
    with EventStorage(5) as s:
        s.put_scalar("acc", dev(0.25))
        s.step()
        s.put_scalars(acc=dev(0.5), count=dev(3, torch.int64), lr=0.1)
        s.step()
        assert reads["batches"] == [] and reads["items"] == 0  # nothing read yet
        assert s.history("acc").values() == [(0.25, 5), (0.5, 6)]
        assert reads["batches"] == [3]  # one batch for all three
        assert s.latest()["count"] == (3.0, 6)
        # the order of the puts, as detectron2's (a name keeps the place of its put)
        assert list(s.latest()) == ["acc", "count", "lr"]
        assert reads["items"] == 0


def test_the_name_scope_and_cur_iter_are_those_of_the_put():
    with EventStorage(0) as s:
        with s.name_scope("val"):
            s.put_scalar("acc", dev(0.75), cur_iter=40)
        s.put_scalar("acc", dev(0.5))
        assert s.latest()["val/acc"] == (0.75, 40)
        assert s.latest()["acc"] == (0.5, 0)


def test_values_match_item_across_dtypes():
    values = [
        dev(2**25 + 1, torch.int64),  # float32 promotion would round it
        dev(0.1, torch.float32),
        dev(0.1, torch.float64),
        dev(True, torch.bool),
        dev(1.5, torch.bfloat16),
        dev(float("nan")),
    ]
    with EventStorage(0) as s:
        s.put_scalars(**{f"v{i}": v for i, v in enumerate(values)})
        got = [s.latest()[f"v{i}"][0] for i in range(len(values))]
    want = [float(torch.Tensor.item(v.as_subclass(torch.Tensor))) for v in values]
    assert got[:-1] == want[:-1] and got[-1] != got[-1]


def test_mixed_shapes_are_read_per_value_shape():
    with EventStorage(0) as s:
        s.put_scalar("a", dev([1.5]))
        s.put_scalar("b", dev([[2.5]]))
        s.put_scalar("c", dev(3.5))
        assert {k: v for k, (v, _) in s.latest().items()} == {"a": 1.5, "b": 2.5, "c": 3.5}


def test_a_plain_put_under_a_waiting_name_keeps_the_order_of_the_puts(reads):
    with EventStorage(0) as s:
        s.put_scalar("x", dev(1.0))
        s.put_scalar("other", 7.0)  # another name: the device value keeps waiting
        assert reads["batches"] == []
        s.step()
        s.put_scalar("x", 2.0)  # the same name: the waiting value goes first
        assert reads["batches"] == [1]
        assert s.history("x").values() == [(1.0, 0), (2.0, 1)]


def test_a_changed_smoothing_hint_fails_at_the_put():
    with EventStorage(3) as s:
        s.put_scalar("lr", 0.1, smoothing_hint=False)
        with pytest.raises(ValueError, match=r"smoothing_hint for 'lr' changed from False to True"):
            s.put_scalar("lr", dev(0.2))
        assert s.history("lr").values() == [(0.1, 3)]


def test_values_that_are_not_one_number_still_fail_at_the_put():
    with EventStorage(0) as s:
        with pytest.raises(TypeError, match="'v'"):
            s.put_scalar("v", dev([1.0, 2.0]))
        with pytest.raises(TypeError, match="'c'"):
            s.put_scalar("c", torch.tensor(1 + 2j).as_subclass(OnDevice))
        assert s.latest() == {}


def test_every_read_sees_the_waiting_values(tmp_path):
    reads = {
        "history": lambda s: s.history("a").latest(),
        "histories": lambda s: s.histories()["a"].latest(),
        "latest": lambda s: s.latest()["a"][0],
        "smoothing": lambda s: s.latest_with_smoothing_hint(20)["a"][0],
        "hints": lambda s: s.smoothing_hints()["a"] and 4.0,
        "count": lambda s: s.count_samples("a", 20) * 4.0,
        "state": lambda s: s._state()["scalars"][0][2],
    }
    for name, read in reads.items():
        with EventStorage(0) as s:
            s.put_scalar("a", dev(4.0))
            assert read(s) == 4.0, name
    path = tmp_path / "metrics.json"
    with EventStorage(0) as s:
        s.put_scalar("a", dev(4.0))
        w = JSONWriter(path)
        w.write()
        w.close()
    assert json.loads(path.read_text()) == {"a": 4.0, "iteration": 0}


def test_a_kept_history_buffer_sees_the_waiting_values():
    with EventStorage(0) as s:
        s.put_scalar("a", 1.0)
        buffer = s.history("a")
        s.step()
        s.put_scalar("a", dev(2.0))
        assert buffer.latest() == 2.0
        assert buffer.values() == [(1.0, 0), (2.0, 1)]


def test_waiting_values_are_bounded_without_reads(reads, monkeypatch):
    with EventStorage(0) as s:
        for _ in range(2500):
            s.put_scalar("a", dev(1.0))
            s.step()
        assert reads["batches"] == [1024, 1024]
        assert len(s.history("a").values()) == 2500
        assert reads["batches"] == [1024, 1024, 452]


def test_a_waiting_tensor_does_not_keep_its_autograd_graph_alive():
    """A value computed with grad (a mean of logits) waits detached: what its graph saved is
    freed at once, not at the read."""

    class Saved:
        pass

    class KeepsSaved(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, saved):
            ctx.saved = saved  # held by the graph's node as long as the graph lives
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2, None

    saved = Saved()
    gone = weakref.ref(saved)
    x = dev(1.5).requires_grad_()
    y = KeepsSaved.apply(x, saved)
    assert isinstance(y, OnDevice) and y.requires_grad
    with EventStorage(0) as s:
        s.put_scalar("a", y)
        del y, saved
        gc.collect()
        assert gone() is None
        assert s.latest()["a"] == (3.0, 0)


def test_cpu_tensors_are_read_at_the_put(reads):
    t = torch.tensor(2.0)
    with EventStorage(0) as s:
        s.put_scalar("a", t)
        t.fill_(5.0)  # read at the put: the later value is not what is stored
        assert s.latest()["a"] == (2.0, 0)
    assert reads["batches"] == []


def test_a_model_putting_device_tensors_stores_the_same_as_floats():
    """Scalars put from inside forward, as detectron2 models put accuracies: the trainer's
    storage holds the same histories whether the values are floats or device tensors."""

    class Model(torch.nn.Module):
        def __init__(self, wrap):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.wrap = wrap
            self.n = 0

        def forward(self, data):
            self.n += 1
            get_event_storage().put_scalar("acc", self.wrap(self.n / 8))
            return {"loss": self.w * self.n}

    class Reader(HookBase):
        def __init__(self):
            self.seen = []

        def after_step(self):
            if self.trainer.iter % 3 == 0:
                self.seen.append(self.trainer.storage.latest()["acc"])

    runs = []
    for wrap in (float, dev):
        m = Model(wrap)
        t = SimpleTrainer(m, itertools.repeat(None), torch.optim.SGD(m.parameters(), lr=0.0))
        reader = Reader()
        t.register_hooks([reader])
        t.train(0, 10)
        runs.append((t.storage.history("acc").values(), reader.seen))
    assert runs[0] == runs[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# torch (2.11 at least) warns once per process, at the first set_sync_debug_mode: this test
# met it whenever it ran before test_train_loop's CUDA sync test, or alone
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
def test_put_scalar_of_a_cuda_tensor_does_not_synchronize():
    x = torch.full((), 0.5, device="cuda")
    with EventStorage(0) as s:
        torch.cuda.set_sync_debug_mode("error")
        try:
            s.put_scalar("a", x * 2)
            s.put_scalars(b=x + 1, c=(x > 0).sum())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert {k: v for k, (v, _) in s.latest().items()} == {"a": 1.0, "b": 1.5, "c": 1.0}
