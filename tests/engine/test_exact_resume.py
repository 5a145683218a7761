"""The headline guarantee: a run killed with SIGKILL at any moment (before its first checkpoint
too, and while an asynchronous save is on its way to the disk) and restarted with resume ends
exactly as a run that was never interrupted: the same weights,
optimizer and scheduler state, best-checkpoint record, metrics.json (the same iterations, none
twice, none missing, the same values) and TensorBoard curves (one value per step)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

CHILD = Path(__file__).with_name("resume_child.py")
MAX_ITER = 40
TIMEOUT = 120
# Wall-clock metrics differ between any two runs; everything else must be identical.
TIMING = {"time", "data_time", "rank_data_time", "eta_seconds"}


def run(out: Path, *extra: str) -> int:
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(out), str(MAX_ITER), *extra],
        capture_output=True,
        timeout=TIMEOUT,
    )
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(proc.stderr.decode())
    return proc.returncode


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    assert run(out) == 0
    return out


def metrics(out: Path):
    rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def scalars(out: Path, tag: str):
    # The directory, as TensorBoard reads a run: every event file in it, in order.
    acc = EventAccumulator(str(out), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill",
    [
        ["--kill-at", "14"],
        ["--kill-at", "33"],
        ["--kill-in-save", "19"],
        ["--kill-at", "6"],
        ["--kill-at", "10", "--async-save"],
        ["--kill-at", "23", "--async-save"],
    ],
    ids=[
        "mid-period",
        "late",
        "during-save",
        "before-the-first-checkpoint",
        "async-save-in-flight",
        "async-mid-period",
    ],
)
def test_killed_and_resumed_run_equals_uninterrupted_run(straight, tmp_path, kill):
    assert run(tmp_path, *kill) == -signal.SIGKILL
    assert run(tmp_path, *[a for a in kill if a == "--async-save"]) == 0

    a, b = load(straight / "model_final.pth"), load(tmp_path / "model_final.pth")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    ta, tb = a["trainer"], b["trainer"]
    assert ta["iteration"] == tb["iteration"] == MAX_ITER - 1
    for idx, state in ta["optimizer"]["state"].items():
        assert torch.equal(
            state["momentum_buffer"], tb["optimizer"]["state"][idx]["momentum_buffer"]
        )
    assert ta["optimizer"]["param_groups"] == tb["optimizer"]["param_groups"]
    assert ta["hooks"]["LRScheduler"] == tb["hooks"]["LRScheduler"]
    assert ta["hookloop_hooks"]["BestCheckpointer"] == tb["hookloop_hooks"]["BestCheckpointer"]
    best_a, best_b = load(straight / "model_best.pth"), load(tmp_path / "model_best.pth")
    for k, v in best_a["model"].items():
        assert torch.equal(v, best_b["model"][k]), k

    rows_a, rows_b = metrics(straight), metrics(tmp_path)
    iters = [r["iteration"] for r in rows_b]
    assert len(iters) == len(set(iters)), "an iteration was written twice"
    assert rows_b == rows_a

    for tag in ("total_loss", "lr", "val/mse"):
        points = scalars(tmp_path, tag)
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{tag}: a step was written twice"
        assert points == scalars(straight, tag)
