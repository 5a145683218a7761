"""CUDAGraphTrainer: the whole step behind the capture seam.

The CPU tests run the seam's eager implementation (``graph="eager"``): the static batch, the
device step counter, the LR table, the loss ring buffer and its reads by the storage, hooks,
writers, checkpoints and resume, compared with SimpleTrainer on the same seed and data. The
CUDA tests (marked, skipped without a device) check the capture itself."""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from hookloop._core import PENDING_READ_EVERY
from hookloop.engine import CUDAGraphTrainer, DefaultTrainer, SimpleTrainer, TrainConfig, hooks
from hookloop.engine import graph as graph_module
from hookloop.engine.graph import EagerStepGraph
from hookloop.engine.graph import guard as graph_guard
from hookloop.engine.graph import seam as graph_seam
from hookloop.engine.train_loop import HookBase
from hookloop.solver.lr_scheduler import WarmupParamScheduler
from hookloop.solver.param_scheduler import CosineParamScheduler, MultiStepParamScheduler
from hookloop.utils.events import JSONWriter
from torch import nn

HAS_CUDA = torch.cuda.is_available()
TIMING = {"time", "data_time", "rank_data_time", "eta_seconds"}
MAX_ITER = 60


class Net(nn.Module):
    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8) if bn else nn.Identity())
        self.head = nn.Linear(8, 1)

    def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
        x, y = batch
        out = self.head(torch.relu(self.body(x)))
        return {"loss_mse": ((out - y) ** 2).mean(), "loss_l1": 0.1 * (out - y).abs().mean()}


def batches(n: int = 12, size: int = 16, seed: int = 1) -> List[Any]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(size, 4, generator=g)
        out.append((x, x.sum(1, keepdim=True)))
    return out


def build(
    cls: type,
    out: Optional[Path] = None,
    *,
    data: Optional[List[Any]] = None,
    optim: str = "sgd",
    schedule: str = "cosine",
    bn: bool = False,
    extra_hooks: Optional[List[HookBase]] = None,
    period: int = 5,
    net: type = Net,
    head_later: bool = False,
    **kw: Any,
) -> Any:
    """``head_later``: the head frozen and outside the optimizer (for :class:`AddHead`)."""
    torch.manual_seed(0)
    model = net(bn)
    trained = frozen_head(model) if head_later else model.parameters()
    if optim in ("sgd", "fused"):
        fused = {"fused": True} if optim == "fused" else {}
        opt: torch.optim.Optimizer = torch.optim.SGD(trained, lr=0.1, momentum=0.9, **fused)
    else:
        opt = torch.optim.Adam(trained, lr=0.01)
    if cls is CUDAGraphTrainer:
        kw.setdefault("graph", "eager")
    trainer = cls(model, batches() if data is None else data, opt, **kw)
    sched: Any
    if schedule == "cosine":
        sched = WarmupParamScheduler(CosineParamScheduler(1, 0), 0.01, 0.1)
    elif schedule == "multistep":
        sched = MultiStepParamScheduler([1, 0.1, 0.01], milestones=[20, 40], num_updates=MAX_ITER)
    else:  # a torch scheduler
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15, 35], gamma=0.5)
    trainer.scheduler = sched
    hs: List[Optional[HookBase]] = [hooks.IterationTimer(), hooks.LRScheduler(opt, sched)]
    hs += extra_hooks or []
    if out is not None:
        hs.append(hooks.PeriodicWriter([JSONWriter(str(out / "metrics.json"))], period=period))
    trainer.register_hooks(hs)
    return trainer


def frozen_head(model: nn.Module) -> List[nn.Parameter]:
    """Freezes the model's head: the parameters to train first (the body's)."""
    for p in model.head.parameters():
        p.requires_grad_(False)
    return list(model.body.parameters())


class AddHead(HookBase):
    """Gradual unfreezing: after iteration ``at``, the head (frozen, outside the optimizer)
    trains, in a param group of its own with its own LR."""

    def __init__(self, at: int = 9) -> None:
        self.at = at

    def after_step(self) -> None:
        if self.trainer.iter == self.at:
            head = list(self.trainer.model.head.parameters())
            for p in head:
                p.requires_grad_(True)
            self.trainer.optimizer.add_param_group({"params": head, "lr": 0.05})


class ResetState(HookBase):
    """Changes the optimizer's state between steps: clears it after iteration 9, gives the
    first layer's weight a new state after 19 (zeros), replaces one of the head weight's
    state tensors after 29 (halved); from 31 on, gives the head weight a new dict holding the
    same tensors at every step (no change to what a replay updates)."""

    def after_step(self) -> None:
        it, opt, model = self.trainer.iter, self.trainer.optimizer, self.trainer.model
        if it == 9:
            opt.state.clear()
        elif it == 19:
            w = model.body[0].weight
            opt.state[w] = {k: torch.zeros_like(v) for k, v in opt.state[w].items()}
        elif it == 29:
            s = opt.state[model.head.weight]
            for key in [k for k in s if k != "step"][:1]:  # none where a replay kept it empty
                s[key] = s[key] * 0.5
        elif it >= 31:
            opt.state[model.head.weight] = dict(opt.state[model.head.weight])


BIG_COUNT = 2**24 + 1  # float32 holds 2**24 and 2**24 + 2, not this


class WithCount(Net):
    """Net whose loss dict also holds an int64 count float32 cannot hold exactly."""

    def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
        out = super().forward(batch)
        out["loss_count"] = torch.full((), BIG_COUNT, dtype=torch.int64, device=batch[0].device)
        return out


def two_dirs(tmp_path: Path) -> None:
    """The output folders of the two runs a test compares: tmp_path/a and tmp_path/b."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()


def metrics(out: Path) -> List[Dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def assert_same_metrics(a: Path, b: Path, rel: float = 1e-6) -> None:
    ra, rb = metrics(a), metrics(b)
    assert [r["iteration"] for r in ra] == [r["iteration"] for r in rb]
    assert len(ra) > 1
    for x, y in zip(ra, rb):
        assert sorted(x) == sorted(y)
        assert x["lr"] == y["lr"]  # the host's LR, stepped as the eager trainer steps it
        for k in x:
            assert y[k] == pytest.approx(x[k], rel=rel, abs=1e-9), (x["iteration"], k)


class GradNorm(HookBase):
    """Puts the norm of the gradients the step left in ``.grad`` (a device scalar: no sync)."""

    def after_step(self) -> None:
        norms = [p.grad.norm() for p in self.trainer.model.parameters() if p.grad is not None]
        self.trainer.storage.put_scalar("grad_norm", torch.stack(norms).norm())


def params(model: nn.Module) -> List[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


# ----------------------------------------------------------------------------------------------
# Same results as the eager trainer


@pytest.mark.parametrize("schedule", ["cosine", "multistep", "torch"])
def test_metrics_json_and_weights_equal_simple_trainers(tmp_path, schedule):
    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", schedule=schedule)
    eager.train(0, MAX_ITER)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", schedule=schedule)
    graphed.train(0, MAX_ITER)
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    # SGD reads the tensor LR as its float32 scalar: the same arithmetic, the same weights.
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    step = graphed._hookloop.graph
    # The device table held every LR the host's schedulers produced: no row was rewritten.
    assert step.rows_rewritten == 0
    assert [s.warmups for s in step.shapes] == [3] and step.captured
    assert int(step.counter) == MAX_ITER


def test_adam_with_the_lr_tensor_matches_within_float32_rounding(tmp_path):
    two_dirs(tmp_path)
    build(SimpleTrainer, tmp_path / "a", optim="adam").train(0, MAX_ITER)
    build(CUDAGraphTrainer, tmp_path / "b", optim="adam").train(0, MAX_ITER)
    assert_same_metrics(tmp_path / "a", tmp_path / "b", rel=1e-4)


def test_bfloat16_autocast_matches_amp_trainer(tmp_path):
    from hookloop.engine import AMPTrainer

    two_dirs(tmp_path)
    build(AMPTrainer, tmp_path / "a", precision=torch.bfloat16).train(0, 20)
    build(CUDAGraphTrainer, tmp_path / "b", precision=torch.bfloat16).train(0, 20)
    assert_same_metrics(tmp_path / "a", tmp_path / "b", rel=1e-2)


def test_losses_reach_the_storage_from_the_ring_buffer_at_their_iterations():
    trainer = build(CUDAGraphTrainer)
    trainer.train(0, 50)
    step = trainer._hookloop.graph
    ring_size = step.ring.shape[0]
    assert ring_size == 2 * PENDING_READ_EVERY
    # One dict of views per slot, made once: a step hands over views[iter % R].
    assert step.losses_at(3) is step.losses_at(3 + ring_size)
    assert step.losses_at(3)["loss_mse"].data_ptr() == step.ring[3, 0].data_ptr()
    assert step.ring.dtype == torch.float32  # float32 losses: float32 holds them exactly
    history = trainer.storage.history("loss_mse").values()
    assert [it for _, it in history] == list(range(50))
    # The last R iterations are still in the ring: the storage read these values.
    for value, it in history[-ring_size:]:
        assert value == float(step.ring[it % ring_size, 0])


def test_an_int64_loss_above_2_24_is_logged_exactly(tmp_path):
    # The ring is float64 when a loss holds values float32 does not (here 2**24 + 1, which
    # float32 rounds to 2**24); the storage's reads are float64.
    two_dirs(tmp_path)
    build(SimpleTrainer, tmp_path / "a", net=WithCount).train(0, 30)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", net=WithCount)
    graphed.train(0, 30)
    assert graphed._hookloop.graph.ring.dtype == torch.float64
    history = graphed.storage.history("loss_count").values()
    assert [it for _, it in history] == list(range(30))
    assert {v for v, _ in history} == {BIG_COUNT}
    assert {r["loss_count"] for r in metrics(tmp_path / "b")} == {BIG_COUNT}
    assert_same_metrics(tmp_path / "a", tmp_path / "b")


def test_gather_metric_period_and_the_ring_size_invariant():
    with pytest.raises(ValueError, match=r"ring_size=79 is too small.*2 \* 20 \* 2 = 80"):
        build(CUDAGraphTrainer, gather_metric_period=2, ring_size=79)
    trainer = build(CUDAGraphTrainer, gather_metric_period=2)
    assert trainer._hookloop.graph.ring_size == 80
    trainer.train(0, 30)
    assert [it for _, it in trainer.storage.history("total_loss").values()] == list(range(1, 30, 2))


def test_non_finite_loss_raises_at_the_read_naming_the_iteration():
    data = batches()
    data[7] = (data[7][0], torch.full_like(data[7][1], float("nan")))
    trainer = build(CUDAGraphTrainer, data=data)
    with pytest.raises(FloatingPointError, match="iteration=7!"):
        trainer.train(0, 30)


def test_hooks_are_called_in_the_eager_trainers_order():
    class Record(HookBase):
        def __init__(self) -> None:
            self.calls: List[Any] = []

        def before_train(self) -> None:
            self.calls.append(("before_train", self.trainer.iter))

        def before_step(self) -> None:
            self.calls.append(("before_step", self.trainer.iter))

        def after_step(self) -> None:
            lr = self.trainer.optimizer.param_groups[0]["lr"]
            self.calls.append(("after_step", self.trainer.iter, type(lr), lr))

        def after_train(self) -> None:
            self.calls.append(("after_train", self.trainer.iter))

    seen = []
    for cls in (SimpleTrainer, CUDAGraphTrainer):
        rec = Record()
        build(cls, extra_hooks=[rec]).train(0, 10)
        seen.append(rec.calls)
    assert seen[0] == seen[1]
    # Between replays the host sees a float LR (the tensor is swapped in inside the step only).
    assert all(c[2] is float for c in seen[1] if c[0] == "after_step")


def test_an_lr_set_outside_the_schedule_is_written_into_the_table(tmp_path):
    class Halve(HookBase):
        def before_step(self) -> None:
            if self.trainer.iter == 25:
                for g in self.trainer.optimizer.param_groups:
                    g["lr"] = g["lr"] * 0.5

    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", schedule="torch", extra_hooks=[Halve()])
    eager.train(0, 40)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", schedule="torch", extra_hooks=[Halve()])
    graphed.train(0, 40)
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    assert graphed._hookloop.graph.rows_rewritten >= 1
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


def test_eval_and_precise_bn_run_eagerly_on_the_same_parameters(tmp_path):
    evals: List[float] = []

    def test_fn() -> Dict[str, float]:
        model = trainer.model
        model.eval()
        with torch.no_grad():
            x, y = batches(1, seed=5)[0]
            evals.append(float(((model.head(torch.relu(model.body(x))) - y) ** 2).mean()))
        model.train()
        return {"val/mse": evals[-1]}

    bn_data = batches(12, seed=9)  # three runs of 4 batches
    trainer = build(CUDAGraphTrainer, bn=True)
    bn = trainer.model.body[1]
    ptr = bn.running_mean.data_ptr()
    trainer.register_hooks(
        [hooks.EvalHook(10, test_fn), hooks.PreciseBN(10, trainer.model, bn_data, 4)]
    )
    trainer.train(0, 30)
    assert len(evals) == 3 and len(set(evals)) == 3
    # PreciseBN writes its statistics into the buffers the graph updates (not new tensors).
    assert bn.running_mean.data_ptr() == ptr


class HeldSeam(EagerStepGraph):
    """The eager seam with what a CUDA graph holds from the capture on: a replay runs with the
    model's buffers and parameters, the parameters' ``requires_grad``, the modules' training
    modes, the optimizer's param groups and their options (all but the LR) and the optimizer's
    state tensors that the capture saw, whatever they are now (put back after the replay,
    without torch's registration hooks; the held tensors keep what the replay wrote)."""

    def __init__(self, trainer: Any) -> None:
        super().__init__()
        self._trainer = trainer
        self._held: Any = None

    def _state(self) -> Any:
        opt = self._trainer.optimizer
        model, groups = self._trainer.model, opt.param_groups
        return (
            [
                (m, kind, n, t)
                for m in model.modules()
                for kind in ("_buffers", "_parameters")
                for n, t in getattr(m, kind).items()
            ],
            [(p, p.requires_grad) for p in model.parameters()],
            [(m, m.training) for m in model.modules()],
            [(g, {k: v for k, v in g.items() if k not in ("params", "lr")}) for g in groups],
            (opt, groups, list(groups), opt.state, [(p, d, dict(d)) for p, d in opt.state.items()]),
        )

    @staticmethod
    def _set(state: Any) -> None:
        tensors, grads, modes, options, (opt, groups, members, held, entries) = state
        groups[:] = members
        opt.param_groups, opt.state = groups, held
        held.clear()
        for p, d, items in entries:
            d.clear()
            d.update(items)
            held[p] = d
        for m, kind, n, t in tensors:
            getattr(m, kind)[n] = t
        for p, flag in grads:
            p.requires_grad_(flag)
        for m, flag in modes:
            m.training = flag
        for g, saved in options:
            g.update(saved)

    def capture(self, fn: Any, params: Any) -> None:
        super().capture(fn, params)
        self._held = self._state()

    def replay(self) -> None:
        now = self._state()
        self._set(self._held)
        try:
            super().replay()
        finally:
            self._set(now)


class AssignStats(HookBase):
    """Every ``period`` iterations, new running statistics for each BatchNorm, assigned as
    fvcore's ``update_bn_stats`` (detectron2's PreciseBN) assigns them: new tensors."""

    def __init__(self, period: int = 10) -> None:
        self.period = period

    def after_step(self) -> None:
        if (self.trainer.iter + 1) % self.period == 0:
            for m in self.trainer.model.modules():
                if isinstance(m, nn.BatchNorm1d):
                    m.running_mean = m.running_mean * 0.5 + 1.0
                    m.running_var = m.running_var * 2.0


def test_a_tensor_assigned_on_the_model_between_steps_is_captured_again(tmp_path, caplog):
    # A graph would go on updating the running statistics it captured, and the model's new
    # ones would never move again: the graphs are dropped and the step captured again.
    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", bn=True, extra_hooks=[AssignStats(10)])
    eager.train(0, 30)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", bn=True, extra_hooks=[AssignStats(10)])
    step = graphed._hookloop.graph
    step._new_seam = lambda: HeldSeam(graphed)
    with caplog.at_level(logging.INFO, logger="hookloop.engine.train_loop"):
        graphed.train(0, 30)
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    for p, q in zip(params(eager.model), params(graphed.model)):  # buffers too
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    said = [r.getMessage() for r in caplog.records]
    assert [m[: m.index(" for")] for m in said if "captured the step at" in m] == [
        f"CUDAGraphTrainer: captured the step at iteration {it}" for it in (3, 13, 23)
    ]
    assert [m for m in said if "assigned anew" in m] == [
        f"CUDAGraphTrainer: body.1.running_mean of the model was assigned anew after iteration "
        f"{it}: the step is captured again (a replay runs the step as it was captured)"
        for it in (9, 19, 29)
    ]
    assert not step.captured  # the last assignment, after iteration 29, dropped it too


class Retune(HookBase):
    """Freezes the first layer after iteration 9, puts the BatchNorm in eval mode after 19 and
    lowers the momentum after 29; sets the same again at every later iteration."""

    def after_step(self) -> None:
        it, model = self.trainer.iter, self.trainer.model
        if it >= 9:
            model.body[0].weight.requires_grad_(False)
        if it >= 19:
            model.body[1].eval()
        group = self.trainer.optimizer.param_groups[0]
        if it >= 29:
            group["momentum" if "momentum" in group else "weight_decay"] = 0.5


def test_frozen_parameters_eval_modules_and_new_options_are_captured_again(tmp_path, caplog):
    # A graph runs the step it captured: with the first layer trained, the BatchNorm in
    # training mode and the old momentum. Before each replay the trainer compares them with
    # the capture's and captures again where the eager step would differ.
    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", bn=True, extra_hooks=[Retune()])
    eager.train(0, 40)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", bn=True, extra_hooks=[Retune()])
    step = graphed._hookloop.graph
    step._new_seam = lambda: HeldSeam(graphed)
    with caplog.at_level(logging.INFO, logger="hookloop.engine.train_loop"):
        graphed.train(0, 40)
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    said = [r.getMessage() for r in caplog.records]
    suffix = ": the step is captured again (a replay runs the step as it was captured)"
    assert [m for m in said if "captured again" in m] == [
        f"CUDAGraphTrainer: {why}{suffix}"
        for why in (
            "requires_grad of body.0.weight changed to False before iteration 10",
            "body.1 was put in eval mode before iteration 20",
            "param group 0's momentum changed from 0.9 to 0.5 before iteration 30",
        )
    ]
    assert [m[: m.index(" for")] for m in said if "captured the step at" in m] == [
        f"CUDAGraphTrainer: captured the step at iteration {it}" for it in (3, 13, 23, 33)
    ]
    assert step.recaptures == 3


@pytest.mark.parametrize("at", [1, 9])
def test_a_param_group_added_between_steps_rebuilds_the_lr_table(tmp_path, caplog, at):
    # Gradual unfreezing: the head joins the optimizer in a group of its own after iteration
    # `at` (1: while the first graph warms up; 9: after its capture). The LR table gets a
    # column for it, its rows from the schedulers as they are then (MultiStepLR halves both
    # groups at 15 and 35: no row is rewritten), the graphs are dropped, and the next steps
    # warm up and capture again, with the new group.
    two_dirs(tmp_path)
    run: Dict[str, Any] = {"schedule": "torch", "head_later": True}
    eager = build(SimpleTrainer, tmp_path / "a", extra_hooks=[AddHead(at)], **run)
    eager.train(0, 40)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", extra_hooks=[AddHead(at)], **run)
    step = graphed._hookloop.graph
    step._new_seam = lambda: HeldSeam(graphed)
    with caplog.at_level(logging.INFO, logger="hookloop.engine.train_loop"):
        graphed.train(0, 40)
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    lrs = [g["lr"] for g in graphed.optimizer.param_groups]
    assert lrs == [g["lr"] for g in eager.optimizer.param_groups] == [0.025, 0.0125]
    assert step.table.shape[1] == 2 and step.rows_rewritten == 0 and step.captured
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "LR table" in m] == [
        f"CUDAGraphTrainer: the optimizer has 2 param groups before iteration {at + 1} (the "
        "LR table was built for 1): the table is built again from this iteration on, and the "
        "next steps warm up and capture again"
    ]
    assert [m for m in said if "captured again (a replay" in m] == (
        [
            "CUDAGraphTrainer: requires_grad of head.weight changed to True before iteration "
            "10: the step is captured again (a replay runs the step as it was captured)"
        ]  # the first change found is named (the group too: test_what_the_capture_holds_...)
        if at == 9
        else []
    )
    # The warm-ups start again after the change: the capture is 3 steps later.
    assert [m[: m.index(" for")] for m in said if "captured the step at" in m] == [
        f"CUDAGraphTrainer: captured the step at iteration {it}"
        for it in ((5,) if at == 1 else (3, 13))
    ]


def test_the_optimizers_state_changed_between_steps_is_captured_again(tmp_path, caplog):
    # A replay updates the state tensors it captured: after `state.clear()` or a new state,
    # a graph would go on updating the old tensors (and the optimizer's own would never
    # move). The tensors are compared by identity before each replay; a change captures again.
    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", extra_hooks=[ResetState()])
    eager.train(0, 40)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", extra_hooks=[ResetState()])
    step = graphed._hookloop.graph
    step._new_seam = lambda: HeldSeam(graphed)
    with caplog.at_level(logging.INFO, logger="hookloop.engine.train_loop"):
        graphed.train(0, 40)
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    for p, q in zip(eager.model.parameters(), graphed.model.parameters()):
        a, b = eager.optimizer.state[p], graphed.optimizer.state[q]
        assert a.keys() == b.keys() == {"momentum_buffer"}
        torch.testing.assert_close(b["momentum_buffer"], a["momentum_buffer"])
    said = [r.getMessage() for r in caplog.records]
    suffix = ": the step is captured again (a replay runs the step as it was captured)"
    assert [m for m in said if "captured again" in m] == [
        f"CUDAGraphTrainer: {why}{suffix}"
        for why in (
            "the optimizer's state was cleared before iteration 10",
            "the optimizer's state of body.0.weight changed (momentum_buffer replaced) before "
            "iteration 20",
            "the optimizer's state of head.weight changed (momentum_buffer replaced) before "
            "iteration 30",
        )
    ]
    # A new dict holding the same tensors (iterations 31 to 39) is no change.
    assert [m[: m.index(" for")] for m in said if "captured the step at" in m] == [
        f"CUDAGraphTrainer: captured the step at iteration {it}" for it in (3, 13, 23, 33)
    ]
    assert step.recaptures == 3


def test_without_warm_up_the_capture_holds_the_state_its_first_replay_made():
    # warmup_iters=0: the optimizer's state is made by the first step (a CUDA capture records
    # it; the eager seam's first replay runs it). What the capture holds is taken after it:
    # no change is seen at the next step.
    trainer = build(CUDAGraphTrainer, warmup_iters=0)
    trainer.train(0, 10)
    step = trainer._hookloop.graph
    assert step.captured and step.recaptures == 0


def test_what_the_capture_holds_of_the_optimizers_state_names_each_change():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    w = model.body[0].weight

    def replaced() -> None:  # a copy, equal in value: another tensor all the same
        opt.state[w]["momentum_buffer"] = opt.state[w]["momentum_buffer"].clone()

    checks = [
        (lambda: opt.state.update({w: dict(opt.state[w])}), None),  # the same tensors
        (opt.state.clear, "the optimizer's state was cleared"),
        (replaced, "the optimizer's state of body.0.weight changed (momentum_buffer replaced)"),
        (
            lambda: opt.state.update({w: {}}),
            "the optimizer's state of body.0.weight changed (momentum_buffer removed)",
        ),
        (
            lambda: opt.state[w].update(extra=torch.zeros(())),
            "the optimizer's state of body.0.weight changed (extra added)",
        ),
    ]
    for change, said in checks:
        opt.zero_grad()
        sum(model(batches(1)[0]).values()).backward()
        opt.step()  # the state, made again after a clear
        baked = graph_module._Baked(model, opt)
        assert baked.changed(model, opt) is None
        change()
        assert baked.changed(model, opt) == said


def test_what_the_capture_holds_names_each_change():
    model = Net(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    baked = graph_module._Baked(model, opt)
    assert baked.changed(model, opt) is None
    group = opt.param_groups[0]
    group["lr"] = 0.5  # read from the LR table: not held by the capture
    group["params"] = list(group["params"])  # the same parameters in a new list
    assert baked.changed(model, opt) is None
    checks = [
        (
            lambda: model.head.bias.requires_grad_(False),
            "requires_grad of head.bias changed to False",
        ),
        (lambda: model.body.eval(), "body was put in eval mode"),
        (
            lambda: group.update(weight_decay=1e-4),
            "param group 0's weight_decay changed from 0 to 0.0001",
        ),
        (
            lambda: group.update(params=group["params"][:-1]),
            "param group 0's parameters or options changed",
        ),
        (lambda: group.update(betas=(0.9, 0.99)), "param group 0's parameters or options changed"),
        (
            lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]}),
            "the optimizer's param groups changed (2, captured with 1)",
        ),
    ]
    for change, said in checks:
        baked = graph_module._Baked(model, opt)
        change()
        assert baked.changed(model, opt) == said


def test_many_recaptures_warn_once(monkeypatch):
    class Toggle(HookBase):  # a change before every other step
        def after_step(self) -> None:
            bn = self.trainer.model.body[1]
            bn.train(not bn.training)

    monkeypatch.setattr(graph_guard, "RECAPTURE_WARNING", 3)
    trainer = build(CUDAGraphTrainer, bn=True, extra_hooks=[Toggle()], warmup_iters=0)
    with pytest.warns(RuntimeWarning, match=r"captured the step again 3 times.*body.1 was put"):
        trainer.train(0, 12)
    assert trainer._hookloop.graph.recaptures == 11


def test_assignments_inside_the_step_or_on_other_modules_keep_the_graph():
    class CachesInForward(Net):
        def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
            self.last_x = batch[0].mean()  # a buffer assigned by every forward
            return super().forward(batch)

    trainer = build(CUDAGraphTrainer)
    model = CachesInForward()
    model.load_state_dict(trainer.model.state_dict())
    model.register_buffer("last_x", torch.zeros(()))
    other = nn.BatchNorm1d(3)

    class AssignElsewhere(HookBase):
        def after_step(self) -> None:
            other.running_mean = torch.ones(3)  # not the trainer's model

    trainer = CUDAGraphTrainer(
        model, batches(), torch.optim.SGD(model.parameters(), lr=0.1), graph="eager"
    )
    trainer.register_hooks([AssignElsewhere()])
    trainer.train(0, 12)
    step = trainer._hookloop.graph
    assert [s.warmups for s in step.shapes] == [3] and step.captured


def test_the_assignment_watch_goes_with_the_trainer():
    import gc

    from torch.nn.modules import module as nn_module

    def watches() -> set:
        return set(nn_module._global_buffer_registration_hooks)

    before = watches()  # other tests' trainers may still be alive, and go with this gc
    trainer = build(CUDAGraphTrainer)
    mine = watches() - before
    assert len(mine) == 1
    del trainer
    gc.collect()
    assert not mine & watches()


# ----------------------------------------------------------------------------------------------
# Checkpoints and resume


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    import copy

    saved: Dict[str, Any] = {}

    class Save(HookBase):  # a checkpoint at the end of iteration 22, as a checkpointer's
        def after_step(self) -> None:
            if self.trainer.iter == 22:
                saved["state"] = copy.deepcopy(self.trainer.state_dict())
                saved["model"] = copy.deepcopy(self.trainer.model.state_dict())

    two_dirs(tmp_path)
    kw: Dict[str, Any] = dict(optim="adam", bn=True, schedule="torch")
    straight = build(CUDAGraphTrainer, tmp_path / "a", extra_hooks=[Save()], **kw)
    straight.train(0, 40)

    resumed = build(CUDAGraphTrainer, **kw)
    resumed.train(0, 5)  # a capture made before the load is dropped by it
    assert resumed._hookloop.graph.captured
    writer = JSONWriter(str(tmp_path / "b" / "metrics.json"))
    resumed.register_hooks([hooks.PeriodicWriter([writer], period=5)])
    resumed.model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["state"])
    assert not resumed._hookloop.graph.captured
    resumed.train(23, 40)
    assert resumed._hookloop.graph.captured  # captured again after the load
    assert int(resumed._hookloop.graph.counter) == 40
    for p, q in zip(params(straight.model), params(resumed.model)):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    tail = [r for r in metrics(tmp_path / "a") if r["iteration"] >= 23]
    assert [r for r in metrics(tmp_path / "b") if r["iteration"] >= 23] == tail


def test_an_eager_trainers_checkpoint_resumes_in_the_graph_trainer(tmp_path):
    # torch's load replaces a param group's options by the saved ones: without the graph
    # trainer keeping its optimizer's fused=True, the SGD saved by SimpleTrainer would make
    # the step impossible to capture (on CUDA).
    import copy

    saved: Dict[str, Any] = {}

    class Save(HookBase):
        def after_step(self) -> None:
            if self.trainer.iter == 22:
                saved["state"] = copy.deepcopy(self.trainer.state_dict())
                saved["model"] = copy.deepcopy(self.trainer.model.state_dict())

    two_dirs(tmp_path)
    straight = build(SimpleTrainer, tmp_path / "a", extra_hooks=[Save()], schedule="torch")
    straight.train(0, 40)
    assert saved["state"]["optimizer"]["param_groups"][0]["fused"] is None
    resumed = build(CUDAGraphTrainer, optim="fused", schedule="torch")
    writer = JSONWriter(str(tmp_path / "b" / "metrics.json"))
    resumed.register_hooks([hooks.PeriodicWriter([writer], period=5)])
    resumed.model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["state"])
    assert [g["fused"] for g in resumed.optimizer.param_groups] == [True]
    assert saved["state"]["optimizer"]["param_groups"][0]["fused"] is None  # not changed
    resumed.train(23, 40)
    for p, q in zip(params(straight.model), params(resumed.model)):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    tail = [r for r in metrics(tmp_path / "a") if r["iteration"] >= 23]
    got = [r for r in metrics(tmp_path / "b") if r["iteration"] >= 23]
    assert [r["iteration"] for r in got] == [r["iteration"] for r in tail] != []
    for x, y in zip(tail, got):
        assert y == pytest.approx(x, rel=1e-6)


def test_a_load_keeps_the_optimizers_capture_options():
    model = Net()
    eager = torch.optim.Adam(model.parameters(), lr=0.01)
    model(batches(1)[0])["loss_mse"].backward()
    eager.step()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    CUDAGraphTrainer(model, batches(), opt, graph="eager")
    state = eager.state_dict()
    opt.load_state_dict(state)
    assert [g["capturable"] for g in opt.param_groups] == [True]
    assert opt.param_groups[0]["lr"] == 0.01 and len(opt.state) == len(eager.state)
    assert state["param_groups"][0]["capturable"] is False  # the caller's dict is untouched
    # torch still checks the groups: a state of another optimizer's groups is refused
    two = torch.optim.Adam([{"params": [model.head.weight]}, {"params": [model.head.bias]}])
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict(two.state_dict())


@pytest.mark.usefixtures("hookloop_logs_info")
def test_default_trainer_with_cuda_graph(tmp_path, monkeypatch):
    from hookloop.data import TrainingSampler
    from torch.utils.data import DataLoader, TensorDataset

    # The seam's CPU implementation stands in for the device.
    monkeypatch.setattr(graph_seam, "CUDAStepGraph", lambda device=None: EagerStepGraph())

    class Toy(DefaultTrainer):
        @classmethod
        def build_model(cls, cfg: TrainConfig) -> nn.Module:
            return Net()

        @classmethod
        def build_train_loader(cls, cfg: TrainConfig) -> Any:
            g = torch.Generator().manual_seed(123)
            xs = torch.randn(64, 4, generator=g)
            ds = TensorDataset(xs, xs.sum(1, keepdim=True))
            return DataLoader(ds, batch_size=8, sampler=TrainingSampler(64, seed=0))

    runs = {}
    for name, cuda_graph in (("eager", False), ("graph", True)):
        out = tmp_path / name
        cfg = TrainConfig(
            max_iter=30,
            output_dir=str(out),
            checkpoint_period=10,
            log_period=5,
            base_lr=0.05,
            warmup_iters=4,
            seed=0,
            cuda_graph=cuda_graph,
        )
        trainer = Toy(cfg)
        if cuda_graph:
            assert isinstance(trainer._trainer, CUDAGraphTrainer)
            assert all(g["fused"] for g in trainer.optimizer.param_groups)
        trainer.train()
        runs[name] = (out, trainer)
    assert_same_metrics(runs["eager"][0], runs["graph"][0])
    inner = runs["graph"][1]._trainer
    assert inner._hookloop.graph.rows_rewritten == 0
    # The ring's slots are read in batches there too (not one read per step).
    assert inner._hookloop.metrics.deferring


# ----------------------------------------------------------------------------------------------
# What cannot be captured says so


def short_last(n: int = 12) -> List[Any]:
    """An epoch whose last batch is smaller (a loader without drop_last)."""
    data = batches(n)
    data[-1] = (data[-1][0][:10], data[-1][1][:10])
    return data


@pytest.mark.usefixtures("hookloop_logs_info")
def test_a_smaller_last_batch_gets_a_graph_of_its_own(tmp_path, caplog):
    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", data=short_last())
    eager.train(0, MAX_ITER)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", data=short_last())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the second shape is no problem
        graphed.train(0, MAX_ITER)
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    step = graphed._hookloop.graph
    # 5 epochs: the short batch came 5 times (3 warm-ups, the capture, a replay).
    assert [s.describe() for s in step.shapes] == [
        "(torch.float32 (16, 4), torch.float32 (16, 1))",
        "(torch.float32 (10, 4), torch.float32 (10, 1))",
    ]
    assert [s.warmups for s in step.shapes] == [3, 3]
    assert all(s.seam.captured for s in step.shapes)
    assert int(step.counter) == MAX_ITER
    # Each capture is logged: the first batches' at iteration 3, the short one's at its 4th
    # epoch (iteration 47)
    assert [r.getMessage() for r in caplog.records if "captured" in r.getMessage()] == [
        "CUDAGraphTrainer: captured the step at iteration 3 for the batch (torch.float32 "
        "(16, 4), torch.float32 (16, 1)) (graph 1 of at most 4)",
        "CUDAGraphTrainer: captured the step at iteration 47 for the batch (torch.float32 "
        "(10, 4), torch.float32 (10, 1)) (graph 2 of at most 4)",
    ]


def test_a_replay_after_another_graph_or_an_eager_step_restores_its_gradients(monkeypatch):
    # A CUDA graph writes the gradients into buffers of its own pool: after another graph's
    # replay or an eager step (a warm-up) left other tensors in .grad, a replay points .grad
    # back at its own. The eager seam records when; the CUDA test checks the values.
    data = batches(6)
    data[5] = (data[5][0][:10], data[5][1][:10])  # A A A A A B, again and again
    trainer = build(CUDAGraphTrainer, data=data, warmup_iters=1)
    restored: List[int] = []
    monkeypatch.setattr(EagerStepGraph, "restore", lambda self: restored.append(trainer.iter))
    trainer.train(0, 24)
    # A: warm-up at 0, capture at 1; B: warm-up at 5, capture at 11. A replay restores after
    # B's warm-up (6) or replay (12, 18, 24 is past the end); B's replay at 17 and 23 after A's.
    assert restored == [6, 12, 17, 18, 23]


class GraphLikeSeam(EagerStepGraph):
    """The eager seam with a CUDA graph's effect on ``.grad``: a replay writes the gradient
    buffers the capture left in ``.grad`` and changes no Python state, so ``.grad`` keeps
    whatever the last other step left there until :meth:`restore`."""

    def __init__(self) -> None:
        super().__init__()
        self._grads: List[Any] = []

    def capture(self, fn: Any, params: Any) -> None:
        super().capture(fn, params)
        self._params = list(params)
        self._grads = []

    def replay(self) -> None:
        before = [p.grad for p in self._params]
        super().replay()  # the step, leaving new tensors in .grad
        if not self._grads:  # the capture's run: its gradients are the graph's buffers
            self._grads = [p.grad for p in self._params]
            return
        for p, buf, old in zip(self._params, self._grads, before):
            buf.copy_(p.grad)
            p.grad = old

    def restore(self) -> None:
        for p, buf in zip(self._params, self._grads):
            p.grad = buf

    def reset(self) -> None:
        super().reset()
        self._grads = []


def test_hooks_read_this_steps_gradients_with_two_graphs(tmp_path, monkeypatch):
    # Without the restore after another graph's replay or a warm-up, GradNorm would read the
    # other graph's (or the warm-up's) stale gradients.
    monkeypatch.setattr(graph_seam, "EagerStepGraph", GraphLikeSeam)
    data = batches(6)
    data[5] = (data[5][0][:10], data[5][1][:10])
    runs = []
    for cls, kw in ((SimpleTrainer, {}), (CUDAGraphTrainer, {"warmup_iters": 1})):
        trainer = build(cls, data=data, extra_hooks=[GradNorm()], **kw)
        trainer.train(0, 30)
        runs.append(trainer)
    eager, graphed = runs
    assert all(
        isinstance(s.seam, GraphLikeSeam) and s.seam.captured
        for s in graphed._hookloop.graph.shapes
    )
    a = eager.storage.history("grad_norm").values()
    b = graphed.storage.history("grad_norm").values()
    assert [it for _, it in b] == list(range(30))
    assert [v for v, _ in b] == pytest.approx([v for v, _ in a], rel=1e-6)


def test_the_cuda_seam_points_grad_at_the_captured_buffers(monkeypatch):
    # CUDAStepGraph's own logic, with torch's capture machinery stood in for.
    class Graph:
        def replay(self) -> None:
            pass

    class Capture:
        fail: Optional[str] = None
        modes: List[str] = []

        def __init__(self, graph: Any, capture_error_mode: str = "global") -> None:
            Capture.modes.append(capture_error_mode)

        def __enter__(self) -> None:
            if Capture.fail:
                raise RuntimeError(Capture.fail)

        def __exit__(self, *exc: Any) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    seam = graph_module.CUDAStepGraph("cpu")
    w = nn.Parameter(torch.ones(2))

    def step() -> None:  # what a capture leaves: .grad, a buffer of the graph's pool
        w.grad = torch.full((2,), 3.0)

    seam.capture(step, [w])
    # Other threads (a DataLoader's pin-memory thread) may call CUDA during the capture.
    assert Capture.modes == ["thread_local"]
    captured = w.grad
    w.grad = torch.zeros(2)  # another graph's replay or an eager step
    seam.replay()
    seam.restore()
    assert seam.captured and w.grad is captured
    seam.reset()
    assert not seam.captured
    seam.restore()  # nothing recorded: .grad is left alone
    assert w.grad is captured
    Capture.fail = "operation not permitted when stream is capturing"
    with pytest.raises(RuntimeError, match="(?s)capturing the step failed: operation not.*item"):
        seam.capture(step, [w])
    assert not seam.captured


def test_batch_shapes_beyond_max_graphs_are_refused_naming_them():
    data = short_last(4)
    trainer = build(CUDAGraphTrainer, data=data, max_graphs=1)
    with pytest.raises(ValueError) as info:
        trainer.train(0, 5)
    msg = str(info.value)
    assert "at iteration 3" in msg
    assert "a batch (torch.float32 (10, 4), torch.float32 (10, 1))" in msg
    # Iteration 3 would have captured the first batches' step: nothing is captured yet.
    assert "but the max_graphs=1 batch signature is taken by (torch.float32 (16, 4), " in msg
    assert "captured" not in msg
    assert "drop_last=True" in msg

    data = short_last(4)
    data[1] = (data[1][0][:8], data[1][1][:8])
    trainer = build(CUDAGraphTrainer, data=data, max_graphs=2)
    with pytest.raises(ValueError, match=r"\(10, 4\).*max_graphs=2.*\(16, 4\).* and .*\(8, 4\)"):
        trainer.train(0, 5)


def test_batch_shape_change_with_fallback_warns_once_and_steps_eagerly(tmp_path):
    data = batches(4)
    data[2] = (data[2][0][:10], data[2][1][:10])
    two_dirs(tmp_path)
    build(SimpleTrainer, tmp_path / "a", data=data).train(0, 20)
    trainer = build(CUDAGraphTrainer, tmp_path / "b", data=data, fallback="eager", max_graphs=1)
    with pytest.warns(RuntimeWarning, match="this step runs eagerly") as record:
        trainer.train(0, 20)
    assert len([w for w in record if "runs eagerly" in str(w.message)]) == 1
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    assert int(trainer._hookloop.graph.counter) == 20


def test_construction_errors_name_the_cause_and_the_fix():
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"SGD\(\.\.\., fused=True\)"):
        CUDAGraphTrainer(model, batches(), sgd)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"capturable=True"):
        CUDAGraphTrainer(model, batches(), adam)
    with pytest.raises(ValueError, match="precision=torch.bfloat16"):
        CUDAGraphTrainer(model, batches(), sgd, graph="eager", precision=torch.float16)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    with pytest.raises(ValueError, match="GradScaler"):
        CUDAGraphTrainer(model, batches(), sgd, graph="eager", grad_scaler=scaler)
    with pytest.raises(ValueError, match="async_write_metrics"):
        CUDAGraphTrainer(model, batches(), sgd, async_write_metrics=True, graph="eager")
    with pytest.raises(ValueError, match="graph must be"):
        CUDAGraphTrainer(model, batches(), sgd, graph="cpu")
    with pytest.raises(TypeError, match="max_graphs must be an int, got '2'"):
        CUDAGraphTrainer(model, batches(), sgd, graph="eager", max_graphs="2")
    with pytest.raises(ValueError, match="max_graphs must be >= 1, got 0"):
        CUDAGraphTrainer(model, batches(), sgd, graph="eager", max_graphs=0)
    with pytest.raises(TypeError, match="DataParallel model"):
        CUDAGraphTrainer(torch.nn.DataParallel(model), batches(), sgd, graph="eager")


def test_ddp_model_is_refused(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = torch.nn.parallel.DistributedDataParallel(Net())
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match="DistributedDataParallel model.*SimpleTrainer"):
            CUDAGraphTrainer(model, batches(), sgd, graph="eager")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(HAS_CUDA, reason="checks the machine without CUDA")
def test_no_cuda_device_raises_or_falls_back(tmp_path):
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    with pytest.raises(RuntimeError, match="needs a CUDA device.*fallback='eager'"):
        CUDAGraphTrainer(model, batches(), sgd)
    two_dirs(tmp_path)
    build(SimpleTrainer, tmp_path / "a", optim="fused").train(0, 20)
    with pytest.warns(RuntimeWarning, match="needs a CUDA device"):
        trainer = build(
            CUDAGraphTrainer, tmp_path / "b", optim="fused", graph="cuda", fallback="eager"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train(0, 20)  # no second warning
    assert_same_metrics(tmp_path / "a", tmp_path / "b")


def test_after_backward_hook_and_step_optimizer_false_are_refused():
    class Clip(HookBase):
        def after_backward(self) -> None:
            pass

    trainer = build(CUDAGraphTrainer, extra_hooks=[Clip()])
    with pytest.raises(TypeError, match="Clip.after_backward.*after_step"):
        trainer.train(0, 3)
    trainer = build(CUDAGraphTrainer)
    trainer.step_optimizer = False
    with pytest.raises(TypeError, match="step_optimizer=False"):
        trainer.train(0, 3)


def test_an_after_backward_set_on_a_hook_instance_is_refused_too():
    # The dispatcher calls a stage method assigned on a hook instance (SimpleTrainer runs it at
    # every step); a replay could not run it between backward and the optimizer step. The
    # graph asks the dispatcher's rule (dispatch.overrides), not only the hook's class.
    calls: List[int] = []

    def hooked() -> HookBase:
        hook = HookBase()
        hook.after_backward = lambda: calls.append(1)  # type: ignore[method-assign]
        return hook

    build(SimpleTrainer, extra_hooks=[hooked()]).train(0, 3)
    assert len(calls) == 3
    trainer = build(CUDAGraphTrainer, extra_hooks=[hooked()])
    with pytest.raises(TypeError, match="HookBase.after_backward.*after_step"):
        trainer.train(0, 3)
    calls.clear()
    trainer = build(CUDAGraphTrainer, extra_hooks=[hooked()], fallback="eager")
    with pytest.warns(RuntimeWarning, match="HookBase.after_backward"):
        trainer.train(0, 6)
    assert len(calls) == 6  # eager steps, each running it


def test_losses_must_keep_their_names():
    class Flaky(Net):
        calls = 0

        def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
            Flaky.calls += 1
            out = super().forward(batch)
            return out if Flaky.calls < 3 else {"other": out["loss_mse"]}

    model = Flaky()
    trainer = CUDAGraphTrainer(
        model, batches(), torch.optim.SGD(model.parameters(), lr=0.1), graph="eager"
    )
    with pytest.raises(ValueError) as info:
        trainer.train(0, 5)
    # At iteration 2, a warm-up: nothing was captured.
    assert str(info.value).startswith(
        "CUDAGraphTrainer: the model returned losses ['other'] at iteration 2, but ['loss_mse', "
        "'loss_l1'] at its first step: every step must return the same losses"
    )


# ----------------------------------------------------------------------------------------------
# The capture itself (CUDA)

cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _cuda_trainer(
    out: Optional[Path] = None,
    *,
    data: Optional[List[Any]] = None,
    extra_hooks: Optional[List[HookBase]] = None,
    net: type = Net,
    head_later: bool = False,
    **kw: Any,
) -> Any:
    """``head_later``: the head frozen and outside the optimizer (for :class:`AddHead`), and
    torch's MultiStepLR (hookloop's schedules refuse a param group added later)."""
    torch.manual_seed(0)
    model = net(bn=True).cuda()
    trained = frozen_head(model) if head_later else model.parameters()
    opt = torch.optim.Adam(trained, lr=0.01, capturable=True)
    data = [(x.cuda(), y.cuda()) for x, y in (batches() if data is None else data)]
    trainer = CUDAGraphTrainer(model, data, opt, **kw)
    sched: Any = WarmupParamScheduler(CosineParamScheduler(1, 0), 0.01, 0.1)
    if head_later:
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15, 35], gamma=0.5)
    hs: List[Optional[HookBase]] = [hooks.IterationTimer(), hooks.LRScheduler(opt, sched)]
    hs += extra_hooks or []
    if out is not None:
        hs.append(hooks.PeriodicWriter([JSONWriter(str(out / "metrics.json"))], period=5))
    trainer.register_hooks(hs)
    return trainer


def _eager_and_captured(tmp_path: Path, iters: int, *hook_classes: type, **kw: Any) -> Any:
    """The same CUDA run through the eager seam (metrics in tmp_path/a) and captured
    (tmp_path/b), each with its own instances of ``hook_classes``: (eager, captured)."""
    two_dirs(tmp_path)
    runs = []
    for out, graph in ((tmp_path / "a", {"graph": "eager"}), (tmp_path / "b", {})):
        trainer = _cuda_trainer(out, extra_hooks=[h() for h in hook_classes], **graph, **kw)
        trainer.train(0, iters)
        runs.append(trainer)
    return runs[0], runs[1]


def _assert_trained_alike(tmp_path: Path, eager: Any, graphed: Any) -> None:
    """The eager seam's run and the captured one wrote the same metrics and ended with the
    same parameters and buffers (to the device's float tolerance)."""
    assert_same_metrics(tmp_path / "a", tmp_path / "b", rel=1e-4)
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
@cuda
# graph="eager" runs the capturable Adam's step outside a capture: torch warns it is slower
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable")
def test_cuda_capture_matches_the_eager_seam(tmp_path):
    _, graphed = _eager_and_captured(tmp_path, MAX_ITER)
    assert isinstance(graphed._hookloop.graph.shapes[0].seam, graph_module.CUDAStepGraph)
    assert graphed._hookloop.graph.captured
    assert_same_metrics(tmp_path / "a", tmp_path / "b", rel=1e-4)
    assert graphed._hookloop.graph.rows_rewritten == 0


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable")
def test_cuda_two_batch_shapes_match_the_eager_seam(tmp_path):
    # A A A A A B: B is warmed up at 5, 11 and 17 and captured at 23; the replays of A after
    # B's point .grad back at A's buffers, which GradNorm reads after every step.
    eager, graphed = _eager_and_captured(tmp_path, MAX_ITER, GradNorm, data=short_last(6))
    step = graphed._hookloop.graph
    assert len(step.shapes) == 2 and all(s.seam.captured for s in step.shapes)
    assert_same_metrics(tmp_path / "a", tmp_path / "b", rel=1e-4)
    a = eager.storage.history("grad_norm").values()
    b = graphed.storage.history("grad_norm").values()
    assert [it for _, it in b] == list(range(MAX_ITER))
    assert [v for v, _ in b] == pytest.approx([v for v, _ in a], rel=1e-4)


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable")
def test_cuda_a_buffer_assigned_between_steps_is_captured_again(tmp_path):
    # AssignStats gives the BatchNorm new running-statistics tensors after iterations 9, 19
    # and 29: each time the graphs are dropped and the step captured again, so the captured
    # replays update the model's tensors, as the eager seam's steps do.
    eager, graphed = _eager_and_captured(tmp_path, 35, AssignStats)
    assert graphed._hookloop.graph.captured
    _assert_trained_alike(tmp_path, eager, graphed)  # the BN buffers too


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable")
def test_cuda_a_frozen_layer_and_an_eval_module_are_captured_again(tmp_path):
    # Retune freezes a layer after iteration 9, puts the BatchNorm in eval mode after 19 and
    # changes Adam's weight decay after 29: each is captured again, so the replays train as
    # the eager seam's steps do.
    eager, graphed = _eager_and_captured(tmp_path, 40, Retune)
    assert graphed._hookloop.graph.recaptures == 3
    _assert_trained_alike(tmp_path, eager, graphed)


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable")
def test_cuda_a_param_group_added_between_steps_is_captured_again(tmp_path):
    # AddHead puts the head in a group of its own after iteration 9: the LR table gets its
    # column and the step is captured again, so the replays train the head (at its own LR)
    # as the eager seam's steps do.
    eager, graphed = _eager_and_captured(tmp_path, 40, AddHead, head_later=True)
    step = graphed._hookloop.graph
    assert step.captured and step.recaptures == 1
    assert step.table.shape[1] == 2 and step.rows_rewritten == 0
    _assert_trained_alike(tmp_path, eager, graphed)


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable")
def test_cuda_the_optimizers_state_changed_between_steps_is_captured_again(tmp_path):
    # ResetState clears the state after iteration 9, gives a weight a new one after 19 and
    # replaces one of Adam's tensors after 29: each is captured again, so the replays update
    # the optimizer's tensors, as the eager seam's steps do.
    eager, graphed = _eager_and_captured(tmp_path, 40, ResetState)
    assert graphed._hookloop.graph.recaptures == 3
    _assert_trained_alike(tmp_path, eager, graphed)
    for p, q in zip(eager.model.parameters(), graphed.model.parameters()):
        a, b = eager.optimizer.state[p], graphed.optimizer.state[q]
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable")
def test_cuda_an_int64_loss_is_logged_exactly(tmp_path):
    _, graphed = _eager_and_captured(tmp_path, 30, net=WithCount)
    step = graphed._hookloop.graph
    assert step.captured and step.ring.dtype == torch.float64
    history = graphed.storage.history("loss_count").values()
    assert [it for _, it in history] == list(range(30))
    assert {v for v, _ in history} == {BIG_COUNT}
    assert_same_metrics(tmp_path / "a", tmp_path / "b", rel=1e-4)


SYNCING_CHILD = """
import sys
import pytest, torch
sys.path.insert(0, sys.argv[1])
from test_cuda_graph import Net, batches
from hookloop.engine import CUDAGraphTrainer


class Syncing(Net):
    def forward(self, batch):
        out = super().forward(batch)
        if out["loss_mse"].item() > 1e9:  # a host read: not capturable
            out["loss_mse"] = out["loss_mse"] * 0
        return out


def make(**kw):
    torch.manual_seed(0)
    model = Syncing().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    return CUDAGraphTrainer(model, [(x.cuda(), y.cuda()) for x, y in batches()], opt, **kw)


with pytest.raises(RuntimeError, match="(?s)capturing the step failed.*host synchronization"):
    make().train(0, 6)
print("raised as expected")
# fallback="eager": one warning at the capture (iteration 3), then eager steps to the end
trainer = make(fallback="eager")
with pytest.warns(RuntimeWarning, match="(?s)capturing the step failed"):
    trainer.train(0, 10)
assert trainer._hookloop.graph.eager_reason is not None
assert [it for _, it in trainer.storage.history("loss_mse").values()] == list(range(10))
print("fell back as expected")
"""


@pytest.mark.cuda
@cuda
def test_cuda_host_sync_in_the_loss_fails_at_capture():
    # In a process of its own: a failed capture may leave CUDA unusable for later tests.
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", SYNCING_CHILD, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "fell back as expected" in proc.stdout, proc.stderr


class NoSyncAfterCapture(HookBase):
    """Syncs are errors from iteration 6 (after the capture) to the last step."""

    def before_step(self) -> None:
        if self.trainer.iter == 6:
            torch.cuda.set_sync_debug_mode("error")

    def after_step(self) -> None:
        if self.trainer.iter == self.trainer.max_iter - 1:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@cuda
# torch (2.11 at least) warns once per process, at the first set_sync_debug_mode
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
def test_cuda_replays_do_not_synchronize():
    trainer = _cuda_trainer()
    trainer.register_hooks([NoSyncAfterCapture()])
    try:
        # No writer: losses wait as views; the read of 20 starts a device copy, no host wait.
        trainer.train(0, 6 + 2 * PENDING_READ_EVERY)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:This instance was constructed with capturable")
def test_cuda_bfloat16_capture_matches_the_eager_seam(tmp_path):
    _, graphed = _eager_and_captured(tmp_path, 30, precision=torch.bfloat16)
    assert graphed._hookloop.graph.captured
    assert_same_metrics(tmp_path / "a", tmp_path / "b", rel=1e-2)


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
def test_cuda_pinned_host_batches_are_copied_without_a_sync():
    torch.manual_seed(0)
    model = Net(bn=True).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    data = [(x.pin_memory(), y.pin_memory()) for x, y in batches()]  # a loader's pinned batches
    trainer = CUDAGraphTrainer(model, data, opt)
    trainer.register_hooks([NoSyncAfterCapture()])
    try:
        trainer.train(0, 30)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    step = trainer._hookloop.graph
    assert step.captured and step.shapes[0].static[0].is_cuda
    history = trainer.storage.history("loss_mse").values()
    assert [it for _, it in history] == list(range(30))


@pytest.mark.cuda
@cuda
def test_cuda_host_copies_do_not_wait_for_the_queued_replays():
    torch.manual_seed(0)
    model = Net(bn=True).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    trainer = CUDAGraphTrainer(model, batches(), opt)  # pageable host batches
    trainer.train(0, 8)
    step = trainer._hookloop.graph
    assert step.captured
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(1 << 31)  # about a second of device work queued ahead of the copies
    # A copy from pageable memory would wait for the sleep; pinned first, it does not: the
    # static batch, and a table row for an LR set outside the schedule.
    assert step.place(batches(1, seed=2)[0]) is None
    for g in opt.param_groups:
        g["lr"] = 0.5
    step.sync_lr(opt, 7)
    copies_waited = stream.query()
    torch.cuda.synchronize()
    assert not copies_waited
    assert step.rows_rewritten == 1 and float(step.table[7, 0]) == 0.5
    torch.testing.assert_close(step.current.static[0].cpu(), batches(1, seed=2)[0][0])


@pytest.mark.cuda
@cuda
def test_cuda_capture_beside_a_dataloaders_pin_memory_thread():
    # Workers and pin_memory=True: the loader's pin-memory thread allocates pinned memory
    # while the step is captured (which "global" capture mode turns into a failed capture
    # and a failing loader).
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * 64, 4, generator=g)
    loader = DataLoader(
        TensorDataset(x, x.sum(1, keepdim=True)),
        batch_size=16,
        num_workers=2,
        pin_memory=True,
        drop_last=True,
    )
    torch.manual_seed(0)
    model = Net(bn=True).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    trainer = CUDAGraphTrainer(model, loader, opt)
    trainer.train(0, 40)
    assert trainer._hookloop.graph.captured
    history = trainer.storage.history("loss_mse").values()
    assert [it for _, it in history] == list(range(40))
    assert all(math.isfinite(v) for v, _ in history)


def test_a_failed_capture_with_fallback_warns_once_and_steps_eagerly(tmp_path, monkeypatch):
    def fail(self: Any, fn: Any, params: Any) -> None:
        raise RuntimeError("capturing the step failed: (a stand-in for CUDA's error)")

    monkeypatch.setattr(EagerStepGraph, "capture", fail)
    two_dirs(tmp_path)
    build(SimpleTrainer, tmp_path / "a").train(0, 20)
    with pytest.raises(RuntimeError, match="stand-in"):
        build(CUDAGraphTrainer).train(0, 20)
    trainer = build(CUDAGraphTrainer, tmp_path / "b", fallback="eager")
    with pytest.warns(RuntimeWarning, match="stand-in") as record:
        trainer.train(0, 20)
    assert len(record) == 1
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    step = trainer._hookloop.graph
    assert step.eager_reason is not None and int(step.counter) == 20


def test_static_batch_buffers_are_what_the_model_sees():
    class Seen(Net):
        def __init__(self) -> None:
            super().__init__()
            self.ptrs: List[int] = []

        def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
            self.ptrs.append(batch[0].data_ptr())
            return super().forward(batch)

    model = Seen()
    data = batches(4)
    trainer = CUDAGraphTrainer(
        model, data, torch.optim.SGD(model.parameters(), lr=0.1), graph="eager"
    )
    trainer.train(0, 8)
    # One static buffer, filled with each batch: never a loader's tensor.
    assert len(set(model.ptrs)) == 1
    assert model.ptrs[0] not in {x.data_ptr() for x, _ in data}


def test_batches_are_copied_outside_autograd():
    # A model that asks for its input's gradients makes the static batch require them, and a
    # loader's tensor may require them too: each batch is still copied in, as no part of an
    # autograd graph (the copy skips torch.no_grad() where nothing requires gradients).
    class InputGrad(Net):
        def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
            batch[0].requires_grad_(True)
            return super().forward(batch)

    def data() -> List[Any]:
        out = batches(4)
        out[1] = (out[1][0].clone().requires_grad_(True), out[1][1])
        return out

    eager = build(SimpleTrainer, data=data(), net=InputGrad)
    eager.train(0, 10)
    graphed = build(CUDAGraphTrainer, data=data(), net=InputGrad)
    graphed.train(0, 10)
    static = graphed._hookloop.graph.shapes[0].static[0]
    assert static.requires_grad and static.grad_fn is None  # a leaf: no copy was recorded
    a = eager.storage.history("loss_mse").values()
    assert graphed.storage.history("loss_mse").values() == a


def test_a_different_non_tensor_value_is_refused():
    class WithFlag(Net):
        def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
            return super().forward(batch[:2])

    data = [(x, y, "train") for x, y in batches(4)]
    data[3] = (data[3][0], data[3][1], "other")
    model = WithFlag()
    trainer = CUDAGraphTrainer(
        model, data, torch.optim.SGD(model.parameters(), lr=0.1), graph="eager", max_graphs=1
    )
    with pytest.raises(ValueError, match=r"a batch \(.*'other'\), but .*'train'\)"):
        trainer.train(0, 6)


def test_non_tensor_leaves_without_one_truth_value_are_compared_safely():
    # A numpy array's == is elementwise: such a leaf matches the captured one only as the
    # same object, and a different one is a clear error, not numpy's "truth value ambiguous".
    import numpy as np

    class WithArray(Net):
        def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
            return super().forward(batch[:2])

    same = np.arange(3)
    data = [(x, y, same) for x, y in batches(4)]
    model = WithArray()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    CUDAGraphTrainer(model, data, opt, graph="eager", max_graphs=1).train(0, 6)
    data[3] = (data[3][0], data[3][1], np.arange(3))
    trainer = CUDAGraphTrainer(model, data, opt, graph="eager", max_graphs=1)
    with pytest.raises(ValueError, match=r"array\(\[0, 1, 2\]\).*described alike.*numpy"):
        trainer.train(0, 6)


def test_loading_the_optimizer_drops_the_capture():
    trainer = build(CUDAGraphTrainer)
    trainer.train(0, 6)
    step = trainer._hookloop.graph
    assert step.captured
    trainer.optimizer.load_state_dict(trainer.optimizer.state_dict())
    assert not step.captured and step.shapes == []


def test_data_parallel_with_fallback_warns_once_and_trains_eagerly(tmp_path):
    two_dirs(tmp_path)
    build(SimpleTrainer, tmp_path / "a").train(0, 20)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(RuntimeWarning, match="DataParallel model"):
        trainer = CUDAGraphTrainer(
            torch.nn.DataParallel(model), batches(), opt, graph="eager", fallback="eager"
        )
    assert trainer._hookloop.graph.eager_reason is not None
    sched = WarmupParamScheduler(CosineParamScheduler(1, 0), 0.01, 0.1)
    writer = JSONWriter(str(tmp_path / "b" / "metrics.json"))
    trainer.register_hooks(
        [hooks.IterationTimer(), hooks.LRScheduler(opt, sched), hooks.PeriodicWriter([writer], 5)]
    )
    trainer.train(0, 20)
    assert_same_metrics(tmp_path / "a", tmp_path / "b")


def test_trainer_freed_by_refcount():
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        trainer = build(CUDAGraphTrainer)
        trainer.train(0, 6)
        ref = weakref.ref(trainer)
        del trainer
        assert ref() is None
    finally:
        gc.enable()


def test_a_subclass_that_skips_init_still_trains():
    class Own(CUDAGraphTrainer):
        def __init__(self, model: nn.Module, data: Any, opt: Any) -> None:
            # detectron2-style: the base's attributes by hand, no CUDAGraphTrainer.__init__
            HookBase.__init__(self)
            self._hooks, self.iter, self.start_iter = [], 0, 0
            self.model, self.data_loader, self.optimizer = model, data, opt
            self._data_loader_iter_obj = None
            self.gather_metric_period = 1

    model = Net()
    trainer = Own(model, batches(), torch.optim.SGD(model.parameters(), lr=0.1, fused=True))
    if HAS_CUDA:
        pytest.skip("the default seam would need the model on the device")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        trainer.train(0, 3)


def test_logging_quiet():
    # The trainer logs nothing at WARNING on an ordinary run.
    log = logging.getLogger("hookloop")
    records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        build(CUDAGraphTrainer).train(0, 5)
    finally:
        log.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.WARNING]
