"""``hookloop.engine.launch`` with real ranks: gloo on 127.0.0.1, spawned by ``launch``, by
``torchrun`` on one "machine" and on two. Workers report through files in tmp_path."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import hookloop
import launch_helpers
import pytest
import torch.distributed as dist
from hookloop.engine import DEFAULT_TIMEOUT, WorkerError, launch
from hookloop.utils import comm

launch_module = sys.modules["hookloop.engine.launch"]

# A process-group timeout that bounds every test that spawns: generous for workers that start
# slowly on 2 busy cores, and a small fraction of the default 30 minutes.
TIMEOUT = timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        import psutil
    except ImportError:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _results(out_dir: Path, tag: str, world_size: int) -> list:
    return [json.loads((out_dir / f"{tag}-rank{r}.json").read_text()) for r in range(world_size)]


def _check_two_ranks(results: list, local_size: int) -> None:
    gathered = [{"rank": 0, "sq": 0}, {"rank": 1, "sq": 1}]
    for rank, res in enumerate(results):
        assert res["initialized"] and res["backend"] == "gloo"
        assert res["world_size"] == 2
        assert res["rank"] == rank
        assert res["local_rank"] == (rank if local_size == 2 else 0)
        assert res["local_size"] == local_size
        assert res["local_all_gather"] == ([0, 1] if local_size == 2 else [rank])
        assert res["is_main"] is (rank == 0)
        assert res["all_gather"] == gathered
        assert res["seed"] == res["rank0_seed"]  # each rank seeded numpy differently
    assert results[0]["gather"] == [["r", 0], ["r", 1]]
    assert results[1]["gather"] == []
    assert results[0]["gather_dst1"] == []
    assert results[1]["gather_dst1"] == [10, 11]
    assert results[0]["reduced"] == {"a": 1.5, "b": 4.0}
    assert results[0]["pid"] != results[1]["pid"]


def _subprocess_env() -> dict:
    env = dict(os.environ)
    package_root = str(Path(hookloop.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU, also on a machine with GPUs
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _torchrun(*options: str, out_dir: Path, tag: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", *options]
    command += ["--master_addr", "127.0.0.1", launch_helpers.__file__, str(out_dir), tag]
    return subprocess.Popen(
        command,
        env=_subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(proc: subprocess.Popen) -> None:
    try:
        output, _ = proc.communicate(timeout=TIMEOUT.total_seconds())
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT}:\n{output}")
    assert proc.returncode == 0, output


@pytest.fixture
def cpu_workers(monkeypatch):
    """Workers spawned by launch() see no GPU (gloo), also on a machine with GPUs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# --- without spawning -------------------------------------------------------------------------


def test_exports_and_signature():
    assert DEFAULT_TIMEOUT == timedelta(minutes=30)
    import inspect

    params = inspect.signature(launch).parameters
    assert list(params) == [
        "main_func",
        "num_gpus_per_machine",
        "num_machines",
        "machine_rank",
        "dist_url",
        "args",
        "timeout",
    ]
    assert params["timeout"].default is DEFAULT_TIMEOUT
    assert WorkerError is launch_module.WorkerError


def test_world_size_one_runs_in_process():
    calls = []
    launch(lambda a, b: calls.append((os.getpid(), a, b, comm.get_world_size())), 1, args=(1, 2))
    assert calls == [(os.getpid(), 1, 2, 1)]
    assert not dist.is_initialized()


def test_worker_exception_in_world_size_one_passes_through():
    def boom():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        launch(boom, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_machines": 2, "dist_url": "auto"}, "auto"),
        ({"dist_url": None}, "dist_url"),
        ({"num_machines": 2, "machine_rank": 2, "dist_url": "tcp://127.0.0.1:1"}, "machine_rank"),
    ],
)
def test_bad_arguments_raise_before_spawning(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(launch_helpers.report, 2, **kwargs)


def test_torchrun_environment_runs_in_process(monkeypatch, tmp_path):
    """One worker of a torchrun job: env:// in this process, and the group is gone after."""
    env = {
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_module, "_backend", lambda: "gloo")
    launch(launch_helpers.report, 8, args=(str(tmp_path), "env"))  # 8 is ignored under torchrun
    (res,) = _results(tmp_path, "env", 1)
    assert res["pid"] == os.getpid()
    assert res["initialized"] and res["world_size"] == 1 and res["local_size"] == 1
    assert res["all_gather"] == [{"rank": 0, "sq": 0}]
    assert not dist.is_initialized() and comm._LOCAL_PROCESS_GROUP is None


def _record(error_dir: Path, rank: int, when: float, exc: BaseException) -> None:
    try:
        raise exc
    except BaseException as e:
        launch_module._record_error(str(error_dir), rank, e)
    path = error_dir / f"rank{rank}.pickle"
    record = pickle.loads(path.read_bytes())
    record["time"] = when
    path.write_bytes(pickle.dumps(record))


def test_failure_reported_is_the_earliest_exception(tmp_path):
    """Rank 1 raised first; rank 0 then failed in its next collective (a consequence)."""
    procs = [SimpleNamespace(pid=100, exitcode=1), SimpleNamespace(pid=101, exitcode=1)]
    _record(tmp_path, 2, 5.0, RuntimeError("Connection closed by peer"))
    _record(tmp_path, 3, 4.0, ValueError("the cause"))
    # Both were seen at the same wake-up, rank 0 (global rank 2) first.
    error = launch_module._worker_error(procs, 0, 2, str(tmp_path))
    assert (error.rank, error.local_rank, error.pid, error.exitcode) == (3, 1, 101, 1)
    assert isinstance(error.__cause__, ValueError) and "ValueError: the cause" in str(error)
    assert pickle.loads(pickle.dumps(error)).remote_traceback == error.remote_traceback


def test_failure_without_exception_is_reported_by_exit_status(tmp_path):
    """A worker killed by a signal writes nothing; the collective error it caused on its peer
    is not the cause."""
    procs = [SimpleNamespace(pid=100, exitcode=-9), SimpleNamespace(pid=101, exitcode=1)]
    _record(tmp_path, 1, 5.0, RuntimeError("Connection closed by peer"))
    error = launch_module._worker_error(procs, 0, 0, str(tmp_path))
    assert str(error) == "worker rank 0 (pid 100) terminated with signal SIGKILL"
    assert (error.rank, error.exitcode, error.remote_traceback, error.__cause__) == (
        0,
        -9,
        None,
        None,
    )


def test_failure_before_running_points_at_the_output(tmp_path):
    procs = [SimpleNamespace(pid=100, exitcode=1), SimpleNamespace(pid=101, exitcode=-15)]
    error = launch_module._worker_error(procs, 0, 0, str(tmp_path), str(tmp_path / "none"))
    assert "exit code 1 (its traceback, if any, is in its output above)" in str(error)
    (tmp_path / "torch").write_bytes(pickle.dumps("Traceback ...\nOSError: disk full\n"))
    error = launch_module._worker_error(procs, 0, 0, str(tmp_path), str(tmp_path / "torch"))
    assert str(error).endswith("exit code 1:\n\nTraceback ...\nOSError: disk full\n")
    assert error.remote_traceback.endswith("OSError: disk full\n")


# --- spawned by launch ------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_spawned_with_auto_url(tmp_path, cpu_workers):
    launch(
        launch_helpers.report, 2, dist_url="auto", args=(str(tmp_path), "spawn"), timeout=TIMEOUT
    )
    results = _results(tmp_path, "spawn", 2)
    _check_two_ranks(results, local_size=2)
    assert os.getpid() not in (results[0]["pid"], results[1]["pid"])
    assert not any(_alive(r["pid"]) for r in results)


@pytest.mark.slow
def test_rank_raising_stops_every_worker_and_is_reraised(tmp_path, monkeypatch, cpu_workers):
    # Rank 0 ignores SIGTERM: the launcher has to escalate to SIGKILL after the grace period.
    monkeypatch.setattr(launch_module, "_TERM_GRACE_S", 1.0)
    url = f"tcp://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed on purpose") as info:
        launch(
            launch_helpers.fail_on_rank1, 2, dist_url=url, args=(str(tmp_path),), timeout=TIMEOUT
        )
    # A bound against hanging, not a speed figure (it takes seconds): without the kill the
    # launcher would wait forever. Generous, so that a slow machine cannot fail it.
    assert time.monotonic() - start < 5 * TIMEOUT.total_seconds()
    error = info.value
    assert error.rank == 1 and error.local_rank == 1 and error.exitcode == 1
    assert isinstance(error.__cause__, ValueError)
    assert "fail_on_rank1" in error.remote_traceback  # the worker's own frames
    assert "ValueError: rank 1 failed on purpose" in str(error)
    pids = [int((tmp_path / f"pid-rank{r}").read_text()) for r in range(2)]
    assert error.pid == pids[1]
    assert not any(_alive(pid) for pid in pids)
    assert not list(tmp_path.glob("*.json"))


# --- under torchrun ---------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    port = str(_free_port())
    _wait(_torchrun("--nproc_per_node", "2", "--master_port", port, out_dir=tmp_path, tag="tr"))
    _check_two_ranks(_results(tmp_path, "tr", 2), local_size=2)


@pytest.mark.slow
def test_torchrun_two_machines_on_one_host(tmp_path):
    port = str(_free_port())
    nodes = [
        _torchrun(
            *("--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1"),
            *("--master_port", port),
            out_dir=tmp_path,
            tag="nodes",
        )
        for node in range(2)
    ]
    try:
        for proc in nodes:
            _wait(proc)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    _check_two_ranks(_results(tmp_path, "nodes", 2), local_size=1)
