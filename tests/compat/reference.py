"""The writer oracle of the writer tests: ``compat.d2``'s writers run on a copy of a hookloop
``EventStorage``.

``snapshot`` reads a hookloop storage only through its raw data accessors (``latest()``,
``histories()`` + ``HistoryBuffer.values()``, ``smoothing_hints()``, ``iter``) into a
``compat.d2.EventStorage``; everything derived (``count_samples``, medians, means, the global
mean, the lines) is then computed by ``compat.d2``'s fvcore/detectron2 model, so the oracle
shares none of hookloop's smoothing or formatting code.

Each writer takes the storage as an argument instead of calling ``get_event_storage()``: the
model stays independent of hookloop and tests decide when it runs. Where hookloop differs from
detectron2 on purpose, the difference is written here, named: ``count_samples`` of an unknown
name and ``CommonMetricPrinterRef``'s ``epoch``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from compat import d2

__all__ = [
    "Snapshot",
    "snapshot",
    "count_samples",
    "latest_with_smoothing_hint",
    "JSONWriterRef",
    "TensorboardScalarsRef",
    "CommonMetricPrinterRef",
]


class Snapshot(d2.EventStorage):
    """A ``compat.d2.EventStorage`` copied from a hookloop storage; ``puts`` lists the scalars
    put into it afterwards (by a writer: ``CommonMetricPrinter``'s ``eta_seconds``)."""

    def __init__(self, start_iter: int = 0, *, max_length: int = 1000000) -> None:
        super().__init__(start_iter, max_length=max_length)
        self.puts: List[Tuple[str, Any]] = []

    def put_scalar(
        self, name: str, value: Any, smoothing_hint: bool = True, cur_iter: Optional[int] = None
    ) -> None:
        super().put_scalar(name, value, smoothing_hint=smoothing_hint, cur_iter=cur_iter)
        self.puts.append((name, value))

    def __enter__(self) -> Snapshot:
        # numpy's overflow/empty-slice warnings (which the suite turns into errors) are part
        # of the arithmetic being modelled, not failures: the oracle computes as numpy does.
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(np.errstate(all="ignore"))
        self._quiet.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", RuntimeWarning)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._quiet.close()


def snapshot(storage: Any) -> Snapshot:
    """``storage``'s scalars in a ``compat.d2`` storage, in ``storage``'s order.

    Each history is replayed through fvcore's ``HistoryBuffer.update``, so its global mean is
    that of the samples ``storage`` still holds (hookloop's also counts evicted ones; no writer
    test evicts)."""
    values = {k: h.values() for k, h in storage.histories().items()}
    longest = max([len(v) for v in values.values()], default=0)
    snap = Snapshot(storage.iter, max_length=max(1000000, longest))
    for name, data in values.items():
        history = snap.histories()[name]  # a defaultdict: creates the history
        for v, it in data:
            history.update(float(v), it)
    snap._latest_scalars = {k: (float(v), it) for k, (v, it) in storage.latest().items()}
    snap._smoothing_hints = dict(storage.smoothing_hints())
    return snap


def count_samples(storage: Any, name: str, window_size: int = 20) -> int:
    """detectron2's ``EventStorage.count_samples``: samples in the last ``window_size``
    iterations, counted back from the newest sample.

    An unknown name is a ``KeyError``, as in hookloop: detectron2's ``defaultdict`` would create
    an empty history for it and return 0."""
    if name not in storage.histories():
        raise KeyError(name)
    with snapshot(storage) as snap:
        return snap.count_samples(name, window_size)


def latest_with_smoothing_hint(storage: Any, window_size: int = 20) -> Dict[str, Tuple[float, Any]]:
    """detectron2's ``EventStorage.latest_with_smoothing_hint``, values as Python floats."""
    with snapshot(storage) as snap:
        smoothed = snap.latest_with_smoothing_hint(window_size)
    return {k: (float(v), itr) for k, (v, itr) in smoothed.items()}


class _Lines:
    """The file ``compat.d2.JSONWriter`` writes into for the oracle. It has no ``fileno``, so
    the writer skips its fsync (detectron2 does the same for files without one)."""

    def __init__(self) -> None:
        self._parts: List[str] = []

    def write(self, text: str) -> None:
        self._parts.append(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self._parts = "".join(self._parts), []
        return text


class _JSONWriterToLines(d2.JSONWriter):
    """``compat.d2.JSONWriter`` holding a ``_Lines`` instead of an open file: tests never close
    the oracle, and an unclosed file would warn."""

    def __init__(self, window_size: int) -> None:
        self._file_handle = _Lines()
        self._window_size = window_size
        self._last_write = -1


class JSONWriterRef:
    """detectron2's ``JSONWriter``: appends one ``json.dumps(sort_keys=True)`` line per new
    iteration."""

    def __init__(self, json_file: str, window_size: int = 20) -> None:
        self._path = json_file
        self._writer = _JSONWriterToLines(window_size)

    def write(self, storage: Any) -> None:
        with snapshot(storage):
            self._writer.write()
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(self._writer._file_handle.take())

    def close(self) -> None:
        pass


class _ScalarCalls:
    """Stands in for torch's ``SummaryWriter``: records the ``add_scalar`` calls."""

    def __init__(self, calls: List[Tuple[str, float, Any]]) -> None:
        self._calls = calls

    def add_scalar(self, tag: str, value: float, step: Any) -> None:
        self._calls.append((tag, float(value), step))


class _TensorboardXWriterToCalls(d2.TensorboardXWriter):
    """``compat.d2.TensorboardXWriter`` with a ``_ScalarCalls`` instead of a ``SummaryWriter``."""

    def __init__(self, window_size: int, calls: List[Tuple[str, float, Any]]) -> None:
        self._window_size = window_size
        self._writer = _ScalarCalls(calls)
        self._last_write = -1


class TensorboardScalarsRef:
    """The scalar part of detectron2's ``TensorboardXWriter.write``: records the
    ``add_scalar(tag, value, step)`` calls it would make."""

    def __init__(self, window_size: int = 20) -> None:
        self.calls: List[Tuple[str, float, Any]] = []
        self._writer = _TensorboardXWriterToCalls(window_size, self.calls)

    def write(self, storage: Any) -> None:
        with snapshot(storage):
            self._writer.write()


class _EpochPrinter(d2.CommonMetricPrinter):
    """``compat.d2.CommonMetricPrinter`` plus hookloop's ``epoch`` (not in detectron2): with
    ``max_iter``, the line gets ``epoch: e/E`` after the iteration, the iterations split evenly
    (``ceil(max_iter / E)`` per epoch)."""

    def __init__(self, max_iter: Optional[int], window_size: int, epoch: Optional[int]) -> None:
        super().__init__(max_iter, window_size)
        self._epoch = epoch

    def format_line(self, storage: d2.EventStorage, max_mem_mb: Optional[float]) -> str:
        line = super().format_line(storage, max_mem_mb)
        if self._epoch is None or self._max_iter is None:
            return line
        per_epoch = max(1, -(-self._max_iter // self._epoch))
        e = min(max(storage.iter // per_epoch + 1, 1), self._epoch)
        # The first "iter: N  " is the iteration field: only the ETA ("eta: 1 day, 0:00:03  ")
        # comes before it.
        field = f"iter: {storage.iter}  "
        return line.replace(field, f"{field}epoch: {e}/{self._epoch}  ", 1)


class CommonMetricPrinterRef:
    """detectron2's ``CommonMetricPrinter``. ``line(storage)`` returns the logged line (None
    at ``max_iter``) and the ETA seconds it would put; ``write(storage)`` also puts them.

    ``epoch`` is hookloop's addition (see ``_EpochPrinter``).
    """

    def __init__(
        self, max_iter: Optional[int] = None, window_size: int = 20, epoch: Optional[int] = None
    ) -> None:
        self._printer = _EpochPrinter(max_iter, window_size, epoch)

    def line(
        self, storage: Any, max_mem_mb: Optional[float] = None
    ) -> Tuple[Optional[str], Optional[float]]:
        if storage.iter == self._printer._max_iter:
            return None, None  # as write() does: nothing once training has finished
        snap = snapshot(storage)
        line = self._printer.format_line(snap, max_mem_mb)
        eta = [v for name, v in snap.puts if name == "eta_seconds"]
        return line, eta[-1] if eta else None

    def write(self, storage: Any, max_mem_mb: Optional[float] = None) -> Optional[str]:
        line, eta_seconds = self.line(storage, max_mem_mb)
        if eta_seconds is not None:
            storage.put_scalar("eta_seconds", eta_seconds, smoothing_hint=False)
        return line
