"""Metric storage and writers, mirroring ``detectron2.utils.events``.

The state of :class:`EventStorage` and :class:`HistoryBuffer` lives in Rust (``hookloop._core``);
this module adds what needs Python: the context-manager stack behind
:func:`get_event_storage`, ``name_scope``, and turning image/histogram tensors into data.
torch is imported only when an image or histogram is put.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import shutil
import socket
import stat
import sys
import time
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from hookloop import _core
from hookloop.utils._base import (
    _CURRENT_STORAGE_STACK,
    EventWriter,
    get_event_storage,
    has_event_storage,
)
from hookloop.utils._base import (
    NoEventStorageError as NoEventStorageError,
)
from hookloop.utils._media import image_point as _image_point

__all__ = [
    "get_event_storage",
    "has_event_storage",
    "EventStorage",
    "HistoryBuffer",
    "EventWriter",
    "JSONWriter",
    "TensorboardXWriter",
    "CommonMetricPrinter",
]

# The tracker writers are imported on first use (their clients are optional dependencies).


def __getattr__(name: str) -> Any:
    if name == "MLflowWriter":
        from hookloop.utils.trackers import MLflowWriter

        return MLflowWriter
    if name == "WandbWriter":
        from hookloop.utils.wandb_writer import WandbWriter

        return WandbWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


logger = logging.getLogger(__name__)

HistoryBuffer = _core.HistoryBuffer

# The most buckets put_histogram makes (torch.histc allocates them all).
_MAX_BINS = 1 << 24


class EventStorage(_core.EventStorage):
    """The user-facing class that stores metrics during training.

    Use it as a context manager: ``with EventStorage(start_iter) as storage: ...``; code inside
    reaches it with :func:`get_event_storage`. Scalars (``put_scalar``/``put_scalars``), their
    histories and smoothing live in Rust and are safe to put from several threads. Images and
    histograms wait for the writers that take them (TensorBoard, MLflow, W&B): each such writer
    gets every one, and one stays until all have it, at most ``max_images``/``max_histograms``
    waiting (older ones are dropped first, with one warning in the log).

    Args:
        start_iter (int): the iteration number to start with.
        max_length (int): entries kept per scalar history (fvcore's default, 1e6).
        max_images (int): images held until a writer takes them.
        max_histograms (int): histograms held until a writer takes them.
    """

    def __enter__(self) -> EventStorage:
        if "torch" in sys.modules:
            # Tensors may be put: the module that reads them hands its reads to the
            # extension at its import (hookloop.engine has imported it already).
            import hookloop.utils._tensors  # noqa: F401
        _CURRENT_STORAGE_STACK.append(self)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if not _CURRENT_STORAGE_STACK or _CURRENT_STORAGE_STACK[-1] is not self:
            raise RuntimeError("EventStorage contexts must be exited in the order entered")
        _CURRENT_STORAGE_STACK.pop()
        # Every line written inside the block is in its file when the block ends (and so when
        # train() returns), even from a writer that is never closed, as with detectron2's
        # synchronous writers: code that reads metrics.json right after its loop sees it all.
        _core.flush_writers()

    def histories(self) -> Dict[str, HistoryBuffer]:  # type: ignore[override]
        """``{name: HistoryBuffer}`` for every scalar, in first-put order. Like detectron2's
        ``defaultdict(HistoryBuffer)``: each buffer is the storage's own (live); a name put
        after this call is found when it is read from the dict; reading a name never put gives
        an empty buffer (which writers do not see); and assigning
        ``histories()[name] = buffer`` makes it that scalar's history in this storage (a name
        put before keeps its latest value, as detectron2's ``_latest_scalars``). A test
        double with a ``values()`` method may stand in for the buffer: its pairs are copied."""
        return _HistoryMap(self, super().histories())

    @property
    def _history(self) -> Dict[str, HistoryBuffer]:
        """detectron2's private name for :meth:`histories`."""
        return self.histories()

    @_history.setter
    def _history(self, histories: Mapping[str, HistoryBuffer]) -> None:
        """detectron2 code prunes names by assigning a filtered dict (a validation hook that
        drops its ``val_*`` losses between its steps): the names left out are forgotten, their
        latest values too (:meth:`_forget`); each name in it gets that buffer as its history,
        as ``histories()[name] = buffer`` does."""
        if not isinstance(histories, Mapping):
            raise TypeError(
                f"EventStorage._history must be a dict of HistoryBuffer, got "
                f"{type(histories).__name__}"
            )
        self._forget([n for n in super().histories() if n not in histories])
        assign = self.histories()
        for name, buffer in histories.items():
            assign[name] = buffer

    @property
    def _latest_scalars(self) -> Dict[str, Tuple[float, Any]]:
        """detectron2's private ``{name: (value, iteration)}`` (a snapshot)."""
        return self.latest()

    @_latest_scalars.setter
    def _latest_scalars(self, scalars: Mapping[str, Tuple[float, Any]]) -> None:
        """Assigning a filtered snapshot (detectron2 code that prunes names) forgets the names
        left out, their histories too (:meth:`_forget`). A value is set by ``put_scalar``: one
        that is not the storage's latest is a ``ValueError``."""
        if not isinstance(scalars, Mapping):
            raise TypeError(
                f"EventStorage._latest_scalars must be a dict of (value, iteration), got "
                f"{type(scalars).__name__}"
            )
        now = self.latest()
        for name, entry in scalars.items():
            if name not in now or not _same_entry(entry, now[name]):
                raise ValueError(
                    f"EventStorage._latest_scalars[{name!r}] = {entry!r}: assigning "
                    f"_latest_scalars can only leave names out (to forget them); the storage's "
                    f"latest is {now.get(name)!r}. Use put_scalar to store a value"
                )
        self._forget([n for n in now if n not in scalars])

    @contextmanager
    def name_scope(self, name: str) -> Iterator[None]:
        """Scalars put inside this context get the prefix ``name + "/"``. The scope is the
        calling thread's: what other threads put meanwhile is not prefixed."""
        if not isinstance(name, str):
            raise TypeError(f"name_scope() name must be a str, got {type(name).__name__}")
        old_prefix = self._current_prefix
        self._current_prefix = name.rstrip("/") + "/"
        try:
            yield
        finally:
            self._current_prefix = old_prefix

    def put_image(self, img_name: str, img_tensor: Any) -> None:
        """Adds an image to be shown in TensorBoard.

        Args:
            img_name (str): the tag of the image.
            img_tensor (torch.Tensor or numpy.ndarray): a ``(C, H, W)`` image with C in
                {1, 3, 4}, uint8 in [0, 255] or float in [0, 1], RGB. It is kept as given (a
                CUDA tensor is not read) until a writer converts it.
        """
        if not isinstance(img_name, str):
            raise TypeError(f"put_image() img_name must be a str, got {type(img_name).__name__}")
        _check_image_data(img_name, img_tensor)
        # The shape rule is the core's (checked again on the pixels when encoded).
        if self._put_image(img_name, img_tensor):
            logger.warning(
                "EventStorage holds more than %d images that not every writer took; dropping "
                "the oldest. Add a TensorboardXWriter (and write it as often as the others), "
                "or stop calling put_image.",
                len(self._vis_data),
            )

    def put_histogram(self, hist_name: str, hist_tensor: Any, bins: int = 1000) -> None:
        """Creates a histogram from a tensor (detectron2's bucket layout).

        Args:
            hist_name (str): the tag of the histogram.
            hist_tensor (torch.Tensor): a tensor of any shape; all its values are counted.
            bins (int): the number of buckets.
        """
        import torch

        if not isinstance(hist_name, str):
            raise TypeError(
                f"put_histogram() hist_name must be a str, got {type(hist_name).__name__}"
            )
        if not isinstance(hist_tensor, torch.Tensor):
            raise TypeError(
                f"put_histogram('{hist_name}') needs a torch.Tensor, "
                f"got {type(hist_tensor).__name__}"
            )
        if isinstance(bins, bool) or not isinstance(bins, int) or not 0 < bins <= _MAX_BINS:
            raise ValueError(
                f"put_histogram('{hist_name}') bins must be an int in [1, {_MAX_BINS}], "
                f"got {bins!r}"
            )
        if hist_tensor.numel() == 0:
            raise ValueError(f"put_histogram('{hist_name}') got an empty tensor")
        t = hist_tensor.detach()
        if not t.is_floating_point():
            t = t.float()  # histc needs a floating dtype; detectron2 would fail here
        ht_min, ht_max = t.min().item(), t.max().item()
        if not (math.isfinite(ht_min) and math.isfinite(ht_max)) or max(-ht_min, ht_max) > float(
            torch.finfo(torch.float32).max
        ):
            raise ValueError(
                f"put_histogram('{hist_name}') values must be finite and within float32's "
                f"range (TensorBoard's bucket edges are float32), got min {ht_min}, "
                f"max {ht_max}"
            )
        hist_counts = torch.histc(t, bins=bins)
        hist_edges = torch.linspace(start=ht_min, end=ht_max, steps=bins + 1, dtype=torch.float32)
        dropped = self._put_histogram(
            hist_name,
            ht_min,
            ht_max,
            # detectron2's `num` is len(tensor): the first dimension, not every value
            float(len(t) if t.dim() > 0 else 1),
            float(t.sum()),
            float(torch.sum(t**2)),
            hist_edges[1:].tolist(),
            hist_counts.tolist(),
        )
        if dropped:
            logger.warning(
                "EventStorage holds more histograms than its bound that not every writer took; "
                "dropping the oldest. Add a TensorboardXWriter (and write it as often as the "
                "others), or stop calling put_histogram."
            )


def _same_entry(a: Any, b: Tuple[float, Any]) -> bool:
    """Whether ``a`` is the ``(value, iteration)`` pair ``b`` (NaN equal to NaN)."""
    if a is b:
        return True
    try:
        value, it = a
    except (TypeError, ValueError):
        return False
    return it == b[1] and (value == b[0] or (value != value and b[0] != b[0]))


class _HistoryMap(dict):  # type: ignore[type-arg]
    """What ``EventStorage.histories()`` returns: a dict that behaves like detectron2's
    ``defaultdict(HistoryBuffer)`` for reads, and writes assignments through to the storage."""

    def __init__(self, storage: EventStorage, histories: Dict[str, HistoryBuffer]) -> None:
        super().__init__(histories)
        self._storage = storage

    def __missing__(self, name: str) -> HistoryBuffer:
        # A name put since this dict was made: the storage's own buffer, as in detectron2,
        # where this dict is the storage's.
        try:
            buffer = self._storage.history(name)
        except KeyError:
            # Never put: as detectron2's defaultdict, the read creates the storage's own empty
            # history, listed at this place by every later histories() (writers see the name
            # only once it is put).
            buffer = self._storage._read_history(name)
        dict.__setitem__(self, name, buffer)
        return buffer

    def __setitem__(self, name: str, buffer: HistoryBuffer) -> None:
        if not isinstance(buffer, HistoryBuffer):
            buffer = _history_from_double(name, buffer)
        self._storage._set_history(name, buffer)
        dict.__setitem__(self, name, self._storage.history(name))


def _history_from_double(name: str, double: Any) -> HistoryBuffer:
    """A ``HistoryBuffer`` holding the ``(value, iteration)`` pairs of a test double's
    ``values()``. detectron2 stores any object in ``histories()``; its writers and
    ``count_samples`` read ``values()`` and the statistics fvcore computes from those pairs,
    which the storage's copy computes the same way. The copy is taken now: the storage does
    not call the double's ``update`` or statistics later."""
    values = getattr(double, "values", None)
    if not callable(values):
        raise TypeError(
            f"histories()[{name!r}] must be a HistoryBuffer or have a values() method "
            f"returning (value, iteration) pairs, got {type(double).__name__}"
        )
    max_length = getattr(double, "_max_length", getattr(double, "max_length", None))
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        buffer = HistoryBuffer()
    else:
        buffer = HistoryBuffer(max_length)
    for value, iteration in values():
        buffer.update(value, iteration)
    return buffer


class _NativeFileWriter(EventWriter):
    """What ``JSONWriter`` and ``TensorboardXWriter`` share: their state is the native
    writer's (``self._native``), read and set through detectron2's attribute names."""

    _native: Any

    @property
    def _window_size(self) -> int:
        return int(self._native.window_size)

    @property
    def _last_write(self) -> int:
        return int(self._native._last_write)

    @_last_write.setter
    def _last_write(self, value: int) -> None:
        self._native._last_write = value

    def flush(self) -> None:
        """Blocks until everything written so far is in the file."""
        self._native.flush()

    def close(self) -> None:
        self._native.close()
        self._unsubscribe_media()  # nothing waits for a closed writer's reader


class JSONWriter(_NativeFileWriter):
    """Write scalars to a json file.

    It saves scalars as one json per line (instead of a big json) for easy parsing. Each line
    holds the scalars of one iteration that were not written before, smoothed over
    ``window_size`` iterations per their smoothing hint, with an ``"iteration"`` key and sorted
    keys: byte-identical to detectron2's ``json.dumps(..., sort_keys=True)``.

    Formatting and I/O happen on the writer's own thread; ``write()`` only takes a snapshot.
    Lines reach the file in write calls of whole lines that lie within one 4 KiB page of the
    file; a line that crosses a page boundary gets a write call of its own. A process killed
    with SIGKILL can still leave its last line torn, only a line that crosses a 4096-aligned
    offset of the file and cut at that offset (rarely: the kill must land while that line is
    copied); a reader that skips an unterminated last line sees only whole lines, and opening
    the file again (the next run's ``JSONWriter``) cuts the torn tail off. Opening keeps a
    whole last object that lacks its newline, and refuses (``ValueError``) a file whose first
    or last line is not a JSON object.

    Args:
        json_file (str or os.PathLike): path to the json file. New data is appended if the
            file exists; the file is opened (created) here, so an unwritable path fails now.
        window_size (int): the window size of median smoothing for scalars whose
            ``smoothing_hint`` is True.
        fsync (str): when the writer thread fsyncs the file. Lines reach the file (the OS)
            within 5 ms of ``write()`` under every policy, so they survive a kill of the
            process; an fsync makes them survive a crash of the machine. ``"periodic"``
            (default): at most once a second while lines keep coming, and whenever writing
            pauses, at ``flush()`` and at ``close()``. ``"always"``: after each batch of lines
            (detectron2 fsyncs inside each ``write()``; on a VM each fsync's I/O interrupt
            also costs the CPU the training thread runs on). ``"close"`` (only when closed) or
            ``"never"``.
    """

    def __init__(
        self,
        json_file: Union[str, os.PathLike[str]],
        window_size: int = 20,
        *,
        fsync: str = _core.JSON_FSYNC_DEFAULT,
    ) -> None:
        path = _fspath("json_file", json_file)
        self._earlier_lines = _regular_and_not_empty(path)
        self._native = _core.JSONWriter(path, window_size, fsync)

    def write(self) -> None:
        self._native.write(get_event_storage())

    @property
    def _file_handle(self) -> _JSONFileHandle:
        """A file-like object whose writes land in metrics.json, in order with this writer's
        own lines (detectron2's ``JSONWriter`` has an open file here; subclasses write to it)."""
        return _JSONFileHandle(self._native)

    def _resume_from(self, start_iter: int) -> None:
        """A run starts at ``start_iter``: the lines an earlier run wrote for iterations >=
        ``start_iter`` are removed from the file (an atomic rewrite), so this run's lines
        follow without duplicates. ``PeriodicWriter`` calls this at ``before_train``.

        A resumed run (``start_iter > 0``) removes what the killed run wrote after its
        checkpoint: the resumed run writes those iterations again. A run that starts at 0 (a
        fresh start, or a resume that found no checkpoint) replaces the whole file; a file
        that held lines is first copied to ``<path>.1`` (``.2``, ... when taken), and a
        warning names both."""
        kept = None
        if start_iter <= 0:
            kept = self._keep_earlier_run()
            if kept is None:
                return  # nothing of an earlier run in the file
        removed = self._native._purge_from(start_iter)
        if kept is not None:
            logger.warning(
                "%s held %d line(s) of an earlier run; this run starts at iteration %d and "
                "replaces them (the earlier file is kept as %s)",
                self._native.path,
                removed,
                start_iter,
                kept,
            )
        elif removed:
            logger.info(
                "Removed %d line(s) of iterations >= %d from %s, left by an earlier run",
                removed,
                start_iter,
                self._native.path,
            )

    def _keep_earlier_run(self) -> Optional[str]:
        """A copy of the file at the first free ``<path>.N``, when it is a regular file that
        held lines when this writer opened it (not a device, a pipe, or only this writer's
        own lines)."""
        if not self._earlier_lines:
            return None
        self._native.flush()
        path = self._native.path
        n = 1
        while os.path.exists(f"{path}.{n}"):
            n += 1
        kept = f"{path}.{n}"
        shutil.copyfile(path, kept)
        return kept


def _regular_and_not_empty(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size > 0


class _JSONFileHandle:
    """``JSONWriter._file_handle``: text written here goes through the writer thread, after
    the lines already queued."""

    def __init__(self, native: Any) -> None:
        self._native = native

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._native._write_text(text)
        return len(text)

    def flush(self) -> None:
        self._native.flush()

    @property
    def name(self) -> str:
        return str(self._native.path)


_SUMMARY_WRITER_KWARGS = {"comment", "purge_step", "max_queue", "flush_secs", "filename_suffix"}


class TensorboardXWriter(_NativeFileWriter):
    """Write all scalars, images and histograms to a TensorBoard event file.

    The event file is written natively (TFRecord framing with masked CRC32C, TensorBoard's
    ``Event``/``Summary`` protobufs, PNG image summaries), without torch's SummaryWriter. It is
    created at the first write, named ``events.out.tfevents.<time>.<host>.<pid>.<n>`` like
    SummaryWriter's, so a rank that never writes leaves no file.

    Args:
        log_dir (str or os.PathLike): the directory to save the output events
        window_size (int): the scalars will be median-smoothed by this window size
        kwargs: SummaryWriter's keyword arguments. ``filename_suffix`` is honoured;
            ``max_queue`` and ``flush_secs`` are accepted and ignored (every ``write()`` reaches
            the file); ``fsync`` (``"close"`` by default, or ``"always"``/``"periodic"``/
            ``"never"``, as for :class:`JSONWriter`) is
            hookloop's own.
    """

    def __init__(
        self, log_dir: Union[str, os.PathLike[str]], window_size: int = 20, **kwargs: Any
    ) -> None:
        unknown = set(kwargs) - _SUMMARY_WRITER_KWARGS - {"fsync"}
        if unknown:
            raise TypeError(
                f"TensorboardXWriter got unexpected keyword arguments {sorted(unknown)}"
            )
        purge_step = kwargs.get("purge_step")
        if purge_step is not None and (
            isinstance(purge_step, bool) or not isinstance(purge_step, int) or purge_step < 0
        ):
            raise ValueError(
                f"TensorboardXWriter purge_step must be an int >= 0, got {purge_step!r}"
            )
        self._native = _core.TensorboardXWriter(
            _fspath("log_dir", log_dir),
            window_size,
            socket.gethostname(),
            str(kwargs.get("filename_suffix", "")),
            kwargs.get("fsync", _core.EVENTS_FSYNC_DEFAULT),
        )
        self._writer = _SummaryWriter(self._native, os.fspath(log_dir))
        self._media_reader = self._native._reader
        if purge_step is not None:
            self._resume_from(purge_step)

    def _resume_from(self, start_iter: int) -> None:
        """A run starts at ``start_iter``: writes TensorBoard's purge marker (a
        ``SessionLog.START`` event at that step, what ``SummaryWriter(purge_step=...)`` writes),
        so TensorBoard's reader discards the events an earlier run left at steps >= it. At 0
        (a fresh start) only when the directory holds an earlier event file: a first run's
        file stays as SummaryWriter's. The earlier files stay on disk."""
        if start_iter <= 0 and not self._earlier_event_files():
            return
        self._native._purge_from(start_iter)

    def _earlier_event_files(self) -> bool:
        log_dir = self._writer.log_dir
        try:
            return any(n.startswith("events.out.tfevents.") for n in os.listdir(log_dir))
        except OSError:
            return False  # not created yet: nothing earlier in it

    def write(self) -> None:
        storage = get_event_storage()
        self._note_media_storage(storage)  # its reader, forgotten at close()
        if self._native.write(storage):
            # Images are the caller's tensors until now: convert them here, in one batch. One
            # that fails is skipped (the others are written) and named in the error.
            points, failed = [], []
            for name, img, step in storage._take_images(self._media_reader):
                try:
                    points.append(_image_point(name, img, step))
                except Exception as e:
                    failed.append(f"image '{name}' at iter {step}: {type(e).__name__}: {e}")
            self._native.add_points(images=points)
            if failed:
                raise ValueError(
                    f"TensorboardXWriter skipped {len(failed)} of {len(failed) + len(points)} "
                    "images that could not be converted (the others were written): "
                    + "; ".join(failed)
                )


class _SummaryWriter:
    """The subset of ``torch.utils.tensorboard.SummaryWriter`` that detectron2-based code
    reaches through ``TensorboardXWriter._writer``; it writes into the same event file."""

    def __init__(self, native: Any, log_dir: str) -> None:
        self._native = native
        self.log_dir = log_dir

    def get_logdir(self) -> str:
        return self.log_dir

    def add_scalar(
        self,
        tag: str,
        scalar_value: Any,
        global_step: Optional[int] = None,
        walltime: Optional[float] = None,
        **_: Any,
    ) -> None:
        step = _global_step("add_scalar", tag, global_step)
        self._native.add_points(
            scalars=[(tag, _as_float(tag, scalar_value), step)], walltime=walltime
        )

    def add_image(
        self,
        tag: str,
        img_tensor: Any,
        global_step: Optional[int] = None,
        walltime: Optional[float] = None,
        dataformats: str = "CHW",
    ) -> None:
        point = _image_point(
            tag, img_tensor, _global_step("add_image", tag, global_step), dataformats
        )
        self._native.add_points(images=[point], walltime=walltime)

    def add_histogram_raw(
        self,
        tag: str,
        min: float,
        max: float,
        num: float,
        sum: float,
        sum_squares: float,
        bucket_limits: Any,
        bucket_counts: Any,
        global_step: Optional[int] = None,
        walltime: Optional[float] = None,
    ) -> None:
        limits = [float(x) for x in bucket_limits]
        counts = [float(x) for x in bucket_counts]
        if len(limits) != len(counts):
            raise ValueError(
                f"add_histogram_raw('{tag}'): len(bucket_limits) != len(bucket_counts)"
            )
        step = _global_step("add_histogram_raw", tag, global_step)
        hist = (tag, step, float(min), float(max), float(num), float(sum),
                float(sum_squares), limits, counts)  # fmt: skip
        self._native.add_points(histograms=[hist], walltime=walltime)

    def add_histogram(
        self,
        tag: str,
        values: Any,
        global_step: Optional[int] = None,
        bins: Any = "tensorflow",
        walltime: Optional[float] = None,
        max_bins: Optional[int] = None,
    ) -> None:
        """``SummaryWriter.add_histogram``: ``numpy.histogram`` of the values over ``bins``
        (``"tensorflow"``: SummaryWriter's default exponential buckets), laid out as
        TensorBoard stores it."""
        import numpy as np

        global_step = _global_step("add_histogram", tag, global_step)
        arr = values.detach().cpu().numpy() if hasattr(values, "detach") else values
        arr = np.asarray(arr, dtype=np.float64).reshape(-1)
        if arr.size == 0:
            raise ValueError(f"add_histogram('{tag}'): the histogram is empty")
        counts, edges = np.histogram(arr, bins=_tf_bins() if bins == "tensorflow" else bins)
        limits, buckets = _core._histogram_buckets(
            edges.tolist(), counts.astype(np.float64).tolist(), max_bins
        )
        self.add_histogram_raw(tag, arr.min(), arr.max(), arr.size, arr.sum(), arr.dot(arr),
                               limits, buckets, global_step, walltime)  # fmt: skip

    def add_text(
        self,
        tag: str,
        text_string: str,
        global_step: Optional[int] = None,
        walltime: Optional[float] = None,
    ) -> None:
        """``SummaryWriter.add_text``: for TensorBoard's text plugin, under
        ``tag + "/text_summary"``."""
        if not isinstance(text_string, str):
            raise TypeError(
                f"add_text('{tag}'): text must be a str, got {type(text_string).__name__}"
            )
        step = _global_step("add_text", tag, global_step)
        self._native.add_points(texts=[(tag, step, text_string)], walltime=walltime)

    def flush(self) -> None:
        self._native.flush()

    def close(self) -> None:
        self._native.close()


@functools.lru_cache(maxsize=1)
def _tf_bins() -> List[float]:
    """SummaryWriter's default histogram edges: ±1e-12 growing by 1.1 up to 1e20, and 0."""
    v, pos = 1e-12, []
    while v < 1e20:
        pos.append(v)
        v *= 1.1
    return [-x for x in reversed(pos)] + [0.0] + pos


class CommonMetricPrinter(EventWriter):
    """Print **common** metrics to the terminal, including iteration time, ETA, memory, all
    losses, and the learning rate. It also applies smoothing using a window of 20 elements.

    It's meant to print common metrics in common ways. To print something in more customized
    ways, please implement a similar printer by yourself.

    The line is formatted in Rust and logged once per ``write()`` through the logger
    ``hookloop.utils.events``, from the calling thread.

    Args:
        max_iter: the maximum number of iterations to train. Used to compute ETA. If not
            given, ETA will not be printed.
        window_size (int): the losses will be median-smoothed by this window size
        epoch (int): the number of epochs of the run (as runner-style trainers pass it);
            with ``max_iter`` it adds ``epoch: e/E`` to the line, splitting the iterations
            evenly.

    Epochs of the trainer: a :class:`~hookloop.engine.hooks.PeriodicWriter` gives its writers
    the trainer in ``before_train`` (``_bind_trainer``, kept as a weak reference). When that
    trainer runs epochs (a finite data loader, ``trainer.iters_per_epoch``, that ``max_iter``
    goes over more than once), the line shows ``epoch: e/E`` after ``iter``, with
    ``e = trainer.epoch + 1`` and ``E = ceil(trainer.max_iter / trainer.iters_per_epoch)``;
    this takes the place of the even
    split of ``epoch``. Without epochs the line is detectron2's, unchanged.
    """

    def __init__(
        self, max_iter: Optional[int] = None, window_size: int = 20, *, epoch: Optional[int] = None
    ) -> None:
        self.logger = self._default_logger = logging.getLogger(__name__)
        self._native = _core.CommonMetricPrinter(max_iter, window_size, epoch)
        self._cuda = _cuda_available()
        self._trainer: Any = None

    def _bind_trainer(self, trainer: Any) -> None:
        """The trainer whose epoch the line shows (``PeriodicWriter.before_train`` calls it).
        Held weakly: the trainer owns its hooks, which own this printer."""
        if trainer is not None and not isinstance(
            trainer, (weakref.ProxyType, weakref.CallableProxyType)
        ):
            trainer = weakref.proxy(trainer)
        self._trainer = trainer
        if trainer is not None:
            # The one epoch rule, the data cursor's (imported here, at before_train: hookloop.data
            # imports torch, and importing events does not).
            from hookloop.data.cursor import run_epochs

            self._run_epochs = run_epochs

    def _trainer_epoch(self) -> Optional[Tuple[int, int]]:
        """``(trainer.epoch + 1, epochs of the run)`` when the bound trainer runs epochs."""
        trainer = self._trainer
        if trainer is None:
            return None
        try:
            per_epoch = self._run_epochs(trainer)
            if per_epoch is None:
                return None  # no epochs, or a run within one pass: detectron2's line
            return int(trainer.epoch) + 1, -(-int(trainer.max_iter) // per_epoch)
        except (ReferenceError, AttributeError, TypeError):
            return None  # the trainer is gone, or is not one that counts epochs

    @property
    def _max_iter(self) -> Optional[int]:
        return self._native._max_iter

    @_max_iter.setter
    def _max_iter(self, value: Optional[int]) -> None:
        self._native._max_iter = value

    @property
    def _window_size(self) -> int:
        return self._native._window_size

    @property
    def _last_write(self) -> Optional[Tuple[int, float]]:
        """``(iteration, time.perf_counter())`` of the last wall-time ETA estimate."""
        return self._native._last_write

    @_last_write.setter
    def _last_write(self, value: Optional[Tuple[int, float]]) -> None:
        self._native._last_write = value

    def _get_eta(self, storage: EventStorage) -> Optional[str]:
        """detectron2's ETA string (None until it can be estimated, "" without max_iter);
        puts ``eta_seconds`` when a ``time`` metric exists."""
        return self._native._get_eta(storage, time.perf_counter())

    def write(self) -> None:
        storage = get_event_storage()
        max_mem_mb = None
        if self._cuda:
            import torch

            max_mem_mb = torch.cuda.max_memory_allocated() / 1024.0 / 1024.0
        epoch = self._trainer_epoch() if self._trainer is not None else None
        line = self._native.format(storage, max_mem_mb, time.perf_counter(), epoch)
        if line is None:
            return
        log = self.logger
        if log is not self._default_logger or "info" in log.__dict__:
            log.info(line)  # a subclass's own, wrapped or patched logger sees every line
        elif log.isEnabledFor(logging.INFO):
            # logger.info(line), without the stack walk that finds the caller: the record
            # names this line as its origin, as logger.info would. The origin is fixed, so it
            # is found once (a frame's f_lineno decodes the line table: ~4k instructions).
            origin = _PRINTER_ORIGIN
            if origin is None:
                origin = _printer_origin(sys._getframe())
            record = log.makeRecord(
                log.name, logging.INFO, origin[0], origin[1], line, (), None, "write"
            )
            log.handle(record)


# (filename, line) of CommonMetricPrinter.write's logging, once it has logged a line.
_PRINTER_ORIGIN: Optional[Tuple[str, int]] = None


def _printer_origin(frame: Any) -> Tuple[str, int]:
    global _PRINTER_ORIGIN
    _PRINTER_ORIGIN = (frame.f_code.co_filename, frame.f_lineno)
    return _PRINTER_ORIGIN


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def _fspath(what: str, path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def _global_step(method: str, tag: str, step: Any) -> int:
    """A ``SummaryWriter`` method's ``global_step`` as the int64 an event holds (None: 0), or
    an error naming it (torch's raises protobuf's ``ValueError`` beyond int64)."""
    if step is None:
        return 0
    try:
        value = int(step)
    except (OverflowError, ValueError):  # inf, nan
        raise ValueError(f"{method}('{tag}'): global_step must be an int, got {step!r}") from None
    except TypeError:
        raise TypeError(
            f"{method}('{tag}'): global_step must be an int, got {type(step).__name__}"
        ) from None
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{method}('{tag}'): global_step must fit in int64, got {value}")
    return value


def _as_float(tag: str, value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"add_scalar('{tag}') needs a number, got {type(value).__name__}")
    return float(value)


# torch dtypes an image may have (numpy: kinds b, i, u, f); bfloat16 and float16 are read as
# float32, as torch's SummaryWriter does.
_IMAGE_TORCH_DTYPES = {
    f"torch.{t}"
    for t in (
        "bool uint8 int8 int16 int32 int64 float16 bfloat16 float32 float64".split()
        + ["half", "float", "double"]
    )
}


def _check_image_data(tag: str, img: Any) -> None:
    """What `put_image` can check without reading the data: a numeric dtype, a device with
    data. Raises TypeError/ValueError naming the image."""
    dtype = getattr(img, "dtype", None)
    if dtype is None:
        return  # no dtype: the shape check names it
    device = getattr(img, "device", None)
    if getattr(device, "type", None) == "meta":
        raise ValueError(f"put_image('{tag}'): the image is a meta tensor, which holds no data")
    if type(dtype).__module__ == "torch":
        ok = str(dtype) in _IMAGE_TORCH_DTYPES
    else:
        ok = getattr(dtype, "kind", None) in ("b", "i", "u", "f")
    if not ok:
        raise TypeError(
            f"put_image('{tag}') image must be a tensor or array of numbers "
            f"(uint8 in [0, 255] or float in [0, 1]), got dtype {dtype}"
        )


def _flush_at_exit() -> None:
    """Interpreter exit writes whatever writers queued and did not close, and logs at ERROR
    an I/O error that no call reported (one after the last ``write()``). The exit status
    cannot reflect it: an atexit handler's exception does not change it, and ``os._exit``
    would skip the handlers registered before this one. A file that blocks (a hung mount)
    is waited for at most ``HOOKLOOP_WRITER_TIMEOUT`` seconds (10 by default), then logged."""
    try:
        _core.flush_writers()
    except OSError as e:
        logger.error("hookloop: writers not flushed at exit: %s", e)
    for err in _core._take_writer_errors():
        logger.error("hookloop: a writer failed after its last write() or flush(): %s", err)


atexit.register(_flush_at_exit)
