"""A writer to Weights & Biases: :class:`WandbWriter`. The snapshot on the training thread,
the sender thread, the bounded buffer, the retries and the resume state are those of
:class:`~hookloop.utils.trackers.TrackerWriter`, the base it shares with ``MLflowWriter``.

The client is optional: ``pip install "hookloop[wandb]"``. Importing hookloop never imports it.
"""

from __future__ import annotations

import functools
import logging
import numbers
import os
import secrets
import string
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Union

from hookloop.utils._media import histogram_edges, image_array, rebinned
from hookloop.utils.trackers import TrackerWriter, _Call, _Part, _Row, flatten_config

__all__ = ["WandbWriter"]

logger = logging.getLogger(__name__)

# The modes wandb.init takes (its "dryrun" and "run" are old names of offline and online).
_MODES = ("online", "offline", "disabled", "shared")


def _new_run_id() -> str:
    """A run id as W&B makes them (8 lowercase letters and digits)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _config_value(value: Any) -> Any:
    """A config value as W&B stores it: numbers, strings, None and lists of them as they are,
    anything else as its ``str`` (an object W&B cannot serialize would make every
    ``wandb.init`` fail, and the writer retry it to the end)."""
    if value is None or isinstance(value, (str, numbers.Number)):
        return value
    if isinstance(value, (list, tuple)):
        return [_config_value(v) for v in value]
    return str(value)


def _wandb_name(name: str) -> str:
    """A name as the writer logs it to W&B, which takes any string key but keeps those that
    start with ``_`` for itself (``_step``, ``_timestamp``, ``_runtime``): their leading
    underscores become ``-`` (``_x`` is logged as ``-x``; an empty name as ``-``)."""
    if name and not name.startswith("_"):
        return name
    stripped = name.lstrip("_")
    return "-" * (len(name) - len(stripped) or 1) + stripped


def _wandb_value(key: Any, value: Any) -> Any:
    """A queued value as ``run.log`` takes it: a scalar as it is, an image as ``wandb.Image``,
    a histogram as ``wandb.Histogram`` (merged to W&B's 512 buckets at most, see
    ``_media.rebinned``)."""
    if not isinstance(key, tuple):
        return value
    import numpy as np
    import wandb

    if key[0] == "image":
        return wandb.Image(image_array(value))
    counts, edges = rebinned(*histogram_edges(value), wandb.Histogram.MAX_LENGTH)
    return wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))


class WandbWriter(TrackerWriter):
    """Writes the smoothed scalars that ``JSONWriter`` writes, at the same iterations, to a
    Weights & Biases run: one ``run.log(values, step=iteration, commit=False)`` per iteration
    written, from the writer's own thread. The W&B step is the iteration; the point's
    ``_timestamp`` is the training thread's wall time at ``write()`` (as ``MLflowWriter``'s
    timestamps), not the time the writer's thread got to it.

    W&B takes no step below its current one, and a step once committed takes nothing more.
    The newest step is therefore left open (``commit=False``) until a later one comes (W&B
    then commits it) or the run ends: images and histograms that a hook after
    ``PeriodicWriter`` puts at an iteration already written reach the next write, and go
    into their own step. A row below the open step (put for an earlier iteration by hand) is
    refused, counted and named. A checkpoint holds the open step's rows with those not sent.

    The run is made by ``wandb.init(..., reinit="create_new")`` on the writer's first points,
    and the writer logs to the run object it returned, never to the global ``wandb.run``: several
    writers (several runs) in one process each log to their own run. The default ``mode`` is
    ``"offline"``: the run is written under ``<dir>/wandb/offline-run-*`` and uploaded later
    with ``wandb sync``; ``mode="online"`` logs to the server as training goes.

    Resuming: the run id is chosen when the writer is made (unless ``id`` is given), so every
    checkpoint holds it (with :class:`PeriodicWriter`'s state), even one saved before the run
    was open. A run resumed from it calls ``wandb.init(id=<that id>, resume="allow")``; W&B
    refuses a ``log()`` at a step below the run's current one, so:

    - Online, the client learns the run's step from the server (``run.starting_step``, one
      past the last step the run has) and ignores every lower one, with a warning each
      ("Tried to log to step ... that is less than the current step ..."; checked in-process
      with wandb 0.31.0). The steps that the killed run logged after its checkpoint thus stay
      as it logged them, and the writer does not send them again (the resumed run computes the
      same values): it logs from the run's first step it does not have.
    - Offline, the client knows nothing of earlier runs: ``starting_step`` is 0, and the
      resumed run is a new ``offline-run-*`` folder with the same run id that holds every step
      from the resumed iteration on, those the killed run had logged after its checkpoint
      included (what wandb 0.31.0 writes). What ``wandb sync`` of both folders makes of the
      steps they share is the server's to decide; it is not checked here.
    """

    _name = "WandbWriter"

    def __init__(
        self,
        project: Optional[str] = None,
        entity: Optional[str] = None,
        name: Optional[str] = None,
        id: Optional[str] = None,
        config: Any = None,
        mode: str = "offline",
        dir: Optional[Union[str, "os.PathLike[str]"]] = None,
        window_size: int = 20,
        *,
        max_buffered: int = 100_000,
        max_buffered_bytes: int = 64 << 20,
        strict: bool = False,
        close_timeout: float = 30.0,
    ) -> None:
        """
        Args:
            project, entity, name, id: as in ``wandb.init`` (the project defaults to W&B's
                default project; a given ``id`` is continued, with ``resume="allow"``)
            config: a nested config (a dict, a ``CfgNode``, a dataclass, an OmegaConf object)
                logged once, at the run's start, as the run's config with dotted keys (see
                :func:`~hookloop.utils.trackers.flatten_config`)
            mode (str): ``"offline"`` (the default), ``"online"``, ``"disabled"`` or
                ``"shared"``, as in ``wandb.init``
            dir (str): where W&B writes its ``wandb/`` folder (default: ``WANDB_DIR`` or the
                working directory); made if missing
            window_size (int): the scalars' smoothing window, as ``JSONWriter``'s
            max_buffered (int): points kept while the tracker does not take them
            max_buffered_bytes (int): bytes of images and histograms kept while the tracker
                does not take them (64 MiB); also what a checkpoint holds of them at most
            strict (bool): raise at ``close()`` what was not logged, instead of a warning
            close_timeout (float): seconds ``close()`` waits for the queue to drain
        """
        wandb = self._import_client("wandb", "wandb")
        for arg, value in (("project", project), ("entity", entity), ("name", name), ("id", id)):
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"WandbWriter {arg} must be a str or None, got {type(value).__name__}"
                )
        if dir is not None and not isinstance(dir, (str, os.PathLike)):
            raise TypeError(f"WandbWriter dir must be a path or None, got {type(dir).__name__}")
        if not isinstance(mode, str):
            raise TypeError(f"WandbWriter mode must be a str, got {type(mode).__name__}")
        if mode not in _MODES:
            raise ValueError(f"WandbWriter mode must be one of {_MODES}, got {mode!r}")
        try:
            # W&B's own rules for a project and a run id (reserved characters, empty ids), so
            # that a bad one fails here and not on the writer's thread, retried to the end.
            wandb.Settings(project=project, run_id=id)
        except Exception as e:
            raise ValueError(f"WandbWriter: {e}") from e
        super().__init__(
            window_size,
            max_buffered=max_buffered,
            max_buffered_bytes=max_buffered_bytes,
            strict=strict,
            close_timeout=close_timeout,
        )
        self._wb_project = project
        self._wb_entity = entity
        self._wb_name = name
        self._wb_mode = mode
        self._wb_dir = None if dir is None else os.fspath(dir)
        # What is not a config fails here, not at the run's start on the writer's thread.
        try:
            flat = flatten_config(config)
        except TypeError as e:
            raise TypeError(f"WandbWriter config: {e}") from e
        self._wb_config: Dict[str, Any] = {k: _config_value(v) for k, v in flat.items()}
        # W&B lets the client choose the run id: it is chosen here, not when the writer's
        # thread gets the run open, so that a checkpoint saved before then (or while W&B is
        # unreachable) holds it too, and a run resumed from it continues this run.
        self._wb_given_id = id
        self._wb_id: Optional[str] = id or _new_run_id()
        self._wb_run: Any = None  # the wandb Run that _open made
        self._wb_run_dir: Optional[str] = None
        # The open step (see the class): (step, its wall time, its keys), and its rows.
        self._wb_open: Optional[Tuple[int, float, Set[str]]] = None
        self._wb_open_rows: List[_Row] = []
        self._wb_floor = 0  # the lowest step the run takes (online: one past what it has)

    def _where(self) -> str:
        project = self._wb_project or "(default project)"
        place = self._wb_run_dir or self._wb_dir or os.environ.get("WANDB_DIR") or "."
        return f"W&B project {project} ({self._wb_mode}, {place})"

    def _run_id(self) -> Optional[str]:
        return self._wb_id

    def _adopt_run(self, run_id: str) -> None:
        self._wb_id = run_id

    def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        # The base adopts a checkpoint's run id only when the writer has none; the id chosen
        # at construction is a default that the checkpoint's replaces (an id the user gave, or
        # the one of a run already open, is kept, as the base keeps them).
        if self._wb_given_id is not None or self._wb_run is not None:
            super()._load_state_dict(state)
            return
        chosen = self._wb_id
        self._wb_id = None  # the base adopts the checkpoint's id when _run_id() is None
        try:
            super()._load_state_dict(state)
        finally:
            if self._wb_id is None:
                self._wb_id = chosen

    def _open(self) -> None:
        import wandb

        if self._wb_dir is not None:
            # wandb.init falls back to a temporary directory when dir is missing.
            os.makedirs(self._wb_dir, exist_ok=True)
        run = wandb.init(
            project=self._wb_project,
            entity=self._wb_entity,
            name=self._wb_name,
            id=self._wb_id,
            # A given or checkpointed id continues its run; an unknown one starts it.
            resume="allow",
            config=self._wb_config or None,
            mode=self._wb_mode,  # type: ignore[arg-type]  # checked against _MODES
            dir=self._wb_dir,
            # A run of its own, even when another one (another writer's) is open.
            reinit="create_new",
        )
        self._wb_run = run
        self._wb_run_dir = os.path.dirname(run.dir) if getattr(run, "dir", None) else None
        # Online, a continued run already has the steps below starting_step (a resumed run:
        # the killed run's points after its checkpoint); the client would ignore each of them
        # with a warning. Offline, starting_step is 0.
        starting = int(getattr(run, "starting_step", 0) or 0)
        self._wb_floor = starting
        if starting > 0:
            if not self._resumed:
                logger.warning(
                    "%s: W&B run %s already has steps below %d; they are not logged again",
                    self._name,
                    self._wb_id,
                    starting,
                )
            self._skip_through = max(self._skip_through, starting - 1)

    def _claim_names(self, rows: List[_Row]) -> None:
        """W&B has one kind of key: two names written that map to one (``_x`` and ``-x``)
        are kept apart (an image or a histogram named as a scalar shares the scalar's key,
        and ``_calls`` separates them within a step)."""
        names = {key[1] if isinstance(key, tuple) else key for _, _, v in rows for key in v}
        self._claim("key", names, _wandb_name)

    def _calls(self, rows: List[_Row]) -> List[_Call]:
        """One ``run.log(commit=False)`` per row, into its step (see the class). W&B has one
        value per key and step: a histogram whose name an image or a scalar of the same step
        has is logged as ``<name>/histogram`` (an image, as ``<name>/image``, beside a
        scalar). A row W&B refuses is logged again in halves, then one value at a time, so
        that only the value it refuses is dropped."""
        step, wall0, taken = self._wb_open if self._wb_open is not None else (None, 0.0, set())
        taken = set(taken)
        calls = []
        for it, wall, values in rows:
            if not values:
                continue  # its images went past max_buffered_bytes, or the run had them
            floor = step if step is not None else self._wb_floor
            if it < floor:
                error = ValueError(f"W&B takes no step below its current one ({floor})")
                self._refuse([((it, key), None) for key in values], error)
                continue
            if it != step:
                step, wall0, taken = it, wall, set()
            parts: List[_Part] = []
            for kind in (None, "image", "histogram"):
                for key, value in values.items():
                    if (key[0] if isinstance(key, tuple) else None) != kind:
                        continue
                    written = key[1] if isinstance(key, tuple) else key
                    name = self._tracker_name(written, "key", _wandb_name)
                    if name in taken and kind is not None:
                        name = f"{name}/{kind}"
                    taken.add(name)
                    parts.append(((it, key), (name, key, value)))
            calls.append(_Call(functools.partial(self._log, it, wall0), parts))
        return calls

    def _log(self, it: int, wall: float, parts: List[Any]) -> None:
        """Values into step ``it``, left open; ``_timestamp`` is its first row's wall time
        (a commit without it would take the commit's time)."""
        values = {name: _wandb_value(key, value) for name, key, value in parts}
        self._wb_run.log({**values, "_timestamp": wall}, step=it, commit=False)
        with self._lock:  # a checkpoint reads the open step's rows
            if self._wb_open is None or self._wb_open[0] != it:
                self._wb_open = (it, wall, set())
                self._wb_open_rows = []
            self._wb_open[2].update(values)
            self._wb_open_rows.append((it, wall, {key: value for _, key, value in parts}))

    def _unsettled(self) -> List[_Row]:
        return [(it, wall, dict(values)) for it, wall, values in self._wb_open_rows]

    def _refuses(self, error: BaseException) -> bool:
        """W&B refuses a value it cannot convert (``ValueError``, ``TypeError``); anything else
        (``wandb.Error``, an ``OSError``) is a failure."""
        return isinstance(error, (ValueError, TypeError))

    def _finish(self, state: str) -> None:
        """Commits the open step, then ends the run (exit code 1 unless FINISHED: W&B shows
        it failed)."""
        run = self._wb_run
        if run is None:
            return
        if self._wb_open is not None:
            it, wall, _ = self._wb_open
            run.log({"_timestamp": wall}, step=it, commit=True)
            with self._lock:
                self._wb_open = None
                self._wb_open_rows = []
        run.finish(exit_code=0 if state == "FINISHED" else 1)
