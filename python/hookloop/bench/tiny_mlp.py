"""The end-to-end tiny model of issue 11, for ``hookloop bench`` and ``benches/gpu_check.py``.

Linear 32→64, ReLU, Linear 64→1 on batches of 16, SGD with momentum, four losses: a step
cheap enough (a few hundred µs on one CPU thread) that the training loop's bookkeeping shows.
The same model calls are made three ways: by a hand-written loop (:func:`hand_loop`, the
floor: data, forward, sum, zero_grad, backward, step), by each engine's ``SimpleTrainer`` or
``AMPTrainer`` (:func:`make_trainer`), and each is timed to the end of its last iteration
(:func:`time_hand`, :func:`time_trainer`), after waiting for the device.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hookloop.bench import overhead

__all__ = [
    "TinyMLP",
    "make_batches",
    "build",
    "hand_loop",
    "make_trainer",
    "time_hand",
    "time_trainer",
    "amp_settings",
]

Batch = Tuple[torch.Tensor, torch.Tensor]


class TinyMLP(nn.Module):
    """Linear 32→64, ReLU, Linear 64→1; four losses from one prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, batch: Batch) -> Dict[str, torch.Tensor]:
        x, y = batch
        pred = self.net(x)
        err = pred - y
        return {
            "loss_mse": (err * err).mean(),
            "loss_l1": err.abs().mean(),
            "loss_huber": nn.functional.smooth_l1_loss(pred, y),
            "loss_reg": 1e-4 * (pred * pred).mean(),
        }


def make_batches(
    device: Any = "cpu", count: int = 64, batch: int = 16, seed: int = 0
) -> List[Batch]:
    """``count`` batches of generated regression data, already on ``device`` (the data path
    stays out of the figure); a loader cycles through them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 1, generator=g)
    out = []
    for _ in range(count):
        x = torch.randn(batch, 32, generator=g)
        out.append((x.to(device), (x @ w).to(device)))
    return out


def build(
    device: Any = "cpu", seed: int = 0
) -> Tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The model, SGD with momentum, and torch's MultiStepLR (as in issue 11's measurement)."""
    torch.manual_seed(seed)
    model = TinyMLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10**9], gamma=0.1)
    return model, opt, sched


def amp_settings(device: torch.device) -> Tuple[str, torch.dtype, bool]:
    """What AMPTrainer uses: float16 with a GradScaler on CUDA, bfloat16 without on the CPU."""
    if device.type == "cuda":
        return "cuda", torch.float16, True
    return "cpu", torch.bfloat16, False


def hand_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: Iterator[Batch],
    n: int,
    amp: bool = False,
    scaler: Optional[Any] = None,
) -> None:
    """The same model calls as ``SimpleTrainer.run_step`` (``AMPTrainer.run_step`` with
    ``amp``), with no bookkeeping: no timing, no metrics, no hooks."""
    model.train()
    if not amp:
        for _ in range(n):
            loss_dict = model(next(data))
            losses = sum(loss_dict.values())
            opt.zero_grad()
            losses.backward()  # type: ignore[union-attr]
            opt.step()
        return
    device_type, dtype, _ = amp_settings(next(model.parameters()).device)
    assert scaler is not None
    for _ in range(n):
        with torch.autocast(device_type=device_type, dtype=dtype):
            loss_dict = model(next(data))
            losses = sum(loss_dict.values())
        opt.zero_grad()
        scaler.scale(losses).backward()
        scaler.step(opt)
        scaler.update()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_hand(device: torch.device, batches: Sequence[Batch], n: int, amp: bool = False) -> float:
    """Seconds for ``n`` steps of :func:`hand_loop` on a fresh model."""
    model, opt, _ = build(device)
    data = itertools.cycle(batches)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_settings(device)[2]) if amp else None
    _sync(device)
    t0 = time.perf_counter()
    hand_loop(model, opt, data, n, amp, scaler)
    _sync(device)
    return time.perf_counter() - t0


def _ref_amp_trainer() -> Any:
    """detectron2's AMPTrainer.run_step over the reference SimpleTrainer (the reference has
    no AMPTrainer of its own)."""
    from hookloop import _d2_reference as ref

    class RefAMPTrainer(ref.SimpleTrainer):  # type: ignore[misc]
        def __init__(self, model: nn.Module, data_loader: Any, optimizer: Any) -> None:
            super().__init__(model, data_loader, optimizer)
            device = next(model.parameters()).device
            self._device_type, self.precision, enabled = amp_settings(device)
            self.grad_scaler = torch.amp.GradScaler(self._device_type, enabled=enabled)

        def run_step(self) -> None:
            assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
            start = time.perf_counter()
            data = next(self._data_loader_iter)
            data_time = time.perf_counter() - start
            with torch.autocast(device_type=self._device_type, dtype=self.precision):
                loss_dict = self.model(data)
                losses = sum(loss_dict.values())
            self.optimizer.zero_grad()
            self.grad_scaler.scale(losses).backward()
            self.after_backward()
            self._write_metrics(loss_dict, data_time)
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()

    return RefAMPTrainer


_TIMED: Dict[Tuple[str, bool], Any] = {}


def _trainer_cls(impl: str, amp: bool) -> Any:
    """The engine's SimpleTrainer or AMPTrainer, subclassed to record when the last iteration
    ended (after waiting for the device), before after_train's final write and close."""
    key = (impl, amp)
    if key not in _TIMED:
        if not amp:
            base: Any = overhead.engine(impl).SimpleTrainer
        elif impl == "hl":
            from hookloop.engine import AMPTrainer

            base = AMPTrainer
        elif impl == "ref":
            base = _ref_amp_trainer()
        else:
            from detectron2.engine import AMPTrainer as D2AMPTrainer

            base = D2AMPTrainer

        class Timed(base):  # type: ignore[misc, valid-type]
            loop_end: float = 0.0

            def after_train(self) -> None:
                try:
                    _sync(next(self.model.parameters()).device)
                    self.loop_end = time.perf_counter()
                finally:  # the hooks' after_train (writers close) also when that raised
                    super().after_train()

        _TIMED[key] = Timed
    return _TIMED[key]


def make_trainer(
    impl: str,
    device: torch.device,
    batches: Sequence[Batch],
    n: int,
    tmpdir: str,
    hooks: str = "stack",
    amp: bool = False,
    period: int = 20,
    extra: Sequence[Callable[[], Any]] = (),
    writers: Sequence[str] = overhead.ALL_WRITERS,
) -> Any:
    """Engine ``impl``'s trainer on a fresh tiny model. ``hooks``: ``"stack"`` for
    IterationTimer + LRScheduler(MultiStepLR) + PeriodicWriter([printer, JSON, TensorBoard],
    ``period``) in detectron2's order (``writers`` picks a subset), ``"none"`` for none;
    ``extra`` makes more hooks (registered after those)."""
    model, opt, sched = build(device)
    t = _trainer_cls(impl, amp)(model, itertools.cycle(batches), opt)
    hs: List[Any] = []
    if hooks == "stack":
        e = overhead.engine(impl)
        d = tempfile.mkdtemp(prefix=f"mlp-{impl}-", dir=tmpdir)
        hs = overhead.stack_hooks(e, opt, sched, period, n, d, writers)
    hs += [make() for make in extra]
    t.register_hooks(hs)
    return t


def time_trainer(trainer: Any, n: int) -> float:
    """Seconds from the start of ``train(0, n)`` to the end of its last iteration."""
    _sync(next(trainer.model.parameters()).device)
    t0 = time.perf_counter()
    trainer.train(0, n)
    return float(trainer.loop_end - t0)
