"""Reading single-element tensors in batches: the values the storage's pending queue keeps
unread until something needs them (``SimpleTrainer``'s losses, ``EventStorage.put_scalar`` of a
device tensor). The queue (core ``pending``, binding ``pending.rs``) calls :func:`read_scalars`,
:func:`start_read` and :func:`write_failed`, handed to the extension once, at the bottom of this
module (``_core._register_tensor_reads``: the extension imports nothing of the package);
nothing here touches the storage.

One mechanism for both: per device, one stack of the values as float64 and one copy to the
host, so a batch costs one device synchronization per device instead of one per value. The
values are the ones ``item()`` gives, also across dtypes (an int64 count is not rounded
through float32 by type promotion).

A value read later must still hold the value it had when it was put:
:func:`snapshot_losses` copies those that can change.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from hookloop import _core

__all__ = ["read_scalars", "snapshot_losses", "stack_scalars", "start_read", "write_failed"]

# The trainer's logger, by name: a failed store of its losses is detectron2's train_loop record.
_train_logger = logging.getLogger("hookloop.engine.train_loop")


def snapshot_losses(losses: Dict[str, Any]) -> Dict[str, Any]:
    """``losses`` as they are at this step, for a read later: the dict itself when every value
    is a tensor computed by autograd (not a leaf: the model's code made it this step, and
    nothing changes it in place afterwards), else a new dict in which every leaf tensor (an
    ``nn.Parameter``, a buffer, a tensor given as it is, which an optimizer step or the model
    may change in place before the read) is a detached copy; numpy arrays are copied, numbers
    kept. detectron2 reads every loss at its step, so its log has the value of that step."""
    for v in losses.values():
        if type(v) is not torch.Tensor or v.is_leaf:
            return {k: _snapshot(v) for k, v in losses.items()}
    return losses


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.is_leaf else value
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def stack_scalars(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """Single-element tensors stacked on their device as float64, shape ``(n, 1)``; None when
    they cannot be stacked (different shapes or devices).

    Raises:
        TypeError: a tensor with more than one element.
    """
    try:
        flat = _stack(tensors).reshape(len(tensors), -1)
    except RuntimeError:
        return None
    if flat.shape[1] != 1:
        raise TypeError(
            f"a scalar must be a single-element tensor, got one with {flat.shape[1]} elements"
        )
    return flat


def _stack(tensors: List[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` as float64 (RuntimeError for different shapes or devices)."""
    with torch.no_grad():
        dtype = tensors[0].dtype
        if any(t.dtype != dtype for t in tensors):
            # Promotion would round to the widest input type; float64 first is exact.
            tensors = [t.to(torch.float64) for t in tensors]
        return torch.stack(tensors).to(torch.float64)


def read_scalars(tensors: List[torch.Tensor]) -> List[float]:
    """The values of single-element tensors, in order: one stack and one copy to the host per
    device (one synchronization per device)."""
    if not tensors:
        return []
    flat = stack_scalars(tensors)
    if flat is not None:
        return flat.cpu().reshape(-1).tolist()
    # Several devices or shapes: a batch per device, each value made 0-d first.
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = [0.0] * len(tensors)
    for indices in by_device.values():
        values = _stack([_as_0d(tensors[i]) for i in indices]).cpu().tolist()
        for i, v in zip(indices, values):
            out[i] = v
    return out


def _as_0d(t: torch.Tensor) -> torch.Tensor:
    if t.numel() != 1:
        raise TypeError(
            f"a scalar must be a single-element tensor, got one with shape {tuple(t.shape)}"
        )
    return t.detach().reshape(())


def start_read(values: List[Any]) -> Optional["HostCopy"]:
    """A started read of ``values`` when every one is a single-element CUDA tensor on one
    device: one stack, one non-blocking copy into pinned memory and an event after it (no
    synchronization now); None otherwise (the caller reads them at once)."""
    if not all(isinstance(v, torch.Tensor) and v.is_cuda for v in values):
        return None
    flat = stack_scalars(values)
    return None if flat is None else HostCopy(flat)


class HostCopy:
    """Values stacked on a CUDA device (:func:`stack_scalars`) on their way to the host,
    copied without blocking into pinned memory, with an event recorded after the copy.
    :meth:`values` waits for that event only (not for the whole device)."""

    def __init__(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            self._host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            # On the stream of the values' device (the copy's), not the current device's.
            self._event = torch.cuda.current_stream(flat.device).record_event()

    def values(self) -> List[float]:
        self._event.synchronize()
        return self._host.reshape(-1).tolist()


def write_failed(error: BaseException) -> None:
    """A read of the queue that held a trainer's losses failed (a non-finite total, a loss that
    is not a number): logged as detectron2's ``_write_metrics`` logs it, then raised by the
    caller wherever the read happened (a writer, a hook's ``latest()``, the next step)."""
    _train_logger.error("Exception in writing metrics: ", exc_info=error)


# Handed to the extension once. Each looks its function up here at the call, so that replacing
# one in this module (a test's monkeypatch) reaches the storage's reads.
_core._register_tensor_reads(
    lambda values: read_scalars(values),
    lambda values: start_read(values),
    lambda error: write_failed(error),
)
