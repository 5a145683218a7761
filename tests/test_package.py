"""The package surface: cheap import, the CLI demo (the README's main job), the build profile."""

from __future__ import annotations

import json
import subprocess
import sys

import hookloop
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def test_importing_hookloop_and_events_does_not_import_torch():
    code = (
        "import sys, hookloop, hookloop.utils.events; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_version_and_build_profile():
    assert hookloop.__version__.count(".") == 2
    assert hookloop.BUILD_PROFILE in ("release", "debug")


@pytest.mark.slow
def test_demo_trains_and_writes_metrics_and_events(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "hookloop", "demo", "--iters", "300", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # Progress lines in detectron2's format, then the summary.
    assert "Starting training from iteration 0" in proc.stdout
    assert " iter: 19  total_loss: " in proc.stdout
    assert "hookloop demo: 300 iterations in" in proc.stdout

    lines = [json.loads(x) for x in (out / "metrics.json").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == list(range(19, 300, 20))  # 299 is the last
    assert lines[-1]["total_loss"] < lines[0]["total_loss"]  # it learns

    (event_file,) = out.glob("events.out.tfevents.*")
    acc = EventAccumulator(str(event_file), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("total_loss")]
    assert steps == [x["iteration"] for x in lines]
    assert acc.Tags()["images"] == ["weights/body"]
    assert acc.Tags()["histograms"] == ["weights/body"]


def test_demo_rejects_bad_arguments():
    proc = subprocess.run(
        [sys.executable, "-m", "hookloop", "demo", "--iters", "0"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "--iters and --period must be positive" in proc.stderr
