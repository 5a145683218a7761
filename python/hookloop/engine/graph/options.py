"""The options of a :class:`CUDAGraphTrainer`'s graph, checked in one place.

:class:`GraphOptions` holds what ``CUDAGraphTrainer(...)`` takes beyond ``SimpleTrainer``'s
arguments for the captured step (``graph``, ``fallback``, ``precision``, ``warmup_iters``,
``ring_size``, ``max_graphs``); :meth:`GraphOptions.checked` is the one place they are
validated, each error naming the argument and the value, and the ring's size resolved against
the trainer's ``gather_metric_period`` (the ring's invariant: :mod:`.ring`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hookloop._core import PENDING_READ_EVERY
from hookloop.engine.graph.ring import RING_SAFETY, min_ring_size
from hookloop.engine.graph.seam import WHO

__all__ = ["DEFAULT_MAX_GRAPHS", "GraphOptions"]

#: Graphs (batch signatures) a CUDAGraphTrainer captures unless told otherwise.
DEFAULT_MAX_GRAPHS = 4


@dataclass(frozen=True)
class GraphOptions:
    """The graph's options (see :class:`CUDAGraphTrainer`'s arguments); made by
    :meth:`checked`. The defaults are the trainer's, with ``ring_size`` not yet resolved."""

    #: ``"cuda"`` (torch.cuda.CUDAGraph) or ``"eager"`` (the seam's CPU implementation).
    graph: str = "cuda"
    #: None (a problem raises) or ``"eager"`` (one warning, then eager steps).
    fallback: Optional[str] = None
    #: None (float32) or ``torch.bfloat16`` (autocast without its cache).
    precision: Optional[torch.dtype] = None
    #: Eager steps each batch signature runs before its capture.
    warmup_iters: int = 3
    #: Slots of the loss ring; None only before :meth:`checked` resolved it.
    ring_size: Optional[int] = None
    #: Batch signatures that get a graph of their own.
    max_graphs: int = DEFAULT_MAX_GRAPHS

    @classmethod
    def checked(
        cls,
        gather_metric_period: int,
        graph: str = "cuda",
        fallback: Optional[str] = None,
        precision: Optional[torch.dtype] = None,
        warmup_iters: int = 3,
        ring_size: Optional[int] = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> "GraphOptions":
        """The options, each checked (``TypeError``/``ValueError`` naming it), with
        ``ring_size`` None made the smallest that keeps the ring's invariant for
        ``gather_metric_period`` (an int >= 1, checked by the trainer)."""
        if precision is not None and precision not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"{WHO} precision must be None, torch.float32 or torch.bfloat16, got "
                f"{precision}: float16 needs a GradScaler, whose inf check and scale update "
                "read the device on the host every step. Use precision=torch.bfloat16"
            )
        if graph not in ("cuda", "eager"):
            raise ValueError(f"{WHO} graph must be 'cuda' or 'eager', got {graph!r}")
        if fallback not in (None, "eager"):
            raise ValueError(f"{WHO} fallback must be None or 'eager', got {fallback!r}")
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int):
            raise TypeError(f"{WHO} warmup_iters must be an int, got {warmup_iters!r}")
        if warmup_iters < 0:
            raise ValueError(f"{WHO} warmup_iters must be >= 0, got {warmup_iters}")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int):
            raise TypeError(f"{WHO} max_graphs must be an int, got {max_graphs!r}")
        if max_graphs < 1:
            raise ValueError(f"{WHO} max_graphs must be >= 1, got {max_graphs}")
        need = min_ring_size(gather_metric_period)
        if ring_size is None:
            ring_size = need
        if isinstance(ring_size, bool) or not isinstance(ring_size, int):
            raise TypeError(f"{WHO} ring_size must be an int, got {ring_size!r}")
        if ring_size < need:
            raise ValueError(
                f"{WHO} ring_size={ring_size} is too small: a loss slot must be read before "
                f"the graph writes it again, and the storage reads at least every "
                f"{PENDING_READ_EVERY} recorded iterations (one in gather_metric_period="
                f"{gather_metric_period}), so ring_size must be at least "
                f"{RING_SAFETY} * {PENDING_READ_EVERY} * {gather_metric_period} = {need}"
            )
        return cls(graph, fallback, precision, warmup_iters, ring_size, max_graphs)
