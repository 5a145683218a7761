"""The static batches: one per batch signature, at fixed addresses, with its graph.

A batch signature (:class:`_Shape`: structure, shapes, dtypes, non-tensor values) gets its
static batch and its graph at its first batch, up to ``max_graphs``; each warms up and is
captured at its own first batches, and has its own memory pool (so its own gradient buffers:
``restore``). The loader's tensors are copied into the static buffers before each replay
(``copy_(non_blocking=True)``: a device-to-device copy, or from the loader's host memory,
pinned first if it is not, without a synchronization). With the loader's graph source (a
``DeviceResidentLoader``'s ``ResidentBatches``) the graph makes the batch itself, and the
signature is the batch size.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from hookloop.engine.graph.seam import StepGraph

__all__ = ["StaticBatches"]


def _copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, queued on the stream without waiting for it, and no part of any
    autograd graph. From pageable host memory CUDA's copy first waits for everything queued on
    the stream (here every replay not yet run): such a source is pinned first (torch's caching
    host allocator, its block reused once the copy is done)."""
    if dst.is_cuda and not src.is_cuda and not src.is_pinned():
        src = src.pin_memory()
    if dst.requires_grad or src.requires_grad:
        # A model that made its input require gradients (the static batch is that input), or
        # a loader's tensor that requires them. Otherwise autograd records nothing, and
        # torch.no_grad() would cost more than the rest of the copy (about 1.5 µs).
        with torch.no_grad():
            dst.copy_(src, non_blocking=True)
        return
    dst.copy_(src, non_blocking=True)


def _same_value(x: Any, s: Any) -> bool:
    """Whether non-tensor leaf ``x`` equals the captured ``s``: the same object, or ``==``
    with one truth value (a numpy array's elementwise ``==`` counts as different)."""
    if x is s:
        return True
    try:
        same = x == s
        return getattr(same, "ndim", 0) == 0 and bool(same)
    except Exception:  # a comparison that fails: not the same value
        return False


class _Leaf:
    """A batch leaf as its description: a tensor's dtype and shape, or the value itself."""

    __slots__ = ("text",)

    def __init__(self, x: Any) -> None:
        self.text = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)

    def __repr__(self) -> str:
        return self.text


def _describe(spec: Any, leaves: Sequence[Any]) -> str:
    """A batch as its structure with each tensor's dtype and shape: ``(torch.float32 (16, 4),
    'train')``."""
    return repr(pytree.tree_unflatten([_Leaf(x) for x in leaves], spec))


class _Shape:
    """One batch signature (structure, tensor shapes and dtypes, non-tensor values), its static
    buffers and its graph."""

    __slots__ = ("spec", "static", "batch", "seam", "warmups", "size")

    def __init__(
        self,
        spec: Any,
        leaves: Sequence[Any],
        device: torch.device,
        seam: StepGraph,
        size: Optional[int] = None,
    ) -> None:
        #: The batch size of a graph source's batch (the graph makes the batch), or None.
        self.size = size
        self.spec = spec
        #: Leaves: a static tensor for each tensor, the captured value for the others (none
        #: for a graph source's batch).
        self.static: List[Any] = [
            torch.empty(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor) else x
            for x in leaves
        ]
        self.batch = None if size is not None else pytree.tree_unflatten(self.static, spec)
        self.seam = seam
        self.warmups = 0

    def matches(self, spec: Any, leaves: Sequence[Any]) -> bool:
        if spec != self.spec:
            return False
        for x, s in zip(leaves, self.static):
            if isinstance(s, torch.Tensor):
                if not (isinstance(x, torch.Tensor) and x.shape == s.shape and x.dtype == s.dtype):
                    return False
            elif not _same_value(x, s):
                return False
        return True

    def describe(self) -> str:
        if self.size is not None:
            return f"of {self.size} made by the loader's graph source"
        return _describe(self.spec, self.static)


class StaticBatches:
    """The batch signatures seen (one graph each, in the order first seen), this step's, the
    one whose gradient buffers ``.grad`` holds, and the loader's graph source."""

    __slots__ = ("max_graphs", "shapes", "current", "grads_of", "source", "size")

    def __init__(self, max_graphs: int) -> None:
        self.max_graphs = max_graphs
        #: One graph per batch signature, in the order first seen; ``current`` is this step's.
        self.shapes: List[_Shape] = []
        self.current: Optional[_Shape] = None
        #: The shape whose graph's gradient buffers the parameters' ``.grad`` now are.
        self.grads_of: Optional[_Shape] = None
        #: The data loader's graph source (``loader.graph_source(device)``, a
        #: DeviceResidentLoader's :class:`~hookloop.data.resident.ResidentBatches`): the graph
        #: makes the batch itself; None: the loader's batches are copied in (:meth:`place`).
        self.source: Optional[Any] = None
        #: The size of this step's batch from the source.
        self.size = 0

    @property
    def captured(self) -> bool:
        """Whether a graph is captured (for some batch signature)."""
        return any(s.seam.captured for s in self.shapes)

    def reset(self) -> None:
        """Drops every graph and static batch."""
        for shape in self.shapes:
            shape.seam.reset()
        self.shapes = []
        self.current = None
        self.grads_of = None

    def pick_source(self, data_loader: Any, device: torch.device) -> None:
        """The loader's graph source on ``device`` (at ``before_train``), or None: any loader
        with a ``graph_source`` method, which says None for data on another device."""
        make = getattr(data_loader, "graph_source", None)
        self.source = make(device) if callable(make) else None

    def place(
        self, data: Any, new_seam: Callable[[], StepGraph], device: torch.device
    ) -> Optional[str]:
        """Copies ``data`` into the static batch of its signature (made at its first batch,
        on ``device``, with a seam from ``new_seam``, up to ``max_graphs`` signatures) and
        makes that signature's graph this step's. Returns None, or why no graph can take
        ``data`` (then nothing is copied)."""
        leaves, spec = pytree.tree_flatten(data)
        shape = self.current
        if shape is None or not shape.matches(spec, leaves):
            shape = next((s for s in self.shapes if s.matches(spec, leaves)), None)
            if shape is None:
                if len(self.shapes) >= self.max_graphs:
                    this, held = _describe(spec, leaves), [s.describe() for s in self.shapes]
                    why = (
                        " (described alike: a non-tensor value in it compares unequal, such as "
                        "a numpy array or an object made per batch; make it a tensor)"
                        if this in held
                        else ""
                    )
                    # A signature holds its graph from its first batch on, captured or still
                    # warming up: the message names them without saying they were captured
                    # (and stays the same from step to step: it is the warning's key).
                    n = self.max_graphs
                    return (
                        f"a batch {this}, but the max_graphs={n} batch "
                        f"{'signature is' if n == 1 else 'signatures are'} taken by "
                        f"{' and '.join(held)}{why}"
                    )
                shape = _Shape(spec, leaves, device, new_seam())
                self.shapes.append(shape)
        self.current = shape
        for x, s in zip(leaves, shape.static):
            if isinstance(s, torch.Tensor):
                _copy_async(s, x)
        return None

    def place_source(
        self, size: int, new_seam: Callable[[], StepGraph], device: torch.device
    ) -> Optional[str]:
        """:meth:`place` for a graph source's batch of ``size``: its signature is the size."""
        shape = self.current
        if shape is None or shape.size != size:
            shape = next((s for s in self.shapes if s.size == size), None)
            if shape is None:
                if len(self.shapes) >= self.max_graphs:
                    held = " and ".join(s.describe() for s in self.shapes)
                    return (
                        f"a batch of {size} from the loader's graph source, but the "
                        f"max_graphs={self.max_graphs} batch signatures are taken by {held}"
                    )
                shape = _Shape(None, (), device, new_seam(), size)
                self.shapes.append(shape)
        self.current = shape
        return None

    def batch(self) -> Any:
        """This step's batch: the static one, or the source's, made now (in the graph)."""
        shape = self.current
        assert shape is not None
        if shape.size is None:
            return shape.batch
        return self.source.batch(shape.size)  # type: ignore[union-attr]
