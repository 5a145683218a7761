"""The trainer: :class:`CUDAGraphTrainer`, ``SimpleTrainer`` whose step is one CUDA graph, and
its parts (:class:`_GraphTrainerParts`: ``SimpleTrainer``'s and the :class:`GraphStep`)."""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional

import torch

from hookloop.engine.graph.options import DEFAULT_MAX_GRAPHS, GraphOptions
from hookloop.engine.graph.seam import WHO
from hookloop.engine.graph.step import GraphStep
from hookloop.engine.parts import SimpleTrainerParts
from hookloop.engine.train_loop import SimpleTrainer

__all__ = ["CUDAGraphTrainer"]


class _GraphTrainerParts(SimpleTrainerParts):
    """:class:`SimpleTrainerParts` with the :class:`GraphStep`."""

    def __init__(self) -> None:
        super().__init__()
        self.graph = GraphStep()

    def hooks_ready(self, trainer: Any, outer: Any) -> None:
        """``outer``'s hooks ran their ``before_train``: the step is prepared from them (the
        LR table from ``outer``'s ``LRScheduler`` hooks) at ``outer``'s iteration."""
        super().hooks_ready(trainer, outer)
        self.graph.prepare(trainer, outer._hooks, outer.iter)


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
    (bfloat16 autocast is supported), ``async_write_metrics``, a hook's ``after_backward``
    (its class's, or one set on the hook itself), ``step_optimizer=False``, a host
    synchronization in the model or loss (at capture), a batch whose structure, shapes, dtypes
    or non-tensor values differ from every captured one when ``max_graphs`` are taken (at that
    step). With ``fallback="eager"`` each of these is one ``RuntimeWarning`` and
    :class:`SimpleTrainer`'s eager step instead (for the rest of the run, or for that batch).

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
        if grad_scaler is not None and getattr(grad_scaler, "is_enabled", lambda: True)():
            raise ValueError(
                f"{WHO} does not capture a GradScaler: its step reads found_inf on the host "
                "(a sync per step) and skips steps by a host decision. Use "
                "precision=torch.bfloat16 without a scaler"
            )
        if async_write_metrics:
            raise ValueError(
                f"{WHO} does not take async_write_metrics=True: the ring buffer's batched "
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
        options = GraphOptions.checked(
            gather_metric_period, graph, fallback, precision, warmup_iters, ring_size, max_graphs
        )
        self.precision = precision
        self._hookloop.graph.configure(self, options)

    def before_train(self) -> None:
        super().before_train()
        self._hookloop.graph.prepare(self, self._hooks)

    def run_step(self) -> None:
        """One replay of the captured step (the first ``warmup_iters`` steps: the same step,
        run eagerly; then the capture)."""
        if not self.model.training:
            raise RuntimeError(f"[{WHO}] model was changed to eval mode!")
        step = self._hookloop.graph
        if not step.prepared:  # a stage called by someone else's loop (DefaultTrainer)
            step.prepare(self, self._hooks)
        batches = step.batches
        start = time.perf_counter()
        data: Any = None
        if batches.source is None:
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
            batches.size = batches.source.stage()
        data_time = time.perf_counter() - start
        # What the step itself assigns on the model is part of what is captured: only an
        # assignment between steps drops the graphs (GraphStep.assigned).
        step.state.in_step = True
        try:
            self._graph_step(step, data, data_time)
        finally:
            step.state.in_step = False

    def _graph_step(self, step: GraphStep, data: Any, data_time: float) -> None:
        if step.state.eager_reason is not None:
            self._eager_step(data, data_time)
            return
        step.check_baked(self)
        step.sync_lr(self.optimizer, self.iter)  # before place: it may drop the graphs
        source = step.batches.source
        different = step.place(data) if source is None else step.place_source(step.batches.size)
        if different is not None:
            if step.options.fallback != "eager":
                raise ValueError(
                    f"{WHO} got {different} at iteration {self.iter}: each graph replays "
                    "one batch shape. Give it batches of fewer shapes (drop_last=True, "
                    "padding), raise max_graphs, or pass fallback='eager' to run such batches "
                    "eagerly"
                )
            step.warn_once(different, f"{WHO}: {different}; this step runs eagerly")
            self._eager_step(data, data_time)
            return
        if not step.run(self):  # the capture failed, fallback="eager"
            self._eager_step(data, data_time)
            return
        self._write_metrics(step.losses.losses_at(self.iter), data_time)

    def _eager_step(self, data: Any, data_time: float) -> None:
        """SimpleTrainer's step (``fallback="eager"``), keeping the device step counter."""
        step = self._hookloop.graph
        batches = step.batches
        if batches.source is not None:  # the source's batch, made eagerly (None was given)
            data = batches.source.batch(batches.size)
        # New gradients, as SimpleTrainer's: a graph's replay points .grad back at its own.
        self.optimizer.zero_grad()
        step.grads_replaced()
        loss_dict, losses = step.forward(self, data)
        losses.backward()
        self.after_backward()
        self._write_metrics(loss_dict, data_time)
        self.optimizer.step()
        if step.counter is not None:
            with torch.no_grad():
                step.counter.add_(1)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The optimizer's state tensors were replaced: capture again (the hooks do that too),
        # after a prepare at the next step (-> CONFIGURED).
        self._hookloop.graph.invalidate()
        self._hookloop.graph.state.unprepared()
