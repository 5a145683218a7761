"""The loose ends that real detectron2-based repositories rely on, each tested as that code
uses it (after rewriting its imports)."""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pytest
import torch
from hookloop.engine import HookBase, SimpleTrainer, TrainerBase, hooks
from hookloop.solver.param_scheduler import CosineParamScheduler
from hookloop.utils.events import (
    CommonMetricPrinter,
    EventStorage,
    HistoryBuffer,
    JSONWriter,
    get_event_storage,
)


class NoopTrainer(TrainerBase):
    def run_step(self):
        self.storage.put_scalar("loss", 1.0)


# --- storage ----------------------------------------------------------------------------------


def test_early_stopping_hook_sets_storage_private_iter():
    """A hook ending training early (or a loop evaluating saved checkpoints) sets
    ``storage._iter`` before writing; later puts land on that iteration."""
    with EventStorage() as s:
        s._iter = 42
        assert s.iter == 42 and s._iter == 42
        s.put_scalar("acc", 0.5)
        assert s.latest()["acc"] == (0.5, 42)


def test_reading_validation_loss_before_first_evaluation_gives_an_empty_history():
    """``histories()["validation_total_loss"]`` before any evaluation: the storage's own empty
    buffer, as detectron2's defaultdict gives, listed at that place from then on (before names
    put later, after its first put too); the writers see the name only once it is put, and the
    buffer read first is the one that fills."""
    with EventStorage() as s:
        s.put_scalar("loss", 1.0)
        h = s.histories()["validation_total_loss"]
        assert isinstance(h, HistoryBuffer) and len(h) == 0
        s.put_scalar("lr", 0.1, smoothing_hint=False)
        assert list(s.histories()) == ["loss", "validation_total_loss", "lr"]
        assert "validation_total_loss" not in s.latest_with_smoothing_hint()
        assert len(s.history("validation_total_loss")) == 0
        s.put_scalar("validation_total_loss", 0.5)
        assert list(s.histories()) == ["loss", "validation_total_loss", "lr"]
        assert list(s.latest()) == ["loss", "lr", "validation_total_loss"]
        assert h.values() == [(0.5, 0)]


def test_unit_test_injects_a_history_into_the_storage():
    """Repositories' tests assign ``storage.histories()[name] = buf``; later reads see it."""
    with EventStorage(5) as s:
        buf = HistoryBuffer()
        for i, v in enumerate([3.0, 1.0, 2.0]):
            buf.update(v, i)
        s.histories()["val_loss"] = buf
        assert s.history("val_loss").values() == [(3.0, 0), (1.0, 1), (2.0, 2)]
        assert s.latest()["val_loss"] == (2.0, 2)
        assert s.latest_with_smoothing_hint(20)["val_loss"] == (2.0, 2)
        with pytest.raises(TypeError, match="HistoryBuffer"):
            s.histories()["x"] = [1.0]


def test_unit_test_injects_a_history_test_double():
    """A test double with ``values()`` (what detectron2's writers read) is accepted, as
    detectron2 accepts any object there: the storage holds a copy of its pairs."""

    class MockHistory:
        def values(self):
            return [(2.0, 0), (4.0, 1)]

    with EventStorage(1) as s:
        s.put_scalar("time", 1.0)
        s.histories()["time"] = MockHistory()
        s._history["data_time"] = MockHistory()
        assert s.history("time").values() == [(2.0, 0), (4.0, 1)]
        assert s.history("time").median(2) == 3.0
        assert s.history("data_time").global_avg() == 3.0


def test_private_views_real_code_reads():
    with EventStorage() as s:
        s.put_scalar("loss", 1.5)
        s.put_histogram("w", torch.arange(6.0))
        assert "loss" in s._history and s._history["loss"]._data[-1][0] == 1.5
        assert dict(s._history.items())["loss"].latest() == 1.5
        assert s._latest_scalars == {"loss": (1.5, 0)}
        (hist,) = s._histograms
        assert hist["num"] == 6 and isinstance(hist["num"], int)
        assert s._vis_data == []
        # Assigning a filtered copy forgets the names left out (a validation hook's pruning).
        s._latest_scalars = {}
        assert s.latest() == {} and s.histories() == {}


def test_detic_puts_a_single_element_tensor_ratio():
    with EventStorage() as s:
        s.put_scalar("fg_ratio", torch.tensor([0.25]))
        s.put_scalar("nested", torch.tensor([[2.0]]))
        s.put_scalars(count=torch.tensor([3]))
        assert s.latest()["fg_ratio"][0] == 0.25 and s.latest()["nested"][0] == 2.0
        with pytest.raises(TypeError, match=r"'pair'.*shape torch.Size\(\[2\]\)"):
            s.put_scalar("pair", torch.zeros(2))


# --- writers ----------------------------------------------------------------------------------


class EpochPrinter(CommonMetricPrinter):
    """A research repo's printer: its own logger prefix, ETA from _get_eta, and _last_write."""

    def __init__(self, max_iter):
        super().__init__(max_iter)
        self.lines = []
        base = self.logger

        class Capture:
            def info(_, msg):  # noqa: N805
                self.lines.append(msg)
                base.info(msg)

        self.logger = Capture()

    def write(self):
        storage = get_event_storage()
        self.eta = self._get_eta(storage)
        super().write()


def test_printer_subclass_with_its_own_logger_sees_every_line_and_reads_eta():
    p = EpochPrinter(max_iter=100)
    with EventStorage() as s:
        for i in range(3):
            s.iter = i
            s.put_scalar("time", 0.5)
            s.put_scalar("total_loss", 1.0)
            p.write()
    assert len(p.lines) == 3 and all("iter:" in line for line in p.lines)
    assert p.eta == "0:00:48"  # 97 iterations left at 0.5 s
    assert p._last_write is None
    p._last_write = (2, 10.0)
    assert p._last_write == (2, 10.0)
    p._max_iter = 50
    assert p._max_iter == 50


class NotesWriter(JSONWriter):
    """A JSONWriter subclass that writes its own lines through _file_handle and moves
    _last_write."""

    def write(self):
        super().write()
        storage = get_event_storage()
        self._file_handle.write(json.dumps({"note": storage.iter}) + "\n")
        self._file_handle.flush()


def test_json_writer_subclass_writes_own_lines_in_order(tmp_path):
    path = tmp_path / "metrics.json"
    w = NotesWriter(path)
    with EventStorage() as s:
        for i in range(2):
            s.iter = i
            s.put_scalar("loss", float(i), smoothing_hint=False)
            w.write()
        assert w._last_write == 1
        w._last_write = 5
        s.iter = 3
        s.put_scalar("loss", 3.0, smoothing_hint=False)
        w.write()  # 3 <= 5: skipped, as detectron2's rule says
    w.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"iteration": 0, "loss": 0.0},
        {"note": 0},
        {"iteration": 1, "loss": 1.0},
        {"note": 1},
        {"note": 3},
    ]


def test_plain_train_net_reads_metrics_json_right_after_its_loop(tmp_path):
    """detectron2's plain_train_net.py style: writers never closed, file read after the
    storage's block; every line is there."""
    path = tmp_path / "metrics.json"
    writer = JSONWriter(path)
    with EventStorage() as s:
        for i in range(50):
            s.iter = i
            s.put_scalar("loss", float(i), smoothing_hint=False)
            writer.write()
    assert len(path.read_text().splitlines()) == 50
    writer.close()


def test_train_returns_with_every_line_on_disk(tmp_path):
    path = tmp_path / "metrics.json"
    t = NoopTrainer()
    t.register_hooks([hooks.PeriodicWriter([JSONWriter(path)], period=1)])
    t.train(0, 30)
    assert len(path.read_text().splitlines()) == 30


# --- hooks and trainers -----------------------------------------------------------------------


def test_lazyconfig_script_passes_a_param_scheduler_to_lr_scheduler():
    """ViTDet/MViTv2/detrex: ``hooks.LRScheduler(scheduler=<ParamScheduler>)``."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)

    class T(NoopTrainer):
        optimizer = opt

    t = T()
    t.register_hooks([hooks.LRScheduler(scheduler=CosineParamScheduler(1.0, 0.0))])
    t.train(0, 4)
    lrs = [v for v, _ in t.storage.history("lr").values()]
    # LRMultiplier over max_iter=4: the cosine at where = 0, 1/4, 2/4, 3/4.
    assert lrs == pytest.approx([1.0, 0.8535533905932737, 0.5, 0.1464466094067262])


def test_fvcore_style_param_scheduler_is_wrapped_too():
    class Halving:  # fvcore's ParamScheduler protocol, from another package
        def __call__(self, where):
            return 0.5 if where >= 0.5 else 1.0

    ParamScheduler = type("ParamScheduler", (), {"__module__": "fvcore.common.param_scheduler"})
    Fv = type("Fv", (Halving, ParamScheduler), {})
    p = torch.nn.Parameter(torch.zeros(1))

    class T(NoopTrainer):
        optimizer = torch.optim.SGD([p], lr=2.0)

    t = T()
    t.register_hooks([hooks.LRScheduler(scheduler=Fv())])
    t.train(0, 4)
    assert [v for v, _ in t.storage.history("lr").values()] == [2.0, 2.0, 1.0, 1.0]


def test_hook_list_prints_and_copies_like_a_list():
    t = NoopTrainer()
    h = hooks.IterationTimer()
    t.register_hooks([h])
    assert repr(t._hooks) == repr([h]) and t._hooks == [h]
    assert type(copy.copy(t._hooks)) is list and t._hooks[:] == [h]


def test_non_finite_loss_error_formats_the_loss_dict_as_detectron2():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return {"loss_cls": self.w.sum() * float("nan"), "loss_box": self.w.sum()}

    m = Model()
    t = SimpleTrainer(m, iter(lambda: 0, None), torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(FloatingPointError) as info:
        t.train(0, 1)
    # detectron2 formats the dict of numpy means: np.float64(nan) in numpy 2's repr.
    means = {"loss_cls": np.float64("nan"), "loss_box": np.float64(1.0)}
    assert str(info.value) == f"Loss became infinite or NaN at iteration=0!\nloss_dict = {means}"


# --- logging ----------------------------------------------------------------------------------


def test_script_that_silences_detectron2_logger_silences_the_engine(caplog):
    logging.getLogger("detectron2").setLevel(logging.WARNING)
    try:
        with caplog.at_level(logging.INFO):
            NoopTrainer().train(0, 1)
        assert not [r for r in caplog.records if r.name.startswith("hookloop.engine")]
    finally:
        logging.getLogger("detectron2").setLevel(logging.NOTSET)


def test_engine_logger_sits_under_detectron2():
    assert logging.getLogger("hookloop").parent is logging.getLogger("detectron2")


# --- pickling and copies ----------------------------------------------------------------------


def test_deep_copied_hook_list_builds_a_second_trainer():
    first = NoopTrainer()
    first.register_hooks([hooks.IterationTimer(), HookBase()])
    second = NoopTrainer()
    second.register_hooks(copy.deepcopy(first._hooks))
    second.train(0, 5)
    assert len(second.storage.history("time").values()) == 3  # warmup_iter 3: iters 2-4


def test_printer_whose_logger_info_is_patched_sees_every_line():
    """Some repos patch ``printer.logger.info`` to capture the lines."""
    p = CommonMetricPrinter(max_iter=10)
    lines = []
    p.logger.info = lines.append
    try:
        with EventStorage() as s:
            s.put_scalar("total_loss", 1.0)
            p.write()
    finally:
        del p.logger.info
    assert len(lines) == 1 and "total_loss: 1" in lines[0]
