"""A non-finite loss stops the run before any checkpoint holds the weights it made (issue 42).

Losses are read in batches (the storage's pending queue), so a NaN is seen up to 20 iterations
after it happened. Every save a trainer's hooks make reads what waits first (periodic, final,
stop, best: ``engine.metrics.settle_before_save``); a NaN read on another thread is raised on
the training thread, naming its iteration; and a loss that can change after its step (an
``nn.Parameter`` in the loss dict) is logged with the value of its step, as in detectron2.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import threading

import pytest
import torch
from compat import d2
from hookloop.checkpoint import Checkpointer
from hookloop.engine import (
    BestCheckpointer,
    EarlyStopping,
    EvalHook,
    HookBase,
    PeriodicCheckpointer,
    PreemptionHandler,
    SimpleTrainer,
)
from torch import nn

torch.set_num_threads(1)

WAIT = 30  # seconds: a bound on every wait between threads, never reached when all is well


class NanAt(nn.Module):
    """A one-weight model whose loss is NaN at iteration ``nan_at`` (and, its weight then NaN,
    at every iteration after it); ``on_step(iteration)`` runs at each forward."""

    def __init__(self, nan_at, on_step=None):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.nan_at = nan_at
        self.on_step = on_step
        self.calls = 0

    def forward(self, x):
        it = self.calls
        self.calls += 1
        if self.on_step is not None:
            self.on_step(it)
        loss = (self.w * x).sum() ** 2
        return {"loss": loss * float("nan") if it == self.nan_at else loss}


def nan_trainer(nan_at, on_step=None):
    model = NanAt(nan_at, on_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return SimpleTrainer(model, itertools.repeat(torch.ones(1)), opt)


def pth(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".pth"))


def last_checkpoint(d):
    with open(os.path.join(d, "last_checkpoint")) as f:
        return f.read().strip()


@pytest.mark.parametrize("with_trainer", [False, True])
def test_a_nan_stops_the_run_at_the_settle_before_the_next_periodic_save(tmp_path, with_trainer):
    trainer = nan_trainer(7)
    extra = {"trainer": trainer} if with_trainer else {}
    ckpt = Checkpointer(trainer.model, str(tmp_path), optimizer=trainer.optimizer, **extra)
    trainer.register_hooks([PeriodicCheckpointer(ckpt, 5, max_to_keep=2)])
    with pytest.raises(FloatingPointError, match=r"iteration=7!"):
        trainer.train(0, 30)
    assert trainer.iter == 9  # the save at 9 read the losses first
    assert pth(tmp_path) == ["model_0000004.pth"]
    assert last_checkpoint(tmp_path) == "model_0000004.pth"


def test_a_nan_read_at_the_end_of_training_refuses_the_best_model(tmp_path):
    """The last losses are read at after_train, before the hooks' after_train: the evaluation
    after training still runs, but BestCheckpointer does not save the NaN weights."""
    trainer = nan_trainer(8)
    ckpt = Checkpointer(trainer.model, str(tmp_path))
    trainer.register_hooks(
        [EvalHook(0, lambda: {"acc": 0.5}), BestCheckpointer(0, ckpt, "acc", mode="max")]
    )
    with pytest.raises(FloatingPointError, match=r"iteration=8!"):
        trainer.train(0, 10)
    assert pth(tmp_path) == []


def test_a_nan_before_a_preemption_refuses_the_stop_checkpoint(tmp_path):
    """A signal at iteration 8 stops the run after it, and the stop is checkpointed in
    after_train: with a NaN at 7 (read only at after_train) the run raises it instead, and the
    good file stays."""
    trainer = nan_trainer(7, lambda it: it == 8 and signal.raise_signal(signal.SIGUSR1))
    ckpt = Checkpointer(trainer.model, str(tmp_path), optimizer=trainer.optimizer)
    handler = PreemptionHandler(signals=(signal.SIGUSR1,))
    trainer.register_hooks([PeriodicCheckpointer(ckpt, 5, max_to_keep=1), handler])
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(FloatingPointError, match=r"iteration=7!"):
        trainer.train(0, 30)
    assert handler.signum == signal.SIGUSR1 and trainer.iter == 8
    assert signal.getsignal(signal.SIGUSR1) == before
    assert pth(tmp_path) == ["model_0000004.pth"]
    assert last_checkpoint(tmp_path) == "model_0000004.pth"


def test_a_nan_before_an_early_stop_refuses_the_stop_checkpoint(tmp_path):
    trainer = nan_trainer(7)

    class PutsAcc(HookBase):
        def after_step(self):
            if self.trainer.iter in (6, 8):
                self.trainer.storage.put_scalar("acc", 1.0 if self.trainer.iter == 6 else 0.5)

    ckpt = Checkpointer(trainer.model, str(tmp_path), optimizer=trainer.optimizer)
    trainer.register_hooks(
        [PutsAcc(), EarlyStopping("acc", patience=1), PeriodicCheckpointer(ckpt, 5, max_to_keep=1)]
    )
    with pytest.raises(FloatingPointError, match=r"iteration=7!"):
        trainer.train(0, 30)
    assert pth(tmp_path) == ["model_0000004.pth"]
    assert last_checkpoint(tmp_path) == "model_0000004.pth"


class _Poller:
    """A dashboard thread that reads ``storage.latest()`` once, while the training thread
    waits in ``after_step`` of iteration ``at`` (every wait bounded by WAIT): ``hook`` to
    register, ``seen`` its result (``"latest"`` or ``"error"``)."""

    def __init__(self, trainer, at):
        go, polled = threading.Event(), threading.Event()
        self.seen = {}

        class Poll(HookBase):
            def after_step(self):
                if self.trainer.iter == at:
                    go.set()
                    assert polled.wait(WAIT)

        def poll():
            try:
                if go.wait(WAIT):
                    self.seen["latest"] = trainer.storage.latest()
            except BaseException as e:  # noqa: BLE001 - what the poller got is the result
                self.seen["error"] = e
            finally:
                polled.set()

        self.hook, self._go = Poll(), go
        self._thread = threading.Thread(target=poll)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._go.set()
        self._thread.join(WAIT)


def test_a_nan_read_by_a_polling_thread_is_raised_by_the_training_thread(tmp_path, caplog):
    """A dashboard thread reads storage.latest() at iteration 32, which reads the losses of
    20..32 (NaN at 30): it gets the finite values (up to 29) and no error; the training thread
    raises the error at its next step, naming iteration 30, and logs it there; no checkpoint
    is saved after it."""
    trainer = nan_trainer(30)
    ckpt = Checkpointer(trainer.model, str(tmp_path), optimizer=trainer.optimizer)
    with _Poller(trainer, 32) as poller:
        trainer.register_hooks([poller.hook, PeriodicCheckpointer(ckpt, 5, max_to_keep=2)])
        with (
            caplog.at_level(logging.ERROR),
            pytest.raises(FloatingPointError, match=r"iteration=30!"),
        ):
            trainer.train(0, 60)
    seen = poller.seen
    assert "error" not in seen, seen.get("error")
    assert seen["latest"]["total_loss"][1] == 29
    assert trainer.iter == 33  # the next step's record raised it, before its optimizer step
    failed = [r for r in caplog.records if "Exception in writing metrics" in r.getMessage()]
    assert [r.threadName for r in failed] == [threading.current_thread().name]
    assert pth(tmp_path) == ["model_0000024.pth", "model_0000029.pth"]
    assert last_checkpoint(tmp_path) == "model_0000029.pth"


def test_a_nan_kept_for_the_training_thread_refuses_a_save_before_its_next_step(tmp_path):
    """A poller that reads the NaN in the very iteration of a save: the save's read raises it
    on the training thread."""
    trainer = nan_trainer(7)
    ckpt = Checkpointer(trainer.model, str(tmp_path), optimizer=trainer.optimizer)
    with _Poller(trainer, 9) as poller:
        trainer.register_hooks([poller.hook, PeriodicCheckpointer(ckpt, 5, max_to_keep=2)])
        with pytest.raises(FloatingPointError, match=r"iteration=7!"):
            trainer.train(0, 30)
    seen = poller.seen
    assert "error" not in seen, seen.get("error")
    assert seen["latest"]["total_loss"][1] == 6
    assert trainer.iter == 9
    assert pth(tmp_path) == ["model_0000004.pth"]


class ParameterLoss(nn.Module):
    """A model whose loss dict holds an ``nn.Parameter`` (a learned loss weight), which every
    optimizer step changes in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(2, 1)
        self.scale = nn.Parameter(torch.tensor(0.59))

    def forward(self, x):
        return {"loss_fit": self.linear(x).pow(2).mean(), "loss_scale": self.scale}


def test_a_parameter_in_the_loss_dict_is_logged_with_the_value_of_its_iteration(tmp_path):
    """Its value at each iteration, as the reference engine (detectron2's, which reads every
    loss at its step) logs it, in the storage and in metrics.json."""
    x = torch.tensor([[0.5, -1.0]])
    logs = {}
    for name, engine in (("hookloop", None), ("detectron2", d2)):
        model = ParameterLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        out = tmp_path / name
        out.mkdir()
        if engine is None:
            from hookloop.engine import PeriodicWriter
            from hookloop.utils.events import JSONWriter

            trainer = SimpleTrainer(model, itertools.repeat(x), opt)
            trainer.register_hooks([PeriodicWriter([JSONWriter(str(out / "m.json"), 1)], 10)])
        else:
            trainer = d2.SimpleTrainer(model, itertools.repeat(x), opt)
            trainer.register_hooks([d2.PeriodicWriter([d2.JSONWriter(str(out / "m.json"), 1)], 10)])
        trainer.train(0, 30)
        history = {k: trainer.storage.history(k).values() for k in ("loss_scale", "total_loss")}
        with open(out / "m.json") as f:
            lines = [json.loads(line) for line in f]
        logs[name] = (history, [(r["iteration"], r["loss_scale"]) for r in lines])
    assert logs["hookloop"] == logs["detectron2"]
    values = [v for v, _ in logs["hookloop"][0]["loss_scale"]]
    assert values[0] == pytest.approx(0.59) and values[-1] == pytest.approx(0.59 - 0.29)
