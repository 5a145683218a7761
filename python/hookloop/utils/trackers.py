"""Writers to experiment trackers: :class:`MLflowWriter` (and the base the Weights & Biases
writer shares). They write what :class:`~hookloop.utils.events.JSONWriter` writes (the same
smoothed scalars, at the same iterations) into the tracker, with the same promises:

- ``write()`` on the training thread takes a snapshot of the new scalars and queues it; a
  thread of the writer's own hands the points to the client. Nothing on the training thread
  waits for the tracker.
- A tracker that fails (unreachable, hanging, an error of its client) is logged once with its
  address and the client's error, retried with backoff, and buffers at most ``max_buffered``
  points (the oldest are dropped, counted). ``close()`` waits at most ``close_timeout``
  seconds and warns naming what was not logged. It is never a training error unless
  ``strict=True``.
- Its state (run id, last step sent) goes into the trainer's checkpoint with
  :class:`~hookloop.engine.hooks.PeriodicWriter`'s, so a resumed run logs into the same run.

The clients are optional: ``pip install "hookloop[mlflow]"``. Importing hookloop never
imports them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

from hookloop import _core
from hookloop.utils import comm
from hookloop.utils._base import EventWriter, get_event_storage
from hookloop.utils._media import image_array, safe_key, take_media

__all__ = ["MLflowWriter", "TrackerWriter", "flatten_config"]

logger = logging.getLogger(__name__)

# One queued write: (iteration, wall time in seconds, {name: smoothed value, and
# (kind, name): a queued image or histogram, see hookloop.utils._media}).
_Row = Tuple[int, float, Dict[Any, Any]]


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


class TrackerWriter(EventWriter):
    """What :class:`MLflowWriter` and ``WandbWriter`` share: the snapshot on the training
    thread, the sender thread, the bounded buffer, the retries and the resume state.

    A subclass implements ``_open()`` (create or resume the run; returns nothing),
    ``_send(rows)`` (log a batch of rows; raises on failure), ``_finish()`` (end the run),
    ``_where()`` (the tracker's address, for messages) and ``_name``.
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
        strict: bool = False,
        close_timeout: float = 30.0,
    ) -> None:
        for arg, value in (("window_size", window_size), ("max_buffered", max_buffered)):
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
        self._strict = strict
        self._close_timeout = float(close_timeout)
        # Only the main process logs, as the other writers are made there only.
        self._active = comm.is_main_process()
        self._lock = threading.Condition()
        self._queue: Deque[_Row] = collections.deque()
        self._queued_points = 0
        self._in_flight = 0  # points the thread holds, being sent
        self._batch: List[_Row] = []  # those points' rows
        self._dropped = 0
        self._sent = 0
        self._error: Optional[BaseException] = None
        self._closing = False
        self._close_deadline = 0.0  # close() waits for the queue until then
        self._closed = False
        self._thread: Optional[threading.Thread] = None
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
        for it, items in media.items():
            rows.setdefault(it, {}).update(items)
        if not rows or not self._active:
            return
        now = time.time()
        with self._lock:
            for it in sorted(rows):
                self._queue.append((it, now, rows[it]))
                self._queued_points += len(rows[it])
            self._bound()
            self._start()
            self._lock.notify()

    def _start(self) -> None:
        """Starts the sender thread, once (lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._send_loop, name=f"hookloop-{self._name}", daemon=True
            )
            self._thread.start()

    def _bound(self) -> None:
        """Drops the oldest queued rows beyond ``max_buffered`` points (lock held)."""
        dropped = 0
        while self._queued_points > self._max_buffered and self._queue:
            _, _, values = self._queue.popleft()
            self._queued_points -= len(values)
            dropped += len(values)
        if dropped:
            self._dropped += dropped
            logger.warning(
                "%s: %s is not taking points; dropped the oldest %d (%d so far, at most %d "
                "are kept)",
                self._name,
                self._where(),
                dropped,
                self._dropped,
                self._max_buffered,
            )

    # -- the sender thread -----------------------------------------------------------------

    def _send_loop(self) -> None:
        opened = False
        wait = self._BACKOFF[0]
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if not self._queue and (opened or self._closing):
                    return
                batch: List[_Row] = []
                points = 0
                while self._queue and (not batch or points < self._BATCH_POINTS):
                    row = self._queue.popleft()
                    batch.append(row)
                    points += len(row[2])
                self._queued_points -= points
                self._in_flight = points
                self._batch = batch
            try:
                if not opened:
                    self._open()
                    opened = True
                    self._opened.set()
                fresh = [row for row in batch if row[0] > self._skip_through]
                if fresh:
                    self._send(fresh)
                    self._last_step = max(self._last_step, fresh[-1][0])
            except Exception as e:  # a tracker's error is never a training error
                with self._lock:
                    self._queue.extendleft(reversed(batch))
                    self._queued_points += points
                    self._in_flight = 0
                    self._batch = []
                    self._bound()
                    if self._error is None:
                        logger.warning(
                            "%s: logging to %s failed, retrying with backoff: %s: %s",
                            self._name,
                            self._where(),
                            type(e).__name__,
                            e,
                        )
                    self._error = e
                    if self._closing:
                        # close() waits up to close_timeout: retry until then.
                        left = self._close_deadline - time.monotonic()
                        if left <= 0:
                            return
                        self._lock.wait(min(wait, left))
                    else:
                        self._lock.wait(wait)
                    wait = min(wait * 2, self._BACKOFF[1])
                continue
            with self._lock:
                self._sent += points
                self._in_flight = 0
                self._batch = []
                if self._error is not None:
                    logger.warning("%s: logging to %s works again", self._name, self._where())
                self._error = None
                wait = self._BACKOFF[0]
                self._lock.notify_all()

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
        warns naming what did not reach the tracker (raises it with ``strict=True``)."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        with self._lock:
            self._close_deadline = time.monotonic() + self._close_timeout
            self._closing = True
            self._lock.notify_all()
        with self._lock:
            if self._queue and self._active:
                self._start()  # rows a checkpoint handed over, and no write since
            thread = self._thread
        if thread is not None:
            thread.join(self._close_timeout)
        with self._lock:
            lost = self._queued_points + self._in_flight + self._dropped
            error = self._error
            alive = thread is not None and thread.is_alive()
        # A run is ended when the thread is done and the tracker answers (points dropped from
        # a full buffer earlier do not keep it open).
        if thread is not None and not alive and error is None:
            try:
                self._finish()
            except Exception as e:
                error = e
        if lost or error is not None:
            message = (
                f"{self._name}: {lost} of {lost + self._sent} points were not logged to "
                f"{self._where()}"
                + (f" ({self._dropped} dropped from a full buffer)" if self._dropped else "")
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
                self._queue.append((int(it), float(wall), dict(values)))
                self._queued_points += len(values)
            self._bound()

    def _resume_from(self, start_iter: int) -> None:
        """A run starts at ``start_iter``: scalars of earlier iterations (the restored
        history) are not written again."""
        self._last_write = max(self._last_write, start_iter - 1)

    # -- what a tracker implements -------------------------------------------------------

    def _open(self) -> None:
        raise NotImplementedError

    def _send(self, rows: List[_Row]) -> None:
        raise NotImplementedError

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
            strict (bool): raise at ``close()`` what was not logged, instead of a warning
            close_timeout (float): seconds ``close()`` waits for the queue to drain
        """
        MlflowClient = self._import_client("mlflow.tracking", "mlflow").MlflowClient
        super().__init__(
            window_size, max_buffered=max_buffered, strict=strict, close_timeout=close_timeout
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
        self._params: Dict[str, Any] = {}
        self._mlflow_run_id: Optional[str] = run_id
        # (first row, metrics sent) of a batch whose send failed part-way.
        self._partial: Optional[Tuple[Any, int]] = None
        if params is not None:
            self.log_params(params)

    def log_params(self, params: Any) -> None:
        """Logs a nested config (flattened with dotted keys) as the run's params, once: with
        the run's first batch."""
        self._params.update(flatten_config(params))

    def _where(self) -> str:
        return f"MLflow at {self._tracking_uri}"

    def _run_id(self) -> Optional[str]:
        return self._mlflow_run_id

    def _adopt_run(self, run_id: str) -> None:
        self._mlflow_run_id = run_id

    def _open(self) -> None:
        from mlflow.entities import Param, RunStatus

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
        if self._params:
            params = [Param(k, str(v)) for k, v in self._params.items()]
            for at in range(0, len(params), 100):  # log_batch takes 100 params at most
                client.log_batch(self._mlflow_run_id, params=params[at : at + 100])

    def _send(self, rows: List[_Row]) -> None:
        from mlflow.entities import Metric

        run_id = self._mlflow_run_id or ""  # _open made it
        client = self._client
        metrics = []
        calls: List[Callable[[], Any]] = []
        for it, wall, values in rows:
            for name, value in values.items():
                if isinstance(name, tuple):  # an image or a histogram
                    calls.append(functools.partial(self._log_media, run_id, name, it, wall, value))
                else:
                    metrics.append(Metric(name, value, int(wall * 1000), it))
        step = self._BATCH_POINTS
        calls[:0] = [
            functools.partial(client.log_batch, run_id, metrics=metrics[at : at + step])
            for at in range(0, len(metrics), step)
        ]
        # After a failure part-way, the same rows come again: the calls that went through
        # are not repeated (MLflow would keep both copies).
        first = rows[0] if rows else None
        start = self._partial[1] if self._partial and self._partial[0] is first else 0
        for done, call in enumerate(calls[start:], start + 1):
            call()
            self._partial = (first, done)
        self._partial = None

    def _log_media(
        self, run_id: str, key: Tuple[str, str], it: int, wall: float, item: Any
    ) -> None:
        """An image as MLflow's image artifact at its step (``log_image(key=, step=)``, which
        the UI shows over steps); a histogram, which MLflow has no kind of metric for, as a
        JSON artifact ``histograms/<name>/step_<iteration>.json`` of detectron2's fields."""
        kind, name = key
        if kind == "image":
            self._client.log_image(
                run_id,
                image_array(item),
                key=safe_key(name),
                step=it,
                timestamp=int(wall * 1000),
                synchronous=True,  # a failure raises here, and the call is retried
            )
        else:
            record = {"name": name, "step": it, **item}
            path = f"histograms/{safe_key(name)}/step_{it:010d}.json"
            self._client.log_dict(run_id, record, path)

    def _finish(self) -> None:
        if self._mlflow_run_id is not None:
            self._client.set_terminated(self._mlflow_run_id)
