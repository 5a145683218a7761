"""``python -m hookloop`` / ``hookloop``: the command line.

``hookloop demo`` trains a small model on generated data with ``SimpleTrainer`` and the
default hooks, printing detectron2-style progress lines and writing ``metrics.json`` and
TensorBoard event files into its output directory.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    from hookloop.engine import AMPTrainer, SimpleTrainer, hooks
    from hookloop.engine.train_loop import HookBase
    from hookloop.utils.events import CommonMetricPrinter, JSONWriter, TensorboardXWriter

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)

    # Generated data: points in 16-d space, a class from a hidden linear map, and a regression
    # target; a fixed pool of batches cycled forever, so data time stays near zero.
    dim, classes, batch = 16, 4, 64
    w_true = torch.randn(dim, classes)
    device = torch.device(args.device)
    pool = []
    for _ in range(64):
        x = torch.randn(batch, dim)
        y, t = (x @ w_true).argmax(1), (x @ w_true).sum(1, keepdim=True)
        pool.append((x.to(device), y.to(device), t.to(device)))

    def data() -> Iterator:
        while True:
            yield from pool

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(dim, 32), nn.ReLU())
            self.cls = nn.Linear(32, classes)
            self.reg = nn.Linear(32, 1)

        def forward(self, batch):  # type: ignore[no-untyped-def]
            x, y, t = batch
            h = self.body(x)
            return {
                "loss_cls": nn.functional.cross_entropy(self.cls(h), y),
                "loss_reg": 0.1 * nn.functional.smooth_l1_loss(self.reg(h), t),
            }

    class Visualize(HookBase):
        """Every `period` iterations: a weight histogram and an image of the first layer."""

        def __init__(self, period: int) -> None:
            self.period = period

        def after_step(self) -> None:
            if (self.trainer.iter + 1) % self.period:
                return
            trainer: Any = self.trainer
            weight = trainer.model.body[0].weight.detach()
            storage = self.trainer.storage
            storage.put_histogram("weights/body", weight)
            img = (weight - weight.min()) / (weight.max() - weight.min() + 1e-8)
            storage.put_image("weights/body", img[None].repeat(3, 1, 1))

    model = Model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer_cls = AMPTrainer if args.amp else SimpleTrainer
    trainer = trainer_cls(model, data(), optimizer)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.iters)
    writers = [
        CommonMetricPrinter(args.iters),
        JSONWriter(out / "metrics.json"),
        TensorboardXWriter(out),
    ]
    trainer.register_hooks(
        [
            hooks.IterationTimer(),
            hooks.LRScheduler(scheduler=scheduler),
            Visualize(max(args.iters // 10, 1)),
            hooks.PeriodicWriter(writers, period=args.period),
        ]
    )
    start = time.perf_counter()
    trainer.train(0, args.iters)
    elapsed = time.perf_counter() - start
    final = trainer.storage.history("total_loss").median(20)
    events = sorted(p.name for p in out.glob("events.out.tfevents.*"))
    print(
        f"\nhookloop demo: {args.iters} iterations in {elapsed:.2f} s "
        f"({args.iters / elapsed:,.0f} steps/s), final total_loss {final:.4f}"
    )
    print(f"  metrics:     {out / 'metrics.json'}")
    print(f"  tensorboard: {out}/{events[-1] if events else '(none)'}")
    print(f"  view with:   tensorboard --logdir {out}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hookloop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on generated data")
    demo.add_argument("--output", default="output/demo", help="directory for metrics and events")
    demo.add_argument("--iters", type=int, default=5000, help="iterations to train")
    demo.add_argument("--period", type=int, default=20, help="write metrics every N iterations")
    demo.add_argument("--lr", type=float, default=0.05)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    demo.add_argument("--amp", action="store_true", help="use AMPTrainer (bfloat16 on the CPU)")
    args = parser.parse_args(argv)
    if args.iters <= 0 or args.period <= 0:
        demo.error("--iters and --period must be positive")
    for name in ("iters", "period"):
        value = getattr(args, name)
        if value > 2**53:
            demo.error(f"--{name} must be at most 2**53 (an exact iteration), got {value}")
    try:
        Path(args.output).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        demo.error(f"--output {args.output!r} is not a usable directory: {e.strerror or e}")
    import torch

    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        demo.error(f"--device {args.device!r} is not usable here: {first_line}")
    logging.basicConfig(
        level=logging.INFO,
        format="[%(asctime)s %(name)s]: %(message)s",
        datefmt="%m/%d %H:%M:%S",
        stream=sys.stdout,
    )
    return _demo(args)


if __name__ == "__main__":
    sys.exit(main())
