"""``python -m hookloop`` / ``hookloop``: the command line.

``hookloop demo`` trains a small model on generated data with ``DefaultTrainer`` (warmup +
cosine schedule, evaluation on held-out data, periodic and best checkpoints), printing
detectron2-style progress lines (and a live progress bar on a terminal) and writing
``metrics.json``, TensorBoard event files and checkpoints into its output directory;
``--resume`` continues from the last checkpoint; ``--cuda-graph`` (with ``--device cuda``) trains
with ``CUDAGraphTrainer``.

``hookloop bench`` measures what the loop's bookkeeping costs on this machine: hookloop over
a bare loop, side by side with detectron2 when it is importable; ``--hook MODULE:CLASS`` adds
that hook's cost per iteration, ``--cuda-graph`` adds ``CUDAGraphTrainer`` over the hand-written
loop on a GPU, ``--quick`` makes the runs short, ``--json PATH`` keeps the rows (see
``hookloop.bench``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    from hookloop.data import DeviceResidentLoader, TrainingSampler
    from hookloop.engine import DefaultTrainer, TrainConfig, hooks
    from hookloop.engine.train_loop import HookBase
    from hookloop.utils.progress import ProgressBar

    torch.set_num_threads(1)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)

    # Generated data: points in 16-d space, a class from a hidden linear map, and a regression
    # target. 4096 training points, drawn in batches through a seeded TrainingSampler (so a
    # resumed run sees exactly the batches an uninterrupted one would), and 512 held out for
    # the evaluation.
    dim, classes, batch = 16, 4, 64
    g = torch.Generator().manual_seed(args.seed)
    w_true = torch.randn(dim, classes, generator=g)
    device = torch.device(args.device)
    xs = torch.randn(4096 + 512, dim, generator=g)
    ys, ts = (xs @ w_true).argmax(1), (xs @ w_true).sum(1, keepdim=True)
    xs, ys, ts = xs.to(device), ys.to(device), ts.to(device)
    train_x, train_y, train_t = xs[:4096], ys[:4096], ts[:4096]
    val_x, val_y = xs[4096:], ys[4096:]

    class Batches:
        """Batches of the training points in the sampler's order; resumable through the
        sampler's state."""

        def __init__(self) -> None:
            self.sampler = TrainingSampler(len(train_x), seed=args.seed)

        def __iter__(self) -> Iterator:
            indices = iter(self.sampler)
            while True:
                idx = torch.tensor([next(indices) for _ in range(batch)], device=device)
                yield train_x[idx], train_y[idx], train_t[idx]

        def state_dict(self) -> Any:
            return self.sampler.state_dict()

        def load_state_dict(self, state: Any) -> None:
            self.sampler.load_state_dict(state)

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

        def _dispatch_period(self, stage: str) -> Optional[int]:
            return self.period if stage == "after_step" else None

        def after_step(self) -> None:
            if (self.trainer.iter + 1) % self.period:
                return
            trainer: Any = self.trainer
            weight = trainer.model.body[0].weight.detach()
            storage = self.trainer.storage
            storage.put_histogram("weights/body", weight)
            img = (weight - weight.min()) / (weight.max() - weight.min() + 1e-8)
            storage.put_image("weights/body", img[None].repeat(3, 1, 1))

    class Interrupt(HookBase):
        """--interrupt-at N: a Ctrl-C at the end of iteration N - 1, to try --resume."""

        def after_step(self) -> None:
            if self.trainer.iter == args.interrupt_at - 1:
                # What a Ctrl-C runs here (Python's SIGINT handler, or one the program put in
                # its place), called directly: a SIGINT sent to ourselves never arrives in a
                # process that inherited it as ignored (a background job, nohup, CI runners).
                handler = signal.getsignal(signal.SIGINT)
                if not callable(handler):
                    handler = signal.default_int_handler
                handler(signal.SIGINT, sys._getframe())

    class DemoTrainer(DefaultTrainer):
        """DefaultTrainer with the demo's model, data and evaluation; its default hooks plus
        the weight images, a live progress line on a terminal and --interrupt-at."""

        @classmethod
        def build_model(cls, cfg: TrainConfig) -> nn.Module:
            return Model().to(device)

        @classmethod
        def build_train_loader(cls, cfg: TrainConfig) -> Any:
            if cfg.data_on_device:
                # The same batches (TrainingSampler's stream), gathered on the device.
                return DeviceResidentLoader(
                    (train_x, train_y, train_t), batch, seed=args.seed, endless=True
                )
            return Batches()

        @classmethod
        def test(cls, cfg: TrainConfig, model: nn.Module) -> Any:
            net: Any = model
            model.eval()
            with torch.no_grad():
                logits = net.cls(net.body(val_x))
                accuracy = (logits.argmax(1) == val_y).float().mean().item()
                loss = nn.functional.cross_entropy(logits, val_y).item()
            model.train()
            return {"val": {"accuracy": accuracy, "loss_cls": loss}}

        def build_hooks(self) -> List[Optional[HookBase]]:
            ret = super().build_hooks()
            # Before the writers, so that its images are written with the iteration's metrics.
            writer_at = next(
                (i for i, h in enumerate(ret) if isinstance(h, hooks.PeriodicWriter)), len(ret)
            )
            ret.insert(writer_at, Visualize(max(self.cfg.max_iter // 10, 1)))
            if sys.stderr.isatty():
                # Redrawn at most every 0.1 s; between redraws a write is one clock read.
                ret.append(hooks.PeriodicWriter([ProgressBar(self.cfg.max_iter)], period=1))
            if args.interrupt_at:
                ret.append(Interrupt())
            return ret

    cfg = TrainConfig(
        max_iter=args.iters,
        output_dir=str(out),
        checkpoint_period=args.checkpoint_period,
        max_to_keep=3,
        eval_period=args.eval_period,
        log_period=args.period,
        amp=args.amp,
        cuda_graph=args.cuda_graph,
        data_on_device=args.data_on_device,
        base_lr=args.lr,
        weight_decay=0.0,
        warmup_iters=max(1, min(100, args.iters // 10)),
        rescale_interval=True,
        best_metric="val/accuracy",
        best_mode="max",
        seed=args.seed,
        trackers=tuple(
            t for t, on in (("mlflow", args.mlflow is not None), ("wandb", args.wandb)) if on
        ),
    )
    if args.mlflow:
        os.environ["MLFLOW_TRACKING_URI"] = args.mlflow
    trainer = DemoTrainer(cfg)
    trainer.resume_or_load(resume=args.resume)
    start_iter = trainer.start_iter
    checkpointer = trainer.checkpointer
    if start_iter >= args.iters:
        print(f"hookloop demo: {out} already holds a run of {args.iters} iterations")
        return 0
    if start_iter:
        print(f"hookloop demo: resuming from {checkpointer.get_checkpoint_file()}")
    start = time.perf_counter()
    try:
        trainer.train()
    except KeyboardInterrupt:
        print(
            f"\nhookloop demo: interrupted at iteration {trainer.iter}; the last checkpoint is "
            f"{checkpointer.get_checkpoint_file()}\n"
            f"  continue with: hookloop demo --output {out} --iters {args.iters} --resume"
        )
        return 130
    elapsed = time.perf_counter() - start
    done = args.iters - start_iter
    final = trainer.storage.history("total_loss").median(20)
    events = sorted(p.name for p in out.glob("events.out.tfevents.*"))
    checkpoints = sorted(p.name for p in out.glob("*.pth"))
    accuracy = trainer.storage.latest().get("val/accuracy", (float("nan"), 0))[0]
    print(
        f"\nhookloop demo: {done} iterations in {elapsed:.2f} s "
        f"({done / elapsed:,.0f} steps/s), final total_loss {final:.4f}, "
        f"held-out accuracy {accuracy:.3f}"
    )
    print(f"  metrics:     {out / 'metrics.json'}")
    print(f"  tensorboard: {out}/{events[-1] if events else '(none)'}")
    print(f"  checkpoints: {out}/{{{', '.join(checkpoints)}}}")
    print(f"  view with:   tensorboard --logdir {out}")
    print(f"  resume with: hookloop demo --output {out} --iters N --resume")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hookloop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on generated data")
    bench = sub.add_parser(
        "bench",
        help="measure the training loop's bookkeeping overhead on this machine",
        description="Bookkeeping overhead per iteration: hookloop over a bare loop, side by side "
        "with detectron2 when it is importable.",
    )
    bench.add_argument("--quick", action="store_true", help="short runs (a few seconds)")
    bench.add_argument("--json", metavar="PATH", help="also write the machine and the rows as JSON")
    bench.add_argument(
        "--hook",
        metavar="MODULE:CLASS",
        help="also measure this hook's cost per iteration (the class is made with no arguments)",
    )
    bench.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also measure CUDAGraphTrainer over the hand-written loop on the GPU (needs CUDA)",
    )
    demo.add_argument("--output", default="output/demo", help="directory for metrics and events")
    demo.add_argument("--iters", type=int, default=5000, help="iterations to train")
    demo.add_argument("--period", type=int, default=20, help="write metrics every N iterations")
    demo.add_argument("--lr", type=float, default=0.05)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    demo.add_argument("--amp", action="store_true", help="use AMPTrainer (bfloat16 on the CPU)")
    demo.add_argument(
        "--cuda-graph",
        action="store_true",
        help="capture the whole step as one CUDA graph (CUDAGraphTrainer; needs --device cuda)",
    )
    demo.add_argument(
        "--data-on-device",
        action="store_true",
        help="gather the batches on --device with hookloop.data.DeviceResidentLoader",
    )
    demo.add_argument(
        "--checkpoint-period", type=int, default=1000, help="save a checkpoint every N iterations"
    )
    demo.add_argument(
        "--eval-period", type=int, default=500, help="evaluate on held-out data every N iterations"
    )
    demo.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in --output"
    )
    demo.add_argument(
        "--interrupt-at",
        type=int,
        default=None,
        metavar="N",
        help="act as if Ctrl-C was pressed after iteration N - 1 (to try --resume)",
    )
    demo.add_argument(
        "--mlflow",
        nargs="?",
        const="",
        metavar="URI",
        help="also log to MLflow (default: sqlite:///<output>/mlflow.db, or MLFLOW_TRACKING_URI)",
    )
    demo.add_argument(
        "--wandb", action="store_true", help="also log to Weights & Biases (offline by default)"
    )
    args = parser.parse_args(argv)
    if args.command == "bench":
        raw = list(sys.argv[1:] if argv is None else argv)
        args.argv = raw[raw.index("bench") + 1 :] if "bench" in raw else []
        from hookloop import bench as bench_module  # imports torch

        return bench_module.run(args, bench)
    for name in ("iters", "period", "checkpoint_period", "eval_period"):
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value <= 0:
            demo.error(f"{flag} must be positive, got {value}")
        if value > 2**53:
            demo.error(f"{flag} must be at most 2**53 (an exact iteration), got {value}")
    if args.interrupt_at is not None and not 0 < args.interrupt_at <= args.iters:
        demo.error(
            f"--interrupt-at must be between 1 and --iters ({args.iters}), got {args.interrupt_at}"
        )
    if not (math.isfinite(args.lr) and args.lr > 0):
        demo.error(f"--lr must be a positive finite number, got {args.lr}")
    if args.seed >= 2**32:
        demo.error(
            f"--seed must be below 2**32 (negative: a seed drawn from the OS), got {args.seed}"
        )
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
    if args.cuda_graph and device.type != "cuda":
        demo.error(f"--cuda-graph needs a CUDA device (--device cuda), got --device {args.device}")
    logging.basicConfig(
        level=logging.INFO,
        format="[%(asctime)s %(name)s]: %(message)s",
        datefmt="%m/%d %H:%M:%S",
        stream=sys.stdout,
    )
    return _demo(args)


if __name__ == "__main__":
    sys.exit(main())
