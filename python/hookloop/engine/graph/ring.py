"""The loss ring: where the captured step writes its losses, and the views the storage reads.

``ring[step % R, j]`` is loss ``j`` of that step (float32, or float64 where a loss has values
float32 does not hold exactly: a float64 loss, an int64 count above 2**24). Each iteration
hands the storage the views of its slot (dicts built once); the storage reads them in one
batched copy. **Invariant**: a slot's read is started (its values copied out on the device's
stream) before the graph writes that slot again, ``R`` iterations later. The storage's pending
queue starts a read at least every ``_core.PENDING_READ_EVERY`` (20) recorded iterations, and
records one iteration in ``gather_metric_period``; so ``R >= 2 * PENDING_READ_EVERY *
gather_metric_period`` (a safety factor of 2: :func:`min_ring_size`), checked with a
``ValueError`` by the options.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from hookloop._core import PENDING_READ_EVERY
from hookloop.engine.graph.seam import WHO

__all__ = ["RING_SAFETY", "LossRing", "min_ring_size"]

#: Safety factor of the ring-buffer invariant (see the module docstring).
RING_SAFETY = 2


def min_ring_size(gather_metric_period: int) -> int:
    """The fewest slots that keep the invariant (see the module docstring)."""
    return RING_SAFETY * PENDING_READ_EVERY * gather_metric_period


def _ring_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """float32 where it holds every loss's value exactly (bool, integers of up to 16 bits,
    floats of up to 32), float64 otherwise: a float64 loss, an int32/int64 count (float32's
    24-bit significand would round 2**24 + 1)."""
    for dt in dtypes:
        if dt.itemsize > 2 and not (dt.is_floating_point and dt.itemsize <= 4):
            return torch.float64
    return torch.float32


class LossRing:
    """The ring of ``size`` slots (made at the first step, from its losses' names and dtypes)
    and the storage's views of each slot."""

    __slots__ = ("size", "ring", "names", "views")

    def __init__(self, size: Optional[int] = None) -> None:
        #: Slots (the options' ring_size); None before the options are set.
        self.size = size
        self.ring: Optional[torch.Tensor] = None
        #: The losses' names, in the ring's column order (every step must return these).
        self.names: Optional[Tuple[str, ...]] = None
        #: The storage's views of each slot, made once: a step hands over ``views[slot]``.
        self.views: List[Dict[str, torch.Tensor]] = []

    def write(
        self,
        loss_dict: Mapping[str, torch.Tensor],
        counter: torch.Tensor,
        it: int,
        device: torch.device,
    ) -> None:
        """Inside the step: the losses into the slot of the step ``counter`` holds (on the
        device, no host read); ``it`` names the iteration in an error."""
        with torch.no_grad():
            ring = self._ring_for(loss_dict, it, device)
            values = torch.stack(
                [v.detach().reshape(()).to(ring.dtype) for v in loss_dict.values()]
            )
            slot = torch.remainder(counter, ring.shape[0])
            ring.index_copy_(0, slot, values.unsqueeze(0))

    def _ring_for(
        self, loss_dict: Mapping[str, torch.Tensor], it: int, device: torch.device
    ) -> torch.Tensor:
        names = tuple(loss_dict)
        if self.ring is None or self.names != names:
            if self.names is not None and self.names != names:
                raise ValueError(
                    f"{WHO}: the model returned losses {list(names)} at iteration {it}, but "
                    f"{list(self.names)} at its first step: every step must return the same "
                    "losses (the step writes them into a ring buffer of one set of names)"
                )
            dtype = _ring_dtype(v.dtype for v in loss_dict.values())
            size = self.size or min_ring_size(1)
            self.ring = ring = torch.zeros(size, len(names), dtype=dtype, device=device)
            self.names = names
            self.views = [{n: ring[s, j] for j, n in enumerate(names)} for s in range(size)]
        return self.ring

    def losses_at(self, it: int) -> Dict[str, torch.Tensor]:
        """The views of iteration ``it``'s slot (what the storage reads, later, in a batch)."""
        views = self.views
        return views[it % len(views)]
