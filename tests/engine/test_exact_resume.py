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


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(out), str(MAX_ITER), *extra],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(proc.stderr)
    return proc


_STRAIGHT = {}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run of a configuration (its options), made once per module."""

    def get(*config):
        if config not in _STRAIGHT:
            out = tmp_path_factory.mktemp("straight")
            assert run(out, *config).returncode == 0
            _STRAIGHT[config] = out
        return _STRAIGHT[config]

    return get


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
    config = tuple(a for a in kill if a == "--async-save")
    assert_resumed_equals_straight(straight(*config), tmp_path, kill, config)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, kill",
    [
        (("--loader", "shuffle"), "14"),
        (("--loader", "shuffle"), "23"),
        (("--loader", "shuffle"), "33"),
        (("--loader", "shuffle-workers"), "17"),
        (("--precise-bn",), "14"),
        (("--precise-bn",), "33"),
        (("--precise-bn", "--loader", "shuffle"), "25"),
    ],
    ids=[
        "shuffle-mid-epoch",
        "shuffle-epoch-end",
        "shuffle-third-epoch",
        "shuffle-workers",
        "precise-bn",
        "precise-bn-late",
        "precise-bn-shuffle",
    ],
)
def test_shuffled_loaders_and_precise_bn_resume_exactly(straight, tmp_path, config, kill):
    """DataLoader(shuffle=True) (whose epoch order comes from torch's RNG when the epoch
    starts) and PreciseBN (whose loader continues across its runs) resume to the batches of
    the uninterrupted run: the same weights, BN statistics, optimizer and curves."""
    assert_resumed_equals_straight(straight(*config), tmp_path, ["--kill-at", kill], config)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, kill",
    [
        (("--loader", "resident"), ["--kill-at", "14"]),
        (("--loader", "resident"), ["--kill-at", "19"]),
        (("--loader", "resident-endless"), ["--kill-at", "23"]),
        (("--loader", "resident-augmented"), ["--kill-at", "33"]),
        (("--loader", "resident", "--cuda-graph"), ["--kill-at", "25"]),
    ],
    ids=["mid-epoch", "epoch-end", "endless", "augmented", "cuda-graph-eager"],
)
def test_a_device_resident_loader_resumes_exactly(straight, tmp_path, config, kill):
    """DeviceResidentLoader (its epochs with a partial last batch, its endless stream, its
    counter-based augmentations; under CUDAGraphTrainer's eager seam too), killed and
    resumed: the batches, weights, optimizer and curves of the uninterrupted run."""
    assert_resumed_equals_straight(straight(*config), tmp_path, kill, config)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, kill",
    [
        (("--cuda-graph",), ["--kill-at", "14"]),
        (("--cuda-graph", "--precise-bn"), ["--kill-at", "33"]),
    ],
    ids=["mid-period", "precise-bn-late"],
)
def test_cuda_graph_trainer_resumes_exactly(straight, tmp_path, config, kill):
    """CUDAGraphTrainer (its eager seam: static buffers, the loss ring buffer, the LR table),
    killed and resumed: the load drops the capture, the resumed run warms up and captures
    again, and ends as the uninterrupted one."""
    assert_resumed_equals_straight(straight(*config), tmp_path, kill, config)


@pytest.mark.slow
# Reading the sqlite store back: mlflow's own deprecations (sqlalchemy's, as in
# tests/utils/test_mlflow_writer.py) are not this test's.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "kill", [["--kill-at", "14"], ["--kill-at", "6"], ["--kill-in-save", "29"]]
)
def test_an_mlflow_run_resumes_with_one_point_per_step(straight, tmp_path, kill):
    pytest.importorskip("mlflow")
    assert_resumed_equals_straight(straight("--mlflow"), tmp_path, kill, ("--mlflow",))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill", [["--kill-at", "14"], ["--kill-at", "6"], ["--kill-in-save", "29"]]
)
def test_a_wandb_run_resumes_with_one_point_per_step(straight, tmp_path, kill):
    """Offline, the resumed run is a new run folder with the killed run's id (the one in the
    checkpoint); the folders of that id hold, together, the uninterrupted run's points."""
    pytest.importorskip("wandb")
    assert_resumed_equals_straight(straight("--wandb"), tmp_path, kill, ("--wandb",))


def test_a_generator_loader_resumes_with_one_warning_naming_it(tmp_path):
    """A plain generator has no position to save or restore: the resumed run says so once."""
    assert run(tmp_path, "--loader", "generator", "--kill-at", "14").returncode == -signal.SIGKILL
    proc = run(tmp_path, "--loader", "generator")
    assert proc.returncode == 0
    warning = "The data loader (generator) cannot be resumed"
    assert proc.stderr.count(warning) == 1, proc.stderr


def assert_resumed_equals_straight(straight_out, tmp_path, kill, config):
    assert run(tmp_path, *kill, *config).returncode == -signal.SIGKILL
    if "--wandb" in config:
        killed_folders = wandb_folders(tmp_path)
        start = resume_point(tmp_path)
    resumed = run(tmp_path, *config)
    assert resumed.returncode == 0
    assert "cannot be resumed" not in resumed.stderr, resumed.stderr

    a, b = load(straight_out / "model_final.pth"), load(tmp_path / "model_final.pth")
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
    best_a, best_b = load(straight_out / "model_best.pth"), load(tmp_path / "model_best.pth")
    for k, v in best_a["model"].items():
        assert torch.equal(v, best_b["model"][k]), k

    rows_a, rows_b = metrics(straight_out), metrics(tmp_path)
    iters = [r["iteration"] for r in rows_b]
    assert len(iters) == len(set(iters)), "an iteration was written twice"
    assert rows_b == rows_a

    for tag in ("total_loss", "lr", "val/mse"):
        points = scalars(tmp_path, tag)
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{tag}: a step was written twice"
        assert points == scalars(straight_out, tag)
    if "--mlflow" in config:
        assert_mlflow_run_equals_straight(straight_out, tmp_path, tb)
    if "--wandb" in config:
        assert_wandb_runs_equal_straight(straight_out, tmp_path, tb, killed_folders, start)


def mlflow_points(out: Path, run_id=None):
    """Each metric's (step, value) points in the run ``run_id`` (else the only run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    if run_id is None:
        (found,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
        run_id = found.info.run_id
    keys = client.get_run(run_id).data.metrics
    return {
        key: sorted((p.step, p.value) for p in client.get_metric_history(run_id, key))
        for key in keys
        if key not in TIMING
    }


def assert_mlflow_run_equals_straight(straight_out, tmp_path, final_trainer_state):
    # The run the final checkpoint names: the killed run's, continued (a kill before the first
    # checkpoint leaves that run with its few points, and the restart makes a new one).
    (state,) = final_trainer_state["hookloop_hooks"]["PeriodicWriter"]["writers"].values()
    got = mlflow_points(tmp_path, state["run_id"])
    want = mlflow_points(straight_out)
    assert got.keys() == want.keys() and "total_loss" in got
    for key, points in got.items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{key}: a step was logged twice"
        assert points == want[key], key


def resume_point(out: Path) -> int:
    """The iteration a run restarted in ``out`` starts at: one past its last checkpoint's."""
    last = out / "last_checkpoint"
    if not last.exists():
        return 0
    return load(out / last.read_text().strip())["trainer"]["iteration"] + 1


def wandb_folders(out: Path):
    """The W&B offline run folders under ``out``, oldest first."""
    return sorted((out / "wandb").glob("offline-run-*"))


def wandb_run_id(folder: Path) -> str:
    return folder.name.rsplit("-", 1)[1]  # offline-run-<date>_<time>-<run id>


def wandb_history(folder: Path):
    """{step: {name: value}} of the run in an offline run folder (W&B's own ``_`` keys and the
    timing metrics left out), read with the client's own reader; each step at most once."""
    from wandb.util import get_core_path

    files = list(folder.glob("run-*.wandb"))
    if not files:
        return {}  # a run killed before its client made the file
    (path,) = files
    out = subprocess.run(
        [get_core_path(), "leet", "inspect", "--no-observability", "--json"]
        + ["--run-file", str(path), str(folder.parent)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    rows = {}
    for line in out.stdout.splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("type") == "history":
            step = record["history"].get("step", {}).get("num", 0)
            assert step not in rows, f"{folder.name}: step {step} logged twice"
            item = record["history"]["item"]
            rows[step] = {
                k: v for k, v in item.items() if not k.startswith("_") and k not in TIMING
            }
    return rows


def assert_wandb_runs_equal_straight(straight_out, tmp_path, final_trainer_state, killed, start):
    (want_folder,) = wandb_folders(straight_out)
    want = wandb_history(want_folder)
    # The uninterrupted run's points are JSONWriter's rows.
    assert want == {
        r["iteration"]: {k: v for k, v in r.items() if k != "iteration"}
        for r in metrics(straight_out)
    }
    (state,) = [
        s
        for key, s in final_trainer_state["hookloop_hooks"]["PeriodicWriter"]["writers"].items()
        if key.endswith(":WandbWriter")
    ]
    run_id = state["run_id"]
    # The killed run made its folder (its kill waited for the writer to hand its points to the
    # client); the resumed run made one more, with the id in the final checkpoint.
    (killed_folder,) = killed
    (resumed_folder,) = [f for f in wandb_folders(tmp_path) if f not in killed]
    assert wandb_run_id(resumed_folder) == run_id
    if start > 0:  # resumed from a checkpoint: the killed run's id, continued
        assert wandb_run_id(killed_folder) == run_id
    else:  # killed before its first checkpoint: the restart is a new run
        assert wandb_run_id(killed_folder) != run_id
    union = {}
    for folder in wandb_folders(tmp_path):
        if wandb_run_id(folder) != run_id:
            continue
        for step, values in wandb_history(folder).items():
            if step in union:
                assert values == union[step], f"step {step}: two folders differ"
            union[step] = values
    assert union == want
    resumed = wandb_history(resumed_folder)
    assert {s: v for s, v in resumed.items() if s >= start} == {
        s: v for s, v in want.items() if s >= start
    }
