"""PreciseBN, TorchProfiler, AutogradProfiler and TorchMemoryStats, each driven by a short
SimpleTrainer run as detectron2's DefaultTrainer.build_hooks registers them."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hookloop.engine import (
    AutogradProfiler,
    HookBase,
    PreciseBN,
    SimpleTrainer,
    TorchMemoryStats,
    TorchProfiler,
    hooks,
)
from hookloop.utils.events import get_event_storage
from torch import nn

torch.set_num_threads(1)

HOOKS_LOGGER = "hookloop.engine.hooks"
STAGES = ("before_train", "before_step", "after_backward", "after_step", "after_train")


class BNModel(nn.Module):
    def __init__(self, bn=True):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3) if bn else nn.Identity()

    def forward(self, x):
        get_event_storage().put_scalar("forwards", 1.0)
        return {"loss": self.bn(self.fc(x)).pow(2).mean() + self.fc.weight.sum() * 0.01}


class CountingLoader:
    """An endless iterable of distinct batches that counts its iterators and batches."""

    def __init__(self, seed=0, limit=None):
        self.iters = 0
        self.batches = []
        self._seed = seed
        self._limit = limit

    def __iter__(self):
        self.iters += 1
        g = torch.Generator().manual_seed(self._seed)
        n = 0
        while self._limit is None or n < self._limit:
            batch = torch.randn(6, 3, generator=g) * 2 + len(self.batches)
            self.batches.append(batch)
            n += 1
            yield batch


def _trainer(model=None, iters_data=None):
    model = model or BNModel()
    data = iters_data if iters_data is not None else CountingLoader(seed=100)
    return SimpleTrainer(model, data, torch.optim.SGD(model.parameters(), lr=0.01))


def _overridden(hook):
    return {s for s in STAGES if getattr(type(hook), s) is not getattr(HookBase, s)}


def _hook_messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == HOOKS_LOGGER]


def test_new_hooks_are_exported():
    for name in ("PreciseBN", "TorchProfiler", "AutogradProfiler", "TorchMemoryStats"):
        assert name in hooks.__all__
        assert getattr(hooks, name).__module__ == "hookloop.engine.hooks"


# ----------------------------------------------------------------------------------------------
# PreciseBN


def test_precise_bn_runs_every_period_and_at_the_end_reusing_one_iterator():
    trainer = _trainer()
    loader = CountingLoader(seed=1)
    hook = PreciseBN(3, trainer.model, loader, num_iter=2)
    assert _overridden(hook) == {"after_step"}
    trainer.register_hooks([hook])
    trainer.train(0, 7)  # runs after iterations 2, 5 and 6 (the last)
    assert loader.iters == 1
    assert len(loader.batches) == 6
    # The final statistics are the population mean and variance of the last run's batches
    # (fvcore's estimate), with the final weights.
    bn = trainer.model.bn
    with torch.no_grad():
        feats = torch.cat([trainer.model.fc(b) for b in loader.batches[-2:]])
    mean = feats.mean(0)
    var = feats.var(0, unbiased=False)
    torch.testing.assert_close(bn.running_mean, mean)
    torch.testing.assert_close(bn.running_var, var)
    assert bn.momentum == 0.1
    # What the model puts during precise BN goes to a throwaway storage.
    assert len(trainer.storage.history("forwards")) == 7


def test_precise_bn_period_zero_runs_only_at_the_end():
    trainer = _trainer()
    loader = CountingLoader(seed=2)
    trainer.register_hooks([PreciseBN(0, trainer.model, loader, num_iter=3)])
    trainer.train(0, 5)
    assert len(loader.batches) == 3


def test_precise_bn_without_training_bn_is_disabled_with_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    trainer = _trainer(BNModel(bn=False))
    loader = CountingLoader()
    trainer.register_hooks([PreciseBN(1, trainer.model, loader, num_iter=2)])
    trainer.train(0, 3)
    assert loader.iters == 0
    assert [m for m in _hook_messages(caplog) if "PreciseBN" in m] == [
        "PreciseBN is disabled because model does not contain BN layers in training mode."
    ]


def test_precise_bn_loader_running_out_stops_training():
    trainer = _trainer()
    trainer.register_hooks([PreciseBN(2, trainer.model, CountingLoader(limit=3), num_iter=2)])
    # detectron2's generator calls next() on the spent iterator: Python's RuntimeError.
    with pytest.raises(RuntimeError, match="^generator raised StopIteration$"):
        trainer.train(0, 4)  # the second run (after iteration 3) gets one batch
    assert trainer.iter == 3


@pytest.mark.parametrize(
    "args,error,match",
    [
        (("2", "model", [], 1), TypeError, "period"),
        ((2, "model", [], 1), TypeError, "model"),
        ((2, "model_ok", 5, 1), TypeError, "data_loader"),
        ((2, "model_ok", [], 0), ValueError, "num_iter"),
        ((2, "model_ok", [], 1.5), TypeError, "num_iter"),
    ],
)
def test_precise_bn_rejects_bad_arguments(args, error, match):
    args = tuple(BNModel() if a == "model_ok" else a for a in args)
    with pytest.raises(error, match=match):
        PreciseBN(*args)


# ----------------------------------------------------------------------------------------------
# TorchProfiler, AutogradProfiler


def test_torch_profiler_writes_a_tensorboard_trace_for_enabled_steps(tmp_path):
    calls = []

    def predicate(trainer):
        calls.append(trainer.iter)
        return trainer.iter == 1

    hook = TorchProfiler(predicate, tmp_path, activities=[torch.profiler.ProfilerActivity.CPU])
    assert _overridden(hook) == {"before_step", "after_step", "after_train"}
    trainer = _trainer()
    trainer.register_hooks([hook])
    trainer.train(0, 3)
    assert calls == [0, 1, 2]
    (trace,) = (tmp_path / "log" / "profiler-tensorboard-iter1").glob("worker0*.pt.trace.json")
    assert "traceEvents" in json.loads(trace.read_text())
    assert not list(tmp_path.glob("profiler-trace-*.json"))


def test_torch_profiler_chrome_trace_without_tensorboard(tmp_path):
    out = tmp_path / "prof"
    hook = TorchProfiler(lambda t: t.iter == 0, str(out), save_tensorboard=False)
    trainer = _trainer()
    trainer.register_hooks([hook])
    trainer.train(0, 2)
    assert [p.name for p in out.iterdir()] == ["profiler-trace-iter0.json"]
    assert "traceEvents" in json.loads((out / "profiler-trace-iter0.json").read_text())


def test_torch_profiler_stops_when_a_profiled_step_raises(tmp_path):
    class Boom(HookBase):
        def after_backward(self):
            raise RuntimeError("boom")

    trainer = _trainer()
    hook = TorchProfiler(lambda t: True, tmp_path, save_tensorboard=False)
    trainer.register_hooks([hook, Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train(0, 2)
    assert hook._profiler is None
    # No profiler is left running: another one can start.
    with torch.profiler.profile():
        pass


def test_autograd_profiler_profiles_the_cpu_without_cuda(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    with pytest.warns(DeprecationWarning, match="TorchProfiler"):
        hook = AutogradProfiler(lambda t: t.iter == 1, tmp_path, use_cuda=True)
    if not torch.cuda.is_available():
        assert "AutogradProfiler: CUDA is not available; profiling the CPU only." in (
            _hook_messages(caplog)
        )
    trainer = _trainer()
    trainer.register_hooks([hook])
    trainer.train(0, 2)
    assert "traceEvents" in json.loads((tmp_path / "profiler-trace-iter1.json").read_text())


def test_profilers_reject_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="enable_predicate"):
        TorchProfiler(True, tmp_path)
    with pytest.raises(TypeError, match="output_dir"):
        TorchProfiler(lambda t: True, 3)
    with pytest.raises(TypeError, match="activities"):
        TorchProfiler(lambda t: True, tmp_path, activities=1)
    with pytest.raises(TypeError, match="enable_predicate"), pytest.warns(DeprecationWarning):
        AutogradProfiler(None, tmp_path)


# ----------------------------------------------------------------------------------------------
# TorchMemoryStats


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_torch_memory_stats_without_cuda_logs_once(caplog):
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    hook = TorchMemoryStats(period=2, max_runs=3)
    assert _overridden(hook) == {"after_step"}
    trainer = _trainer()
    trainer.register_hooks([hook])
    trainer.train(0, 7)
    assert _hook_messages(caplog) == [
        "TorchMemoryStats: CUDA is not available; no memory statistics are logged."
    ]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_memory_stats_logs_max_runs_times_then_the_summary(caplog):
    caplog.set_level(logging.INFO, logger=HOOKS_LOGGER)
    trainer = _trainer()
    trainer.register_hooks([TorchMemoryStats(period=2, max_runs=2)])
    trainer.train(0, 9)
    messages = _hook_messages(caplog)
    assert [m.split("max_reserved_mem")[0] for m in messages[:2]] == [" iter: 1  ", " iter: 3  "]
    assert len(messages) == 3 and messages[2].startswith("\n")


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"period": 0}, ValueError),
        ({"period": 2.0}, TypeError),
        ({"max_runs": -1}, ValueError),
        ({"max_runs": None}, TypeError),
    ],
)
def test_torch_memory_stats_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        TorchMemoryStats(**kwargs)


def test_precise_bn_negative_period_is_refused_like_eval_hooks():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    with pytest.raises(ValueError, match="PreciseBN period must be >= 0, got -1"):
        PreciseBN(-1, model, [torch.zeros(4, 2)], num_iter=1)
