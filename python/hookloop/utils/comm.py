"""Distributed helpers over ``torch.distributed``, mirroring ``detectron2.utils.comm``.

Every function is correct in a single process (world size 1, no process group) and when a
process group is initialised. Object collectives go through a gloo group, as in detectron2,
so they work under NCCL too.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = [
    "get_world_size",
    "get_rank",
    "get_local_rank",
    "get_local_size",
    "is_main_process",
    "synchronize",
    "all_gather",
    "gather",
    "reduce_dict",
    "shared_random_seed",
]

_LOCAL_PROCESS_GROUP: Optional[Any] = None


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
    """This process's rank within its machine (set by ``LOCAL_RANK`` launchers)."""
    if not _initialized():
        return 0
    if _LOCAL_PROCESS_GROUP is not None:
        return dist.get_rank(group=_LOCAL_PROCESS_GROUP)
    import os

    return int(os.environ.get("LOCAL_RANK", 0))


def get_local_size() -> int:
    """Number of processes on this machine."""
    if not _initialized():
        return 1
    if _LOCAL_PROCESS_GROUP is not None:
        return dist.get_world_size(group=_LOCAL_PROCESS_GROUP)
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", get_world_size()))


def is_main_process() -> bool:
    """True on rank 0."""
    return get_rank() == 0


def synchronize() -> None:
    """A barrier among all processes; a no-op in a single process."""
    if not _initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == dist.Backend.NCCL:
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


@functools.lru_cache
def _get_global_gloo_group() -> Any:
    if dist.get_backend() == "nccl":
        return dist.new_group(backend="gloo")
    return dist.group.WORLD


def all_gather(data: Any, group: Optional[Any] = None) -> List[Any]:
    """Gathers any picklable object from every rank; returns the list on every rank."""
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
    """Gathers any picklable object on rank ``dst``; other ranks get an empty list."""
    if get_world_size() == 1:
        return [data]
    if group is None:
        group = _get_global_gloo_group()
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return [data]
    rank = dist.get_rank(group=group)
    if rank == dst:
        output: List[Any] = [None for _ in range(world_size)]
        dist.gather_object(data, output, dst=dst, group=group)
        return output
    dist.gather_object(data, None, dst=dst, group=group)
    return []


def shared_random_seed() -> int:
    """A random seed that is the same on every rank (rank 0's)."""
    import numpy as np

    ints = np.random.randint(2**31)
    return int(all_gather(ints)[0])


def reduce_dict(input_dict: Dict[str, torch.Tensor], average: bool = True) -> Dict[str, Any]:
    """Sums (or averages) a dict of scalar tensors over ranks; the result is valid on rank 0."""
    world_size = get_world_size()
    if world_size < 2:
        return input_dict
    with torch.no_grad():
        names = sorted(input_dict.keys())
        values = torch.stack([input_dict[k] for k in names], dim=0)
        dist.reduce(values, dst=0)
        if dist.get_rank() == 0 and average:
            values /= world_size
        return dict(zip(names, values))
