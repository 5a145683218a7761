"""Distributed helpers over ``torch.distributed``, mirroring ``detectron2.utils.comm``.

Every function is correct in a single process (world size 1, no process group) and when a
process group is initialised. Object collectives go through a gloo group, as in detectron2,
so they work under NCCL too.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = [
    "get_world_size",
    "get_rank",
    "get_local_rank",
    "get_local_size",
    "get_local_process_group",
    "create_local_process_group",
    "is_main_process",
    "synchronize",
    "all_gather",
    "gather",
    "reduce_dict",
    "shared_random_seed",
]

_LOCAL_PROCESS_GROUP: Optional[Any] = None
"""
A torch process group which only includes processes that are on the same machine as the
current process. Set by :func:`create_local_process_group`, which ``launch()`` in
``hookloop/engine/launch.py`` calls in every worker.
"""


# Whether this torch build has torch.distributed at all; fixed for the process, and checked on
# every metric write, so looked up once.
_AVAILABLE = dist.is_available()


def _initialized() -> bool:
    return _AVAILABLE and dist.is_initialized()


def get_world_size() -> int:
    """Number of processes in the default group (1 without torch.distributed)."""
    return dist.get_world_size() if _AVAILABLE and dist.is_initialized() else 1


def get_rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    return dist.get_rank() if _initialized() else 0


def get_local_rank() -> int:
    """
    Returns:
        The rank of the current process within the local (per-machine) process group.

    Without a local process group (workers not started by ``launch()`` and no
    :func:`create_local_process_group` call), the ``LOCAL_RANK`` variable that ``torchrun``
    sets is used; with neither, this raises ``RuntimeError`` (detectron2 asserts).
    """
    if not _initialized():
        return 0
    if _LOCAL_PROCESS_GROUP is not None:
        return dist.get_rank(group=_LOCAL_PROCESS_GROUP)
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        raise RuntimeError(
            "get_local_rank() needs the local process group: start the workers with "
            "hookloop.engine.launch() or torchrun, or call "
            "comm.create_local_process_group(num_workers_per_machine) in every process"
        )
    return int(local_rank)


def get_local_size() -> int:
    """
    Returns:
        The size of the per-machine process group, i.e. the number of processes per machine.

    Without a local process group, ``torchrun``'s ``LOCAL_WORLD_SIZE``, else the world size
    (what detectron2 returns then).
    """
    if not _initialized():
        return 1
    if _LOCAL_PROCESS_GROUP is not None:
        return dist.get_world_size(group=_LOCAL_PROCESS_GROUP)
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def create_local_process_group(num_workers_per_machine: int) -> None:
    """
    Create a process group that contains ranks within the same machine.

    ``launch()`` calls this in every worker. If you start workers without it, call this in
    every process (it is a collective: all ranks must call it together), otherwise
    :func:`get_local_rank` has to fall back to the environment.

    Ranks are assumed contiguous per machine (ranks ``i * n .. (i + 1) * n - 1`` on machine
    ``i``), as ``launch()`` and ``torchrun`` assign them. Calling it again with the same number
    is a no-op; without an initialized process group there is nothing to create.

    Args:
        num_workers_per_machine: the number of worker processes per machine. Typically
            the number of GPUs.
    """
    global _LOCAL_PROCESS_GROUP
    if num_workers_per_machine < 1:
        raise ValueError(f"num_workers_per_machine must be >= 1, got {num_workers_per_machine}")
    if not _initialized():
        return
    world_size = get_world_size()
    if world_size % num_workers_per_machine != 0:
        raise ValueError(
            f"world size {world_size} is not a multiple of "
            f"num_workers_per_machine={num_workers_per_machine}"
        )
    if _LOCAL_PROCESS_GROUP is not None:
        size = dist.get_world_size(group=_LOCAL_PROCESS_GROUP)
        if size == num_workers_per_machine:
            return
        raise RuntimeError(
            f"the local process group already exists with {size} processes per machine, "
            f"not {num_workers_per_machine}"
        )
    machine_rank = get_rank() // num_workers_per_machine
    # new_group is collective over the default group: every rank creates every machine's group.
    for i in range(world_size // num_workers_per_machine):
        ranks_on_i = list(range(i * num_workers_per_machine, (i + 1) * num_workers_per_machine))
        pg = dist.new_group(ranks_on_i)
        if i == machine_rank:
            _LOCAL_PROCESS_GROUP = pg


def get_local_process_group() -> Any:
    """
    Returns:
        A torch process group which only includes processes that are on the same machine as
        the current process (useful for communication within a machine, e.g. per-machine
        SyncBN). Raises ``RuntimeError`` before :func:`create_local_process_group`.
    """
    if _LOCAL_PROCESS_GROUP is None:
        raise RuntimeError(
            "no local process group: start the workers with hookloop.engine.launch() or call "
            "comm.create_local_process_group(num_workers_per_machine)"
        )
    return _LOCAL_PROCESS_GROUP


def _reset() -> None:
    """Forget the groups made from the default group; call after destroying it."""
    global _LOCAL_PROCESS_GROUP
    _LOCAL_PROCESS_GROUP = None
    _get_global_gloo_group.cache_clear()
    _get_off_thread_group.cache_clear()


def is_main_process() -> bool:
    """True on rank 0."""
    return get_rank() == 0


def synchronize() -> None:
    """A barrier among all processes; a no-op in a single process."""
    if not _initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == dist.Backend.NCCL:
        # Names the device, which NCCL would otherwise guess (and warn about).
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


@functools.lru_cache
def _get_global_gloo_group() -> Any:
    """A gloo group over all ranks (the default group when it is gloo); cached."""
    if dist.get_backend() == "nccl":
        return dist.new_group(backend="gloo")
    return dist.group.WORLD


@functools.lru_cache
def _get_off_thread_group() -> Any:
    """A gloo group over all ranks that is never the default group; cached. For collectives
    made off the training thread (asynchronous metric writes): on the default group they
    could interleave with DDP's all-reduces in a different order on each rank. Creating it is
    a collective: every rank must make the first call at the same point."""
    return dist.new_group(backend="gloo")


def all_gather(data: Any, group: Optional[Any] = None) -> List[Any]:
    """
    Run all_gather on arbitrary picklable data (not necessarily tensors).

    Args:
        data: any picklable object
        group: a torch process group. By default, a group which contains all ranks on the
            gloo backend.

    Returns:
        list[data]: list of data gathered from each rank, in rank order
    """
    if get_world_size() == 1:
        return [data]
    if group is None:
        group = _get_global_gloo_group()
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return [data]
    output: List[Any] = [None for _ in range(world_size)]
    dist.all_gather_object(output, data, group=group)
    return output


def gather(data: Any, dst: int = 0, group: Optional[Any] = None) -> List[Any]:
    """
    Run gather on arbitrary picklable data (not necessarily tensors).

    Args:
        data: any picklable object
        dst (int): destination rank, within ``group``
        group: a torch process group. By default, a group which contains all ranks on the
            gloo backend.

    Returns:
        list[data]: on dst, a list of data gathered from each rank. Otherwise, an empty list.
    """
    if get_world_size() == 1:
        return [data]
    if group is None:
        group = _get_global_gloo_group()
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return [data]
    rank = dist.get_rank(group=group)
    # torch's gather_object takes the destination as a global rank.
    global_dst = dst if group is dist.group.WORLD else dist.get_global_rank(group, dst)
    if rank == dst:
        output: List[Any] = [None for _ in range(world_size)]
        dist.gather_object(data, output, dst=global_dst, group=group)
        return output
    dist.gather_object(data, None, dst=global_dst, group=group)
    return []


def shared_random_seed() -> int:
    """
    Returns:
        int: a random number that is the same across all workers (rank 0's). If workers need
        a shared RNG, they can use this shared seed to create one.

    All workers must call this function, otherwise it will deadlock.
    """
    import numpy as np

    ints = np.random.randint(2**31)
    return int(all_gather(ints)[0])


def reduce_dict(input_dict: Dict[str, torch.Tensor], average: bool = True) -> Dict[str, Any]:
    """
    Reduce the values in the dictionary from all processes so that the process with rank 0
    has the reduced results.

    Args:
        input_dict (dict): inputs to be reduced. All the values must be scalar tensors (CUDA
            tensors under NCCL).
        average (bool): whether to do average or sum

    Returns:
        a dict with the same keys as input_dict, after reduction (valid on rank 0; other
        ranks get partial sums).
    """
    world_size = get_world_size()
    if world_size < 2 or not input_dict:
        return input_dict
    with torch.no_grad():
        # Sorted so that every rank stacks the values in the same order.
        names = sorted(input_dict.keys())
        values = torch.stack([input_dict[k] for k in names], dim=0)
        dist.reduce(values, dst=0)
        if dist.get_rank() == 0 and average:
            # Only the main process receives the sum, so only it divides.
            values /= world_size
        return dict(zip(names, values))
