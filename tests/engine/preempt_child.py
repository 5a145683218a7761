"""A training run for the preemption test, run as a child process:

    python preempt_child.py OUT MAX_ITER [--signal-at N]

It trains a small model with dropout on a seeded dataset drawn through
``hookloop.data.TrainingSampler``, with ``PreemptionHandler`` and a ``PeriodicCheckpointer``,
resuming from OUT when a checkpoint is there. ``--signal-at N`` sends itself SIGTERM in the
``after_step`` of iteration N (a hook registered before the handler: deterministic).
"""

import argparse
import os
import signal

import torch
from hookloop.checkpoint import Checkpointer
from hookloop.data import TrainingSampler
from hookloop.engine import HookBase, SimpleTrainer, hooks


def run(out, max_iter, signal_at=-1):
    """Trains to ``max_iter``, resuming from ``out``; returns the model's state_dict."""
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(48, 4, generator=g)
    ys = xs.sum(1) + 0.1 * torch.randn(48, generator=g)
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, batch):
            x, y = batch
            return ((self.net(x).squeeze(1) - y) ** 2).mean()

    m = Model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xs, ys),
        batch_size=4,
        sampler=TrainingSampler(len(xs), seed=3),
        num_workers=0,
    )
    trainer = SimpleTrainer(m, loader, opt)
    ckpt = Checkpointer(m, out, trainer=trainer)

    class SendSignal(HookBase):
        def after_step(self):
            if self.trainer.iter == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer.register_hooks(
        [
            hooks.PeriodicCheckpointer(ckpt, period=10),
            SendSignal(),
            hooks.PreemptionHandler(),
        ]
    )
    ckpt.resume_or_load("", resume=True)
    start = trainer.iter + 1 if ckpt.has_checkpoint() else 0
    trainer.train(start, max_iter)
    return m.state_dict()


def main():
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("max_iter", type=int)
    p.add_argument("--signal-at", type=int, default=-1)
    args = p.parse_args()
    run(args.out, args.max_iter, args.signal_at)


if __name__ == "__main__":
    main()
