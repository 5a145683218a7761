"""Stand-ins shared by the patterns: a tiny model, a deterministic data stream, optimizers.

They replace what surrounds the engine calls in the real code (datasets, detectors, configs);
the engine calls themselves stay in each pattern as the source writes them."""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterator

import torch
from torch import nn

#: The logger patterns log to (captured and compared like the engine's).
log = logging.getLogger("corpus")


class TinyDetector(nn.Module):
    """Returns a dict of two losses, as detectron2's meta-architectures do in training."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, batch: torch.Tensor) -> Any:
        feats = torch.tanh(self.backbone(batch))
        out = self.head(feats)
        if not self.training:
            return out
        return {
            "loss_cls": (out**2).mean(),
            "loss_box_reg": (feats.abs()).mean() * 0.5,
        }


class TinyRegressor(nn.Module):
    """Returns one loss tensor (SimpleTrainer names it ``total_loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return (self.fc(batch) ** 2).mean()


def batches(seed: int = 1, size: int = 3) -> Iterator[torch.Tensor]:
    """An endless stream of (size, 4) batches, the same for every engine."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(size, 4, generator=g)


def batch_list(n: int, seed: int = 1, size: int = 3) -> list:
    it = batches(seed, size)
    return [next(it) for _ in range(n)]


def sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def weights(model: nn.Module) -> Dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def preempted_before(E: Any, iteration: int) -> Any:
    """A hook that stands in for a job killed before ``iteration`` (a preemption): its
    ``before_step`` raises there, and the pattern then resumes in a new trainer."""

    class Preempted(E.HookBase):
        def before_step(self) -> None:
            if self.trainer.iter == iteration:
                raise RuntimeError(f"preempted before iteration {iteration}")

    return Preempted()
