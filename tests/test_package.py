"""The package surface: cheap import, the CLI demo (the README's main job), the build profile."""

from __future__ import annotations

import json
import signal
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
    # 299 is the last iteration; the evaluation after training is put at 300 (detectron2's).
    assert [x["iteration"] for x in lines] == [*range(19, 300, 20), 300]
    assert set(lines[-1]) == {"iteration", "val/accuracy", "val/loss_cls"}
    assert lines[-2]["total_loss"] < lines[0]["total_loss"]  # it learns
    assert lines[-1]["val/accuracy"] > 0.5
    assert "checkpoints:" in proc.stdout and (out / "model_final.pth").exists()
    assert (out / "last_checkpoint").read_text().strip() == "model_final.pth"

    (event_file,) = out.glob("events.out.tfevents.*")
    acc = EventAccumulator(str(event_file), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("total_loss")]
    assert steps == [x["iteration"] for x in lines[:-1]]
    assert acc.Tags()["images"] == ["weights/body"]
    assert acc.Tags()["histograms"] == ["weights/body"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--iters", "0"], "--iters must be positive, got 0"),
        (["--period", str(10**20)], "--period must be at most 2**53"),
        (["--checkpoint-period", "-1"], "--checkpoint-period must be positive"),
        (["--device", "nope"], "--device 'nope' is not usable here"),
    ],
)
def test_demo_rejects_bad_arguments_with_one_usage_line(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "hookloop", "demo", *args], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_demo_interrupt_does_not_depend_on_the_inherited_sigint(tmp_path):
    """``--interrupt-at`` stops the run as Ctrl-C would even when the process inherited
    SIGINT as ignored (a background job, nohup, some CI runners), where a signal sent to
    itself would never arrive."""
    proc = subprocess.run(
        [sys.executable, "-m", "hookloop", "demo", "--output", str(tmp_path), "--iters", "60"]
        + ["--checkpoint-period", "20", "--eval-period", "1000", "--interrupt-at", "40"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.returncode == 130, proc.stderr
    assert "interrupted at iteration 39" in proc.stdout


@pytest.mark.slow
def test_demo_resumes_where_it_stopped(tmp_path):
    """Interrupted (Ctrl-C) after its checkpoint at 199, then resumed to 300: the metrics
    equal a run that went to 300 at once, apart from wall-clock times."""
    common = ["--checkpoint-period", "100", "--eval-period", "100"]

    def demo(out, iters, *extra, rc=0):
        cmd = [sys.executable, "-m", "hookloop", "demo", "--output", str(out), "--iters"]
        proc = subprocess.run(
            [*cmd, str(iters), *common, *extra], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == rc, proc.stderr
        return proc

    demo(tmp_path / "straight", 300)
    stopped = demo(tmp_path / "resumed", 300, "--interrupt-at", "200", rc=130)
    assert "interrupted at iteration 199" in stopped.stdout
    proc = demo(tmp_path / "resumed", 300, "--resume")
    assert "resuming from" in proc.stdout

    def rows(out):
        timing = {"time", "data_time", "rank_data_time", "eta_seconds"}
        lines = (out / "metrics.json").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in timing} for x in lines]

    assert rows(tmp_path / "resumed") == rows(tmp_path / "straight")
