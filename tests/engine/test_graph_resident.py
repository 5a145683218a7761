"""CUDAGraphTrainer with a DeviceResidentLoader: the graph makes the batch itself (the gather
by a device position into the epoch's permutation, the augmentations from a device counter),
and sees exactly the batches SimpleTrainer sees with the same loader.

The CPU tests run the eager seam (``graph="eager"``) and ``HeldSeam`` (what a CUDA graph
holds from its capture on); the CUDA test (marked, skipped without a device) captures it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from hookloop.data import DeviceResidentLoader, Normalize, RandomCrop, RandomHorizontalFlip
from hookloop.engine import CUDAGraphTrainer, SimpleTrainer, hooks
from hookloop.engine.train_loop import HookBase
from hookloop.utils.events import JSONWriter
from test_cuda_graph import HeldSeam, assert_same_metrics, metrics, params, two_dirs
from torch import nn

# 22 samples in batches of 4: epochs of 6 batches, the last one of 2.
SIZE, BATCH = 22, 4


class Recorder(nn.Module):
    """Records each batch it sees (the sample indices and the augmented images)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 1)
        self.seen: List[Any] = []

    def forward(self, batch: Any) -> Dict[str, torch.Tensor]:
        x, y, idx = batch
        self.seen.append((idx.clone(), x.clone()))
        out = self.head(x.flatten(1)).squeeze(1)
        return {"loss_mse": ((out - y) ** 2).mean(), "loss_l1": 0.1 * (out - y).abs().mean()}


def loader(device: Any = None, **kw: Any) -> DeviceResidentLoader:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SIZE, 1, 4, 4, generator=g)
    y = x.mean((1, 2, 3))
    augment = [RandomCrop(4, padding=1), RandomHorizontalFlip(), Normalize([0.1], [2.0])]
    return DeviceResidentLoader(
        (x, y, torch.arange(SIZE)), BATCH, seed=7, augment=augment, device=device, **kw
    )


def build(
    cls: type, out: Optional[Path] = None, held: bool = False, device: Any = None, **kw: Any
) -> Any:
    torch.manual_seed(0)
    model = Recorder().to(device)
    fused = {"fused": True} if device is not None else {}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **fused)
    extra = {"graph": "eager"} if cls is CUDAGraphTrainer and device is None else {}
    if cls is CUDAGraphTrainer:
        extra["warmup_iters"] = 1
    trainer = cls(model, loader(device, **kw), opt, **extra)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15], gamma=0.5)
    hs: List[Any] = [hooks.IterationTimer(), hooks.LRScheduler(opt, sched)]
    if out is not None:
        hs.append(hooks.PeriodicWriter([JSONWriter(str(out / "metrics.json"))], period=3))
    trainer.register_hooks(hs)
    if held:
        trainer._hookloop.graph._new_seam = lambda: HeldSeam(trainer)
    return trainer


def assert_same_batches(a: List[Any], b: List[Any]) -> None:
    assert len(a) == len(b)
    for i, ((ia, xa), (ib, xb)) in enumerate(zip(a, b)):
        assert torch.equal(ia, ib), (i, ia, ib)
        assert torch.equal(xa, xb), i


def assert_made_by_the_graph(trainer: Any, sizes: set) -> None:
    step = trainer._hookloop.graph
    assert step.source is not None
    assert {s.size for s in step.shapes} == sizes  # no static batch: nothing placed
    assert step.captured


@pytest.mark.parametrize("held", [False, True], ids=["eager-seam", "held-seam"])
@pytest.mark.parametrize("endless", [False, True], ids=["epochs", "endless"])
def test_the_graph_makes_the_batches_simple_trainer_sees(tmp_path, held, endless):
    # 40 iterations: six epochs and a part, each with its last batch of 2 (a graph of its own).
    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", endless=endless)
    eager.train(0, 40)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", held=held, endless=endless)
    graphed.train(0, 40)
    assert_made_by_the_graph(graphed, {BATCH} if endless else {BATCH, 2})
    assert_same_batches(eager.model.seen, graphed.model.seen)
    if not endless:
        assert [len(i) for i, _ in eager.model.seen[:6]] == [4, 4, 4, 4, 4, 2]
        assert graphed.epoch == eager.epoch == 6
    assert_same_metrics(tmp_path / "a", tmp_path / "b")
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    assert graphed.data_loader.state_dict() == eager.data_loader.state_dict()


@pytest.mark.parametrize("endless", [False, True], ids=["epochs", "endless"])
@pytest.mark.parametrize("at", [8, 11])  # mid-epoch; the end of an epoch (its 2nd)
def test_a_resumed_graph_trainer_continues_with_the_batches_of_the_straight_run(
    tmp_path, endless, at
):
    saved: Dict[str, Any] = {}

    class Save(HookBase):  # a checkpoint at the end of iteration `at`, as a checkpointer's
        def after_step(self) -> None:
            if self.trainer.iter == at:
                saved["state"] = copy.deepcopy(self.trainer.state_dict())
                saved["model"] = copy.deepcopy(self.trainer.model.state_dict())

    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", endless=endless)
    eager.train(0, 30)
    straight = build(CUDAGraphTrainer, held=True, endless=endless)
    straight.register_hooks([Save()])
    straight.train(0, 30)
    assert_same_batches(eager.model.seen, straight.model.seen)

    resumed = build(CUDAGraphTrainer, held=True, endless=endless)
    writer = JSONWriter(str(tmp_path / "b" / "metrics.json"))
    resumed.register_hooks([hooks.PeriodicWriter([writer], period=3)])
    resumed.model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["state"])
    resumed.train(at + 1, 30)
    assert_made_by_the_graph(resumed, {BATCH} if endless else {BATCH, 2})
    assert_same_batches(eager.model.seen[at + 1 :], resumed.model.seen)
    for p, q in zip(params(straight.model), params(resumed.model)):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    tail = [r for r in metrics(tmp_path / "a") if r["iteration"] > at]
    got = [r for r in metrics(tmp_path / "b") if r["iteration"] > at]
    assert [r["iteration"] for r in got] == [r["iteration"] for r in tail]
    for x, y in zip(tail, got):
        for k in x:
            assert y[k] == pytest.approx(x[k], rel=1e-6, abs=1e-9), (x["iteration"], k)


def test_a_loader_on_another_device_is_placed_as_before():
    trainer = build(CUDAGraphTrainer)
    assert trainer.data_loader.graph_source("meta") is None
    trainer.data_loader.device = torch.device("meta")  # as if the data lived elsewhere
    trainer._hookloop.graph.prepare(trainer, trainer._hooks)
    assert trainer._hookloop.graph.source is None


def test_the_iterator_skips_with_the_same_bookkeeping():
    made, skipped = loader(), loader()
    a, b = iter(made), iter(skipped)
    for _ in range(4):
        next(a)
        b.skip()  # type: ignore[attr-defined]
    assert made.state_dict() == skipped.state_dict()
    assert torch.equal(next(a)[2], next(b)[2])
    next(a), next(b)
    with pytest.raises(StopIteration):
        b.skip()  # type: ignore[attr-defined]
    with pytest.raises(StopIteration):
        next(a)
    assert made.state_dict() == skipped.state_dict()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_the_captured_gather_matches_simple_trainer(tmp_path):
    two_dirs(tmp_path)
    eager = build(SimpleTrainer, tmp_path / "a", device="cuda")
    eager.train(0, 40)
    graphed = build(CUDAGraphTrainer, tmp_path / "b", device="cuda")
    graphed.train(0, 40)
    step = graphed._hookloop.graph
    assert {s.size for s in step.shapes} == {BATCH, 2} and step.captured
    # The model records at the warm-ups and the captures only (a replay rewrites what the
    # capture recorded): the replays' batches show in the losses and weights.
    assert_same_metrics(tmp_path / "a", tmp_path / "b", rel=1e-4)
    for p, q in zip(params(eager.model), params(graphed.model)):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
