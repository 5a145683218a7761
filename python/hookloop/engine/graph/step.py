"""The step: :class:`GraphStep`, the coordinator of the rooms one captured step reads and
writes, all at fixed addresses, so that one replay is one training step.

It holds the options (:mod:`.options`), the phase (:mod:`.state`), the static batches and
their graphs (:mod:`.batch`), the LR table (:mod:`.lr`), the loss ring (:mod:`.ring`), the
guard on what the capture baked in (:mod:`.guard`), and the device step counter: the absolute
iteration, incremented by the graph, which all graphs share with the table and the ring.
What the captured function does is :meth:`GraphStep.body`; which of warm-up, capture or
replay a step is, :meth:`GraphStep.run`.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from hookloop.engine.dispatch import overrides
from hookloop.engine.graph.batch import StaticBatches, _Shape
from hookloop.engine.graph.guard import Guard, _watch_assignments, _watch_loads
from hookloop.engine.graph.lr import LRTable
from hookloop.engine.graph.options import GraphOptions
from hookloop.engine.graph.ring import LossRing
from hookloop.engine.graph.seam import (
    WHO,
    StepGraph,
    _keep_capture_options,
    capture_problem,
    seam_maker,
)
from hookloop.engine.graph.state import Phase, StepState
from hookloop.engine.losses import losses_of

__all__ = ["GraphStep"]

logger = logging.getLogger("hookloop.engine.train_loop")


def _model_device(trainer: Any) -> torch.device:
    for p in trainer.model.parameters():
        return p.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class GraphStep:
    """What the captured step reads and writes (static batch, step counter, LR table, ring
    buffer) and the phase of the capture. One per :class:`CUDAGraphTrainer`.

    Its state is ``state`` (:class:`~hookloop.engine.graph.state.StepState`): the phase moves
    NEW -> CONFIGURED (:meth:`configure`) -> WARMING (:meth:`prepare`) -> CAPTURED (a
    capture's first replay, in :meth:`run`) -> WARMING (:meth:`invalidate`), and back to
    CONFIGURED after a load; ``state.eager_reason`` turns the run eager for good. The
    properties below are views of the rooms for tests and tools (``prepared = False``: the
    load's transition)."""

    def __init__(self) -> None:
        self.options = GraphOptions()
        self.state = StepState()
        self.batches = StaticBatches(self.options.max_graphs)
        self.lr = LRTable()
        self.losses = LossRing(self.options.ring_size)
        self.guard = Guard()
        self.device: torch.device = torch.device("cpu")
        #: The device step counter (made at :meth:`prepare`).
        self.counter: Optional[torch.Tensor] = None
        #: Makes a new seam (one per batch signature): CUDAStepGraph or EagerStepGraph.
        self._new_seam: Optional[Callable[[], StepGraph]] = None
        self._trainer: Optional[Callable[[], Any]] = None
        self._warned: Set[str] = set()

    # -- configuration ----------------------------------------------------------------------

    def configure(self, trainer: Any, options: GraphOptions) -> None:
        """NEW -> CONFIGURED: the options (checked: :meth:`GraphOptions.checked`), the rooms
        made for them, the seam picked (or the problem refused), and the watches on loads and
        assignments set."""
        self.options = options
        self.batches = StaticBatches(options.max_graphs)
        self.losses = LossRing(options.ring_size)
        problem = capture_problem(trainer.model, trainer.optimizer, options.graph)
        if problem is not None:
            self._refuse(*problem)
        if self.state.eager_reason is None:
            try:  # no CUDA device: the error at construction
                self._new_seam = seam_maker(options.graph, _model_device(trainer))
            except RuntimeError as e:
                self._refuse(RuntimeError, str(e))
        trainer.optimizer.register_load_state_dict_pre_hook(_keep_capture_options)
        _watch_loads(self, trainer.model, trainer.optimizer)
        self._trainer = weakref.ref(trainer)
        _watch_assignments(self)
        self.state.move(Phase.CONFIGURED)

    def _refuse(self, kind: type, message: str) -> None:
        self.state.refuse(kind, message, self.options.fallback)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, 3)

    # -- what tests and tools read ----------------------------------------------------------

    @property
    def prepared(self) -> bool:
        """Whether :meth:`prepare` ran since the construction or the last load; set False to
        have the next step prepare again."""
        return self.state.prepared

    @prepared.setter
    def prepared(self, value: bool) -> None:
        if value:
            raise ValueError("GraphStep.prepared becomes True by prepare() only")
        self.state.unprepared()

    @property
    def captured(self) -> bool:
        """Whether a graph is captured (for some batch signature)."""
        return self.batches.captured

    @property
    def eager_reason(self) -> Optional[str]:
        return self.state.eager_reason

    @property
    def fallback(self) -> Optional[str]:
        return self.options.fallback

    @property
    def ring_size(self) -> Optional[int]:
        return self.options.ring_size

    @property
    def shapes(self) -> List[_Shape]:
        return self.batches.shapes

    @property
    def current(self) -> Optional[_Shape]:
        return self.batches.current

    @property
    def source(self) -> Optional[Any]:
        return self.batches.source

    @property
    def table(self) -> Optional[torch.Tensor]:
        return self.lr.table

    @property
    def rows_rewritten(self) -> int:
        return self.lr.rows_rewritten

    @property
    def ring(self) -> Optional[torch.Tensor]:
        return self.losses.ring

    @property
    def recaptures(self) -> int:
        return self.guard.recaptures

    # -- a run ------------------------------------------------------------------------------

    def prepare(self, trainer: Any, hooks: Sequence[Any], start: Optional[int] = None) -> None:
        """At ``before_train`` (after the hooks'): the step counter at ``start`` (by default
        ``trainer.iter``), the LR table of this run from the ``LRScheduler`` hooks among
        ``hooks``, and a new capture at the first steps (-> WARMING)."""
        if self.state.phase is Phase.NEW:  # a subclass that skipped CUDAGraphTrainer.__init__
            precision = getattr(trainer, "precision", None)
            options = GraphOptions.checked(trainer.gather_metric_period, precision=precision)
            self.configure(trainer, options)
        self.invalidate()
        if self.state.eager_reason is None:
            for h in hooks:
                # The dispatcher's rule: a class's own method or one set on the instance.
                if overrides(h, "after_backward"):
                    self._refuse(
                        TypeError,
                        f"{WHO} cannot run {type(h).__name__}.after_backward: it would run "
                        "between backward and the optimizer step, inside the captured graph. "
                        "Do that work in after_step, or train with SimpleTrainer",
                    )
                    break
        if self.state.eager_reason is None and not trainer.step_optimizer:
            self._refuse(
                TypeError,
                f"{WHO} captures the optimizer's step: step_optimizer=False (an "
                "OptimizationHook, gradient accumulation) cannot be captured. Train with "
                "SimpleTrainer",
            )
        self.device = _model_device(trainer)
        self.batches.pick_source(trainer.data_loader, self.device)
        start = int(trainer.iter if start is None else start)
        self.lr.build(trainer, hooks, start, self.device)
        with torch.no_grad():
            if self.counter is None or self.counter.device != self.device:
                self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.counter.fill_(start)
        self.state.move(Phase.WARMING)

    def invalidate(self) -> None:
        """Drops every graph and static batch: the next steps warm up and capture again (after
        a load, at ``before_train``; CAPTURED -> WARMING)."""
        self.batches.reset()
        self.guard.forget()
        self.state.invalidated()

    def grads_replaced(self) -> None:
        """An eager step left gradients of its own in ``.grad``: the next replay points
        ``.grad`` back at its graph's buffers."""
        self.batches.grads_of = None

    def check_baked(self, trainer: Any) -> None:
        """Before a replay: what the capture baked in still holds, or the graphs are dropped
        (see :class:`~hookloop.engine.graph.guard._Baked`)."""
        if self.state.phase is Phase.CAPTURED:
            why = self.guard.changed(trainer)
            if why is not None:
                self._capture_again(why)

    def assigned(self, module: Any, name: str) -> None:
        """``module.name = ...`` of a registered tensor or submodule, somewhere in the
        process (torch's registration hooks): one of the captured model's, outside the step,
        drops the graphs. A replay updates the tensors it captured, not the one assigned
        (fvcore's ``update_bn_stats`` assigns new ``running_mean``/``running_var``): the next
        steps warm up and capture again, with the new one."""
        if self.state.phase is not Phase.CAPTURED or self.state.in_step:
            return
        trainer = self._trainer() if self._trainer is not None else None
        why = self.guard.assignment(module, name, None if trainer is None else trainer.iter)
        if why is not None:
            self._capture_again(why)

    def _capture_again(self, why: str) -> None:
        logger.info(
            f"{WHO}: {why}: the step is captured again (a replay runs the step as it was captured)"
        )
        self.invalidate()
        warning = self.guard.recaptured(why, self.options.warmup_iters)
        if warning is not None:
            self.warn_once("recaptures", warning)

    def sync_lr(self, optimizer: Any, it: int) -> None:
        """The host's LRs of iteration ``it`` into the LR table (see :meth:`LRTable.sync`).
        With another number of param groups than the table has columns, the table is built
        again from ``it`` on and the graphs are dropped (they read the old table): before
        :meth:`place`, which picks this step's graph."""
        columns = self.lr.sync(optimizer, it)
        if columns is None:
            return
        trainer = self._trainer() if self._trainer is not None else None
        assert trainer is not None and trainer.optimizer is optimizer
        self.lr.regroup(trainer, it, columns, self.device)
        self.invalidate()

    def place(self, data: Any) -> Optional[str]:
        """``data`` into its signature's static batch (see :meth:`StaticBatches.place`)."""
        assert self._new_seam is not None
        return self.batches.place(data, self._new_seam, self.device)

    def place_source(self, size: int) -> Optional[str]:
        """The graph source's batch of ``size`` (see :meth:`StaticBatches.place_source`)."""
        assert self._new_seam is not None
        return self.batches.place_source(size, self._new_seam, self.device)

    # -- the step ---------------------------------------------------------------------------

    def body(self, trainer: Any) -> None:
        """The step the graph holds: LR from the table, forward, loss sum, backward,
        optimizer step, the losses into the ring at the counter's slot, counter + 1."""
        optimizer = trainer.optimizer
        groups = optimizer.param_groups
        counter = self.counter
        assert counter is not None
        self.lr.select(counter)
        saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, self.lr.views):
            g["lr"] = lr
        try:
            optimizer.zero_grad(set_to_none=True)
            loss_dict, losses = self.forward(trainer, self.batches.batch())
            losses.backward()
            optimizer.step()
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        self.losses.write(loss_dict, counter, trainer.iter, self.device)
        with torch.no_grad():
            counter.add_(1)

    def forward(self, trainer: Any, batch: Any) -> Tuple[Mapping[str, torch.Tensor], Any]:
        """The model's losses on ``batch`` and their sum, in the options' precision."""
        precision = self.options.precision
        if precision is None:
            return losses_of(trainer.model(batch), WHO)
        # No autocast cache: a cached cast made during capture would be a stale tensor.
        with torch.autocast(self.device.type, dtype=precision, cache_enabled=False):
            return losses_of(trainer.model(batch), WHO)

    def run(self, trainer: Any) -> bool:
        """One step through this step's graph (see :meth:`place`): a warm-up, the capture then
        a replay, or a replay. False when the capture failed and ``fallback="eager"`` (one
        warning): the caller steps eagerly, as it will for the rest of the run."""
        batches = self.batches
        shape = batches.current
        assert shape is not None
        seam = shape.seam
        if seam.captured:
            seam.replay()
            if batches.grads_of is not shape:  # another graph or an eager step ran last
                seam.restore()
                batches.grads_of = shape
            return True
        # The seam keeps the function (EagerStepGraph): weak references, so that the trainer
        # and this object are still freed by reference counting.
        this, owner = weakref.ref(self), weakref.ref(trainer)

        def step() -> None:
            graph, trainer = this(), owner()
            assert graph is not None and trainer is not None
            graph.body(trainer)

        self.grads_replaced()
        if shape.warmups < self.options.warmup_iters:
            seam.warmup(step)
            shape.warmups += 1
            return True
        params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        try:
            seam.capture(step, params)
        except RuntimeError as e:
            # Nothing of a failed capture ran on the device: the step is still to be made.
            self._refuse(RuntimeError, str(e))
            return False
        logger.info(
            f"{WHO}: captured the step at iteration {trainer.iter} for the batch "
            f"{shape.describe()} (graph {batches.shapes.index(shape) + 1} of at most "
            f"{batches.max_graphs})"
        )
        seam.replay()
        batches.grads_of = shape
        if self.state.phase is not Phase.CAPTURED:
            self.guard.bake(trainer.model, trainer.optimizer)
            self.state.move(Phase.CAPTURED)
        return True

    def losses_at(self, it: int) -> Dict[str, torch.Tensor]:
        return self.losses.losses_at(it)
