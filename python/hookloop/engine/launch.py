"""Start distributed training: ``launch``, mirroring ``detectron2.engine.launch``.

One machine: ``launch`` spawns one worker per GPU (per process on CPU) and initializes the
process group in each. Several machines: call ``launch`` on every machine with the same
``dist_url``, or start the script with ``torchrun``, in which case ``launch`` reads the
process group from the environment and runs ``main_func`` in the process torchrun started.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from hookloop.utils import comm

__all__ = ["DEFAULT_TIMEOUT", "WorkerError", "launch"]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""The default process-group timeout (detectron2's): how long a collective may wait."""

# After a worker fails, how long the others get to exit after SIGTERM before SIGKILL (at most
# the process-group timeout). A worker blocked in C++ (a collective) or with its own SIGTERM
# handler may not exit on SIGTERM; SIGKILL always works.
_TERM_GRACE_S = 10.0

_TORCHRUN_VARS = ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")

logger = logging.getLogger(__name__)


class WorkerError(ProcessException):
    """
    A worker started by :func:`launch` failed. Raised in the launching process after every
    worker has exited.

    Attributes:
        rank (int): global rank of the failed worker.
        local_rank (int): its index on this machine (torch's ``error_index``).
        pid (int): its process id (torch's ``error_pid``).
        exitcode (int): its exit status (negative: killed by that signal).
        remote_traceback (str | None): the traceback printed in the worker, if it raised.

    When the worker raised a picklable exception, that exception is the ``__cause__``.
    Subclasses torch's ``ProcessException``, the base of what ``torch.multiprocessing.spawn``
    raises, so ``except ProcessException`` clauses keep working.
    """

    def __init__(
        self,
        msg: str,
        rank: int,
        local_rank: int,
        pid: int,
        exitcode: int,
        remote_traceback: Optional[str] = None,
    ):
        super().__init__(msg, local_rank, pid)
        self.rank = rank
        self.local_rank = local_rank
        self.pid = pid
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> Any:
        args = (self.msg, self.rank, self.local_rank, self.pid, self.exitcode)
        return type(self), (*args, self.remote_traceback)


def _find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Binding to port 0 makes the OS pick a free port. Another process may still take it
        # before the workers bind it.
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARS)


def launch(
    main_func: Callable[..., Any],
    num_gpus_per_machine: int,
    num_machines: int = 1,
    machine_rank: int = 0,
    dist_url: Optional[str] = None,
    args: Sequence[Any] = (),
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> None:
    """
    Launch multi-gpu or distributed training.
    This function must be called on all machines involved in the training.
    It will spawn child processes (defined by ``num_gpus_per_machine``) on each machine.

    Without CUDA the workers use gloo on the CPU and ``num_gpus_per_machine`` is the number of
    processes per machine; with CUDA, NCCL with one GPU per worker. In a script started by
    ``torchrun`` (``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set), nothing is spawned:
    the process group comes from the environment (``env://``) and ``main_func`` runs in this
    process; the process counts come from torchrun too.

    If a worker fails, the others are stopped (SIGTERM, then SIGKILL) and :class:`WorkerError`
    is raised here with the worker's traceback, the worker's exception as its cause. A worker
    that left through a non-zero ``SystemExit`` (``hooks.Preempted``, which every rank raises
    after a preemption stopped them together) has that exception raised here instead, so the
    launching process exits with the same status.

    Args:
        main_func: a function that will be called by `main_func(*args)`; spawned workers pickle
            it, so it must be importable (defined at the top level of a module)
        num_gpus_per_machine (int): number of GPUs (processes, on CPU) per machine
        num_machines (int): the total number of machines
        machine_rank (int): the rank of this machine
        dist_url (str): url to connect to for distributed jobs, including protocol
            e.g. "tcp://127.0.0.1:8686".
            Can be set to "auto" to automatically select a free port on localhost
        args (tuple): arguments passed to main_func
        timeout (timedelta): timeout of the distributed workers
    """
    if _under_torchrun():
        _run_from_env(main_func, tuple(args), timeout)
        return
    if num_gpus_per_machine < 1 or num_machines < 1:
        raise ValueError(
            f"num_gpus_per_machine and num_machines must be >= 1, got "
            f"{num_gpus_per_machine} and {num_machines}"
        )
    if not 0 <= machine_rank < num_machines:
        raise ValueError(f"machine_rank must be in [0, {num_machines}), got {machine_rank}")
    world_size = num_machines * num_gpus_per_machine
    if world_size == 1:
        main_func(*args)
        return
    if dist_url == "auto":
        if num_machines != 1:
            raise ValueError("dist_url='auto' is not supported in multi-machine jobs")
        dist_url = f"tcp://127.0.0.1:{_find_free_port()}"
    if not dist_url:
        raise ValueError(
            "launch() with more than one process needs dist_url, e.g. 'tcp://127.0.0.1:29500' "
            "or 'auto' on one machine"
        )
    if num_machines > 1 and dist_url.startswith("file://"):
        logger.warning("file:// is not a reliable init_method in multi-machine jobs. Prefer tcp://")
    # CUDA is first looked at in the workers: the launcher stays free of a CUDA context, and
    # CUDA_VISIBLE_DEVICES="" set before launch() gives CPU workers (gloo) on a GPU machine.

    error_dir = tempfile.mkdtemp(prefix="hookloop-launch-")
    try:
        context = mp.start_processes(
            _distributed_worker,
            nprocs=num_gpus_per_machine,
            args=(
                main_func,
                world_size,
                num_gpus_per_machine,
                machine_rank,
                dist_url,
                tuple(args),
                timeout,
                error_dir,
            ),
            daemon=False,
            join=False,
            start_method="spawn",
        )
        _supervise(context, machine_rank * num_gpus_per_machine, timeout, error_dir)
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _distributed_worker(
    local_rank: int,
    main_func: Callable[..., Any],
    world_size: int,
    num_gpus_per_machine: int,
    machine_rank: int,
    dist_url: str,
    args: Tuple[Any, ...],
    timeout: timedelta,
    error_dir: str,
) -> None:
    global_rank = machine_rank * num_gpus_per_machine + local_rank
    try:
        backend = _backend()
        if backend == "nccl":
            if num_gpus_per_machine > torch.cuda.device_count():
                raise ValueError(
                    f"num_gpus_per_machine={num_gpus_per_machine} but this machine has "
                    f"{torch.cuda.device_count()} GPUs"
                )
            # Before the process group, so that NCCL and barriers use this worker's GPU.
            torch.cuda.set_device(local_rank)
        try:
            dist.init_process_group(
                backend=backend,
                init_method=dist_url,
                world_size=world_size,
                rank=global_rank,
                timeout=timeout,
            )
        except Exception:
            logger.error("Process group URL: %s", dist_url)
            raise
        comm.create_local_process_group(num_gpus_per_machine)
        # A barrier here prevents a possible timeout after init_process_group
        # (maskrcnn-benchmark issue 172).
        comm.synchronize()
        main_func(*args)
    except SystemExit as e:
        if e.code in (None, 0):
            raise
        # A non-zero exit (hooks.Preempted: 128 + signum): recorded, so that launch() raises
        # it as a process of one would, and left with its status, without the teardown.
        _record_error(error_dir, global_rank, e)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except Exception as e:
        _record_error(error_dir, global_rank, e)
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        # Exit status 1, always: the interpreter's teardown after an exception can abort
        # (SIGABRT from a backend's threads), which would hide that this rank raised.
        os._exit(1)
    # Reached only on success: a clean teardown (NCCL warns without it).
    dist.destroy_process_group()
    comm._reset()


def _record_error(error_dir: str, rank: int, exc: BaseException) -> None:
    """Write what the parent needs to re-raise this worker's exception."""
    exc_bytes: Optional[bytes]
    try:
        exc_bytes = pickle.dumps(exc)
        pickle.loads(exc_bytes)  # some exceptions pickle but do not unpickle
    except Exception:
        exc_bytes = None
    record = {
        # CLOCK_MONOTONIC is system-wide on Linux: orders the failures of sibling workers.
        "time": time.monotonic(),
        "rank": rank,
        "traceback": traceback.format_exc(),
        "exception": exc_bytes,
    }
    path = os.path.join(error_dir, f"rank{rank}.pickle")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(record, f)
    os.replace(path + ".tmp", path)


def _supervise(context: Any, first_rank: int, timeout: timedelta, error_dir: str) -> None:
    """Wait for the workers; on the first failure (or an interrupt here) stop the others and
    raise the failure."""
    processes: List[Any] = context.processes
    sentinels = {p.sentinel: i for i, p in enumerate(processes)}
    first_failed: Optional[int] = None
    error: Optional[WorkerError] = None
    # A SIGTERM to the launcher (a scheduler preempting the job) reaches the workers as
    # SIGTERM, through the clean-up below, rather than killing the launcher alone. A handler
    # the program installed is left alone.
    forward_sigterm = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    )
    if forward_sigterm:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        while sentinels and first_failed is None:
            for sentinel in multiprocessing.connection.wait(list(sentinels)):
                index = sentinels.pop(sentinel)
                processes[index].join()
                if processes[index].exitcode != 0 and first_failed is None:
                    first_failed = index
    finally:
        # Also on KeyboardInterrupt or SIGTERM: no worker outlives the launcher. A second
        # SIGTERM must not cut the clean-up short (it takes at most the grace period).
        if forward_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop(processes, min(_TERM_GRACE_S, timeout.total_seconds()))
        if forward_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if first_failed is not None:
            error = _worker_error(
                processes, first_failed, first_rank, error_dir, context.error_files[first_failed]
            )
        # torch leaves the files of failed workers behind.
        for path in context.error_files:
            if os.path.exists(path):
                os.unlink(path)
    if error is not None:
        if isinstance(error.__cause__, SystemExit):
            # A worker that exited (hooks.Preempted after a stop of every rank): the launcher
            # exits the same way, as main_func does when launch() runs it in this process.
            raise error.__cause__ from error
        raise error


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _stop(processes: List[Any], grace_s: float) -> None:
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            logger.warning("Worker process %d did not exit on SIGTERM; sending SIGKILL", p.pid)
            p.kill()
        p.join()


def _load_records(error_dir: str) -> List[Dict[str, Any]]:
    records = []
    for name in os.listdir(error_dir):
        if name.endswith(".pickle"):
            with open(os.path.join(error_dir, name), "rb") as f:
                records.append(pickle.load(f))
    return records


def _worker_error(
    processes: List[Any],
    first_failed: int,
    first_rank: int,
    error_dir: str,
    torch_error_file: Optional[str] = None,
) -> WorkerError:
    """The failure to report.

    A rank that raises often makes its peers fail in their next collective, and two failures
    can be seen at the same wake-up: of the exceptions raised, the earliest is the cause. A
    worker seen failing first without raising (killed by a signal, ``os._exit``) is reported
    as such."""
    records = {r["rank"]: r for r in _load_records(error_dir)}
    if first_rank + first_failed in records:
        record = min(records.values(), key=lambda r: r["time"])
        local_rank = record["rank"] - first_rank
        process = processes[local_rank]
        cause: Optional[BaseException] = None
        if record["exception"] is not None:
            try:
                cause = pickle.loads(record["exception"])
            except Exception:
                cause = None
        error = WorkerError(
            f"worker rank {record['rank']} (pid {process.pid}) raised:\n\n{record['traceback']}",
            record["rank"],
            local_rank,
            process.pid,
            process.exitcode,
            record["traceback"],
        )
        error.__cause__ = cause
        return error
    process = processes[first_failed]
    code = process.exitcode
    if code < 0:
        try:
            how = f"signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"signal {-code}"
    else:
        how = f"exit code {code}"
    rank = first_rank + first_failed
    msg = f"worker rank {rank} (pid {process.pid}) terminated with {how}"
    # torch's own record, from an exception raised where ours could not be written.
    remote_traceback: Optional[str] = None
    if torch_error_file is not None and os.path.exists(torch_error_file):
        with open(torch_error_file, "rb") as f:
            remote_traceback = pickle.load(f)
        msg += f":\n\n{remote_traceback}"
    elif code > 0:
        # Failed before running (e.g. main_func not importable in a fresh interpreter).
        msg += " (its traceback, if any, is in its output above)"
    return WorkerError(msg, rank, first_failed, process.pid, code, remote_traceback)


def _run_from_env(main_func: Callable[..., Any], args: Tuple[Any, ...], timeout: timedelta) -> None:
    """The torchrun path: this process is one worker; the environment says which."""
    local_rank = int(os.environ["LOCAL_RANK"])
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    created = not dist.is_initialized()
    if created:
        backend = _backend()
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    if comm._LOCAL_PROCESS_GROUP is None:
        comm.create_local_process_group(local_size)
    comm.synchronize()
    main_func(*args)
    if created:
        # Leaves the process as it was; not on an exception, which ends the process anyway.
        dist.destroy_process_group()
        comm._reset()
