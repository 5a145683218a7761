"""Writers to experiment trackers: :class:`MLflowWriter` (and the base the Weights & Biases
writer shares). They write what :class:`~hookloop.utils.events.JSONWriter` writes (the same
smoothed scalars, at the same iterations) into the tracker, with the same promises:

- ``write()`` on the training thread takes a snapshot of the new scalars and queues it; a
  thread of the writer's own hands the points to the client. Nothing on the training thread
  waits for the tracker.
- A tracker that fails (unreachable, hanging, an error of its client) is logged once with its
  address and the client's error, retried with backoff (from the call that failed: every
  point goes in once), and buffers at most ``max_buffered`` points and
  ``max_buffered_bytes`` of images and histograms (the oldest are dropped, counted).
  ``close()`` waits at most ``close_timeout`` seconds and warns naming what was not logged;
  a tracker still open at interpreter exit is closed then. It is never a training error
  unless ``strict=True``.
- Names are mapped to those the tracker takes (a warning once per renamed name); what it
  still refuses is dropped alone, counted and named, and the rest is logged.
- Its state (run id, last step sent) goes into the trainer's checkpoint with
  :class:`~hookloop.engine.hooks.PeriodicWriter`'s, so a resumed run logs into the same run.

The clients are optional: ``pip install "hookloop[mlflow]"``. Importing hookloop never
imports them.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import importlib
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

from hookloop import _core
from hookloop.utils import comm
from hookloop.utils._base import EventWriter, get_event_storage
from hookloop.utils._media import image_array, media_bytes, mlflow_name, safe_key, take_media

__all__ = ["MLflowWriter", "TrackerWriter", "flatten_config"]

logger = logging.getLogger(__name__)

# One queued write: (iteration, wall time in seconds, {name: smoothed value, and
# (kind, name): a queued image or histogram, see hookloop.utils._media}).
_Row = Tuple[int, float, Dict[Any, Any]]
# One point of a client call: ((iteration or None for a param, name as written), payload).
_Part = Tuple[Tuple[Optional[int], str], Any]


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
    Each part is ``((iteration, name), payload)``; the label names the point in messages.
    A call the tracker refuses is split (``split``: by default into halves) until the part it
    refuses stands alone, and that part is dropped."""

    __slots__ = ("fn", "parts", "split_fn")

    def __init__(
        self,
        fn: Callable[[List[Any]], Any],
        parts: List[_Part],
        split_fn: Optional[Callable[["_Call"], List["_Call"]]] = None,
    ) -> None:
        self.fn = fn
        self.parts = parts
        self.split_fn = split_fn

    def run(self) -> None:
        self.fn([payload for _, payload in self.parts])

    def split(self) -> List["_Call"]:
        if self.split_fn is not None:
            return self.split_fn(self)
        if len(self.parts) < 2:
            return []
        half = len(self.parts) // 2
        return [_Call(self.fn, self.parts[:half]), _Call(self.fn, self.parts[half:])]


# The trackers still open (a sender thread started, close() not called): closed at exit.
_OPEN: "weakref.WeakSet[TrackerWriter]" = weakref.WeakSet()


def _close_at_exit() -> None:
    """Interpreter exit closes the trackers the program did not close: each sends what it can
    within its ``close_timeout`` and warns naming what was not logged, as ``close()`` does.
    It runs before ``atexit`` handlers (the clients' own, W&B's among them, which would end
    the runs first), as ``concurrent.futures`` shuts its workers down."""
    for writer in list(_OPEN):
        try:
            writer.close()
        except Exception as e:  # strict=True: what was not logged, said at exit
            logger.error("%s", e)


def _forget_open_in_child() -> None:
    """A forked child (a DataLoader worker, a ``multiprocessing`` process) does not own its
    parent's trackers: their threads are not in it, and its exit (``multiprocessing`` runs
    ``threading``'s exit hook there too) must not send their queues again or end their runs."""
    _OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_open_in_child)

_register_exit = getattr(threading, "_register_atexit", None)
if _register_exit is not None:
    _register_exit(_close_at_exit)
else:  # pragma: no cover - Python without threading's exit hook
    atexit.register(_close_at_exit)


class TrackerWriter(EventWriter):
    """What :class:`MLflowWriter` and ``WandbWriter`` share: the snapshot on the training
    thread, the sender thread, the bounded buffer, the retries and the resume state.

    A subclass implements ``_open()`` (create or resume the run; returns nothing),
    ``_calls(rows)`` (the client calls that log a batch of rows, see ``_Call``),
    ``_refuses(error)`` (whether a call's error is the tracker refusing what the call holds,
    rather than failing), ``_valid_name(name)`` (its name rule), ``_finish()`` (end the run),
    ``_where()`` (the tracker's address, for messages) and ``_name``.

    The sender takes a batch from the queue and works through its calls: a call that fails
    is retried, with backoff, from that call on (the calls before it went through, and rows
    written meanwhile wait in the queue for the next batch), so every point reaches the
    tracker once. A call the tracker refuses is split until the part it refuses stands alone;
    that part is dropped, counted and named, and the rest goes on.
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
        self._in_flight = 0  # points the thread holds, being sent
        self._batch: List[_Row] = []  # those points' rows
        self._batch_bytes = 0  # their media bytes
        self._dropped = 0
        self._sent = 0
        self._refused: Dict[str, int] = {}  # what the tracker refused, by name
        self._refused_points = 0
        self._error: Optional[BaseException] = None
        self._backing_off = False  # the thread waits out a backoff: a write does not wake it
        self._closing = False
        self._close_deadline = 0.0  # close() waits for the queue until then
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        # Names as the tracker takes them (the sender thread's), for the names seen.
        self._names: Dict[Any, str] = {}
        # Steps at or below this one are already in the run (a resumed run's replay).
        self._skip_through = -1
        self._last_step = -1  # the highest step the client accepted
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
        # (as TensorboardXWriter converts them), sent by the sender thread.
        media, failed = take_media(storage, self._media_reader)
        if failed:
            logger.warning(
                "%s skipped %d images that could not be converted: %s",
                self._name,
                len(failed),
                "; ".join(failed),
            )
        size = 0
        for it, items in media.items():
            rows.setdefault(it, {}).update(items)
            size += sum(media_bytes(k, v) for k, v in items.items())
        if not rows or not self._active:
            return
        now = time.time()
        with self._lock:
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
                "%s: %s is not taking points; dropped the oldest %d%s (%d so far; at most %d "
                "points and %d MiB of images and histograms are kept)",
                self._name,
                self._where(),
                dropped + media,
                f" ({media} images and histograms)" if media else "",
                self._dropped,
                self._max_buffered,
                self._max_bytes >> 20,
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

    def _forget_media(self, values: Dict[Any, Any]) -> None:
        """A row leaves the queue: its images and histograms leave ``_media_order`` (the
        oldest entries; lock held)."""
        order = self._media_order
        while order and order[0][0] is values:
            order.popleft()

    def _send_loop(self) -> None:
        opened = False
        wait = self._BACKOFF[0]
        calls: Deque[_Call] = collections.deque()
        prepared = False
        last = -1
        while True:
            with self._lock:
                if not self._batch:
                    while not self._queue and not self._closing:
                        self._lock.wait()
                    if not self._queue and (opened or self._closing):
                        return
                    self._take_batch()
                    prepared = False
                batch = self._batch
            try:
                if not opened:
                    self._open()
                    opened = True
                    self._opened.set()
                if not prepared:
                    fresh = [row for row in batch if row[0] > self._skip_through]
                    calls = collections.deque(self._calls(fresh))
                    last = fresh[-1][0] if fresh else -1
                    prepared = True
                # A call that fails raises out of here and is retried; those before it are
                # done (popped), so nothing goes in twice.
                while calls:
                    call = calls[0]
                    try:
                        call.run()
                    except Exception as e:
                        if not self._refuses(e):
                            raise
                        calls.popleft()
                        parts = call.split()
                        if parts:
                            calls.extendleft(reversed(parts))
                        else:
                            self._refuse(call, e)
                        continue
                    calls.popleft()
                self._last_step = max(self._last_step, last)
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
                        return  # close()'s timeout is over
                wait = min(wait * 2, self._BACKOFF[1])
                continue
            with self._lock:
                self._sent += self._in_flight
                self._in_flight = 0
                self._media_bytes -= self._batch_bytes
                self._batch = []
                self._batch_bytes = 0
                if self._error is not None:
                    logger.warning("%s: logging to %s works again", self._name, self._where())
                self._error = None
                wait = self._BACKOFF[0]
                self._lock.notify_all()

    def _backoff(self, wait: float) -> bool:
        """Waits ``wait`` seconds after a failure (lock held); writes do not cut it short.
        Once close() began, the wait ends at its deadline, and a close() that begins during
        the wait ends it (one more try now). Returns False when the deadline is past."""
        closing = self._closing
        end = time.monotonic() + wait
        self._backing_off = True
        try:
            while True:
                now = time.monotonic()
                if closing and now >= self._close_deadline:
                    return False
                if self._closing and not closing:
                    return True
                if now >= end:
                    return True
                self._lock.wait((min(end, self._close_deadline) if closing else end) - now)
        finally:
            self._backing_off = False

    def _refuse(self, call: _Call, error: BaseException) -> None:
        """Drops a call's part that the tracker refuses (the sender thread): counted, and
        named in a warning the first time its name is refused."""
        with self._lock:
            for (it, name), _ in call.parts:
                label = f"param '{name}'" if it is None else f"'{name}'"
                first = label not in self._refused
                self._refused[label] = self._refused.get(label, 0) + 1
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

    def _tracker_name(self, name: str, rule: Optional[Callable[[str], str]] = None) -> str:
        """``name`` as the tracker takes it (by ``rule``, by default ``_valid_name``), with a
        warning the first time a name is renamed (the sender thread)."""
        key = name if rule is None else (rule, name)
        out = self._names.get(key)
        if out is None:
            out = self._names[key] = (rule or self._valid_name)(name)
            if out != name:
                logger.warning(
                    "%s: '%s' is logged to %s as '%s' (the names it takes)",
                    self._name,
                    name,
                    self._where(),
                    out,
                )
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
        tracker still open at interpreter exit is closed then."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._unsubscribe_media()  # nothing waits for a closed writer's reader
        with self._lock:
            self._close_deadline = time.monotonic() + self._close_timeout
            self._closing = True
            if self._queue and self._active:
                self._start()  # rows a checkpoint handed over, and no write since
                _OPEN.discard(self)
            thread = self._thread
            self._lock.notify_all()
        if thread is not None:
            thread.join(self._close_timeout)
        with self._lock:
            lost = self._queued_points + self._in_flight + self._dropped
            error = self._error
            alive = thread is not None and thread.is_alive()
            refused = dict(self._refused)
            lost += self._refused_points
        # A run is ended when the thread is done and the tracker answers (points dropped from
        # a full buffer earlier, or refused, do not keep it open).
        if thread is not None and not alive and error is None:
            try:
                self._finish()
            except Exception as e:
                error = e
        n_refused = sum(refused.values())
        if lost or n_refused or error is not None:
            names = ", ".join(f"{k} ({v})" for k, v in sorted(refused.items()))
            message = (
                f"{self._name}: {lost} of {lost + self._sent} points were not logged to "
                f"{self._where()}"
                + (f" ({self._dropped} dropped from a full buffer)" if self._dropped else "")
                + (f"; refused by the tracker and dropped: {names}" if n_refused else "")
                + (f"; last error: {type(error).__name__}: {error}" if error else "")
            )
            if self._strict:
                raise RuntimeError(message)
            logger.warning(message)

    def _state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to continue the same run (PeriodicWriter saves it).

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
            # Rows written but not yet in the tracker: a run killed after this checkpoint
            # would lose them, and the resumed run does not write their iterations again.
            pending = [(it, wall, dict(values)) for it, wall, values in self._batch]
            pending += [(it, wall, dict(values)) for it, wall, values in self._queue]
        return {"run_id": run_id, "last_step": self._last_step, "pending": pending}

    def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        run_id = state.get("run_id")
        if run_id and self._run_id() is None:
            self._adopt_run(str(run_id))
            self._resumed = True
        with self._lock:
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

    def _refuses(self, error: BaseException) -> bool:
        return False

    def _valid_name(self, name: str) -> str:
        return name

    def _finish(self) -> None:
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
    run and skips the steps the run already has (MLflow cannot delete a metric point: the
    killed run's points after its checkpoint stay, and the resumed run, which computes the
    same values, does not log them again).
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
                # The steps the run already has: a killed run's points after its checkpoint.
                for key in run.data.metrics:
                    for point in client.get_metric_history(run_id, key):
                        self._skip_through = max(self._skip_through, point.step)
            if run.info.status != RunStatus.to_string(RunStatus.RUNNING):
                client.update_run(run_id, status="RUNNING")

    def _calls(self, rows: List[_Row]) -> List[_Call]:
        """The params not logged yet (``log_batch``, 100 a call), the scalars (``log_batch``,
        1000 a call), then one call per image or histogram."""
        from mlflow.entities import Metric, Param

        run_id = self._mlflow_run_id or ""  # _open made it
        client = self._client
        with self._lock:
            params, self._params = self._params, {}
        calls = []
        param_parts: List[_Part] = [
            ((None, k), Param(self._tracker_name(k), str(v))) for k, v in params.items()
        ]
        for at in range(0, len(param_parts), 100):  # log_batch takes 100 params at most
            calls.append(
                _Call(functools.partial(_log_params, client, run_id), param_parts[at : at + 100])
            )
        metrics: List[_Part] = []
        media = []
        for it, wall, values in rows:
            for name, value in values.items():
                if isinstance(name, tuple):  # an image or a histogram
                    part = ((it, name[1]), (name, it, wall, value))
                    media.append(_Call(functools.partial(self._log_media, run_id), [part]))
                else:
                    metric = Metric(self._tracker_name(name), value, int(wall * 1000), it)
                    metrics.append(((it, name), metric))
        step = self._BATCH_POINTS
        log_metrics = functools.partial(_log_metrics, client, run_id)
        calls += [
            _Call(log_metrics, metrics[at : at + step]) for at in range(0, len(metrics), step)
        ]
        return calls + media

    def _refuses(self, error: BaseException) -> bool:
        """MLflow refuses a value or a name (``INVALID_PARAMETER_VALUE``: a param changed on
        a resumed run, a value past a limit, a name on a server with stricter rules; the
        client's own ``ValueError``/``TypeError``); anything else is a failure."""
        from mlflow.exceptions import MlflowException

        if isinstance(error, MlflowException):
            return error.error_code in ("INVALID_PARAMETER_VALUE", "BAD_REQUEST")
        return isinstance(error, (ValueError, TypeError))

    def _valid_name(self, name: str) -> str:
        return mlflow_name(name)

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
                key=self._tracker_name(name, safe_key),
                step=it,
                timestamp=int(wall * 1000),
                synchronous=True,  # a failure raises here, and the call is retried
            )
        else:
            record = {"name": name, "step": it, **item}
            path = f"histograms/{self._tracker_name(name, safe_key)}/step_{it:010d}.json"
            self._client.log_dict(run_id, record, path)

    def _finish(self) -> None:
        if self._mlflow_run_id is not None:
            self._client.set_terminated(self._mlflow_run_id)


def _log_params(client: Any, run_id: str, params: List[Any]) -> None:
    client.log_batch(run_id, params=params)


def _log_metrics(client: Any, run_id: str, metrics: List[Any]) -> None:
    client.log_batch(run_id, metrics=metrics)
