"""Writers to experiment trackers: :class:`MLflowWriter` (and the base the Weights & Biases
writer shares). They write what :class:`~hookloop.utils.events.JSONWriter` writes (the same
smoothed scalars, at the same iterations) into the tracker, with the same promises:

- ``write()`` on the training thread takes a snapshot of the new scalars and queues it; a
  thread of the writer's own hands the points to the client. Nothing on the training thread
  waits for the tracker.
- A tracker that fails (unreachable, hanging, an error of its client) is logged once with its
  address and the client's error, retried with backoff (from the call that failed, and a call
  that failed is first checked against what the tracker has: every point goes in once), and
  buffers at most ``max_buffered`` points and ``max_buffered_bytes`` of images and histograms
  (the oldest are dropped, counted). ``close()`` waits at most ``close_timeout`` seconds and
  warns naming what was not logged; a tracker still open at interpreter exit is closed then.
  It is never a training error unless ``strict=True``.
- Names are mapped to those the tracker takes (a warning once per renamed name), and two
  names that map to one are kept apart (see ``TrackerWriter._claim``); what the tracker still
  refuses is dropped alone, counted and named, and the rest is logged. A run the tracker no
  longer takes points for (deleted on the server) is recognised at the first refusal and
  reported once.
- Its state (run id, last step sent, what is not yet in the tracker, the names chosen) goes
  into the trainer's checkpoint with :class:`~hookloop.engine.hooks.PeriodicWriter`'s, so a
  resumed run logs into the same run.
- The run ends FINISHED when everything written reached the tracker (or was refused or
  dropped, each named), FAILED when the writer's thread died or ``close()`` gave up with
  points unsent, KILLED when ``close()`` was interrupted (Ctrl-C); a tracker that fails at
  the end, or a deleted run, is left as it is.

The clients are optional: ``pip install "hookloop[mlflow]"``. Importing hookloop never
imports them.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import enum
import functools
import importlib
import logging
import os
import threading
import time
import weakref
import zlib
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from hookloop import _core
from hookloop.utils import comm
from hookloop.utils._base import EventWriter, get_event_storage
from hookloop.utils._media import image_array, media_bytes, mlflow_name, safe_key, take_media

__all__ = ["MLflowWriter", "TrackerWriter", "flatten_config"]

logger = logging.getLogger(__name__)

# One queued write: (iteration, wall time in seconds, {name: smoothed value, and
# (kind, name): a queued image or histogram, see hookloop.utils._media}).
_Row = Tuple[int, float, Dict[Any, Any]]
# A point's id: (its iteration, its key in the row: a scalar's name, or (kind, name) for an
# image or a histogram); a param's is (None, its name).
_PartId = Tuple[Optional[int], Any]
# One point of a client call: (its id, what the client is given for it).
_Part = Tuple[_PartId, Any]


def flatten_config(config: Any, prefix: str = "") -> Dict[str, Any]:
    """A nested config as one level with dotted keys: ``{"solver": {"lr": 0.1}}`` becomes
    ``{"solver.lr": 0.1}``. Takes a mapping (a dict, detectron2's ``CfgNode``), a dataclass, an
    OmegaConf/LazyConfig object, or anything with ``__dict__``; lists and other values are
    kept as they are."""
    if config is None:
        return {}
    config = _as_mapping(config)
    if not isinstance(config, Mapping):
        raise TypeError(
            f"a config must be a mapping, a dataclass or an OmegaConf object, "
            f"got {type(config).__name__}"
        )
    out: Dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        value = _as_mapping(value)
        if isinstance(value, Mapping):
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value
    return out


def _as_mapping(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    module = type(value).__module__ or ""
    if module.startswith("omegaconf"):
        from omegaconf import OmegaConf  # only present when the value is OmegaConf's

        return OmegaConf.to_container(value, resolve=True)
    return value


class _Call:
    """One call to a tracker's client, which logs all its parts or none: ``fn(payloads)``.
    A call the tracker refuses is split (``split``: by default into halves) until the part it
    refuses stands alone, and that part is dropped. A call that failed is checked before it is
    made again: ``check(parts)`` returns the parts the tracker does not have (a store that
    writes a call's points one by one may have some of them), so none goes in twice."""

    __slots__ = ("fn", "parts", "split_fn", "check", "failed", "points")

    def __init__(
        self,
        fn: Callable[[List[Any]], Any],
        parts: List[_Part],
        split_fn: Optional[Callable[["_Call"], List["_Call"]]] = None,
        check: Optional[Callable[[List[_Part]], List[_Part]]] = None,
    ) -> None:
        self.fn = fn
        self.parts = parts
        self.split_fn = split_fn
        self.check = check
        self.failed = False  # it raised a failure: check it before making it again
        self.points = _points(parts)  # its parts that are points (a param is not)

    def run(self) -> None:
        self.fn([payload for _, payload in self.parts])

    def split(self) -> List["_Call"]:
        if self.split_fn is not None:
            return self.split_fn(self)
        if len(self.parts) < 2:
            return []
        half = len(self.parts) // 2
        return [
            _Call(self.fn, self.parts[:half], check=self.check),
            _Call(self.fn, self.parts[half:], check=self.check),
        ]


def _points(parts: List[_Part]) -> int:
    return sum(1 for (it, _), _ in parts if it is not None)


def _label(part: _PartId) -> str:
    """A point as messages name it: ``'loss'``, ``image 'mask'``, ``param 'lr'``."""
    it, key = part
    if it is None:
        return f"param '{key}'"
    if isinstance(key, tuple):
        return f"{key[0]} '{key[1]}'"
    return f"'{key}'"


def _size(n: int) -> str:
    """Bytes as messages give them: ``64 MiB``, ``1.5 KiB``, ``100 B``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def _pickled_bytes(key: Any, item: Any) -> int:
    """What a checkpoint pickles of a queued image or histogram, at most: ``torch.save``
    pickles with protocol 2, which writes a ``bytes`` object as a latin-1 string in UTF-8, so
    each byte of 0x80 or more takes two (random pixels take 1.5 times their size); a number of
    a histogram takes 9. 0 for a scalar."""
    if not isinstance(key, tuple):
        return 0
    if key[0] == "image":
        import numpy as np

        data = item[3]
        return len(data) + int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) >= 0x80))
    return 9 * (len(item["bucket_limits"]) + len(item["bucket_counts"]) + 5)


class _Phase(enum.IntEnum):
    """Where a writer's sender is. Phases only advance (``TrackerWriter._enter``)."""

    SENDING = 0  # it sends what is written
    CLOSING = 1  # close() waits for the queue to drain, until its deadline
    ABANDONED = 2  # close() returned: no call to the client begins any more
    GONE = 3  # the tracker no longer takes the run's points (deleted): nothing more is sent
    DIED = 4  # the thread died of an exception it does not retry (SystemExit, ...)


class _Stopped(BaseException):
    """Raised on the sender thread where a call would begin after the sender stopped (see
    ``_Phase``); not an ``Exception``, so that nothing retries it."""


# The trackers still open (a sender thread started, close() not called): closed at exit.
_OPEN: "weakref.WeakSet[TrackerWriter]" = weakref.WeakSet()
# The threads close() left in a call (it timed out or was interrupted): each ends its run when
# that call returns. Interpreter exit waits for them, at most _EXIT_WAIT seconds in all.
_HANDED_OFF: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_EXIT_WAIT = 5.0


def _close_at_exit() -> None:
    """Interpreter exit closes the trackers the program did not close: each sends what it can
    within its ``close_timeout`` and warns naming what was not logged, as ``close()`` does.
    It runs before ``atexit`` handlers (the clients' own, W&B's among them, which would end
    the runs first), as ``concurrent.futures`` shuts its workers down. A thread that
    ``close()`` left in a call gets ``_EXIT_WAIT`` seconds to end its run."""
    for writer in list(_OPEN):
        try:
            writer.close()
        except Exception as e:  # strict=True: what was not logged, said at exit
            logger.error("%s", e)
    deadline = time.monotonic() + _EXIT_WAIT
    for thread in list(_HANDED_OFF):
        thread.join(max(0.0, deadline - time.monotonic()))


def _forget_open_in_child() -> None:
    """A forked child (a DataLoader worker, a ``multiprocessing`` process) does not own its
    parent's trackers: their threads are not in it, and its exit (``multiprocessing`` runs
    ``threading``'s exit hook there too) must not send their queues again or end their runs."""
    _OPEN.clear()
    _HANDED_OFF.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_open_in_child)

_register_exit = getattr(threading, "_register_atexit", None)
if _register_exit is not None:
    _register_exit(_close_at_exit)
else:  # pragma: no cover - Python without threading's exit hook
    atexit.register(_close_at_exit)


class TrackerWriter(EventWriter):
    """What :class:`MLflowWriter` and ``WandbWriter`` share: the snapshot on the training
    thread, the sender thread, the bounded buffer, the retries, the names and the resume state.

    A subclass implements ``_open()`` (create or resume the run; returns nothing),
    ``_calls(rows)`` (the client calls that log a batch of rows, see ``_Call``),
    ``_claim_names(rows)`` (gives the rows' names their tracker names, see ``_claim``),
    ``_refuses(error)`` (whether a call's error is the tracker refusing what the call holds,
    rather than failing), ``_gone(error)`` (whether the run itself no longer takes points, and
    why), ``_has(it, key)`` (whether a resumed run already has a point), ``_finish(state)``
    (end the run: ``"FINISHED"``, ``"FAILED"`` or ``"KILLED"``), ``_where()`` (the tracker's
    address, for messages) and ``_name``; ``_unsettled()`` when the client holds points that
    are not yet final (W&B's open step).

    The sender takes a batch from the queue and works through its calls: a call that fails
    is retried, with backoff, from that call on (the calls before it went through, and rows
    written meanwhile wait in the queue for the next batch); before it is made again, the
    tracker is asked which of its points it has. So every point reaches the tracker once. A
    call the tracker refuses is split until the part it refuses stands alone; that part is
    dropped, counted and named, and the rest goes on, unless the first refusal of a batch
    shows the run itself is gone (then nothing more is sent, and one warning says why).
    """

    _name = "TrackerWriter"
    # Rows handed to the client in one call at most (MLflow's log_batch takes 1000 metrics).
    _BATCH_POINTS = 1000
    # Retry waits after a failure, in seconds: doubling from the first to the last.
    _BACKOFF = (0.5, 30.0)
    # How long a checkpoint waits, once, for the tracker to make the run (see _state_dict).
    _STATE_WAIT = 10.0

    def __init__(
        self,
        window_size: int = 20,
        *,
        max_buffered: int = 100_000,
        max_buffered_bytes: int = 64 << 20,
        strict: bool = False,
        close_timeout: float = 30.0,
    ) -> None:
        for arg, value in (
            ("window_size", window_size),
            ("max_buffered", max_buffered),
            ("max_buffered_bytes", max_buffered_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{self._name} {arg} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{self._name} {arg} must be positive, got {value}")
        if not isinstance(strict, bool):
            raise TypeError(f"{self._name} strict must be a bool, got {type(strict).__name__}")
        if not isinstance(close_timeout, (int, float)) or close_timeout < 0:
            raise ValueError(f"{self._name} close_timeout must be >= 0, got {close_timeout!r}")
        self._window_size = window_size
        self._last_write = -1
        self._max_buffered = max_buffered
        self._max_bytes = max_buffered_bytes
        self._strict = strict
        self._close_timeout = float(close_timeout)
        # Only the main process logs, as the other writers are made there only.
        self._active = comm.is_main_process()
        self._lock = threading.Condition()
        self._queue: Deque[_Row] = collections.deque()
        self._queued_points = 0
        self._media_bytes = 0  # images' and histograms' bytes queued or in flight
        # The queued images and histograms, oldest first: (their row's values, key).
        self._media_order: Deque[Tuple[Dict[Any, Any], Any]] = collections.deque()
        self._in_flight = 0  # points of the batch the thread holds, not yet settled
        self._batch: List[_Row] = []  # that batch's rows
        self._batch_bytes = 0  # their media bytes
        self._done: Set[_PartId] = set()  # the batch's points settled (sent, refused, had)
        self._dropped = 0  # from a full buffer
        self._oversized = 0  # images and histograms larger than max_buffered_bytes
        self._unsendable = 0  # written after the sender stopped (the run gone, the thread dead)
        self._sent = 0
        self._refused: Dict[str, int] = {}  # what the tracker refused, by name
        self._refused_points = 0
        self._error: Optional[BaseException] = None  # the last failure, until a batch goes in
        self._phase = _Phase.SENDING
        self._cause: Optional[str] = None  # why the sender stopped (GONE, DIED)
        self._backing_off = False  # the thread waits out a backoff: a write does not wake it
        self._in_call = 0  # the thread is in a call to the client, for that many points (+1)
        self._close_deadline = 0.0  # close() waits for the queue until then
        self._handoff = False  # close() returned while the thread was in a call: it ends the run
        self._interrupted = False  # close() was interrupted (KeyboardInterrupt)
        self._sender_done = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        # Per space (see _claim): names as the tracker takes them, by name, and who holds
        # each tracker name, by tracker name.
        self._names: Dict[str, Dict[str, str]] = collections.defaultdict(dict)
        self._claims: Dict[str, Dict[str, str]] = collections.defaultdict(dict)
        # Points at or below this step may already be in the run (a resumed run): _has says.
        self._skip_through = -1
        self._last_step = -1  # the highest step of a batch the client took
        self._resumed = False  # the run id came from a checkpoint
        self._opened = threading.Event()  # the run exists (its id is known)
        self._gave_up = False  # a checkpoint stopped waiting for the run
        # It takes the storage's images and histograms (each writer that does gets them all).
        self._media_reader = _core._new_reader_id()

    # -- the training thread ---------------------------------------------------------------

    def write(self) -> None:
        """Queues the scalars that changed since the last write, smoothed as ``JSONWriter``
        smooths them, and the images and histograms put since, for the sender thread."""
        if self._closed:
            raise ValueError(f"{self._name}: write() after close()")
        storage = get_event_storage()
        self._note_media_storage(storage)  # its reader, forgotten at close()
        rows: Dict[int, Dict[Any, Any]] = {}
        last = self._last_write
        for name, (value, it) in storage.latest_with_smoothing_hint(self._window_size).items():
            if it > last:
                rows.setdefault(it, {})[name] = value
        if rows:
            self._last_write = max(rows)
        # Images are the caller's tensors until now: converted here, on the training thread
        # (as TensorboardXWriter converts them), sent by the sender thread. Those put after
        # an earlier write at their iteration come now, at theirs.
        media, failed = take_media(storage, self._media_reader)
        if failed:
            logger.warning(
                "%s skipped %d images that could not be converted: %s",
                self._name,
                len(failed),
                "; ".join(failed),
            )
        size = 0
        oversized = []
        for it, items in media.items():
            for key, item in list(items.items()):
                n = media_bytes(key, item)
                if n > self._max_bytes:  # it would not fit even alone
                    del items[key]
                    oversized.append(f"{_label((it, key))} at iter {it} ({_size(n)})")
                else:
                    size += n
            if items:
                rows.setdefault(it, {}).update(items)
        if not self._active:
            return
        if oversized:
            logger.warning(
                "%s: %s larger than max_buffered_bytes (%s) and not sent to %s: %s",
                self._name,
                "one image or histogram is" if len(oversized) == 1 else "images or histograms are",
                _size(self._max_bytes),
                self._where(),
                "; ".join(oversized),
            )
        if not rows and not oversized:
            return
        now = time.time()
        with self._lock:
            self._oversized += len(oversized)
            if not rows:
                return
            if self._phase >= _Phase.GONE:  # nothing more is sent: counted, said at close()
                self._unsendable += sum(len(v) for v in rows.values())
                return
            for it in sorted(rows):
                self._queue.append((it, now, rows[it]))
                self._queued_points += len(rows[it])
            for it in sorted(media):
                self._media_order.extend((rows[it], key) for key in media[it])
            self._media_bytes += size
            self._bound()
            self._start()
            if not self._backing_off:  # a backoff is waited out, not cut short by writes
                self._lock.notify()

    def _start(self) -> None:
        """Starts the sender thread, once (lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._send_loop, name=f"hookloop-{self._name}", daemon=True
            )
            self._thread.start()
            _OPEN.add(self)

    def _bound(self) -> None:
        """Drops the oldest queued rows beyond ``max_buffered`` points, and the oldest queued
        images and histograms while more than ``max_buffered_bytes`` of them are queued or in
        flight (lock held)."""
        dropped = 0
        while self._queued_points > self._max_buffered and self._queue:
            _, _, values = self._queue.popleft()
            self._forget_media(values)
            self._queued_points -= len(values)
            self._media_bytes -= sum(media_bytes(k, v) for k, v in values.items())
            dropped += len(values)
        media = 0
        order = self._media_order
        while self._media_bytes > self._max_bytes and order:
            # A row left empty stays queued: the sender makes no call for it.
            values, key = order.popleft()
            self._media_bytes -= media_bytes(key, values.pop(key))
            self._queued_points -= 1
            media += 1
        if dropped or media:
            self._dropped += dropped + media
            logger.warning(
                "%s: %s is not taking points as fast as they come; dropped the oldest %d%s "
                "(%d so far; at most %d points and %s of images and histograms are kept)",
                self._name,
                self._where(),
                dropped + media,
                f" ({media} images and histograms)" if media else "",
                self._dropped,
                self._max_buffered,
                _size(self._max_bytes),
            )

    # -- the sender thread -----------------------------------------------------------------

    def _take_batch(self) -> None:
        """Moves the next batch from the queue to ``_batch`` (lock held): at most
        ``_BATCH_POINTS`` points and ``max_buffered_bytes`` of media, one row at least."""
        batch: List[_Row] = []
        points = size = 0
        while self._queue and (not batch or points < self._BATCH_POINTS):
            row_size = sum(media_bytes(k, v) for k, v in self._queue[0][2].items())
            if batch and size + row_size > self._max_bytes:
                break
            row = self._queue.popleft()
            self._forget_media(row[2])
            batch.append(row)
            points += len(row[2])
            size += row_size
        self._queued_points -= points
        self._in_flight = points
        self._batch = batch
        self._batch_bytes = size
        self._done = set()

    def _forget_media(self, values: Dict[Any, Any]) -> None:
        """A row leaves the queue: its images and histograms leave ``_media_order`` (the
        oldest entries; lock held)."""
        order = self._media_order
        while order and order[0][0] is values:
            order.popleft()

    def _enter(self, phase: _Phase, cause: Optional[str] = None) -> None:
        """Moves the sender to ``phase`` if it is later than the current one (lock held)."""
        if phase > self._phase:
            self._phase = phase
            if cause is not None:
                self._cause = cause
            self._lock.notify_all()

    def _stopping(self) -> bool:
        """Whether no call may begin (lock held): close() returned, the sender stopped, or
        close()'s deadline is past."""
        return self._phase >= _Phase.ABANDONED or (
            self._phase == _Phase.CLOSING and time.monotonic() >= self._close_deadline
        )

    def _call_client(self, fn: Callable[..., Any], *args: Any, points: int = 0) -> Any:
        """``fn(*args)``, a call to the tracker's client, unless the sender is stopping (then
        ``_Stopped``). While it runs, close() knows the thread is in a call."""
        with self._lock:
            if self._stopping():
                raise _Stopped
            self._in_call = points + 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._in_call = 0

    def _send_loop(self) -> None:
        try:
            self._send()
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - not retried: SystemExit from the client, ...
            with self._lock:
                self._enter(_Phase.DIED, f"the writer's thread stopped: {type(e).__name__}: {e}")
                held = self._queued_points + self._in_flight
            logger.error(
                "%s: the writer's thread stopped on %s: %s; nothing more is sent to %s (%d "
                "points it held and those written from now on are counted at close(), and the "
                "run ends FAILED)",
                self._name,
                type(e).__name__,
                e,
                self._where(),
                held,
            )
        finally:
            self._sender_ended()

    def _send(self) -> None:
        opened = False
        wait = self._BACKOFF[0]
        calls: Deque[_Call] = collections.deque()
        prepared = probed = False
        while True:
            with self._lock:
                if not self._batch:
                    while not self._queue and self._phase == _Phase.SENDING:
                        self._lock.wait()
                    if self._stopping() or not self._queue and (opened or self._phase):
                        return
                    self._take_batch()
                    prepared = probed = False
            try:
                if not opened:
                    self._call_client(self._open)
                    opened = True
                    self._opened.set()
                if not prepared:
                    calls = collections.deque(self._call_client(self._prepare, self._batch))
                    prepared = True
                while calls:
                    call = calls[0]
                    try:
                        if call.failed and call.check is not None:
                            left = self._call_client(call.check, call.parts)
                            kept = {id(p) for p in left}
                            self._settle([p for p in call.parts if id(p) not in kept])
                            call.parts, call.failed, call.points = left, False, _points(left)
                            if not left:
                                calls.popleft()
                                continue
                        self._call_client(call.run, points=call.points)
                    except Exception as e:
                        call.failed = True  # made again only after its check
                        if not probed:  # the first refusal or failure of a batch
                            probed = True
                            cause = self._call_client(self._gone, e)
                            if cause is not None:
                                self._go(cause, e)
                                return
                        if not self._refuses(e):
                            raise
                        calls.popleft()
                        parts = call.split()
                        if parts:
                            calls.extendleft(reversed(parts))
                        else:
                            self._refuse(call.parts, e)
                        continue
                    calls.popleft()
                    self._settle(call.parts, call.points)
            except Exception as e:  # a tracker's error is never a training error
                with self._lock:
                    if self._error is None:
                        logger.warning(
                            "%s: logging to %s failed, retrying with backoff: %s: %s",
                            self._name,
                            self._where(),
                            type(e).__name__,
                            e,
                        )
                    self._error = e
                    if not self._backoff(wait):
                        return  # close()'s deadline is past
                wait = min(wait * 2, self._BACKOFF[1])
                continue
            with self._lock:
                self._sent += self._in_flight  # none left: each call settled its points
                self._in_flight = 0
                self._last_step = max(self._last_step, *(row[0] for row in self._batch))
                self._media_bytes -= self._batch_bytes
                self._batch = []
                self._batch_bytes = 0
                self._done = set()
                if self._error is not None:
                    logger.warning("%s: logging to %s works again", self._name, self._where())
                self._error = None
                wait = self._BACKOFF[0]
                self._lock.notify_all()

    def _prepare(self, batch: List[_Row]) -> List[_Call]:
        """The calls that log a batch: its names claimed, and the points a resumed run
        already has left out (settled: they are in the tracker)."""
        self._claim_names(batch)
        rows: List[_Row] = []
        had: List[_Part] = []
        for it, wall, values in batch:
            if it <= self._skip_through:
                kept = {}
                for key, value in values.items():
                    if self._has(it, key):
                        had.append(((it, key), None))
                    else:
                        kept[key] = value
                values = kept
            rows.append((it, wall, values))
        self._settle(had)
        return self._calls(rows)

    def _settle(self, parts: List[_Part], points: Optional[int] = None) -> None:
        """Parts the tracker has (the sender thread); ``points``: how many are points."""
        if points is None:
            points = _points(parts)
        with self._lock:
            self._done.update(part for part, _ in parts)
            self._sent += points
            self._in_flight -= points

    def _backoff(self, wait: float) -> bool:
        """Waits ``wait`` seconds after a failure (lock held); writes do not cut it short.
        Once close() began, the wait ends at its deadline, and a close() that begins during
        the wait ends it (one more try now). Returns False when no call may begin."""
        closing = self._phase >= _Phase.CLOSING
        end = time.monotonic() + wait
        self._backing_off = True
        try:
            while True:
                now = time.monotonic()
                if self._stopping():
                    return False
                if self._phase >= _Phase.CLOSING and not closing:
                    return True
                if now >= end:
                    return True
                self._lock.wait((min(end, self._close_deadline) if closing else end) - now)
        finally:
            self._backing_off = False

    def _refuse(self, parts: List[_Part], error: BaseException) -> None:
        """Drops parts that the tracker refuses (the sender thread): counted, and named in a
        warning the first time a name is refused."""
        with self._lock:
            for part, _ in parts:
                it = part[0]
                label = _label(part)
                first = label not in self._refused
                self._refused[label] = self._refused.get(label, 0) + 1
                self._done.add(part)
                if it is not None:  # a point (a param is none)
                    self._in_flight -= 1
                    self._refused_points += 1
                if first:
                    logger.warning(
                        "%s: %s refused %s%s, which is dropped (the rest is logged; what it "
                        "refuses of that name again is dropped and counted): %s: %s",
                        self._name,
                        self._where(),
                        label,
                        "" if it is None else f" at iter {it}",
                        type(error).__name__,
                        error,
                    )

    def _go(self, cause: str, error: BaseException) -> None:
        """The tracker no longer takes the run's points (the sender thread): said once;
        nothing more is sent."""
        with self._lock:
            self._enter(_Phase.GONE, f"{self._where()} no longer takes points: {cause}")
            held = self._queued_points + self._in_flight
        logger.warning(
            "%s: %s no longer takes points: %s (%s: %s); the %d points held and those written "
            "from now on are not sent (counted at close())",
            self._name,
            self._where(),
            cause,
            type(error).__name__,
            error,
            held,
        )

    def _claim(
        self,
        space: str,
        names: Iterable[str],
        rule: Callable[[str], str],
        limit: Optional[int] = None,
    ) -> None:
        """Gives each name not seen yet its name in the tracker (the sender thread), within
        ``space`` (a tracker's kind of name: MLflow's metrics, params, image keys and
        histogram paths; W&B's keys): ``rule(name)``, unless another name holds that one.
        Then it is kept apart: ``-`` and the 8 hex digits of its own CRC32 are appended (cut
        to ``limit`` characters as ``_media.valid_name`` cuts a long name; ``.2``, ``.3``
        after them should that be taken too). Names first seen together are claimed in
        order: those the tracker takes as given first, then by sort order. One warning names
        each renamed name (with the name it collides with, if any)."""
        known, claims = self._names[space], self._claims[space]
        new = {n for n in names if n not in known}
        if not new:
            return
        mapped = {n: rule(n) for n in new}
        for name in sorted(new, key=lambda n: (mapped[n] != n, n)):
            out = mapped[name]
            holder = claims.get(out)
            if holder is not None:
                out = self._distinct(space, name, out, limit)
                logger.warning(
                    "%s: '%s' and '%s' are both '%s' in %s (the names it takes): '%s' is "
                    "logged as '%s'",
                    self._name,
                    holder,
                    name,
                    mapped[name],
                    self._where(),
                    name,
                    out,
                )
            elif out != name:
                logger.warning(
                    "%s: '%s' is logged to %s as '%s' (the names it takes)",
                    self._name,
                    name,
                    self._where(),
                    out,
                )
            with self._lock:  # a checkpoint reads them
                known[name] = out
                claims[out] = name

    def _distinct(self, space: str, name: str, out: str, limit: Optional[int]) -> str:
        tag = f"{zlib.crc32(name.encode('utf-8', 'replace')):08x}"
        n = 1
        while True:
            suffix = f"-{tag}" if n == 1 else f"-{tag}.{n}"
            stem = out if limit is None else out[: limit - len(suffix)]
            if stem + suffix not in self._claims[space]:
                return stem + suffix
            n += 1

    def _tracker_name(self, name: str, space: str, rule: Callable[[str], str]) -> str:
        """``name`` as the tracker takes it in ``space`` (claimed by ``_claim_names``)."""
        out = self._names[space].get(name)
        if out is None:
            self._claim(space, (name,), rule)
            out = self._names[space][name]
        return out

    # -- flush, close, resume ----------------------------------------------------------------

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every queued point reached the tracker, at most ``timeout`` seconds
        (``close_timeout`` when None). Returns whether it did."""
        limit = self._close_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._lock.wait(min(left, 0.05))
        return True

    def close(self) -> None:
        """Sends what is queued (waiting at most ``close_timeout`` seconds), ends the run, and
        warns naming what did not reach the tracker (raises it with ``strict=True``). A
        tracker still open at interpreter exit is closed then.

        After it returns no call to the client begins. A call still running then (close()
        timed out, or was interrupted by Ctrl-C, which it raises again) is left to the
        writer's thread, which ends the run when the call returns (FAILED; KILLED after
        Ctrl-C) and says what was logged in all."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._unsubscribe_media()  # nothing waits for a closed writer's reader
        with self._lock:
            self._close_deadline = time.monotonic() + self._close_timeout
            self._enter(_Phase.CLOSING)
            if self._queue and self._active and self._phase == _Phase.CLOSING:
                self._start()  # rows a checkpoint handed over, and no write since
                _OPEN.discard(self)
            thread = self._thread
            self._lock.notify_all()
        interrupted: Optional[BaseException] = None
        try:
            if thread is not None:
                thread.join(self._close_timeout)
        except KeyboardInterrupt as e:  # Ctrl-C: what was sent stays, and is said
            interrupted = e
        with self._lock:
            self._interrupted = interrupted is not None
            self._enter(_Phase.ABANDONED)  # no call begins from now on
            calling = max(self._in_call - 1, 0)
            handoff = thread is not None and not self._sender_done and self._in_call > 0
            self._handoff = handoff  # the thread ends the run when its call returns
        if handoff:
            _HANDED_OFF.add(thread)  # type: ignore[arg-type]  # not None: handoff
            state, error = None, self._error
        else:
            if thread is not None:
                thread.join()  # it makes no other call: it ends now
            state, error = self._end_run()
        lost, total, details = self._counts()
        message = f"{self._name}: {lost} of {total} points were not logged to {self._where()}"
        message += details
        if handoff:
            message += (
                f"; {calling} of them in a call to it still running when close() "
                f"{'was interrupted' if interrupted else 'gave up'}: the writer's thread makes "
                "no other call, and ends the run when that one returns"
            )
        elif state not in (None, "FINISHED"):
            message += f"; the run ends {state}"
        if error is not None:
            message += f"; last error: {type(error).__name__}: {error}"
        if details or lost or handoff or error is not None or state not in (None, "FINISHED"):
            if self._strict and interrupted is None:
                raise RuntimeError(message)
            logger.warning(message)
        if interrupted is not None:
            raise interrupted

    def _counts(self) -> Tuple[int, int, str]:
        """The points written that are not in the tracker, those written in all, and why
        (what was dropped, refused, and why the sender stopped), as close() says them."""
        with self._lock:
            lost = (
                self._queued_points
                + self._in_flight
                + self._dropped
                + self._oversized
                + self._unsendable
                + self._refused_points
            )
            refused = ", ".join(f"{k} ({v})" for k, v in sorted(self._refused.items()))
            why = ", ".join(
                f"{n} {text}"
                for n, text in (
                    (self._dropped, "dropped from a full buffer"),
                    (self._oversized, "larger than max_buffered_bytes"),
                )
                if n
            )
            details = (
                (f" ({why})" if why else "")
                + (f"; refused by the tracker and dropped: {refused}" if refused else "")
                + (f"; {self._cause}" if self._cause else "")
            )
            return lost, lost + self._sent, details

    def _ending(self) -> Optional[str]:
        """The state the run ends in, or None where it is left as the tracker has it (a run
        it no longer takes points for; a tracker that fails, which cannot be told)."""
        with self._lock:
            if self._phase == _Phase.DIED:
                return "FAILED"
            if self._phase == _Phase.GONE or self._error is not None:
                return None
            if self._interrupted:
                return "KILLED"
            if self._queued_points or self._in_flight:
                return "FAILED"  # close() gave up with points unsent
            return "FINISHED"

    def _end_run(self) -> Tuple[Optional[str], Optional[BaseException]]:
        """Ends the run (when the thread made its last call); returns its state and the error
        ending it raised, if any. A writer that never started its thread made no run."""
        if self._thread is None:
            return None, self._error
        state = self._ending()
        if state is None:
            return None, self._error
        try:
            self._finish(state)
        except Exception as e:
            return None, e
        return state, None

    def _sender_ended(self) -> None:
        """The thread's last act: when close() left it in a call, it ends the run now and
        says what reached the tracker in all."""
        with self._lock:
            self._sender_done = True
            handoff = self._handoff
            self._lock.notify_all()
        if not handoff:
            return
        state, error = self._end_run()
        lost, total, details = self._counts()
        logger.warning(
            "%s: the call to %s that close() left running returned: in all, %d of %d points "
            "are not in it%s; %s",
            self._name,
            self._where(),
            lost,
            total,
            details,
            f"the run ends {state}"
            if state is not None
            else "the run is left as the tracker has it"
            + (f" (last error: {type(error).__name__}: {error})" if error else ""),
        )

    def _state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to continue the same run (PeriodicWriter saves it): the
        run id, the last step sent, the points written but not yet in the tracker (at most
        ``max_buffered_bytes`` of images and histograms, as a checkpoint pickles them) and the
        names chosen for names that collide or were renamed.

        A run the tracker has not made yet (its first write is on its way) is waited for at
        most ``_STATE_WAIT`` seconds, once: a checkpoint without the run id resumes into a new
        run, which a warning says."""
        if self._run_id() is None and self._thread is not None and not self._gave_up:
            if not self._opened.wait(self._STATE_WAIT):
                self._gave_up = True
                logger.warning(
                    "%s: %s made no run within %.0f s; this checkpoint has no run id, and a "
                    "run resumed from it logs into a new run",
                    self._name,
                    self._where(),
                    self._STATE_WAIT,
                )
        run_id = self._run_id()
        if not run_id:
            return {}
        with self._lock:
            # Points written but not yet in the tracker: a run killed after this checkpoint
            # would lose them, and the resumed run does not write their iterations again.
            pending = self._unsettled()
            done = self._done
            for it, wall, values in self._batch:
                left = {k: v for k, v in values.items() if (it, k) not in done}
                if left:
                    pending.append((it, wall, left))
            pending += [(it, wall, dict(values)) for it, wall, values in self._queue]
            # list(): the sender adds a kind of name without the lock (one C call: atomic).
            spaces = list(self._names.items())
            names = [[s, n, out] for s, m in spaces for n, out in m.items() if out != n]
        return {
            "run_id": run_id,
            "last_step": self._last_step,
            "pending": self._fit(pending),
            "names": names,
        }

    def _fit(self, pending: List[_Row]) -> List[_Row]:
        """``pending`` with at most ``max_buffered_bytes`` of images and histograms as a
        checkpoint pickles them (``_pickled_bytes``): the newest; the older ones are left out
        of the checkpoint (not of the queue), with a warning that counts them."""
        raw = sum(media_bytes(k, v) for _, _, values in pending for k, v in values.items())
        if 2 * raw <= self._max_bytes:  # a byte pickles as two at most
            return pending
        total = left_out = 0
        fitted: List[_Row] = []
        for it, wall, values in reversed(pending):
            kept = {}
            for key, value in values.items():
                n = _pickled_bytes(key, value)
                if n and total + n > self._max_bytes:
                    left_out += 1
                    continue
                total += n
                kept[key] = value
            if kept:
                fitted.append((it, wall, kept))
        if left_out:
            logger.warning(
                "%s: this checkpoint leaves out %d older images and histograms not yet sent "
                "to %s (it holds at most max_buffered_bytes, %s, of them as it pickles them)",
                self._name,
                left_out,
                self._where(),
                _size(self._max_bytes),
            )
        return fitted[::-1]

    def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        run_id = state.get("run_id")
        if run_id and self._run_id() is None:
            self._adopt_run(str(run_id))
            self._resumed = True
        with self._lock:
            for space, name, out in state.get("names", ()):
                self._names[str(space)][str(name)] = str(out)
                self._claims[str(space)][str(out)] = str(name)
            for it, wall, values in state.get("pending", ()):
                row = (int(it), float(wall), dict(values))
                self._queue.append(row)
                self._queued_points += len(values)
                self._media_bytes += sum(media_bytes(k, v) for k, v in values.items())
                self._media_order.extend((row[2], k) for k in row[2] if isinstance(k, tuple))
            self._bound()

    def _resume_from(self, start_iter: int) -> None:
        """A run starts at ``start_iter``: scalars of earlier iterations (the restored
        history) are not written again."""
        self._last_write = max(self._last_write, start_iter - 1)

    # -- what a tracker implements -------------------------------------------------------

    def _open(self) -> None:
        raise NotImplementedError

    def _calls(self, rows: List[_Row]) -> List[_Call]:
        raise NotImplementedError

    def _claim_names(self, rows: List[_Row]) -> None:
        pass

    def _refuses(self, error: BaseException) -> bool:
        return False

    def _gone(self, error: BaseException) -> Optional[str]:
        """Why the run no longer takes points, when ``error`` shows it (may ask the
        tracker); None otherwise."""
        return None

    def _has(self, it: int, key: Any) -> bool:
        """Whether the run already has the point (asked for steps up to ``_skip_through``)."""
        return True

    def _unsettled(self) -> List[_Row]:
        """Rows the client took that are not final yet (lock held)."""
        return []

    def _finish(self, state: str) -> None:
        pass

    def _where(self) -> str:
        raise NotImplementedError

    @classmethod
    def _import_client(cls, module: str, extra: str) -> Any:
        """The tracker's client module; without it, an ImportError naming the extra that
        installs it (importing hookloop never imports a client)."""
        try:
            return importlib.import_module(module)
        except ImportError as e:
            raise ImportError(
                f'{cls._name} needs the {extra} client: pip install "hookloop[{extra}]"'
            ) from e

    def _run_id(self) -> Optional[str]:
        raise NotImplementedError

    def _adopt_run(self, run_id: str) -> None:
        raise NotImplementedError


class MLflowWriter(TrackerWriter):
    """Writes the smoothed scalars that ``JSONWriter`` writes, at the same iterations, to an
    MLflow run: one ``log_batch`` per pickup of the writer's thread (steps are iterations,
    timestamps the training thread's wall time at ``write()``).

    Resuming: the run id goes into the trainer's checkpoint; a resumed run logs into the same
    run and asks it which points it has (the metrics' steps, the images' and histograms'
    artifacts): MLflow cannot delete a metric point, so the killed run's points after its
    checkpoint stay and are not logged again, and what the checkpoint held that never reached
    MLflow (an image whose upload was cut) is.
    """

    _name = "MLflowWriter"

    def __init__(
        self,
        tracking_uri: Optional[str] = None,
        experiment_name: Optional[str] = None,
        run_name: Optional[str] = None,
        run_id: Optional[str] = None,
        tags: Optional[Mapping[str, Any]] = None,
        window_size: int = 20,
        *,
        artifact_location: Optional[str] = None,
        params: Any = None,
        max_buffered: int = 100_000,
        max_buffered_bytes: int = 64 << 20,
        strict: bool = False,
        close_timeout: float = 30.0,
    ) -> None:
        """
        Args:
            tracking_uri, experiment_name, run_name, run_id, tags: as in ``mlflow`` (the
                tracking URI defaults to ``MLFLOW_TRACKING_URI`` or ``./mlruns``; a given
                ``run_id`` is continued)
            window_size (int): the scalars' smoothing window, as ``JSONWriter``'s
            artifact_location (str): where an experiment this writer creates keeps its
                artifacts (the images and histograms), as ``create_experiment``'s; by default
                MLflow's, which for a database store is ``./mlruns`` in the working directory
            params: a nested config logged once as the run's params (see
                :func:`flatten_config`); more with :meth:`log_params`
            max_buffered (int): points kept while the tracker does not take them
            max_buffered_bytes (int): bytes of images and histograms kept while the tracker
                does not take them (64 MiB); also what a checkpoint holds of them at most
            strict (bool): raise at ``close()`` what was not logged, instead of a warning
            close_timeout (float): seconds ``close()`` waits for the queue to drain
        """
        MlflowClient = self._import_client("mlflow.tracking", "mlflow").MlflowClient
        super().__init__(
            window_size,
            max_buffered=max_buffered,
            max_buffered_bytes=max_buffered_bytes,
            strict=strict,
            close_timeout=close_timeout,
        )
        self._client = MlflowClient(tracking_uri)
        self._tracking_uri = self._client.tracking_uri
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._given_run_id = run_id
        if artifact_location is not None and not isinstance(artifact_location, str):
            raise TypeError(
                "MLflowWriter artifact_location must be a str or None, "
                f"got {type(artifact_location).__name__}"
            )
        self._artifact_location = artifact_location
        self._tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._params: Dict[str, Any] = {}  # not yet handed to the sender thread
        self._mlflow_run_id: Optional[str] = run_id
        # What a resumed run already has (_open asks): metrics and images by (tracker name,
        # step), histograms by (path name, step).
        self._present: Set[Tuple[str, str, int]] = set()
        if params is not None:
            self.log_params(params)

    def log_params(self, params: Any) -> None:
        """Logs a nested config (flattened with dotted keys) as the run's params, once: with
        the run's next batch."""
        flat = flatten_config(params)
        with self._lock:
            self._params.update(flat)

    def _where(self) -> str:
        return f"MLflow at {self._tracking_uri}"

    def _run_id(self) -> Optional[str]:
        return self._mlflow_run_id

    def _adopt_run(self, run_id: str) -> None:
        self._mlflow_run_id = run_id

    def _open(self) -> None:
        from mlflow.entities import RunStatus

        client = self._client
        if self._mlflow_run_id is None:
            experiment_id = "0"
            if self._experiment_name:
                found = client.get_experiment_by_name(self._experiment_name)
                experiment_id = (
                    found.experiment_id
                    if found is not None
                    else client.create_experiment(
                        self._experiment_name, artifact_location=self._artifact_location
                    )
                )
            run = client.create_run(experiment_id, tags=self._tags, run_name=self._run_name)
            self._mlflow_run_id = run.info.run_id
        else:
            run_id = self._mlflow_run_id
            run = client.get_run(run_id)
            if self._resumed:
                self._find_present(run)
            if run.info.status != RunStatus.to_string(RunStatus.RUNNING):
                client.update_run(run_id, status="RUNNING")

    def _find_present(self, run: Any) -> None:
        """What a resumed run has: its metrics' points, images and histograms (a killed run's
        after its checkpoint; a resumed run sends what the checkpoint held that is not
        among them)."""
        run_id = run.info.run_id
        present = set()
        for key in run.data.metrics:
            for point in self._client.get_metric_history(run_id, key):
                present.add(("metric", key, point.step))
        for path in self._artifact_files(run_id, "images"):
            # images/<key, "/" as "~">+step+<step>+timestamp+<ms>+<uuid>.png (log_image's)
            parts = path[len("images/") :].split("+")
            if len(parts) > 2 and parts[1] == "step" and parts[2].isdigit():
                present.add(("image", parts[0], int(parts[2])))
        for path in self._artifact_files(run_id, "histograms"):
            folder, _, file = path[len("histograms/") :].rpartition("/")
            if file.startswith("step_") and file.endswith(".json") and file[5:-5].isdigit():
                present.add(("histogram", folder, int(file[5:-5])))
        self._present = present
        self._skip_through = max((step for _, _, step in present), default=-1)

    def _artifact_files(self, run_id: str, path: str) -> List[str]:
        out = []
        for info in self._client.list_artifacts(run_id, path):
            if info.is_dir:
                out += self._artifact_files(run_id, info.path)
            else:
                out.append(info.path)
        return out

    def _claim_names(self, rows: List[_Row]) -> None:
        """MLflow's four kinds of names, each kept apart within its kind: metrics, image
        keys, histogram paths (params: in ``_calls``)."""
        names: Dict[str, Set[str]] = {"metric": set(), "image": set(), "histogram": set()}
        metrics = self._names["metric"]
        for _, _, values in rows:
            for key in values:
                if isinstance(key, tuple):
                    names[key[0]].add(key[1])
                elif key not in metrics:
                    names["metric"].add(key)
        self._claim("metric", names["metric"], mlflow_name, 250)
        self._claim("image", names["image"], safe_key, 100)
        self._claim("histogram", names["histogram"], safe_key, 100)

    def _name_of(self, key: Any) -> Tuple[str, str]:
        """A point's kind and its name in MLflow (an image key with ``/`` as log_image's file
        names have it, ``~``)."""
        if isinstance(key, tuple):
            kind, name = key
            out = self._tracker_name(name, kind, safe_key)
            return kind, out.replace("/", "~") if kind == "image" else out
        return "metric", self._tracker_name(key, "metric", mlflow_name)

    def _has(self, it: int, key: Any) -> bool:
        return (*self._name_of(key), it) in self._present

    def _calls(self, rows: List[_Row]) -> List[_Call]:
        """The params not logged yet (``log_batch``, 100 a call), the scalars (``log_batch``,
        1000 a call), then one call per image or histogram."""
        from mlflow.entities import Metric, Param

        run_id = self._mlflow_run_id or ""  # _open made it
        client = self._client
        with self._lock:
            params, self._params = self._params, {}
        self._claim("param", params, mlflow_name, 250)
        calls = []
        param_parts: List[_Part] = [
            ((None, k), Param(self._tracker_name(k, "param", mlflow_name), str(v)))
            for k, v in params.items()
        ]
        for at in range(0, len(param_parts), 100):  # log_batch takes 100 params at most
            calls.append(
                _Call(functools.partial(_log_params, client, run_id), param_parts[at : at + 100])
            )
        metrics: List[_Part] = []
        media = []
        image_check = functools.partial(self._unsent_image, run_id)
        known = self._names["metric"]
        for it, wall, values in rows:
            for key, value in values.items():
                if isinstance(key, tuple):  # an image or a histogram
                    part = ((it, key), (key, it, wall, value))
                    # A histogram's path is its own: logged again, it is the same file.
                    check = image_check if key[0] == "image" else None
                    log = functools.partial(self._log_media, run_id)
                    media.append(_Call(log, [part], check=check))
                else:
                    name = known.get(key) or self._tracker_name(key, "metric", mlflow_name)
                    metrics.append(((it, key), Metric(name, value, int(wall * 1000), it)))
        step = self._BATCH_POINTS
        log_metrics = functools.partial(_log_metrics, client, run_id)
        check = functools.partial(self._unsent_metrics, run_id)
        calls += [
            _Call(log_metrics, metrics[at : at + step], check=check)
            for at in range(0, len(metrics), step)
        ]
        return calls + media

    def _unsent_metrics(self, run_id: str, parts: List[_Part]) -> List[_Part]:
        """The metrics of a call that failed that the run does not have: a store may have
        taken some before it failed (the file store writes a batch point by point)."""
        have = set()
        for key in {metric.key for _, metric in parts}:
            for point in self._client.get_metric_history(run_id, key):
                have.add((key, point.step, point.timestamp))
        return [p for p in parts if (p[1].key, p[1].step, p[1].timestamp) not in have]

    def _unsent_image(self, run_id: str, parts: List[_Part]) -> List[_Part]:
        """An image whose ``log_image`` failed, unless its full-size file is in the run (then
        the rest of what log_image does is done here: the compressed copy, the run's tag),
        so that a retry never uploads it twice."""
        ((_, (key, it, wall, item)),) = parts
        _, name = self._name_of(key)
        stem = f"images/{name}+step+{it}+timestamp+{int(wall * 1000)}+"
        files = {info.path for info in self._client.list_artifacts(run_id, "images")}
        full = sorted(p for p in files if p.startswith(stem) and p.endswith(".png"))
        if not full:
            return parts
        compressed = f"{full[0][: -len('.png')]}+compressed.webp"
        if compressed not in files:
            from mlflow.tracking.client import compress_image_size
            from PIL import Image

            small = compress_image_size(Image.fromarray(image_array(item)))
            self._client.log_image(run_id, small, artifact_file=compressed)
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_IMAGES

        self._client.set_tag(run_id, MLFLOW_LOGGED_IMAGES, True)
        return []

    def _refuses(self, error: BaseException) -> bool:
        """MLflow refuses a value or a name (``INVALID_PARAMETER_VALUE``: a param changed on
        a resumed run, a value past a limit, a name on a server with stricter rules; the
        client's own ``ValueError``/``TypeError``); anything else is a failure."""
        from mlflow.exceptions import MlflowException

        if isinstance(error, MlflowException):
            return error.error_code in ("INVALID_PARAMETER_VALUE", "BAD_REQUEST")
        return isinstance(error, (ValueError, TypeError))

    def _gone(self, error: BaseException) -> Optional[str]:
        """MLflow refuses every point of a deleted run (``INVALID_PARAMETER_VALUE``: "must be
        in the 'active' state") and of one that no longer exists: asked once per batch that
        gets a refusal, the run says which."""
        from mlflow.exceptions import MlflowException

        codes = ("INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST")
        if not isinstance(error, MlflowException) or error.error_code not in codes:
            return None
        run_id = self._mlflow_run_id
        try:
            run = self._client.get_run(run_id)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return f"run {run_id} does not exist"
            raise
        if run.info.lifecycle_stage == "deleted":
            return f"run {run_id} is deleted"
        return None

    def _log_media(self, run_id: str, parts: List[Tuple[Any, int, float, Any]]) -> None:
        ((key, it, wall, item),) = parts
        self._log_item(run_id, key, it, wall, item)

    def _log_item(self, run_id: str, key: Tuple[str, str], it: int, wall: float, item: Any) -> None:
        """An image as MLflow's image artifact at its step (``log_image(key=, step=)``, which
        the UI shows over steps); a histogram, which MLflow has no kind of metric for, as a
        JSON artifact ``histograms/<name>/step_<iteration>.json`` of detectron2's fields."""
        kind, name = key
        if kind == "image":
            self._client.log_image(
                run_id,
                image_array(item),
                key=self._tracker_name(name, "image", safe_key),
                step=it,
                timestamp=int(wall * 1000),
                synchronous=True,  # a failure raises here, and the call is retried
            )
        else:
            record = {"name": name, "step": it, **item}
            path = self._tracker_name(name, "histogram", safe_key)
            self._client.log_dict(run_id, record, f"histograms/{path}/step_{it:010d}.json")

    def _finish(self, state: str) -> None:
        if self._mlflow_run_id is not None:
            self._client.set_terminated(self._mlflow_run_id, status=state)


def _log_params(client: Any, run_id: str, params: List[Any]) -> None:
    client.log_batch(run_id, params=params)


def _log_metrics(client: Any, run_id: str, metrics: List[Any]) -> None:
    client.log_batch(run_id, metrics=metrics)
