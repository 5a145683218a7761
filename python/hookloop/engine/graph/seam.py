"""The capture seam: how a step is warmed up, recorded and replayed, and what makes a
model/optimizer impossible to capture.

:class:`StepGraph` is the seam: ``warmup(fn)`` runs the step function for real (on a side
stream for CUDA), ``capture(fn, params)`` records it without running it, ``replay()`` runs
what was recorded, and ``restore()`` points the parameters' ``.grad`` back at the buffers the
replays write (after another graph or an eager step left its own there).
:class:`CUDAStepGraph` is torch's machinery (``torch.cuda.CUDAGraph``, ``torch.cuda.graph``,
a side stream for the warm-up; torch's default CUDA generator is graph-safe by itself).
:class:`EagerStepGraph` "replays" by calling the function again: the CPU tests run every other
part (static buffers, the ring buffer and its reads, the LR table, hooks, writers, checkpoints)
through it, and ``fallback="eager"`` does not need it.

:func:`seam_maker` is the one place that picks the seam for ``graph=``; it reads this module's
names when called (the tests and the host benchmark stand another seam in by setting them).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

__all__ = [
    "CAPTURE_OPTIONS",
    "CUDAStepGraph",
    "EagerStepGraph",
    "StepGraph",
    "WHO",
    "capture_problem",
    "seam_maker",
]

#: Who speaks in the messages of every room of the graph.
WHO = "CUDAGraphTrainer"

#: The param-group options that make an optimizer's step capturable (see capture_problem).
CAPTURE_OPTIONS = ("capturable", "fused")


class StepGraph(Protocol):
    """The capture seam: run a step for real, record it, replay it."""

    @property
    def captured(self) -> bool: ...

    def warmup(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` for real (a training step), as the warm-up before a capture."""

    def capture(self, fn: Callable[[], None], params: Sequence[torch.Tensor]) -> None:
        """Records ``fn``, a step that leaves the gradients of ``params`` in their ``.grad``;
        nothing of it runs until :meth:`replay`."""

    def replay(self) -> None:
        """Runs what :meth:`capture` recorded."""

    def restore(self) -> None:
        """Points the parameters' ``.grad`` at the gradients this step's replays write, after
        another step (another graph's, an eager one) left its own there."""

    def reset(self) -> None:
        """Forgets the recorded step (the next step warms up and captures again)."""


class EagerStepGraph:
    """The seam without a device: a replay calls the step function again."""

    def __init__(self) -> None:
        self._fn: Optional[Callable[[], None]] = None

    @property
    def captured(self) -> bool:
        return self._fn is not None

    def warmup(self, fn: Callable[[], None]) -> None:
        fn()

    def capture(self, fn: Callable[[], None], params: Sequence[torch.Tensor]) -> None:
        self._fn = fn

    def replay(self) -> None:
        fn = self._fn
        if fn is None:
            raise RuntimeError(f"{WHO}: replay() before capture()")
        fn()

    def restore(self) -> None:
        """Nothing: each replay runs the step, which leaves its own gradients."""

    def reset(self) -> None:
        self._fn = None


class CUDAStepGraph:
    """``torch.cuda.CUDAGraph``: the warm-up on a side stream, the capture with
    ``torch.cuda.graph`` (its private memory pool), the replay on the current stream."""

    def __init__(self, device: Any = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{WHO}(graph='cuda') needs a CUDA device and torch finds none: train on a "
                "GPU, use SimpleTrainer/AMPTrainer, or pass fallback='eager' to train eagerly"
            )
        self._device = torch.device("cuda") if device is None else torch.device(device)
        self._side: Optional[torch.cuda.Stream] = None
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._grads: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def warmup(self, fn: Callable[[], None]) -> None:
        if self._side is None:
            self._side = torch.cuda.Stream(self._device)
        side = self._side
        current = torch.cuda.current_stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side), warnings.catch_warnings():
            # A capturable optimizer's step outside a capture warns that capturable=True is
            # slower: here it is the warm-up the capture needs.
            warnings.filterwarnings(
                "ignore", message="This instance was constructed with capturable"
            )
            fn()
        current.wait_stream(side)

    def capture(self, fn: Callable[[], None], params: Sequence[torch.Tensor]) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            # "thread_local": only this thread's unsafe calls break the capture. In the default
            # "global" mode a DataLoader's pin-memory thread (pin_memory=True, workers) that
            # allocates pinned memory during the capture breaks it, and is itself left failing.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                fn()
        except RuntimeError as e:
            raise RuntimeError(
                f"{WHO}: capturing the step failed: {e}. The usual cause is a host "
                "synchronization in the model or the loss (.item(), .cpu(), .tolist(), "
                "printing a tensor, `if tensor:` or other control flow on a tensor's value, "
                "a nonzero()/masked index with a data-dependent shape). Remove it, or pass "
                "fallback='eager' to train those steps eagerly"
            ) from e
        self._graph = graph
        # The captured backward wrote each gradient into a buffer of the graph's own pool
        # (zero_grad(set_to_none=True) first), which every replay writes again.
        self._grads = [(p, p.grad) for p in params]

    def replay(self) -> None:
        graph = self._graph
        if graph is None:
            raise RuntimeError(f"{WHO}: replay() before capture()")
        graph.replay()

    def restore(self) -> None:
        for p, g in self._grads:
            p.grad = g

    def reset(self) -> None:
        self._graph = None
        self._grads = []


def seam_maker(graph: str, device: Any) -> Callable[[], StepGraph]:
    """What makes a new seam (one per batch signature) for ``graph`` (``"cuda"`` or
    ``"eager"``). Raises the :class:`CUDAStepGraph`'s ``RuntimeError`` now when there is no
    CUDA device (the error at construction, not at the first step)."""
    if graph != "cuda":
        return EagerStepGraph
    CUDAStepGraph(device)
    return lambda: CUDAStepGraph(device)


def capture_problem(model: Any, optimizer: Any, graph: str) -> Optional[Tuple[type, str]]:
    """What makes this model/optimizer impossible to capture, as (exception type, message),
    or None. Checked at construction, before the device (a configuration error is reported
    the same on every machine)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        return (
            TypeError,
            f"{WHO} does not capture a {type(model).__name__} model: its gradient "
            "all-reduce runs outside a capturable stream. Train it with SimpleTrainer or "
            "AMPTrainer, or pass fallback='eager'",
        )
    if graph != "cuda":
        return None
    for i, group in enumerate(getattr(optimizer, "param_groups", [])):
        # torch refuses to capture the step of a group with capturable=False (fused or not);
        # an optimizer without that option (SGD) reads a tensor LR on the device when fused.
        key = "capturable" if "capturable" in group else "fused"
        if group.get(key):
            continue
        name = type(optimizer).__name__
        return (
            ValueError,
            f"{WHO} needs a capturable optimizer (its step state on the device, a tensor "
            f"learning rate read without a host sync); {name} param group {i} has "
            f"{key}={group.get(key)!r}: build it as {name}(..., {key}=True)",
        )
    return None


def _keep_capture_options(optimizer: Any, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A load_state_dict pre-hook: the loaded param groups keep this optimizer's
    ``capturable``/``fused``. torch's load replaces every option of a group by the saved one,
    so a checkpoint written by an eager trainer (``capturable=False``, a non-fused SGD) would
    make the step impossible to capture; with the options kept, torch also places the loaded
    state (Adam's ``step``) where a capturable step needs it, on the parameters' device."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list):
        return state_dict  # torch's load reports what is wrong with it
    groups = list(saved_groups)  # as many as saved: torch checks the count
    for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if isinstance(saved, dict):
            groups[i] = {**saved, **{k: group[k] for k in CAPTURE_OPTIONS if k in group}}
    return {**state_dict, "param_groups": groups}
