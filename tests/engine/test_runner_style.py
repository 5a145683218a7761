"""The runner-style hook list of xmodaler / cvpods, end to end on hookloop.

Those codebases build their hooks as ``OptimizationHook`` (which owns backward and the
optimizer step, with gradient accumulation), ``LRScheduler``, ``IterationTimer``,
``PreciseBN``, an epoch-aware ``PeriodicCheckpointer``, ``EvalHook``, a save-best hook, a
``PeriodicWriter`` every log window and a writer of every step; their trainer's ``run_step``
runs only the forward and leaves the loss in ``trainer.step_outputs["loss_for_backward"]``, and
counts epochs over a finite loader. Two such trainers, one on ``TrainerBase`` (xmodaler's
kind, its epoch from the iteration) and one subclassing ``SimpleTrainer`` (cvpods' kind, the
trainer's own epochs), are each checked against a hand-written loop.
"""

from __future__ import annotations

import itertools
import json
import logging
import time

import pytest
import torch
from hookloop.checkpoint import Checkpointer
from hookloop.engine import SimpleTrainer, TrainerBase, hooks
from hookloop.solver import LRMultiplier, WarmupParamScheduler
from hookloop.solver.param_scheduler import CosineParamScheduler
from hookloop.utils.events import CommonMetricPrinter, JSONWriter
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)

BATCH, SAMPLES, EPOCHS, ACCUMULATE, WINDOW = 4, 40, 3, 2, 5
ITERS_PER_EPOCH = SAMPLES // BATCH
MAX_ITER = EPOCHS * ITERS_PER_EPOCH
EVAL_PERIOD = CHECKPOINT_PERIOD = ITERS_PER_EPOCH  # once an epoch


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def _loader(dataset):
    # A seeded sampler whose order changes with set_epoch(), as DistributedSampler's does.
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _losses(model, batch):
    x, y = batch
    return {"loss_mse": nn.functional.mse_loss(model(x), y)}


def _optimizer_and_schedule(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = WarmupParamScheduler(CosineParamScheduler(1.0, 0.0), 0.1, 4 / MAX_ITER)
    return optimizer, LRMultiplier(optimizer, schedule, MAX_ITER)


class Runner(TrainerBase):
    """xmodaler / cvpods style: the epoch comes from the iteration over a finite loader, and
    ``run_step`` runs only the forward."""

    def __init__(self, model, data_loader, optimizer, scheduler):
        super().__init__()
        model.train()
        self.model, self.data_loader = model, data_loader
        self.optimizer, self.scheduler = optimizer, scheduler
        self.iters_per_epoch = len(data_loader)
        self.epoch = 0
        self.step_outputs = {}
        self._data_iter = None

    def run_step(self):
        epoch = self.iter // self.iters_per_epoch
        if self._data_iter is None or epoch != self.epoch:
            self.epoch = epoch
            self.data_loader.sampler.set_epoch(epoch)
            self._data_iter = iter(self.data_loader)
        start = time.perf_counter()
        batch = next(self._data_iter)
        data_time = time.perf_counter() - start
        losses = _losses(self.model, batch)
        SimpleTrainer.write_metrics(losses, data_time, self.iter)
        self.step_outputs = {"loss_for_backward": sum(losses.values())}


class SimpleRunner(SimpleTrainer):
    """cvpods style: a SimpleTrainer subclass whose ``run_step`` runs only the forward; the
    trainer's own epochs (the next pass over the finite loader, ``set_epoch``)."""

    def __init__(self, model, data_loader, optimizer, scheduler):
        super().__init__(model, data_loader, optimizer)
        self.scheduler = scheduler
        self.step_outputs = {}

    def run_step(self):
        start = time.perf_counter()
        try:
            batch = next(self._data_loader_iter)
        except StopIteration:
            # the cursor of SimpleTrainer: epoch += 1, set_epoch, a new pass
            batch = self._hookloop.data.next_epoch(self)
        data_time = time.perf_counter() - start
        losses = _losses(self.model, batch)
        self.write_metrics(losses, data_time, self.iter)
        self.step_outputs = {"loss_for_backward": sum(losses.values())}


RUNNERS = {"TrainerBase": Runner, "SimpleTrainer": SimpleRunner}


def _hand_written_loop():
    """The same training without hooks: accumulate 2, step, zero, schedule; per iteration the
    loss; and every weight update exactly as the hooks should make it."""
    model = _model()
    optimizer, scheduler = _optimizer_and_schedule(model)
    loader = _loader(_data())
    losses = []
    it = 0
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            loss = _losses(model, batch)["loss_mse"]
            losses.append(loss.item())
            (loss / ACCUMULATE).backward()
            if (it + 1) % ACCUMULATE == 0 or it == MAX_ITER - 1:
                optimizer.step()
                optimizer.zero_grad()
            scheduler.step()
            it += 1
    return model, losses


@pytest.fixture(params=list(RUNNERS))
def run(request, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hookloop")
    dataset = _data()
    model = _model()
    optimizer, scheduler = _optimizer_and_schedule(model)
    trainer = RUNNERS[request.param](model, _loader(dataset), optimizer, scheduler)
    checkpointer = Checkpointer(model, str(tmp_path), trainer=trainer)

    evals = []  # (iteration, val loss, the weights evaluated)

    def evaluate():
        model.eval()
        with torch.no_grad():
            x, y = dataset.tensors
            val = nn.functional.mse_loss(model(x), y).item()
        model.train()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        evals.append((trainer.iter, val, state))
        return {"val": {"loss": val}}

    precise_batches = [dataset.tensors[0][i : i + 8] for i in range(0, 32, 8)]  # 4 batches
    # PreciseBN draws from one iterator across its runs (detectron2's): an endless one.
    precise_loader = itertools.cycle(precise_batches)
    trainer.register_hooks(
        [
            hooks.OptimizationHook(accumulate_grad_steps=ACCUMULATE),
            hooks.LRScheduler(optimizer, scheduler),
            hooks.IterationTimer(),
            hooks.PreciseBN(EVAL_PERIOD, model, precise_loader, len(precise_batches)),
            hooks.PeriodicCheckpointer(checkpointer, CHECKPOINT_PERIOD, max_to_keep=2),
            hooks.EvalHook(EVAL_PERIOD, evaluate),
            hooks.BestCheckpointer(EVAL_PERIOD, checkpointer, "val/loss", mode="min"),
            hooks.PeriodicWriter(
                [
                    CommonMetricPrinter(MAX_ITER, window_size=WINDOW),
                    JSONWriter(str(tmp_path / "metrics.json"), window_size=WINDOW),
                ],
                period=WINDOW,
            ),
            hooks.PeriodicWriter([JSONWriter(str(tmp_path / "steps.json"), window_size=1)], 1),
        ]
    )
    trainer.train(0, MAX_ITER)
    return trainer, model, precise_batches, evals, tmp_path, caplog


def _json_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_weights_equal_a_hand_written_accumulate_2_loop(run):
    trainer, model, _, _, out, _ = run
    expected, losses = _hand_written_loop()
    assert trainer.iter == MAX_ITER and trainer.epoch == EPOCHS - 1
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        assert torch.equal(got, want), name
    # The every-step writer saw each iteration's loss, as the hand-written loop computed it.
    steps = _json_lines(out / "steps.json")
    assert [s["iteration"] for s in steps] == [*range(MAX_ITER), MAX_ITER]
    assert [s["total_loss"] for s in steps[:MAX_ITER]] == pytest.approx(losses, rel=1e-6)
    # The schedule: warmup, then cosine, one value per iteration; the last is put at 29.
    assert steps[0]["lr"] == pytest.approx(0.005) and steps[MAX_ITER - 1]["lr"] < 0.005


def test_checkpoints_are_named_by_epoch_and_the_final_one_resumes(run):
    trainer, model, _, _, out, _ = run
    # Once an epoch, at its last iteration; max_to_keep=2 deleted epoch 0's.
    assert sorted(p.name for p in out.glob("*.pth")) == [
        "model_Epoch_00001_Iter_0000019.pth",
        "model_Epoch_00002_Iter_0000029.pth",
        "model_best.pth",
        "model_final.pth",
    ]
    assert (out / "last_checkpoint").read_text() == "model_final.pth"
    saved = torch.load(out / "model_Epoch_00001_Iter_0000019.pth", weights_only=False)
    assert saved["trainer"]["iteration"] == 19
    # A new runner resumes from last_checkpoint at the end of the run.
    again = type(trainer)(_model(), _loader(_data()), *_optimizer_and_schedule(_model()))
    resumed = Checkpointer(again.model, str(out), trainer=again)
    resumed.resume_or_load("", resume=True)
    assert again.iter == MAX_ITER - 1
    for (name, got), want in zip(again.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name


def test_metrics_json_has_a_line_per_window_and_the_evaluations(run):
    _, _, _, evals, out, caplog = run
    lines = _json_lines(out / "metrics.json")
    # Every window (5 iterations) and, after training, the final evaluation (at max_iter).
    assert [x["iteration"] for x in lines] == [4, 9, 14, 19, 24, 29, 30]
    by_iter = {x["iteration"]: x for x in lines}
    # The evaluations once an epoch, put at their iteration; the last one after training.
    assert [it for it, _, _ in evals] == [9, 19, MAX_ITER]
    for it, val, _ in evals:
        assert by_iter[it]["val/loss"] == pytest.approx(val)
    assert set(lines[-1]) == {"iteration", "val/loss"}
    for x in lines[:-1]:
        assert {"total_loss", "lr", "time", "data_time"} <= set(x)  # one loss: total only
    # The printer's lines show the runner's epoch.
    setup = caplog.get_records("setup")  # the run is the fixture's
    printed = [r.getMessage() for r in setup if r.name == "hookloop.utils.events"]
    epochs = [line.split("epoch: ")[1].split()[0] for line in printed]
    assert epochs == ["1/3", "1/3", "2/3", "2/3", "3/3", "3/3"]


def test_best_checkpoint_holds_the_best_evaluated_weights(run):
    _, _, _, evals, out, _ = run
    best_iter, best_val, best_state = min(evals, key=lambda e: e[1])
    best = torch.load(out / "model_best.pth", weights_only=False)
    assert best["iteration"] == best_iter
    for k, v in best["model"].items():
        assert torch.equal(v, best_state[k]), k
    # Saving the best model does not move last_checkpoint.
    assert (out / "last_checkpoint").read_text() == "model_final.pth"
    assert best_val == min(v for _, v, _ in evals)


def test_precise_bn_made_the_running_stats_true_averages(run):
    _, model, batches, _, _, _ = run
    bn = model[1]
    with torch.no_grad():
        features = torch.cat([model[0](b) for b in batches])  # the final weights: BN ran last at 29
    # fvcore's estimate: the population mean and variance of all the batches' samples.
    mean = features.mean(0)
    var = features.var(0, unbiased=False)
    torch.testing.assert_close(bn.running_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, var, rtol=1e-5, atol=1e-6)
