"""A small pure-Python model of detectron2's writers, used as the oracle in writer tests.

It reproduces what ``detectron2.utils.events`` does in ``JSONWriter.write``, the scalar part
of ``TensorboardXWriter.write`` and ``CommonMetricPrinter.write``/``_get_eta``, with fvcore's
``HistoryBuffer`` arithmetic (``np.median``/``np.mean`` over the last samples, the running
global mean). It reads a hookloop ``EventStorage`` only through its raw data accessors
(``latest()``, ``histories()`` + ``HistoryBuffer.values()``, ``smoothing_hints()``, ``iter``)
and recomputes every derived number itself, so it does not share hookloop's smoothing code.

Each writer takes the storage as an argument instead of calling ``get_event_storage()``: the
model stays independent of hookloop and tests decide when it runs.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = [
    "count_samples",
    "latest_with_smoothing_hint",
    "JSONWriterRef",
    "TensorboardScalarsRef",
    "CommonMetricPrinterRef",
]


def _values(storage: Any, name: str) -> List[Tuple[float, Any]]:
    return [(float(v), it) for v, it in storage.histories()[name].values()]


def count_samples(storage: Any, name: str, window_size: int = 20) -> int:
    """detectron2's ``EventStorage.count_samples``: samples in the last ``window_size``
    iterations, counted back from the newest sample."""
    data = _values(storage, name)
    samples = 0
    for _, iter_ in reversed(data):
        if iter_ > data[-1][1] - window_size:
            samples += 1
        else:
            break
    return samples


def _median(data: List[Tuple[float, Any]], n: int) -> float:
    # fvcore: np.median([x[0] for x in self._data[-window_size:]])
    return float(np.median([x for x, _ in data[-n:]]))


def _avg(data: List[Tuple[float, Any]], n: int) -> float:
    return float(np.mean([x for x, _ in data[-n:]]))


def _global_avg(data: List[Tuple[float, Any]]) -> float:
    # fvcore's running mean (valid while nothing was evicted from the history).
    g = 0.0
    for count, (v, _) in enumerate(data, start=1):
        g += (v - g) / count
    return g


def latest_with_smoothing_hint(storage: Any, window_size: int = 20) -> Dict[str, Tuple[float, Any]]:
    """detectron2's ``EventStorage.latest_with_smoothing_hint``."""
    hints = storage.smoothing_hints()
    result = {}
    for k, (v, itr) in storage.latest().items():
        if hints[k]:
            v = _median(_values(storage, k), count_samples(storage, k, window_size))
        result[k] = (float(v), itr)
    return result


class JSONWriterRef:
    """detectron2's ``JSONWriter``: appends one ``json.dumps(sort_keys=True)`` line per new
    iteration."""

    def __init__(self, json_file: str, window_size: int = 20) -> None:
        self._path = json_file
        self._window_size = window_size
        self._last_write = -1

    def write(self, storage: Any) -> None:
        to_save: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for k, (v, itr) in latest_with_smoothing_hint(storage, self._window_size).items():
            # keep scalars that have not been written
            if itr <= self._last_write:
                continue
            to_save[itr][k] = v
        if len(to_save):
            self._last_write = max(sorted(to_save.keys()))
        with open(self._path, "a", encoding="utf-8") as f:
            for itr, scalars_per_iter in to_save.items():
                scalars_per_iter["iteration"] = itr
                f.write(json.dumps(scalars_per_iter, sort_keys=True) + "\n")

    def close(self) -> None:
        pass


class TensorboardScalarsRef:
    """The scalar part of detectron2's ``TensorboardXWriter.write``: records the
    ``add_scalar(tag, value, step)`` calls it would make."""

    def __init__(self, window_size: int = 20) -> None:
        self._window_size = window_size
        self._last_write = -1
        self.calls: List[Tuple[str, float, Any]] = []

    def write(self, storage: Any) -> None:
        new_last_write = self._last_write
        for k, (v, itr) in latest_with_smoothing_hint(storage, self._window_size).items():
            if itr > self._last_write:
                self.calls.append((k, v, itr))
                new_last_write = max(new_last_write, itr)
        self._last_write = new_last_write


class CommonMetricPrinterRef:
    """detectron2's ``CommonMetricPrinter``. ``line(storage)`` returns the logged line (None
    at ``max_iter``) and the ETA seconds it would put; ``write(storage)`` also puts them.

    ``epoch`` is hookloop's addition: with ``max_iter`` the line gets ``epoch: e/E`` after the
    iteration, the iterations split evenly (``ceil(max_iter / E)`` per epoch).
    """

    def __init__(
        self, max_iter: Optional[int] = None, window_size: int = 20, epoch: Optional[int] = None
    ) -> None:
        self._max_iter = max_iter
        self._window_size = window_size
        self._epoch = epoch
        self._last_write: Optional[Tuple[int, float]] = None

    def _get_eta(self, storage: Any) -> Tuple[Optional[str], Optional[float]]:
        if self._max_iter is None:
            return "", None
        iteration = storage.iter
        if "time" in storage.histories():
            data = _values(storage, "time")
            eta_seconds = _median(data, 1000) * (self._max_iter - iteration - 1)
            return str(datetime.timedelta(seconds=int(eta_seconds))), eta_seconds
        # estimate eta on our own - more noisy
        eta_string = None
        if self._last_write is not None:
            estimate_iter_time = (time.perf_counter() - self._last_write[1]) / (
                iteration - self._last_write[0]
            )
            eta_seconds = estimate_iter_time * (self._max_iter - iteration - 1)
            eta_string = str(datetime.timedelta(seconds=int(eta_seconds)))
        self._last_write = (iteration, time.perf_counter())
        return eta_string, None

    def line(
        self, storage: Any, max_mem_mb: Optional[float] = None
    ) -> Tuple[Optional[str], Optional[float]]:
        iteration = storage.iter
        if iteration == self._max_iter:
            return None, None
        histories = storage.histories()
        ws = self._window_size

        def samples(name: str) -> List[Tuple[float, Any]]:
            return _values(storage, name)

        if "data_time" in histories:
            data = samples("data_time")
            avg_data_time: Optional[float] = _avg(data, count_samples(storage, "data_time", ws))
            last_data_time: Optional[float] = data[-1][0]
        else:
            avg_data_time = last_data_time = None
        if "time" in histories:
            data = samples("time")
            avg_iter_time: Optional[float] = _global_avg(data)
            last_iter_time: Optional[float] = data[-1][0]
        else:
            avg_iter_time = last_iter_time = None
        lr = "{:.5g}".format(samples("lr")[-1][0]) if "lr" in histories else "N/A"

        eta_string, eta_seconds = self._get_eta(storage)

        def smoothed(k: str) -> str:
            return "{}: {:.4g}".format(k, _median(samples(k), count_samples(storage, k, ws)))

        epoch = ""
        if self._epoch is not None and self._max_iter is not None:
            per_epoch = max(1, -(-self._max_iter // self._epoch))
            e = min(max(iteration // per_epoch + 1, 1), self._epoch)
            epoch = f"epoch: {e}/{self._epoch}  "

        line = str.format(
            " {eta}iter: {iter}  {epoch}{losses}  {non_losses}  {avg_time}{last_time}"
            + "{avg_data_time}{last_data_time} lr: {lr}  {memory}",
            eta=f"eta: {eta_string}  " if eta_string else "",
            iter=iteration,
            epoch=epoch,
            losses="  ".join([smoothed(k) for k in histories if "loss" in k]),
            non_losses="  ".join([smoothed(k) for k in histories if "[metric]" in k]),
            avg_time="time: {:.4f}  ".format(avg_iter_time) if avg_iter_time is not None else "",
            last_time="last_time: {:.4f}  ".format(last_iter_time)
            if last_iter_time is not None
            else "",
            avg_data_time="data_time: {:.4f}  ".format(avg_data_time)
            if avg_data_time is not None
            else "",
            last_data_time="last_data_time: {:.4f}  ".format(last_data_time)
            if last_data_time is not None
            else "",
            lr=lr,
            memory="max_mem: {:.0f}M".format(max_mem_mb) if max_mem_mb is not None else "",
        )
        return line, eta_seconds

    def write(self, storage: Any, max_mem_mb: Optional[float] = None) -> Optional[str]:
        line, eta_seconds = self.line(storage, max_mem_mb)
        if eta_seconds is not None:
            storage.put_scalar("eta_seconds", eta_seconds, smoothing_hint=False)
        return line
