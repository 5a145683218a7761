"""The whole training step as one CUDA graph: :class:`CUDAGraphTrainer`'s collaborators.

Capture sits behind one small seam, :class:`StepGraph`: ``warmup(fn)`` runs the step function
for real (on a side stream for CUDA), ``capture(fn, params)`` records it without running it,
``replay()`` runs what was recorded, and ``restore()`` points the parameters' ``.grad`` back at
the buffers the replays write (after another graph or an eager step left its own there).
:class:`CUDAStepGraph` is torch's machinery (``torch.cuda.CUDAGraph``, ``torch.cuda.graph``,
a side stream for the warm-up; torch's default CUDA generator is graph-safe by itself).
:class:`EagerStepGraph` "replays" by calling the function again: the CPU tests run every other
part (static buffers, the ring buffer and its reads, the LR table, hooks, writers, checkpoints)
through it, and ``fallback="eager"`` does not need it.

:class:`GraphStep` holds what the captured function reads and writes, all at fixed
addresses, so one replay is one training step:

- one graph per batch signature (:class:`_Shape`: structure, shapes, dtypes, non-tensor
  values), up to ``max_graphs``; each warms up and is captured at its own first batches, and
  has its own static batch and memory pool (so its own gradient buffers: ``restore``). All
  share the counter, the LR table and the ring below;
- the static batch: the loader's tensors are copied into buffers of the captured shapes
  before each replay (``copy_(non_blocking=True)``: a device-to-device copy, or from the
  loader's host memory, pinned first if it is not, without a synchronization);
- the device step counter: the absolute iteration, incremented by the graph;
- the LR table: one row per iteration, the values every param group's ``lr`` takes then,
  evaluated at ``before_train`` from the ``LRScheduler`` hooks' schedulers (a copy of each is
  stepped; the real ones are untouched). The graph copies ``table[step]`` into the tensor the
  optimizer reads as its ``lr``. The host still steps the real schedulers as the eager trainer
  does (so the LR the hook writes is the eager trainer's, as a float, with no read from the
  device); each step compares the host's LRs with the table's row and, where something
  changed an LR outside the schedule, writes that row again (a small non-blocking copy). It
  has a column per param group: a group added or removed between steps builds it again from
  that iteration on (and drops the graphs, which read the old one).
- the ring buffer: ``ring[step % R, j]`` is loss ``j`` of that step (float32, or float64
  where a loss has values float32 does not hold exactly: a float64 loss, an int64 count above
  2**24). Each iteration hands the storage the views of its slot (dicts built once); the
  storage reads them in one batched copy. **Invariant**: a slot's read is started (its
  values copied out on the device's stream) before the graph writes that slot again, ``R``
  iterations later. The storage's pending queue starts a read at least every
  ``_core.PENDING_READ_EVERY`` (20) recorded iterations, and records one iteration in
  ``gather_metric_period``; so ``R >= 2 * PENDING_READ_EVERY * gather_metric_period`` (a
  safety factor of 2), checked with a ``ValueError``.
"""

from __future__ import annotations

import logging
import operator
import time
import warnings
import weakref
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from hookloop._core import PENDING_READ_EVERY
from hookloop.engine.hooks import LRScheduler
from hookloop.engine.losses import losses_of
from hookloop.engine.parts import SimpleTrainerParts
from hookloop.engine.train_loop import HookBase, SimpleTrainer
from hookloop.solver.torch_step import step as torch_step

__all__ = [
    "CUDAGraphTrainer",
    "CUDAStepGraph",
    "EagerStepGraph",
    "GraphStep",
    "StepGraph",
    "capture_problem",
]

logger = logging.getLogger("hookloop.engine.train_loop")

#: Safety factor of the ring-buffer invariant (see the module docstring).
RING_SAFETY = 2
#: Graphs (batch signatures) a CUDAGraphTrainer captures unless told otherwise.
DEFAULT_MAX_GRAPHS = 4
#: A warning when the step has been captured again this many times (see GraphStep.check_baked).
RECAPTURE_WARNING = 10
#: At most this many rows in the LR table (beyond it the last row is rewritten as needed).
MAX_TABLE_ROWS = 1 << 21

_WHO = "CUDAGraphTrainer"


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
            raise RuntimeError(f"{_WHO}: replay() before capture()")
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
                f"{_WHO}(graph='cuda') needs a CUDA device and torch finds none: train on a "
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
                f"{_WHO}: capturing the step failed: {e}. The usual cause is a host "
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
            raise RuntimeError(f"{_WHO}: replay() before capture()")
        graph.replay()

    def restore(self) -> None:
        for p, g in self._grads:
            p.grad = g

    def reset(self) -> None:
        self._graph = None
        self._grads = []


def capture_problem(model: Any, optimizer: Any, graph: str) -> Optional[Tuple[type, str]]:
    """What makes this model/optimizer impossible to capture, as (exception type, message),
    or None. Checked at construction, before the device (a configuration error is reported
    the same on every machine)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        return (
            TypeError,
            f"{_WHO} does not capture a {type(model).__name__} model: its gradient "
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
            f"{_WHO} needs a capturable optimizer (its step state on the device, a tensor "
            f"learning rate read without a host sync); {name} param group {i} has "
            f"{key}={group.get(key)!r}: build it as {name}(..., {key}=True)",
        )
    return None


#: The param-group options that make an optimizer's step capturable (see capture_problem).
CAPTURE_OPTIONS = ("capturable", "fused")


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


class _LRProbe:
    """A stand-in optimizer for stepping copies of the schedulers: its param groups hold the
    hyper-parameters only, and its ``step`` counts as called (torch warns otherwise)."""

    _opt_called = True

    def __init__(self, groups: Sequence[Mapping[str, Any]]) -> None:
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]

        def step(*args: Any, **kwargs: Any) -> None:
            return None

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self.step = step


def lr_rows(
    optimizer: Any, schedulers: Sequence[Any], start_iter: int, rows: int
) -> List[List[float]]:
    """The LR of every param group at iterations ``start_iter .. rows - 1`` (row ``i`` is the
    LR the optimizer's step of iteration ``i`` uses), stepping deep copies of ``schedulers``
    over a stand-in optimizer in hook order, after each iteration, with the function the
    ``LRScheduler`` hooks step the real ones with (:func:`hookloop.solver.torch_step.step`:
    2.3 µs a row instead of 3.9 for torch's MultiStepLR). The real schedulers and the
    optimizer are not touched."""
    import copy

    probe = _LRProbe(optimizer.param_groups)
    copies = copy.deepcopy(list(schedulers), memo={id(optimizer): probe})
    out: List[List[float]] = []
    for it in range(start_iter, rows):
        out.append([float(g["lr"]) for g in probe.param_groups])
        if it + 1 < rows:
            for s in copies:
                torch_step(s)
    return out


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


class _Leaf:
    """A batch leaf as its description: a tensor's dtype and shape, or the value itself."""

    __slots__ = ("text",)

    def __init__(self, x: Any) -> None:
        self.text = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)

    def __repr__(self) -> str:
        return self.text


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


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")
#: Param-group entries a replay does not take from the group: the LR comes from the table.
_NOT_BAKED = frozenset({"params", "lr", "initial_lr"})


class _Baked:
    """What a capture baked in from the Python side, checked before every replay: which
    parameters require gradients, which modules are in training mode, the optimizer's param
    groups (their parameters and every option but the LR, which the graph reads from the
    table), the optimizer's state (the tensors a replay updates, by identity), and the
    model's modules by name (for :meth:`GraphStep.assigned`). A hook that freezes a backbone,
    puts a submodule in eval mode, schedules the momentum, adds a param group or clears or
    replaces the optimizer's state changes one of these, and the eager step would follow it:
    the graphs are dropped and the step is captured again. The check is a few comparisons
    made in C (about 2.5 µs a step for the tiny MLP), while the device runs the replay before."""

    __slots__ = (
        "params",
        "grads",
        "modules",
        "modes",
        "names",
        "groups",
        "keys",
        "getters",
        "options",
        "state",
        "state_ids",
        "ids_of",
    )

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.params = list(model.parameters())
        self.grads = list(map(_REQUIRES_GRAD, self.params))
        named = list(model.named_modules())
        self.modules = [m for _, m in named]
        self.modes = list(map(_TRAINING, self.modules))
        self.names = {id(m): n for n, m in named}
        self.groups = optimizer.param_groups
        self.keys = [[k for k in g if k not in _NOT_BAKED] for g in self.groups]
        self.getters = [operator.itemgetter(*keys) if keys else _nothing for keys in self.keys]
        self.options = self._options(self.groups)
        #: Each parameter's state as the capture saw it (copies of the dicts: the tensors, kept
        #: alive so that their ids stay theirs), and the ids of those values in order. A state
        #: that is not a dict per parameter (torch's optimizers all keep one) is not watched.
        watched = all(isinstance(s, dict) for s in optimizer.state.values())
        self.ids_of = _state_ids if watched else _no_ids
        self.state = [(p, dict(s)) for p, s in optimizer.state.items()] if watched else []
        self.state_ids = self.ids_of(optimizer.state)

    def _options(self, groups: Sequence[Mapping[str, Any]]) -> List[Tuple[Any, ...]]:
        # The params list by identity (== compares its items by identity first), its length.
        return [
            (len(g), g["params"], len(g["params"]), get(g)) for g, get in zip(groups, self.getters)
        ]

    def changed(self, model: Any, optimizer: Any) -> Optional[str]:
        """None, or what changed since the capture."""
        groups = optimizer.param_groups
        try:
            if (
                list(map(_REQUIRES_GRAD, self.params)) == self.grads
                and list(map(_TRAINING, self.modules)) == self.modes
                and groups is self.groups
                and len(groups) == len(self.options)
                and self._options(groups) == self.options  # identity first, then ==
                and self.ids_of(optimizer.state) == self.state_ids
            ):
                return None
        except Exception:  # an option removed, one whose == has no truth value, odd state
            pass
        return self._what_changed(model, optimizer)

    def _what_changed(self, model: Any, optimizer: Any) -> str:
        groups = optimizer.param_groups
        names = {id(p): n for n, p in model.named_parameters()}
        for p, was in zip(self.params, self.grads):
            if p.requires_grad != was:
                return f"requires_grad of {names.get(id(p), 'a parameter')} changed to {not was}"
        for m, was in zip(self.modules, self.modes):
            if m.training != was:
                mode = "eval" if was else "train"
                return f"{self.names[id(m)] or 'the model'} was put in {mode} mode"
        if groups is not self.groups or len(groups) != len(self.options):
            n = len(self.options)
            return f"the optimizer's param groups changed ({len(groups)}, captured with {n})"
        for i, (g, keys, (size, params, n, values)) in enumerate(
            zip(groups, self.keys, self.options)
        ):
            now = g["params"]
            if len(g) != size or len(now) != n or any(p is not q for p, q in zip(now, params)):
                return f"param group {i}'s parameters or options changed"
            for k, old in zip(keys, _as_tuple(values, len(keys))):
                now = g.get(k)
                if now is not old and not (
                    not isinstance(old, torch.Tensor) and _same_value(now, old)
                ):
                    return f"param group {i}'s {k} changed from {old!r} to {now!r}"
        return self._state_changed(optimizer.state, names) or "the captured state changed"

    def _state_changed(self, state: Any, names: Mapping[int, str]) -> Optional[str]:
        """How the optimizer's state differs from the captured one (a replay would update the
        captured tensors, not the ones the optimizer holds now), or None."""
        if self.state and not any(map(len, state.values())):
            return "the optimizer's state was cleared"
        held = {id(p): s for p, s in self.state}
        for p, now in list(state.items()) + [(p, {}) for p, _ in self.state if p not in state]:
            was = held.get(id(p), {})
            diff = [f"{k} replaced" for k, v in was.items() if k in now and now[k] is not v]
            diff += [f"{k} removed" for k in was if k not in now]
            diff += [f"{k} added" for k in now if k not in was]
            if diff:
                name = names.get(id(p), "a parameter outside the model")
                return f"the optimizer's state of {name} changed ({', '.join(diff)})"
        return None


def _state_ids(state: Mapping[Any, Any]) -> List[int]:
    """The ids of every value in an optimizer's state, parameter by parameter (made in C:
    looking the parameters up would hash each tensor in Python)."""
    return list(map(id, chain.from_iterable(map(dict.values, state.values()))))


def _no_ids(state: Any) -> List[int]:
    return []


def _ring_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """float32 where it holds every loss's value exactly (bool, integers of up to 16 bits,
    floats of up to 32), float64 otherwise: a float64 loss, an int32/int64 count (float32's
    24-bit significand would round 2**24 + 1)."""
    for dt in dtypes:
        if dt.itemsize > 2 and not (dt.is_floating_point and dt.itemsize <= 4):
            return torch.float64
    return torch.float32


def _nothing(_: Any) -> Tuple[()]:
    return ()


def _as_tuple(values: Any, n: int) -> Tuple[Any, ...]:
    """``itemgetter``'s result as a tuple of ``n`` (one key gives the value itself)."""
    return (values,) if n == 1 else tuple(values)


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


def _describe(spec: Any, leaves: Sequence[Any]) -> str:
    """A batch as its structure with each tensor's dtype and shape: ``(torch.float32 (16, 4),
    'train')``."""
    return repr(pytree.tree_unflatten([_Leaf(x) for x in leaves], spec))


class GraphStep:
    """What the captured step reads and writes (static batch, step counter, LR table, ring
    buffer) and the phase of the capture. One per :class:`CUDAGraphTrainer`."""

    def __init__(self) -> None:
        self.fallback: Optional[str] = None
        self.precision: Optional[torch.dtype] = None
        self.warmup_iters = 3
        self.ring_size: Optional[int] = None
        self.max_graphs = DEFAULT_MAX_GRAPHS
        #: Makes a new seam (one per batch signature): CUDAStepGraph or EagerStepGraph.
        self._new_seam: Optional[Callable[[], StepGraph]] = None
        #: The eager step replaces the graph for this run (fallback="eager" after a problem).
        self.eager_reason: Optional[str] = None
        self._warned: set = set()
        #: One graph per batch signature, in the order first seen; ``current`` is this step's.
        self.shapes: List[_Shape] = []
        self.current: Optional[_Shape] = None
        #: The shape whose graph's gradient buffers the parameters' ``.grad`` now are.
        self._grads_of: Optional[_Shape] = None
        # Device state
        self.device: torch.device = torch.device("cpu")
        self.counter: Optional[torch.Tensor] = None
        self.table: Optional[torch.Tensor] = None
        self.host_table: List[List[float]] = []
        self.table_start = 0
        self._lr_out: Optional[torch.Tensor] = None
        self._lr_views: List[torch.Tensor] = []
        self.ring: Optional[torch.Tensor] = None
        self.names: Optional[Tuple[str, ...]] = None
        self.views: List[Dict[str, torch.Tensor]] = []
        self.prepared = False
        self.configured = False
        #: Rows of the LR table written again at a step (an LR set outside the schedule).
        self.rows_rewritten = 0
        #: While a graph is captured: what it baked in (checked before each replay; a tensor
        #: or submodule assigned anew on one of its modules between steps drops the graphs).
        self._baked: Optional[_Baked] = None
        #: How many times a change after a capture made it capture again.
        self.recaptures = 0
        #: Inside the trainer's step (place, warm-up, capture, replay, an eager step).
        self.stepping = False
        self._trainer: Optional[Callable[[], Any]] = None
        #: The data loader's graph source (``loader.graph_source(device)``, a
        #: DeviceResidentLoader's :class:`~hookloop.data.resident.ResidentBatches`): the graph
        #: makes the batch itself; None: the loader's batches are copied in (:meth:`place`).
        self.source: Optional[Any] = None
        #: The size of this step's batch from the source.
        self.size = 0

    # -- configuration ----------------------------------------------------------------------

    def configure(
        self,
        trainer: Any,
        graph: str,
        fallback: Optional[str],
        precision: Optional[torch.dtype],
        warmup_iters: int,
        ring_size: Optional[int],
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        if graph not in ("cuda", "eager"):
            raise ValueError(f"{_WHO} graph must be 'cuda' or 'eager', got {graph!r}")
        if fallback not in (None, "eager"):
            raise ValueError(f"{_WHO} fallback must be None or 'eager', got {fallback!r}")
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int):
            raise TypeError(f"{_WHO} warmup_iters must be an int, got {warmup_iters!r}")
        if warmup_iters < 0:
            raise ValueError(f"{_WHO} warmup_iters must be >= 0, got {warmup_iters}")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int):
            raise TypeError(f"{_WHO} max_graphs must be an int, got {max_graphs!r}")
        if max_graphs < 1:
            raise ValueError(f"{_WHO} max_graphs must be >= 1, got {max_graphs}")
        need = RING_SAFETY * PENDING_READ_EVERY * trainer.gather_metric_period
        if ring_size is None:
            ring_size = need
        if isinstance(ring_size, bool) or not isinstance(ring_size, int):
            raise TypeError(f"{_WHO} ring_size must be an int, got {ring_size!r}")
        if ring_size < need:
            raise ValueError(
                f"{_WHO} ring_size={ring_size} is too small: a loss slot must be read before "
                f"the graph writes it again, and the storage reads at least every "
                f"{PENDING_READ_EVERY} recorded iterations (one in gather_metric_period="
                f"{trainer.gather_metric_period}), so ring_size must be at least "
                f"{RING_SAFETY} * {PENDING_READ_EVERY} * {trainer.gather_metric_period} = "
                f"{need}"
            )
        self.fallback = fallback
        self.precision = precision
        self.warmup_iters = warmup_iters
        self.ring_size = ring_size
        self.max_graphs = max_graphs
        problem = capture_problem(trainer.model, trainer.optimizer, graph)
        if problem is not None:
            self.refuse(*problem)
        if self.eager_reason is None:
            if graph == "cuda":
                device = self._model_device(trainer)
                try:
                    CUDAStepGraph(device)  # no CUDA device: the error at construction
                    self._new_seam = lambda: CUDAStepGraph(device)
                except RuntimeError as e:
                    self.refuse(RuntimeError, str(e))
            else:
                self._new_seam = EagerStepGraph
        # A load replaces the optimizer's state tensors (the graph holds the old ones) and
        # may replace the model's (load_state_dict(assign=True)): capture again after it.
        this = weakref.ref(self)

        def invalidate(*_: Any) -> None:
            step = this()
            if step is not None:
                step.invalidate()

        trainer.optimizer.register_load_state_dict_pre_hook(_keep_capture_options)
        trainer.optimizer.register_load_state_dict_post_hook(invalidate)
        trainer.model.register_load_state_dict_post_hook(invalidate)
        self._trainer = weakref.ref(trainer)
        _watch_assignments(self)
        self.configured = True

    def refuse(self, kind: type, message: str) -> None:
        """A problem that makes capture impossible: raised, or with ``fallback="eager"``,
        one warning and eager steps for the rest of the run."""
        if self.fallback != "eager":
            raise kind(message)
        if self.eager_reason is None:
            warnings.warn(f"{message}. Training eagerly (fallback='eager').", RuntimeWarning, 2)
        self.eager_reason = message

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, 3)

    @staticmethod
    def _model_device(trainer: Any) -> torch.device:
        for p in trainer.model.parameters():
            return p.device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # -- a run ------------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        """Whether a graph is captured (for some batch signature)."""
        return any(s.seam.captured for s in self.shapes)

    def grads_replaced(self) -> None:
        """An eager step left gradients of its own in ``.grad``: the next replay points
        ``.grad`` back at its graph's buffers."""
        self._grads_of = None

    def invalidate(self) -> None:
        """Drops every graph and static batch: the next steps warm up and capture again (after
        a load, at ``before_train``)."""
        for shape in self.shapes:
            shape.seam.reset()
        self.shapes = []
        self.current = None
        self._grads_of = None
        self._baked = None

    def check_baked(self, trainer: Any) -> None:
        """Before a replay: what the capture baked in still holds, or the graphs are dropped
        (see :class:`_Baked`)."""
        baked = self._baked
        if baked is not None:
            what = baked.changed(trainer.model, trainer.optimizer)
            if what is not None:
                self._capture_again(f"{what} before iteration {trainer.iter}")

    def _capture_again(self, why: str) -> None:
        logger.info(
            f"{_WHO}: {why}: the step is captured again (a replay runs the step as it was captured)"
        )
        self.invalidate()
        self.recaptures += 1
        if self.recaptures == RECAPTURE_WARNING:
            self.warn_once(
                "recaptures",
                f"{_WHO} has captured the step again {RECAPTURE_WARNING} times, each after a "
                f"change to what the capture holds (the last: {why}), and each capture runs "
                f"warmup_iters={self.warmup_iters} eager steps first. Make such changes less "
                "often, or train with SimpleTrainer",
            )

    def assigned(self, module: Any, name: str) -> None:
        """``module.name = ...`` of a registered tensor or submodule, somewhere in the
        process (torch's registration hooks): one of the captured model's, outside the step,
        drops the graphs. A replay updates the tensors it captured, not the one assigned
        (fvcore's ``update_bn_stats`` assigns new ``running_mean``/``running_var``): the next
        steps warm up and capture again, with the new one."""
        baked = self._baked
        if baked is None or self.stepping:
            return
        where = baked.names.get(id(module))
        if where is None:
            return
        trainer = self._trainer() if self._trainer is not None else None
        at = f" after iteration {trainer.iter}" if trainer is not None else ""
        self._capture_again(
            f"{where + '.' if where else ''}{name} of the model was assigned anew{at}"
        )

    def prepare(self, trainer: Any, hooks: Sequence[Any], start: Optional[int] = None) -> None:
        """At ``before_train`` (after the hooks'): the step counter at ``start`` (by default
        ``trainer.iter``), the LR table of this run from the ``LRScheduler`` hooks among
        ``hooks``, and a new capture at the first steps."""
        if not self.configured:  # a subclass that skipped CUDAGraphTrainer.__init__
            self.configure(trainer, "cuda", None, getattr(trainer, "precision", None), 3, None)
        self.invalidate()
        if self.eager_reason is None:
            for h in hooks:
                if _overrides(h, "after_backward"):
                    self.refuse(
                        TypeError,
                        f"{_WHO} cannot run {type(h).__name__}.after_backward: it would run "
                        "between backward and the optimizer step, inside the captured graph. "
                        "Do that work in after_step, or train with SimpleTrainer",
                    )
                    break
        if self.eager_reason is None and not trainer.step_optimizer:
            self.refuse(
                TypeError,
                f"{_WHO} captures the optimizer's step: step_optimizer=False (an "
                "OptimizationHook, gradient accumulation) cannot be captured. Train with "
                "SimpleTrainer",
            )
        self.device = self._model_device(trainer)
        make = getattr(trainer.data_loader, "graph_source", None)
        self.source = make(self.device) if callable(make) else None
        start = int(trainer.iter if start is None else start)
        self._build_table(trainer, hooks, start)
        with torch.no_grad():
            if self.counter is None or self.counter.device != self.device:
                self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.counter.fill_(start)
        self.prepared = True

    def _build_table(self, trainer: Any, hooks: Sequence[Any], start: int) -> None:
        """The LR table from iteration ``start`` on, a column per param group, from the
        ``LRScheduler`` hooks' schedulers among ``hooks`` as they are now, and the tensor the
        graph copies a row into (its views are the groups' ``lr`` inside the step)."""
        optimizer = trainer.optimizer
        max_iter = int(getattr(trainer, "max_iter", start + 1))
        rows = max(start + 1, min(max_iter, MAX_TABLE_ROWS))
        schedulers = _schedulers_of(hooks, optimizer)
        try:
            self.host_table = lr_rows(optimizer, schedulers, start, rows)
        except Exception as e:  # a scheduler that cannot be copied: rows follow the host
            logger.info(f"{_WHO}: LR table from the current LRs ({type(e).__name__}: {e})")
            now = [float(g["lr"]) for g in optimizer.param_groups]
            self.host_table = [list(now) for _ in range(start, rows)]
        self.table_start = start
        columns = len(optimizer.param_groups)
        with torch.no_grad():
            table = torch.zeros(rows, columns, dtype=torch.float32)
            table[start:] = torch.tensor(self.host_table, dtype=torch.float32)
            self.table = table.to(self.device)
            self._lr_out = torch.zeros(1, columns, dtype=torch.float32, device=self.device)
            self._lr_views = [self._lr_out[0, g] for g in range(columns)]

    def sync_lr(self, optimizer: Any, it: int) -> None:
        """The host's LRs of iteration ``it`` into the table's row where they differ (an LR
        set outside the schedulers the table was built from); nothing otherwise. With another
        number of param groups than the table has columns (``add_param_group`` between
        steps), the table is built again from ``it`` on and the graphs are dropped (they read
        the old table): before :meth:`place`, which picks this step's graph."""
        row = it - self.table_start
        host = self.host_table
        if row >= len(host):
            row = len(host) - 1
        now = [g["lr"] for g in optimizer.param_groups]
        if now == host[row] or row < 0:
            return
        if len(now) != len(host[row]):
            self._regroup(optimizer, it, len(host[row]))
            return
        host[row] = [float(x) for x in now]
        self.rows_rewritten += 1
        table = self.table
        assert table is not None
        with torch.no_grad():
            _copy_async(table[self.table_start + row], torch.tensor(host[row]))

    def _regroup(self, optimizer: Any, it: int, columns: int) -> None:
        trainer = self._trainer() if self._trainer is not None else None
        assert trainer is not None and trainer.optimizer is optimizer
        logger.info(
            f"{_WHO}: the optimizer has {len(optimizer.param_groups)} param groups before "
            f"iteration {it} (the LR table was built for {columns}): the table is built again "
            "from this iteration on, and the next steps warm up and capture again"
        )
        self.invalidate()
        self._build_table(trainer, trainer._hooks, it)

    # -- the static batch -------------------------------------------------------------------

    def place(self, data: Any) -> Optional[str]:
        """Copies ``data`` into the static batch of its signature (made at its first batch,
        up to ``max_graphs`` signatures) and makes that signature's graph this step's. Returns
        None, or why no graph can take ``data`` (then nothing is copied)."""
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
                assert self._new_seam is not None
                shape = _Shape(spec, leaves, self.device, self._new_seam())
                self.shapes.append(shape)
        self.current = shape
        for x, s in zip(leaves, shape.static):
            if isinstance(s, torch.Tensor):
                _copy_async(s, x)
        return None

    def place_source(self, size: int) -> Optional[str]:
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
                assert self._new_seam is not None
                shape = _Shape(None, (), self.device, self._new_seam(), size)
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

    # -- the step ---------------------------------------------------------------------------

    def body(self, trainer: Any) -> None:
        """The step the graph holds: LR from the table, forward, loss sum, backward,
        optimizer step, the losses into the ring at the counter's slot, counter + 1."""
        optimizer = trainer.optimizer
        groups = optimizer.param_groups
        counter = self.counter
        table = self.table
        assert counter is not None and table is not None and self._lr_out is not None
        with torch.no_grad():
            index = torch.clamp(counter, max=table.shape[0] - 1)
            torch.index_select(table, 0, index, out=self._lr_out)
        saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, self._lr_views):
            g["lr"] = lr
        try:
            optimizer.zero_grad(set_to_none=True)
            loss_dict, losses = self._forward(trainer, self.batch())
            losses.backward()
            optimizer.step()
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        with torch.no_grad():
            ring = self._ring_for(loss_dict, trainer.iter)
            values = torch.stack(
                [v.detach().reshape(()).to(ring.dtype) for v in loss_dict.values()]
            )
            slot = torch.remainder(counter, ring.shape[0])
            ring.index_copy_(0, slot, values.unsqueeze(0))
            counter.add_(1)

    def _forward(self, trainer: Any, batch: Any) -> Tuple[Mapping[str, torch.Tensor], Any]:
        if self.precision is None:
            return losses_of(trainer.model(batch), _WHO)
        # No autocast cache: a cached cast made during capture would be a stale tensor.
        with torch.autocast(self.device.type, dtype=self.precision, cache_enabled=False):
            return losses_of(trainer.model(batch), _WHO)

    def _ring_for(self, loss_dict: Mapping[str, torch.Tensor], it: int) -> torch.Tensor:
        names = tuple(loss_dict)
        if self.ring is None or self.names != names:
            if self.names is not None and self.names != names:
                raise ValueError(
                    f"{_WHO}: the model returned losses {list(names)} at iteration {it}, but "
                    f"{list(self.names)} at its first step: every step must return the same "
                    "losses (the step writes them into a ring buffer of one set of names)"
                )
            dtype = _ring_dtype(v.dtype for v in loss_dict.values())
            size = self.ring_size or RING_SAFETY * PENDING_READ_EVERY
            self.ring = ring = torch.zeros(size, len(names), dtype=dtype, device=self.device)
            self.names = names
            # The storage's views of each slot, made once: a step hands over views[slot].
            self.views = [{n: ring[s, j] for j, n in enumerate(names)} for s in range(size)]
        return self.ring

    def run(self, trainer: Any) -> bool:
        """One step through this step's graph (see :meth:`place`): a warm-up, the capture then
        a replay, or a replay. False when the capture failed and ``fallback="eager"`` (one
        warning): the caller steps eagerly, as it will for the rest of the run."""
        shape = self.current
        assert shape is not None
        seam = shape.seam
        if seam.captured:
            seam.replay()
            if self._grads_of is not shape:  # another graph or an eager step ran last
                seam.restore()
                self._grads_of = shape
            return True
        # The seam keeps the function (EagerStepGraph): weak references, so that the trainer
        # and this object are still freed by reference counting.
        this, owner = weakref.ref(self), weakref.ref(trainer)

        def step() -> None:
            graph, trainer = this(), owner()
            assert graph is not None and trainer is not None
            graph.body(trainer)

        self.grads_replaced()
        if shape.warmups < self.warmup_iters:
            seam.warmup(step)
            shape.warmups += 1
            return True
        params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        try:
            seam.capture(step, params)
        except RuntimeError as e:
            # Nothing of a failed capture ran on the device: the step is still to be made.
            self.refuse(RuntimeError, str(e))
            return False
        logger.info(
            f"{_WHO}: captured the step at iteration {trainer.iter} for the batch "
            f"{shape.describe()} (graph {self.shapes.index(shape) + 1} of at most "
            f"{self.max_graphs})"
        )
        seam.replay()
        self._grads_of = shape
        if self._baked is None:
            # After the first replay: the eager seam's (warmup_iters=0) made the optimizer's
            # state, which a CUDA capture makes while it records.
            self._baked = _Baked(trainer.model, trainer.optimizer)
        return True

    def losses_at(self, it: int) -> Dict[str, torch.Tensor]:
        views = self.views
        return views[it % len(views)]


def _overrides(hook: Any, stage: str) -> bool:
    fn = getattr(type(hook), stage, None)
    return fn is not None and fn is not getattr(HookBase, stage)


def _watch_assignments(step: GraphStep) -> None:
    """Calls ``step.assigned(module, name)`` at every assignment of a registered buffer,
    parameter or submodule (torch's global registration hooks), for as long as ``step``
    lives."""
    from torch.nn.modules import module as nn_module

    this = weakref.ref(step)

    def assigned(module: Any, name: str, value: Any) -> None:
        s = this()
        if s is not None:
            s.assigned(module, name)

    handles = [
        nn_module.register_module_buffer_registration_hook(assigned),
        nn_module.register_module_parameter_registration_hook(assigned),
        nn_module.register_module_module_registration_hook(assigned),
    ]
    weakref.finalize(step, _remove_all, handles)


def _remove_all(handles: Sequence[Any]) -> None:
    for h in handles:
        h.remove()


def _schedulers_of(hooks: Sequence[Any], optimizer: Any) -> List[Any]:
    out = []
    for h in hooks:
        if isinstance(h, LRScheduler) and h._optimizer is optimizer and h._scheduler is not None:
            out.append(h._scheduler)
    return out


class _GraphTrainerParts(SimpleTrainerParts):
    """:class:`SimpleTrainerParts` with the :class:`GraphStep`."""

    def __init__(self) -> None:
        super().__init__()
        self.graph = GraphStep()


class CUDAGraphTrainer(SimpleTrainer):
    """Like :class:`SimpleTrainer`, but the whole step (forward, loss sum, backward, optimizer
    step, the write of every loss into a device ring buffer) is one CUDA graph, captured after
    ``warmup_iters`` warm-up steps and replayed at every later iteration. Hooks run on the host
    between replays, on the same parameters; the losses reach the storage as the eager
    trainer's do (read in one batched copy when a writer or a reader needs them), at their own
    iterations; the LR schedule is a device table the graph reads, so it changes without a
    host sync or a recapture. See ``docs/cuda_graph.md``.

    What cannot be captured raises at construction or at capture (``TypeError``,
    ``ValueError`` or ``RuntimeError`` naming the cause and the fix): no CUDA device, a
    ``DistributedDataParallel``/``DataParallel`` model, an optimizer that is not capturable
    (``Adam(..., capturable=True)``, ``SGD(..., fused=True)``), float16 or a ``GradScaler``
    (bfloat16 autocast is supported), ``async_write_metrics``, a hook's ``after_backward``,
    ``step_optimizer=False``, a host synchronization in the model or loss (at capture), a batch
    whose structure, shapes, dtypes or non-tensor values differ from every captured one when
    ``max_graphs`` are taken (at that step). With ``fallback="eager"`` each of these is one
    ``RuntimeWarning`` and :class:`SimpleTrainer`'s eager step instead (for the rest of the run,
    or for that batch).

    Shapes: one graph per batch signature (structure, shapes, dtypes, non-tensor values), each
    warmed up and captured at its own first batches, up to ``max_graphs`` (4): a loader whose
    last batch of an epoch is smaller takes two. A batch of yet another signature is an error
    naming the shapes, or with ``fallback="eager"`` one eager step.

    A replay runs the step as it was captured: before each one, which parameters require
    gradients, which modules train, the param groups (their parameters and options, all but
    the LR), the optimizer's state tensors and the model's tensors are compared with the
    capture's, and a change (a hook that freezes a layer, puts a module in eval mode,
    schedules the momentum, adds a param group, clears the optimizer's state, assigns new
    BatchNorm statistics) drops the graphs: the next steps warm up and capture again (a
    param group added or removed also rebuilds the LR table).

    ``zero_grad_before_forward`` is accepted and has no effect: the captured backward writes
    the gradients afresh at every replay.

    Args (beyond :class:`SimpleTrainer`'s):
        precision: None (float32) or ``torch.bfloat16`` (autocast, without its cache).
        grad_scaler: must be None (or a disabled scaler): loss scaling reads the host.
        warmup_iters: real training steps run eagerly (on a side stream) before the capture.
        ring_size: slots of the loss ring buffer; at least ``2 * PENDING_READ_EVERY *
            gather_metric_period`` (the default), so a slot is read before it is written again.
        max_graphs: how many batch signatures get a graph of their own (each holds its static
            batch, its activations and its gradients in its own memory pool).
        graph: ``"cuda"`` (capture with ``torch.cuda.CUDAGraph``) or ``"eager"`` (the seam's
            CPU implementation: every step runs the captured function eagerly; for tests).
        fallback: None (raise) or ``"eager"`` (warn once, train eagerly).
    """

    _parts_class = _GraphTrainerParts

    def __init__(
        self,
        model: torch.nn.Module,
        data_loader: Any,
        optimizer: torch.optim.Optimizer,
        gather_metric_period: int = 1,
        zero_grad_before_forward: bool = False,
        async_write_metrics: bool = False,
        *,
        check_finite_every_step: bool = False,
        precision: Optional[torch.dtype] = None,
        grad_scaler: Optional[Any] = None,
        warmup_iters: int = 3,
        ring_size: Optional[int] = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        graph: str = "cuda",
        fallback: Optional[str] = None,
    ) -> None:
        if precision is not None and precision not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"{_WHO} precision must be None, torch.float32 or torch.bfloat16, got "
                f"{precision}: float16 needs a GradScaler, whose inf check and scale update "
                "read the device on the host every step. Use precision=torch.bfloat16"
            )
        if grad_scaler is not None and getattr(grad_scaler, "is_enabled", lambda: True)():
            raise ValueError(
                f"{_WHO} does not capture a GradScaler: its step reads found_inf on the host "
                "(a sync per step) and skips steps by a host decision. Use "
                "precision=torch.bfloat16 without a scaler"
            )
        if async_write_metrics:
            raise ValueError(
                f"{_WHO} does not take async_write_metrics=True: the ring buffer's batched "
                "reads are already asynchronous, and a write thread could read a slot after "
                "the graph rewrote it"
            )
        super().__init__(
            model,
            data_loader,
            optimizer,
            gather_metric_period,
            zero_grad_before_forward,
            async_write_metrics,
            check_finite_every_step=check_finite_every_step,
        )
        self.precision = precision
        self._hookloop.graph.configure(
            self, graph, fallback, precision, warmup_iters, ring_size, max_graphs
        )

    def before_train(self) -> None:
        super().before_train()
        self._hookloop.graph.prepare(self, self._hooks)

    def run_step(self) -> None:
        """One replay of the captured step (the first ``warmup_iters`` steps: the same step,
        run eagerly; then the capture)."""
        if not self.model.training:
            raise RuntimeError(f"[{_WHO}] model was changed to eval mode!")
        step = self._hookloop.graph
        if not step.prepared:  # a stage called by someone else's loop (DefaultTrainer)
            step.prepare(self, self._hooks)
        start = time.perf_counter()
        data: Any = None
        if step.source is None:
            try:
                data = next(self._data_loader_iter)
            except StopIteration:  # a finite loader: the next epoch (free while not raised)
                data = self._hookloop.data.next_epoch(self)
        else:
            # The host moves past the batch (the loader's position, the epoch's end) and the
            # graph makes it. The first batch of an epoch is made by next_epoch's next() too
            # (one gather per epoch, unused).
            try:
                self._data_loader_iter.skip()
            except StopIteration:
                self._hookloop.data.next_epoch(self)
            step.size = step.source.stage()
        data_time = time.perf_counter() - start
        # What the step itself assigns on the model is part of what is captured: only an
        # assignment between steps drops the graphs (GraphStep.assigned).
        step.stepping = True
        try:
            self._graph_step(step, data, data_time)
        finally:
            step.stepping = False

    def _graph_step(self, step: GraphStep, data: Any, data_time: float) -> None:
        if step.eager_reason is not None:
            self._eager_step(data, data_time)
            return
        step.check_baked(self)
        step.sync_lr(self.optimizer, self.iter)  # before place: it may drop the graphs
        different = step.place(data) if step.source is None else step.place_source(step.size)
        if different is not None:
            if step.fallback != "eager":
                raise ValueError(
                    f"{_WHO} got {different} at iteration {self.iter}: each graph replays "
                    "one batch shape. Give it batches of fewer shapes (drop_last=True, "
                    "padding), raise max_graphs, or pass fallback='eager' to run such batches "
                    "eagerly"
                )
            step.warn_once(different, f"{_WHO}: {different}; this step runs eagerly")
            self._eager_step(data, data_time)
            return
        if not step.run(self):  # the capture failed, fallback="eager"
            self._eager_step(data, data_time)
            return
        self._write_metrics(step.losses_at(self.iter), data_time)

    def _eager_step(self, data: Any, data_time: float) -> None:
        """SimpleTrainer's step (``fallback="eager"``), keeping the device step counter."""
        step = self._hookloop.graph
        if step.source is not None:  # the source's batch, made eagerly (None was given)
            data = step.source.batch(step.size)
        # New gradients, as SimpleTrainer's: a graph's replay points .grad back at its own.
        self.optimizer.zero_grad()
        step.grads_replaced()
        loss_dict, losses = step._forward(self, data)
        losses.backward()
        self.after_backward()
        self._write_metrics(loss_dict, data_time)
        self.optimizer.step()
        if step.counter is not None:
            with torch.no_grad():
                step.counter.add_(1)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The optimizer's state tensors were replaced: capture again (the hooks do that too).
        self._hookloop.graph.invalidate()
        self._hookloop.graph.prepared = False
