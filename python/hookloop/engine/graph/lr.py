"""The LR table: one row per iteration, the values every param group's ``lr`` takes then.

It is evaluated at ``before_train`` from the ``LRScheduler`` hooks' schedulers (a copy of each
is stepped; the real ones are untouched). The graph copies ``table[step]`` into the tensor the
optimizer reads as its ``lr``. The host still steps the real schedulers as the eager trainer
does (so the LR the hook writes is the eager trainer's, as a float, with no read from the
device); each step compares the host's LRs with the table's row and, where something changed
an LR outside the schedule, writes that row again (a small non-blocking copy). It has a column
per param group: a group added or removed between steps builds it again from that iteration
on (and the graphs, which read the old one, are dropped by the step).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, List, Mapping, Optional, Sequence

import torch

from hookloop.engine.graph.batch import _copy_async
from hookloop.engine.graph.seam import WHO
from hookloop.engine.hooks import LRScheduler
from hookloop.solver.torch_step import step as torch_step

__all__ = ["MAX_TABLE_ROWS", "LRTable", "lr_rows"]

logger = logging.getLogger("hookloop.engine.train_loop")

#: At most this many rows in the LR table (beyond it the last row is rewritten as needed).
MAX_TABLE_ROWS = 1 << 21


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
    probe = _LRProbe(optimizer.param_groups)
    copies = copy.deepcopy(list(schedulers), memo={id(optimizer): probe})
    out: List[List[float]] = []
    for it in range(start_iter, rows):
        out.append([float(g["lr"]) for g in probe.param_groups])
        if it + 1 < rows:
            for s in copies:
                torch_step(s)
    return out


def _schedulers_of(hooks: Sequence[Any], optimizer: Any) -> List[Any]:
    out = []
    for h in hooks:
        if isinstance(h, LRScheduler) and h._optimizer is optimizer and h._scheduler is not None:
            out.append(h._scheduler)
    return out


class LRTable:
    """The table on the device (``table``, from row ``start`` on), its rows as the host knows
    them (``host``), and the tensor the graph copies a row into (``out``; its ``views`` are the
    groups' ``lr`` inside the step)."""

    __slots__ = ("host", "start", "table", "out", "views", "rows_rewritten")

    def __init__(self) -> None:
        self.host: List[List[float]] = []
        self.start = 0
        self.table: Optional[torch.Tensor] = None
        self.out: Optional[torch.Tensor] = None
        self.views: List[torch.Tensor] = []
        #: Rows of the LR table written again at a step (an LR set outside the schedule).
        self.rows_rewritten = 0

    def build(self, trainer: Any, hooks: Sequence[Any], start: int, device: torch.device) -> None:
        """The table from iteration ``start`` on, a column per param group, from the
        ``LRScheduler`` hooks' schedulers among ``hooks`` as they are now."""
        optimizer = trainer.optimizer
        max_iter = int(getattr(trainer, "max_iter", start + 1))
        rows = max(start + 1, min(max_iter, MAX_TABLE_ROWS))
        schedulers = _schedulers_of(hooks, optimizer)
        try:
            self.host = lr_rows(optimizer, schedulers, start, rows)
        except Exception as e:  # a scheduler that cannot be copied: rows follow the host
            logger.info(f"{WHO}: LR table from the current LRs ({type(e).__name__}: {e})")
            now = [float(g["lr"]) for g in optimizer.param_groups]
            self.host = [list(now) for _ in range(start, rows)]
        self.start = start
        columns = len(optimizer.param_groups)
        with torch.no_grad():
            table = torch.zeros(rows, columns, dtype=torch.float32)
            table[start:] = torch.tensor(self.host, dtype=torch.float32)
            self.table = table.to(device)
            self.out = torch.zeros(1, columns, dtype=torch.float32, device=device)
            self.views = [self.out[0, g] for g in range(columns)]

    def select(self, counter: torch.Tensor) -> None:
        """Inside the step: the row of the step ``counter`` holds into :attr:`out` (the last
        row past the table's end), on the device."""
        table, out = self.table, self.out
        assert table is not None and out is not None
        with torch.no_grad():
            index = torch.clamp(counter, max=table.shape[0] - 1)
            torch.index_select(table, 0, index, out=out)

    def sync(self, optimizer: Any, it: int) -> Optional[int]:
        """The host's LRs of iteration ``it`` into the table's row where they differ (an LR
        set outside the schedulers the table was built from); nothing otherwise. Returns None,
        or the table's number of columns when the optimizer has another number of param
        groups (``add_param_group`` between steps): then nothing is written, and the caller
        builds the table again (:meth:`regroup`)."""
        row = it - self.start
        host = self.host
        if row >= len(host):
            row = len(host) - 1
        now = [g["lr"] for g in optimizer.param_groups]
        if now == host[row] or row < 0:
            return None
        if len(now) != len(host[row]):
            return len(host[row])
        host[row] = [float(x) for x in now]
        self.rows_rewritten += 1
        table = self.table
        assert table is not None
        with torch.no_grad():
            _copy_async(table[self.start + row], torch.tensor(host[row]))
        return None

    def regroup(self, trainer: Any, it: int, columns: int, device: torch.device) -> None:
        """The table built again from ``it`` on, for the optimizer's param groups now (it was
        built for ``columns``); the graphs read the old one: the caller drops them."""
        optimizer = trainer.optimizer
        logger.info(
            f"{WHO}: the optimizer has {len(optimizer.param_groups)} param groups before "
            f"iteration {it} (the LR table was built for {columns}): the table is built again "
            "from this iteration on, and the next steps warm up and capture again"
        )
        self.build(trainer, trainer._hooks, it, device)
