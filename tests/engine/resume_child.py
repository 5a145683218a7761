"""A training run for the exact-resume tests, run as a child process:

    python resume_child.py OUT MAX_ITER [--kill-at N] [--kill-in-save N] [--async-save]
                                        [--loader KIND] [--precise-bn] [--mlflow] [--wandb]
                                        [--cuda-graph]

It trains a small model with dropout on a seeded random dataset drawn through
``hookloop.data.TrainingSampler``, with periodic and best checkpoints, an evaluation, an LR
schedule and the JSON and TensorBoard writers, always resuming from OUT when a checkpoint is
there. ``--kill-at N`` sends itself SIGKILL at the end of iteration N; ``--kill-in-save N``
does it in the middle of the checkpoint save of iteration N (after the file's bytes are
written, before the rename). ``--async-save`` saves checkpoints on a background thread.
``--loader`` picks the training data: ``sampler`` (the default, a ``TrainingSampler``),
``shuffle`` (``DataLoader(shuffle=True)``, finite: the run goes over it in epochs),
``shuffle-workers`` (the same with two workers), ``resident`` (a ``DeviceResidentLoader``,
finite: epochs with a last partial batch), ``resident-endless`` (the same over
TrainingSampler's endless stream), ``resident-augmented`` (finite, with an augmentation drawn
from its counter-based randoms) or ``generator`` (a plain generator, which cannot be
resumed). ``--precise-bn`` adds a BatchNorm layer and a ``PreciseBN`` hook over a
shuffled loader of its own. ``--mlflow`` adds an ``MLflowWriter`` (a sqlite store in OUT),
``--wandb`` a ``WandbWriter`` (offline, its runs under ``OUT/wandb/offline-run-*``).
``--cuda-graph`` trains with ``CUDAGraphTrainer`` through its eager seam (``graph="eager"``):
static buffers, the loss ring buffer, the LR table, and a capture dropped by the resume's load.
"""

import argparse
import itertools
import os
import signal

import torch
from hookloop.checkpoint import Checkpointer
from hookloop.data import DeviceResidentLoader, TrainingSampler
from hookloop.engine import CUDAGraphTrainer, HookBase, SimpleTrainer, hooks
from hookloop.utils.events import JSONWriter, TensorboardXWriter

torch.set_num_threads(1)


class _Jitter:
    """An augmentation of the inputs drawn from the loader's counter-based randoms."""

    def __call__(self, x, randoms):
        return x + 0.1 * randoms.uniform(*x.shape)


class Model(torch.nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        norm = [torch.nn.BatchNorm1d(16)] if bn else []
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16),
            *norm,
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(16, 1),
        )

    def forward(self, batch):
        x, y = batch
        out = self.net(x).squeeze(1)
        return {"loss_mse": ((out - y) ** 2).mean(), "loss_l1": (out - y).abs().mean() * 0.1}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("max_iter", type=int)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-in-save", type=int, default=-1)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--loader", default="sampler")
    p.add_argument("--precise-bn", action="store_true")
    p.add_argument("--mlflow", action="store_true", help="also an MLflowWriter (sqlite in out)")
    p.add_argument("--wandb", action="store_true", help="also a WandbWriter (offline, in out)")
    p.add_argument("--cuda-graph", action="store_true", help="CUDAGraphTrainer(graph='eager')")
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    xs = torch.randn(64, 4, generator=g)
    ys = xs.sum(1) + 0.1 * torch.randn(64, generator=g)
    train = torch.utils.data.TensorDataset(xs[:48], ys[:48])
    held_out = (xs[48:], ys[48:])
    torch.manual_seed(1)
    model = Model(bn=args.precise_bn)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.loader == "sampler":
        loader = torch.utils.data.DataLoader(
            train, batch_size=4, sampler=TrainingSampler(len(train), seed=3), num_workers=0
        )
    elif args.loader in ("shuffle", "shuffle-workers"):
        workers = 2 if args.loader == "shuffle-workers" else 0
        loader = torch.utils.data.DataLoader(
            train, batch_size=4, shuffle=True, num_workers=workers, persistent_workers=False
        )
    elif args.loader in ("resident", "resident-endless", "resident-augmented"):
        # On the CPU here: the same loader a GPU run keeps on the device. 48 samples in
        # batches of 5: epochs of 10 batches, the last one of 3 samples.
        augment = [_Jitter()] if args.loader == "resident-augmented" else []
        loader = DeviceResidentLoader(
            train, 5, seed=3, endless=args.loader == "resident-endless", augment=augment
        )
    elif args.loader == "generator":

        def batches():
            for i in itertools.count():
                j = (i * 4) % 48
                yield xs[j : j + 4], ys[j : j + 4]

        loader = batches()
    else:
        raise SystemExit(f"unknown --loader {args.loader}")
    if args.cuda_graph:
        trainer = CUDAGraphTrainer(model, loader, opt, graph="eager")
    else:
        trainer = SimpleTrainer(model, loader, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)
    ckpt = Checkpointer(model, args.out, trainer=trainer, async_save=args.async_save)

    def evaluate():
        model.eval()
        with torch.no_grad():
            out = model(held_out)["loss_mse"].item()
        model.train()
        return {"val": {"mse": out}}

    def kill():
        # The W&B writer's thread first hands the client what it holds (its offline init takes
        # a second or so, far longer than these iterations): the killed run's folder then has
        # points, those after its checkpoint among them, as a longer run's would.
        for writer in trackers:
            if type(writer).__name__ == "WandbWriter" and not writer.flush(60):
                raise SystemExit("the W&B writer did not flush within 60 s")
        os.kill(os.getpid(), signal.SIGKILL)

    class Kill(HookBase):
        def after_step(self):
            if self.trainer.iter == args.kill_at:
                kill()

    if args.kill_in_save >= 0:
        real_save = torch.save

        def save(obj, f, *a, **kw):
            real_save(obj, f, *a, **kw)
            if trainer.iter == args.kill_in_save:
                kill()

        torch.save = save

    precise = []
    if args.precise_bn:
        sampler = torch.utils.data.RandomSampler(train, replacement=True, num_samples=10**6)
        bn_loader = torch.utils.data.DataLoader(train, batch_size=4, sampler=sampler)
        precise = [hooks.PreciseBN(10, model, bn_loader, num_iter=3)]
    trackers = []
    if args.mlflow:
        from hookloop.utils.events import MLflowWriter

        db = os.path.join(os.path.abspath(args.out), "mlflow.db")
        trackers.append(MLflowWriter(f"sqlite:///{db}", experiment_name="resume"))
    if args.wandb:
        from hookloop.utils.events import WandbWriter

        out = os.path.abspath(args.out)
        # Offline, quiet, and nothing of the machine's user: no network, settings or keys.
        # WANDB_SERVICE: a W&B service of the process that started this one (a test that ran
        # the client in pytest's process publishes it there), which this run must not share.
        for name in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID"):
            os.environ.pop(name, None)
        os.environ.pop("WANDB_SERVICE", None)
        os.environ.pop("WANDB_RESUME", None)
        os.environ.update(
            WANDB_MODE="offline",
            WANDB_DIR=out,
            WANDB_CONFIG_DIR=os.path.join(out, "wandb_config"),
            WANDB_CACHE_DIR=os.path.join(out, "wandb_cache"),
            WANDB_DATA_DIR=os.path.join(out, "wandb_data"),
            WANDB_SILENT="true",
            WANDB_CONSOLE="off",
            WANDB_DISABLE_GIT="true",
            WANDB_DISABLE_CODE="true",
            WANDB_ERROR_REPORTING="false",
            WANDB_X_DISABLE_STATS="true",
            WANDB_X_DISABLE_META="true",
        )
        trackers.append(WandbWriter(project="resume", mode="offline", dir=out))
    trainer.register_hooks(
        [
            hooks.IterationTimer(),
            *precise,
            hooks.LRScheduler(scheduler=sched),
            hooks.PeriodicCheckpointer(ckpt, period=10, max_to_keep=2),
            hooks.EvalHook(10, evaluate),
            hooks.BestCheckpointer(10, ckpt, "val/mse", mode="min"),
            hooks.PeriodicWriter(
                [
                    JSONWriter(os.path.join(args.out, "metrics.json")),
                    TensorboardXWriter(args.out),
                    *trackers,
                ],
                period=5,
            ),
            Kill(),
        ]
    )
    ckpt.resume_or_load("", resume=True)
    start = trainer.iter + 1 if ckpt.has_checkpoint() else 0
    trainer.train(start, args.max_iter)


if __name__ == "__main__":
    main()
