"""``Checkpointer`` and ``PeriodicCheckpointer``, with fvcore's API and loading rules.

Differences from ``fvcore.common.checkpoint``, all in what fvcore leaves undefined:

* saves are atomic (a ``kill -9`` at any moment leaves the previous checkpoint and the
  ``last_checkpoint`` pointer to it loadable), and a failed save raises ``OSError`` naming the
  path without moving ``last_checkpoint``;
* ``async_save=True`` serializes on a background thread;
* files load with torch's weights-only unpickler (``weights_only=True``, what ``torch.load``
  does by default since torch 2.6), numpy's scalars, arrays and dtypes of bools and numbers
  admitted too, each checked before numpy sees its bytes: a file cannot run code when it is
  loaded, and one that needs arbitrary unpickling is refused with a ``ValueError`` naming it,
  what it holds and the opt-in (``weights_only=False``, for files you trust);
* bad input raises ``TypeError``/``ValueError``/``OSError`` instead of ``AssertionError``;
* ``PeriodicCheckpointer(max_to_keep=N)`` also deletes older periodic files written before a
  restart.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import operator
import os
import pickle
import re
import threading
from collections import defaultdict
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Tuple,
)

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from hookloop import _core
from hookloop.checkpoint import _numpy_safe
from hookloop.checkpoint._fileio import LocalPathManager, _io_error, atomic_write

__all__ = [
    "Checkpointer",
    "PeriodicCheckpointer",
    "get_missing_parameters_message",
    "get_unexpected_parameters_message",
]

# torch's (major, minor), as fvcore's module defines it.
TORCH_VERSION: Tuple[int, ...] = tuple(int(x) for x in torch.__version__.split(".")[:2])

_LAST_CHECKPOINT = "last_checkpoint"

# errno values that torch's loader reports for a damaged file rather than a failed read.
_NOT_IO_ERRNOS = (errno.EINVAL, None)


class _IncompatibleKeys(
    NamedTuple(
        "IncompatibleKeys",
        [
            ("missing_keys", List[str]),
            ("unexpected_keys", List[str]),
            ("incorrect_shapes", List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]),
        ],
    )
):
    """What :meth:`Checkpointer._load_model` returns: ``torch.nn.Module.load_state_dict``'s
    result plus ``incorrect_shapes``, a list of (key, shape in checkpoint, shape in model)."""


def _check_checkpointable(what: str, obj: Any) -> None:
    for method in ("state_dict", "load_state_dict"):
        if not callable(getattr(obj, method, None)):
            raise TypeError(
                f"{what} must have state_dict() and load_state_dict(); "
                f"{type(obj).__name__} has no {method}()"
            )


class _PendingSave:
    """One save running on a background thread; its error waits for the training thread."""

    def __init__(self, target: Callable[[], None], path: str) -> None:
        self.path = path
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(
            target=self._run, args=(target,), name="hookloop-checkpoint", daemon=False
        )
        self.thread.start()

    def _run(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:  # re-raised on the training thread
            self.error = e
            logging.getLogger(__name__).error(
                f"Background save of {self.path} failed (raised at the next save or wait()): {e!r}"
            )


_DEFAULT_SAVE_OPTIONS: Tuple[bool, Optional[Callable[[], None]]] = (True, None)


class DeferredSaves:
    """Saves begun at one place and finished at another. While :func:`deferring` holds it on a
    :class:`Checkpointer`, each ``save()`` logs its line and takes the model's state and every
    checkpointable's (copied: later code may change the tensors in place), except those that
    ``later(obj)`` picks; :meth:`finish` takes those (a trainer: its hooks' state, the storage,
    the RNG) and writes the files. ``PeriodicCheckpointer`` saves what detectron2 saves at its
    place in the hook order, with the trainer state of the end of the iteration."""

    def __init__(self, later: Callable[[Any], bool]) -> None:
        self.later = later
        self._finishes: List[Callable[[], None]] = []

    def queue(self, finish: Callable[[], None]) -> None:
        self._finishes.append(finish)

    def __len__(self) -> int:
        return len(self._finishes)

    def finish(self) -> None:
        """Writes the saves begun since the last call, in order."""
        finishes, self._finishes = self._finishes, []
        for finish in finishes:
            finish()

    def discard(self) -> int:
        """Drops the saves begun and not finished; returns how many."""
        dropped = len(self._finishes)
        self._finishes = []
        return dropped


@contextlib.contextmanager
def deferring(checkpointer: Any, saves: DeferredSaves) -> Iterator[None]:
    """Within it, ``checkpointer.save()`` begins a save that ``saves.finish()`` completes (see
    :class:`DeferredSaves`). A checkpointer of another class (fvcore's) saves at once."""
    if not isinstance(checkpointer, Checkpointer):
        yield
        return
    previous = checkpointer._deferred
    checkpointer._deferred = saves
    try:
        yield
    finally:
        checkpointer._deferred = previous


# numpy's names for its data, each mapped to hookloop's checking stand-in (see _numpy_safe):
# torch's allowlist holds them while hookloop loads run, and they refuse on other threads.
_SAFE_GLOBALS: List[Any] = list(_numpy_safe.TORCH_GLOBALS)
_SAFE_GLOBALS_LOCK = threading.Lock()


class _SafeGlobalsState:
    """How many hookloop loads run (under ``_SAFE_GLOBALS_LOCK``), and the numpy globals the
    program allowed itself, which are set aside meanwhile: torch's allowlist is one set for
    the process, and with two entries of one name, which one a file gets depends on the
    set's order."""

    loads = 0
    set_aside: List[Any] = []


def _torch_global_name(entry: Any) -> str:
    """The name under which torch's weights-only unpickler allows ``entry``."""
    if isinstance(entry, tuple):
        return entry[1] if len(entry) == 2 and isinstance(entry[1], str) else ""
    return f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}"


@contextlib.contextmanager
def _numpy_allowed() -> Iterator[None]:
    """numpy's data rebuilt, with its checks, by torch's weights-only unpickler on this
    thread; on another thread, a ``torch.load`` meets numpy's names refused."""
    from torch import _weights_only_unpickler

    with _SAFE_GLOBALS_LOCK:
        if _SafeGlobalsState.loads == 0:
            present = torch.serialization.get_safe_globals()
            own = [g for g in present if _torch_global_name(g).startswith("numpy.")]
            _weights_only_unpickler._remove_safe_globals(own)
            _SafeGlobalsState.set_aside = own
            torch.serialization.add_safe_globals(_SAFE_GLOBALS)
        _SafeGlobalsState.loads += 1
    try:
        with _numpy_safe.loading():
            yield
    finally:
        with _SAFE_GLOBALS_LOCK:
            _SafeGlobalsState.loads -= 1
            if _SafeGlobalsState.loads == 0:
                _weights_only_unpickler._remove_safe_globals(_SAFE_GLOBALS)
                torch.serialization.add_safe_globals(_SafeGlobalsState.set_aside)
                _SafeGlobalsState.set_aside = []


class _NotTorchFile(Exception):
    """A ``.pkl`` that is not a file of ``torch.save`` (a model-zoo pickle) failed to load as
    one: ``clause`` says why."""

    def __init__(self, clause: str) -> None:
        super().__init__(clause)
        self.clause = clause


# The start of a file of torch.save: a zip archive, or (the legacy format) a pickled number.
_TORCH_FILE_STARTS = (b"PK\x03\x04", pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2))


def _is_torch_file(f: str) -> bool:
    try:
        with open(f, "rb") as file:
            head = file.read(32)
    except OSError:
        return True
    return head.startswith(_TORCH_FILE_STARTS)


def _torch_load(f: str, weights_only: bool) -> Any:
    """``torch.load`` to the CPU; with ``weights_only``, numpy's scalars, arrays and dtypes
    of bools and numbers rebuilt too, each checked before numpy sees its bytes."""
    cpu = torch.device("cpu")
    if not weights_only:
        return torch.load(f, map_location=cpu, weights_only=False)
    try:
        with _numpy_allowed():
            return _numpy_safe.plain_data(torch.load(f, map_location=cpu, weights_only=True))
    except OSError:
        raise
    except Exception as e:
        if str(f).endswith(".pkl") and not _is_torch_file(f):
            clause = _refusal_clause(e) or f"{type(e).__name__}: {e}"
            raise _NotTorchFile(clause) from e
        refused = _numpy_safe.refusal_in(e)
        if refused is not None and refused is not e:
            # torch's unpickler raised its own error in place of the one naming the type.
            raise _numpy_safe.Refused(refused.clause) from e
        raise


def _refusal_clause(error: BaseException) -> Optional[str]:
    """What a weights-only unpickler refused in the file ("it holds ..."), or None when
    ``error`` is not such a refusal."""
    refused = _numpy_safe.refusal_in(error)
    if refused is not None:
        return refused.clause
    if not isinstance(error, pickle.UnpicklingError) or "weights only" not in str(error).lower():
        return None
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    if found is not None:
        return f"it holds {found.group(1)}, which only arbitrary unpickling can rebuild"
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    detail = next((ln for ln in lines if ln.startswith("Unsupported")), lines[-1])
    return f"it is damaged, or needs arbitrary unpickling ({detail})"


def _weights_only_refusal(path: str, error: BaseException) -> Optional[ValueError]:
    """The error for a file that a weights-only unpickler refused (None for another error):
    it names the file, what was refused (the numpy type, the global), and the opt-in; for a
    ``.pkl`` that is not a file of ``torch.save``, ``DetectionCheckpointer`` instead, which
    loads model-zoo pickles without running their code."""
    if isinstance(error, _NotTorchFile):
        return ValueError(
            f"Cannot load checkpoint {path}: it is a pickle, not a file of torch.save "
            f"({error.clause}). A model-zoo .pkl (detectron2's, Detectron's) loads with "
            "hookloop.checkpoint.DetectionCheckpointer, whose restricted unpickler runs no "
            "code of the file"
        )
    clause = _refusal_clause(error)
    if clause is None:
        return None
    return ValueError(
        f"Cannot load checkpoint {path} with weights_only=True: {clause}. Unpickling can run "
        "any code the file holds: only if you trust the file, load it with weights_only=False "
        "(Checkpointer(..., weights_only=False), or load()/resume_or_load(..., "
        "weights_only=False))"
    )


class Checkpointer:
    """A checkpointer that can save/load model as well as extra checkpointable objects.

    Args:
        model (nn.Module): model. A ``DataParallel``/``DistributedDataParallel`` wrapper is
            unwrapped, so checkpoints never carry its ``module.`` prefix.
        save_dir (str): a directory to save and find checkpoints.
        save_to_disk (bool): if True, save checkpoint to disk, otherwise disable saving for
            this checkpointer.
        async_save (bool): if True, :meth:`save` copies the state to CPU on the calling thread
            and serializes, fsyncs and renames it on a background thread. The next save,
            :meth:`load` and :meth:`wait` wait for it; its error is raised by the next
            :meth:`save` or :meth:`wait`.
        weights_only (bool): how :meth:`load` unpickles (``torch.load``'s argument). True
            (the default): only tensors, numbers, strings, containers and numpy's scalars,
            arrays and dtypes of bools and numbers, so that loading a file cannot run code
            nor make numpy read memory the file chose; every state hookloop and
            detectron2 save is such data. False: any object, which runs whatever code the
            file holds: only for files you trust. :meth:`load` can override it per call.
        checkpointables (object): any checkpointable objects, i.e., objects that have the
            ``state_dict()`` and ``load_state_dict()`` methods. For example, it can be used
            like ``Checkpointer(model, "dir", optimizer=optimizer, trainer=trainer)``.

    Attributes:
        logger (logging.Logger), path_manager (has ``open``, ``exists``, ``isfile``, ``ls``,
        ``mkdirs``, ``rm``, ``get_local_path``; saves to a local path are atomic whatever it
        is, and saves to a URL go through its ``open``),
        save_dir (str), save_to_disk (bool), weights_only (bool), model, checkpointables
        (dict).
    """

    # Class defaults, for subclasses that skip __init__.
    weights_only: bool = True
    # load()'s weights_only while it runs (None: the checkpointer's), read by _load_file().
    _load_weights_only: Optional[bool] = None
    # Where save() queues the rest of each save while a hook defers them (see deferring()).
    _deferred: Optional[DeferredSaves] = None

    def __init__(
        self,
        model: nn.Module,
        save_dir: str = "",
        *,
        save_to_disk: bool = True,
        async_save: bool = False,
        weights_only: bool = True,
        **checkpointables: Any,
    ) -> None:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        _check_checkpointable("Checkpointer model", model)
        if save_dir is None:
            save_dir = ""
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_dir must be a str or path, got {type(save_dir).__name__}")
        self.model = model
        self.checkpointables: Dict[str, Any] = {}
        for key, obj in checkpointables.items():
            self.add_checkpointable(key, obj)
        self.logger: logging.Logger = logging.getLogger(__name__)
        self.save_dir = os.fspath(save_dir)
        self.save_to_disk = save_to_disk
        self.async_save = bool(async_save)
        if not isinstance(weights_only, bool):
            raise TypeError(f"weights_only must be a bool, got {type(weights_only).__name__}")
        self.weights_only = weights_only
        self.path_manager: Any = LocalPathManager()
        self._pending: Optional[_PendingSave] = None
        # What the next save() does besides writing the file; set by _save_with().
        self._save_options: Tuple[bool, Optional[Callable[[], None]]] = _DEFAULT_SAVE_OPTIONS

    def add_checkpointable(self, key: str, checkpointable: Any) -> None:
        """Add a checkpointable object for this checkpointer to track.

        Args:
            key (str): the key used to save the object
            checkpointable: any object with ``state_dict()`` and ``load_state_dict()``
        """
        if not isinstance(key, str):
            raise TypeError(f"checkpointable key must be a str, got {type(key).__name__}")
        if key == "model":
            raise ValueError("'model' is the key of the model's state; pick another key")
        if key in self.checkpointables:
            raise KeyError(f"Key {key} already used in the Checkpointer")
        _check_checkpointable(f"checkpointable {key!r}", checkpointable)
        self.checkpointables[key] = checkpointable

    # ------------------------------------------------------------------------------------------
    # saving

    def save(self, name: str, **kwargs: Any) -> None:
        """Dump model and checkpointables to ``<save_dir>/<name>.pth`` and point
        ``last_checkpoint`` at it.

        Args:
            name (str): name of the file.
            kwargs (dict): extra arbitrary data to save.

        Raises:
            OSError: naming the file, when it cannot be written. No partial file is left and
                ``last_checkpoint`` is not moved.
        """
        tag_last, on_saved = getattr(self, "_save_options", _DEFAULT_SAVE_OPTIONS)
        self._save_options = _DEFAULT_SAVE_OPTIONS  # taken (see _save_with)
        self._save(name, kwargs, tag_last=tag_last, on_saved=on_saved)

    def _save(
        self,
        name: str,
        extra: Dict[str, Any],
        *,
        tag_last: bool = True,
        on_saved: Optional[Callable[[], None]] = None,
    ) -> None:
        """:meth:`save`, optionally without moving ``last_checkpoint``; ``on_saved`` runs once
        the file is on disk (on the background thread with ``async_save``)."""
        if not self.save_dir or not self.save_to_disk:
            return
        if not isinstance(name, str) or not name:
            raise ValueError(f"checkpoint name must be a non-empty str, got {name!r}")
        basename = "{}.pth".format(name)
        if os.path.basename(basename) != basename or name in (".", ".."):
            raise ValueError(f"checkpoint name must be a file name, not a path: {name!r}")
        self.wait()
        deferred = getattr(self, "_deferred", None)
        if deferred is None:
            _flush_writers()
        objects = {"model": self.model, **self.checkpointables}
        later = [k for k, obj in objects.items() if deferred is not None and deferred.later(obj)]
        # Placeholders keep the file's key order whenever the states are taken.
        data: Dict[str, Any] = {
            k: None if k in later else obj.state_dict() for k, obj in objects.items()
        }
        data.update(extra)
        if deferred is not None:
            # The hooks that run before the save is finished may change these tensors in place
            # (an EMA hook swapping its weights in): the file holds them as they are now.
            data = _copy_to_cpu(data)
            for key in later:
                # Taken here too, as detectron2 takes it, so that a state_dict() that raises
                # does so before the log line; the file holds the one taken at the finish.
                objects[key].state_dict()

        save_file = os.path.join(self.save_dir, basename)
        self.logger.info("Saving checkpoint to {}".format(save_file))

        def write() -> None:
            self._write_file(save_file, data)
            if tag_last:
                self.tag_last_checkpoint(basename)
            if on_saved is not None:
                on_saved()

        def finish() -> None:
            if deferred is not None:
                self.wait()
                _flush_writers()
                for key in later:
                    data[key] = objects[key].state_dict()
            if self.async_save:
                # The training thread goes on changing the tensors that state_dict() returned.
                for key in data if deferred is None else later:
                    data[key] = _copy_to_cpu(data[key])
                self._pending = _PendingSave(write, save_file)
            else:
                write()

        if deferred is None:
            finish()
        else:
            deferred.queue(finish)

    def _atomic(self, path: str) -> bool:
        """Whether ``path`` is written atomically: a local path (also with another
        ``path_manager``, such as detectron2's iopath one); a URL goes through
        ``path_manager.open``."""
        return isinstance(self.path_manager, LocalPathManager) or "://" not in path

    def _write_file(self, save_file: str, data: Dict[str, Any]) -> None:
        if self._atomic(save_file):
            atomic_write(save_file, lambda f: torch.save(data, f), what="checkpoint")
        else:
            with self.path_manager.open(save_file, "wb") as f:
                torch.save(data, f)

    def wait(self) -> None:
        """Waits for the save in flight (``async_save``) and raises its error, if any."""
        pending = self._pending
        if pending is None or pending.thread is threading.current_thread():
            return
        pending.thread.join()
        self._pending = None
        if pending.error is not None:
            raise pending.error

    def _join(self) -> None:
        """Waits for the save in flight but leaves its error for the next save or wait."""
        pending = self._pending
        if pending is not None and pending.thread is not threading.current_thread():
            pending.thread.join()

    def tag_last_checkpoint(self, last_filename_basename: str) -> None:
        """Tag the last checkpoint: ``<save_dir>/last_checkpoint`` names it (atomically).

        Args:
            last_filename_basename (str): the basename of the last filename.
        """
        self.wait()
        save_file = os.path.join(self.save_dir, _LAST_CHECKPOINT)
        if self._atomic(save_file):
            data = last_filename_basename.encode("utf-8")
            atomic_write(save_file, lambda f: f.write(data), what="last_checkpoint")
        else:
            with self.path_manager.open(save_file, "w") as f:
                f.write(last_filename_basename)

    # ------------------------------------------------------------------------------------------
    # finding checkpoints

    def has_checkpoint(self) -> bool:
        """Returns:
        bool: whether a checkpoint exists in the target directory.
        """
        save_file = os.path.join(self.save_dir, _LAST_CHECKPOINT)
        return bool(self.path_manager.exists(save_file))

    def get_checkpoint_file(self) -> str:
        """Returns:
        str: The latest checkpoint file in target directory ("" when there is none).
        """
        save_file = os.path.join(self.save_dir, _LAST_CHECKPOINT)
        try:
            with self.path_manager.open(save_file, "r") as f:
                last_saved = f.read().strip()
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{save_file} does not name a checkpoint: it is not text ({e.reason})"
            ) from e
        except OSError:
            # if file doesn't exist, maybe because it has just been deleted by a separate
            # process
            return ""
        if not last_saved:
            return ""
        return os.path.join(self.save_dir, last_saved)

    def get_all_checkpoint_files(self) -> List[str]:
        """Returns:
        list: All available checkpoint files (.pth files) in target directory.
        """
        if not self.path_manager.exists(self.save_dir):
            return []
        return [
            os.path.join(self.save_dir, file)
            for file in sorted(self.path_manager.ls(self.save_dir))
            if self.path_manager.isfile(os.path.join(self.save_dir, file)) and file.endswith(".pth")
        ]

    def resume_or_load(
        self, path: str, *, resume: bool = True, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        """If ``resume`` is True, this method attempts to resume from the last checkpoint, if
        exists. Otherwise, load checkpoint from the given path. This is useful when
        restarting an interrupted training job.

        Args:
            path (str): path to the checkpoint.
            resume (bool): if True, resume from the last checkpoint if it exists and load the
                model together with all the checkpointables. Otherwise only load the model
                without loading any checkpointables.
            weights_only (bool): as in :meth:`load`.

        Returns:
            same as :meth:`load`.
        """
        # Passed on only when given: a subclass's load() may not take it.
        options: Dict[str, Any] = {} if weights_only is None else {"weights_only": weights_only}
        if resume and self.has_checkpoint():
            path = self.get_checkpoint_file()
            return self.load(path, **options)
        return self.load(path, checkpointables=[], **options)

    # ------------------------------------------------------------------------------------------
    # loading

    def load(
        self,
        path: str,
        checkpointables: Optional[List[str]] = None,
        *,
        weights_only: Optional[bool] = None,
    ) -> Dict[str, Any]:
        """Load from the given checkpoint.

        Args:
            path (str): path or url to the checkpoint. If empty, will not load anything.
            checkpointables (list): List of checkpointable names to load. If not specified
                (None), will load all the possible checkpointables. The model is always
                loaded: "model" among the names adds nothing; another name this
                checkpointer does not have is a ``KeyError``.
            weights_only (bool): overrides the checkpointer's ``weights_only`` for this load.
                False unpickles any object and so runs whatever code the file holds: only
                for files you trust.

        Returns:
            dict: extra data loaded from the checkpoint that has not been processed. For
            example, those saved with :meth:`.save(**extra_data)`.

        Raises:
            FileNotFoundError: naming the path, when there is no such file.
            ValueError: naming the path, when the file is not a readable checkpoint, or (with
                ``weights_only``) needs arbitrary unpickling; also naming the entry, when a
                checkpointable's entry is not a state (such as a str for ``optimizer``).
        """
        if weights_only is not None and not isinstance(weights_only, bool):
            raise TypeError(f"weights_only must be a bool, got {type(weights_only).__name__}")
        if not path:
            # no checkpoint provided
            self.logger.info("No checkpoint found. Initializing model from scratch")
            return {}
        path = os.fsdecode(path)
        if checkpointables is not None and (
            isinstance(checkpointables, (str, bytes)) or not hasattr(checkpointables, "__iter__")
        ):
            raise TypeError(
                "load() takes checkpointables as a list of names, got "
                f"{type(checkpointables).__name__} {checkpointables!r}"
            )
        names = list(self.checkpointables) if checkpointables is None else list(checkpointables)
        # The model is always loaded (first): naming it, as fvcore allows, loads nothing more.
        names = [k for k in names if k != "model"]
        unknown = [k for k in names if k not in self.checkpointables]
        if unknown:
            raise KeyError(
                f"load() got checkpointables {unknown} that this Checkpointer does not have "
                f"(it has {sorted(self.checkpointables)})"
            )
        self._join()
        self.logger.info("[Checkpointer] Loading from {} ...".format(path))
        if os.path.isdir(path):
            raise ValueError(f"Cannot load checkpoint {path}: it is a directory, not a file")
        if not os.path.isfile(path):
            local = self.path_manager.get_local_path(path)
            if not os.path.isfile(local):
                raise FileNotFoundError(errno.ENOENT, f"Checkpoint {path} not found", path)
            path = local

        previous = getattr(self, "_load_weights_only", None)
        self._load_weights_only = weights_only
        try:
            checkpoint = self._load_file(path)
        except OSError as e:
            if e.errno in _NOT_IO_ERRNOS:
                # torch's reader of a cut file (its zip directory points past the end) reports
                # EINVAL: the file is damaged, not the disk.
                raise ValueError(
                    f"Cannot load checkpoint {path}: the file is corrupt or not a checkpoint "
                    f"({type(e).__name__}: {e})"
                ) from e
            raise _io_error("Cannot read checkpoint", path, e) from e
        except Exception as e:
            refusal = _weights_only_refusal(path, e)
            if refusal is not None:
                raise refusal from e
            raise ValueError(
                f"Cannot load checkpoint {path}: the file is corrupt or not a checkpoint "
                f"({type(e).__name__}: {e})"
            ) from e
        finally:
            self._load_weights_only = previous
        if not isinstance(checkpoint, dict):
            raise ValueError(
                f"Checkpoint {path} holds a {type(checkpoint).__name__}, not a dict of states"
            )
        if type(self)._load_model is Checkpointer._load_model and "model" not in checkpoint:
            raise ValueError(
                f"Checkpoint {path} has no 'model' entry (it has {sorted(map(str, checkpoint))})"
            )
        if "model" in checkpoint and not isinstance(checkpoint["model"], Mapping):
            raise ValueError(
                f"Checkpoint {path}: its 'model' entry is a {type(checkpoint['model']).__name__}, "
                "not a state dict"
            )

        incompatible = self._load_model(checkpoint)
        if incompatible is not None:  # handle some existing subclasses that return None
            self._log_incompatible_keys(incompatible)

        for key in names:
            if key in checkpoint:
                self.logger.info("Loading {} from {} ...".format(key, path))
                obj = self.checkpointables[key]
                state = checkpoint.pop(key)
                try:
                    result = obj.load_state_dict(state)
                except (AttributeError, TypeError) as e:
                    # torch's optimizer given a str: "'str' object has no attribute 'copy'".
                    raise ValueError(
                        f"Checkpoint {path}: its {key!r} entry ({type(state).__name__}) is not "
                        f"a state that {obj.__class__.__name__}.load_state_dict() takes "
                        f"({type(e).__name__}: {e})"
                    ) from e
                _log_checkpointable_keys(self.logger, key, result)

        # return any further checkpoint data
        return checkpoint

    def _load_file(self, f: str) -> Dict[str, Any]:
        """Load a checkpoint file. Can be overwritten by subclasses to support different
        formats.

        Args:
            f (str): a locally mounted file path.
        Returns:
            dict: with keys "model" and optionally others that are saved by the checkpointer
            dict["model"] must be a dict which maps strings to torch.Tensor or numpy arrays.

        With ``weights_only`` (the checkpointer's, or :meth:`load`'s for this call), torch's
        weights-only unpickler rebuilds only data (numpy's scalars, arrays and dtypes of bools
        and numbers too, checked before numpy sees their bytes): a file that holds anything
        else is refused, and no code of the file runs.
        """
        weights_only = getattr(self, "_load_weights_only", None)
        if weights_only is None:
            weights_only = getattr(self, "weights_only", True)
        return _torch_load(f, weights_only)

    def _load_model(self, checkpoint: Any) -> _IncompatibleKeys:
        """Load weights from a checkpoint.

        Args:
            checkpoint (Any): checkpoint contains the weights.

        Returns:
            ``NamedTuple`` with ``missing_keys``, ``unexpected_keys``, and
            ``incorrect_shapes`` fields:

            * **missing_keys** is a list of str containing the missing keys
            * **unexpected_keys** is a list of str containing the unexpected keys
            * **incorrect_shapes** is a list of (key, shape in checkpoint, shape in model)

            This is just like the return value of :func:`torch.nn.Module.load_state_dict`,
            but with extra support for ``incorrect_shapes``.
        """
        checkpoint_state_dict = checkpoint.pop("model")
        self._convert_ndarray_to_tensor(checkpoint_state_dict)
        model_state_dict = self.model.state_dict()
        _match_module_prefix(checkpoint_state_dict, model_state_dict)

        incorrect_shapes = []
        for k in list(checkpoint_state_dict.keys()):
            if k not in model_state_dict:
                continue
            model_param = model_state_dict[k]
            value = checkpoint_state_dict[k]
            # A lazy module's parameters take their shape from what is loaded.
            if _is_uninitialized(model_param) or _is_uninitialized(value):
                continue
            if not isinstance(model_param, torch.Tensor) or not isinstance(value, torch.Tensor):
                continue
            shape_model = tuple(model_param.shape)
            shape_checkpoint = tuple(value.shape)
            if shape_model != shape_checkpoint:
                incorrect_shapes.append((k, shape_checkpoint, shape_model))
                checkpoint_state_dict.pop(k)
        incompatible = self.model.load_state_dict(checkpoint_state_dict, strict=False)
        return _IncompatibleKeys(
            missing_keys=list(getattr(incompatible, "missing_keys", None) or []),
            unexpected_keys=list(getattr(incompatible, "unexpected_keys", None) or []),
            incorrect_shapes=incorrect_shapes,
        )

    def _log_incompatible_keys(self, incompatible: _IncompatibleKeys) -> None:
        """Log information about the incompatible keys returned by ``_load_model``."""
        # fvcore's levels and wording: one warning per skipped key, then missing, unexpected.
        for k, shape_checkpoint, shape_model in incompatible.incorrect_shapes:
            self.logger.warning(
                "Skip loading parameter '{}' to the model due to incompatible "
                "shapes: {} in the checkpoint but {} in the "
                "model! You might want to double check if this is expected.".format(
                    k, shape_checkpoint, shape_model
                )
            )
        if incompatible.missing_keys:
            missing_keys = _filter_reused_missing_keys(self.model, incompatible.missing_keys)
            if missing_keys:
                self.logger.warning(get_missing_parameters_message(missing_keys))
        if incompatible.unexpected_keys:
            self.logger.warning(get_unexpected_parameters_message(incompatible.unexpected_keys))

    def _convert_ndarray_to_tensor(self, state_dict: Dict[str, Any]) -> None:
        """In-place convert all numpy arrays in the state_dict to torch tensor.

        Args:
            state_dict (dict): a state-dict to be loaded to the model. Will be modified.
        """
        # state_dict may be an OrderedDict with a _metadata attribute (as returned by
        # state_dict()): it is modified in place to keep it.
        for k in list(state_dict.keys()):
            v = state_dict[k]
            if isinstance(v, torch.Tensor):
                continue
            if isinstance(v, (np.ndarray, np.generic)):
                state_dict[k] = torch.as_tensor(np.array(v))
            elif not k.endswith("_extra_state"):  # get_extra_state() may return anything
                raise ValueError("Unsupported type found in checkpoint! {}: {}".format(k, type(v)))


def _flush_writers() -> None:
    """Every metric line and event written so far reaches its file (the page cache) before the
    checkpoint can: a run killed after this checkpoint resumes after its iteration and does not
    write those again. A writer's I/O error is raised here, as its next write would."""
    _core.flush_writers()


def _is_uninitialized(t: Any) -> bool:
    return isinstance(t, (UninitializedParameter, UninitializedBuffer))


def _log_checkpointable_keys(logger: logging.Logger, key: str, result: Any) -> None:
    missing = list(getattr(result, "missing_keys", None) or [])
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    if missing:
        logger.info(f"{key}: " + get_missing_parameters_message(missing))
    if unexpected:
        logger.info(f"{key}: " + get_unexpected_parameters_message(unexpected))


def _strip_prefix_if_present(state_dict: Dict[str, Any], prefix: str) -> None:
    """Strips ``prefix`` from every key, in place, if every non-empty key has it (fvcore's
    rule: the keys then come in sorted order). The ``_metadata`` of a torch state dict is
    renamed too: its keys are module names without the trailing dot, so ``"module"`` (the
    wrapped model) becomes ``""``, replacing the wrapper's own entry."""
    keys = sorted(state_dict.keys())
    if not all(not key or key.startswith(prefix) for key in keys):
        return
    for key in keys:
        state_dict[key[len(prefix) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in list(metadata.keys()):
            if key:  # "" is the wrapper's own entry: "module" replaces it
                metadata[key[len(prefix) :]] = metadata.pop(key)


def _add_prefix(state_dict: Dict[str, Any], prefix: str) -> None:
    """Adds ``prefix`` to every key, in place."""
    items = [(prefix + k, v) for k, v in state_dict.items()]
    state_dict.clear()
    state_dict.update(items)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        renamed = [((prefix + k) if k else prefix[:-1], v) for k, v in metadata.items()]
        metadata.clear()
        metadata.update(renamed)


def _match_module_prefix(checkpoint_sd: Dict[str, Any], model_sd: Dict[str, Any]) -> None:
    """Makes a checkpoint saved with or without a DataParallel/DDP ``module.`` prefix match a
    model with or without it."""
    prefix = "module."
    ckpt_has = bool(checkpoint_sd) and all(k.startswith(prefix) for k in checkpoint_sd)
    model_has = bool(model_sd) and all(k.startswith(prefix) for k in model_sd)
    if ckpt_has and not model_has:
        _strip_prefix_if_present(checkpoint_sd, prefix)
    elif model_has and not any(k.startswith(prefix) for k in checkpoint_sd):
        _add_prefix(checkpoint_sd, prefix)


def _filter_reused_missing_keys(model: nn.Module, keys: List[str]) -> List[str]:
    """Filter "missing keys" to not include keys that have been loaded with another name (a
    parameter or buffer shared by two modules)."""
    keyset = set(keys)
    names_of: Dict[int, set] = defaultdict(set)
    tensors: Dict[int, Any] = {}  # keeps each tensor alive while its id() is a key
    named = list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    )
    for name, t in named:
        tensors[id(t)] = t
        names_of[id(t)].add(name)
    for names in names_of.values():
        # if one name appears missing but its alias exists, then this name is not missing
        if any(n in keyset for n in names) and not all(n in keyset for n in names):
            keyset -= names
    return [k for k in keys if k in keyset]


def _named_modules_with_dup(model: nn.Module, prefix: str = "") -> Iterable[Tuple[str, nn.Module]]:
    """``model.named_modules()``, but a module reachable under several names is yielded under
    each of them (and ``prefix`` starts every name)."""
    yield prefix, model
    for name, child in model._modules.items():
        if child is not None:
            yield from _named_modules_with_dup(child, f"{prefix}.{name}" if prefix else name)


def _group_checkpoint_keys(keys: Iterable[str]) -> Dict[str, List[str]]:
    """Groups keys by module: {"backbone.conv1": ["bias", "weight"], "cls": []}."""
    groups: Dict[str, List[str]] = defaultdict(list)
    for key in keys:
        head, dot, tail = key.rpartition(".")
        if dot:
            groups[head].append(tail)
        else:
            groups[key]
    return groups


def _group_to_str(group: List[str]) -> str:
    if not group:
        return ""
    if len(group) == 1:
        return "." + group[0]
    return ".{" + ", ".join(sorted(group)) + "}"


def get_missing_parameters_message(keys: List[str]) -> str:
    """The log message for parameters of the model that the checkpoint does not have, one
    line per module."""
    groups = _group_checkpoint_keys(keys)
    # fvcore's format: sorted, not indented (unlike the unexpected keys' lines).
    lines = sorted(k + _group_to_str(v) for k, v in groups.items())
    return "Some model parameters or buffers are not found in the checkpoint:\n" + "\n".join(lines)


def get_unexpected_parameters_message(keys: List[str]) -> str:
    """The log message for checkpoint entries that the model does not use, one line per
    module."""
    groups = _group_checkpoint_keys(keys)
    # fvcore's format: indented, in the order the checkpoint holds the modules.
    lines = ["  " + k + _group_to_str(v) for k, v in groups.items()]
    return "The checkpoint state_dict contains keys that are not used by the model:\n" + (
        "\n".join(lines)
    )


def _copy_to_cpu(obj: Any) -> Any:
    """A copy of a state that the training thread can go on changing: tensors copied to the
    CPU, containers rebuilt (an OrderedDict keeps its ``_metadata``), other objects deep-copied.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out: Any = copy.copy(obj)  # same type (OrderedDict, defaultdict) and attributes
        out.clear()
        for k, v in obj.items():
            out[k] = _copy_to_cpu(v)
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_copy_to_cpu(v) for v in obj)
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return obj
    if isinstance(obj, np.ndarray):
        return obj.copy()
    return copy.deepcopy(obj)


# ----------------------------------------------------------------------------------------------


def _save_with(
    checkpointer: Any,
    name: str,
    extra: Dict[str, Any],
    *,
    tag_last: bool = True,
    on_saved: Optional[Callable[[], None]] = None,
) -> bool:
    """``checkpointer.save(name, **extra)``, optionally without moving ``last_checkpoint``,
    and calling ``on_saved`` once the file is on disk. Returns False when a subclass's own
    ``save()`` wrote the file without :meth:`Checkpointer.save` (then ``on_saved`` was not
    called: the caller does not know the file's name).

    It goes through ``save()``, so that a subclass's ``save`` (or a test's mock of it) sees
    every save. A checkpointer of another class (fvcore's) gets the same effect afterwards.
    """
    pointer = os.path.join(checkpointer.save_dir, _LAST_CHECKPOINT)
    before = ""
    if not tag_last and checkpointer.has_checkpoint():
        before = checkpointer.get_checkpoint_file()
    if isinstance(checkpointer, Checkpointer):
        previous = checkpointer._save_options
        options = (tag_last, on_saved)
        checkpointer._save_options = options
        try:
            checkpointer.save(name, **extra)
        finally:
            taken = checkpointer._save_options is not options
            checkpointer._save_options = previous
        if taken:
            return True
        on_saved = None  # the subclass wrote a file of its own naming
    else:
        checkpointer.save(name, **extra)
    if not tag_last:
        if before:
            checkpointer.tag_last_checkpoint(os.path.basename(before))
        elif checkpointer.path_manager.exists(pointer):
            checkpointer.path_manager.rm(pointer)
    if on_saved is None:
        return False
    on_saved()
    return True


def _as_int(what: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


def _saves_to_disk(checkpointer: Any) -> bool:
    return bool(getattr(checkpointer, "save_dir", "")) and bool(
        getattr(checkpointer, "save_to_disk", True)
    )


class PeriodicCheckpointer:
    """Save checkpoints periodically. When ``.step(iteration)`` is called, it will execute
    ``checkpointer.save`` on the given checkpointer, if iteration is a multiple of period or
    if ``max_iter`` is reached.

    Args:
        checkpointer: the checkpointer object used to save checkpoints.
        period (int): the period to save checkpoint.
        max_iter (int): maximum number of iterations. When it is reached, a checkpoint named
            "{file_prefix}_final" will be saved.
        max_to_keep (int): maximum number of most current checkpoints to keep, previous
            checkpoints will be deleted. Periodic files of this prefix left by an earlier run
            in the same directory count as older ones, in both naming styles;
            ``{file_prefix}_final`` and files of other prefixes are never deleted.
        file_prefix (str): the prefix of checkpoint's filename
        max_epoch (int): the number of epochs of the run, for epoch-based training when
            :meth:`step` is not told the epoch: it is then ``iteration // ceil(max_iter /
            max_epoch)`` (iterations split evenly; needs ``max_iter``).

    Periodic files are named ``{file_prefix}_{iteration:07d}`` (detectron2's), or, when an
    epoch is known (given to :meth:`step`, or derived from ``max_epoch``),
    ``{file_prefix}_Epoch_{epoch:05d}_Iter_{iteration:07d}`` as runner-style codebases
    (xmodaler) name them; epochs count from 0, as ``trainer.epoch`` does. The final one is
    ``{file_prefix}_final`` either way.
    """

    def __init__(
        self,
        checkpointer: Any,
        period: int,
        max_iter: Optional[int] = None,
        max_to_keep: Optional[int] = None,
        file_prefix: str = "model",
        max_epoch: Optional[int] = None,
    ) -> None:
        if not callable(getattr(checkpointer, "save", None)):
            raise TypeError(
                f"PeriodicCheckpointer needs a checkpointer with save(), "
                f"got {type(checkpointer).__name__}"
            )
        period = _as_int("PeriodicCheckpointer period", period)
        if period <= 0:
            raise ValueError(f"PeriodicCheckpointer period must be positive, got {period}")
        if max_iter is not None:
            max_iter = _as_int("PeriodicCheckpointer max_iter", max_iter)
        if max_to_keep is not None:
            max_to_keep = _as_int("PeriodicCheckpointer max_to_keep", max_to_keep)
            if max_to_keep <= 0:
                raise ValueError(
                    f"PeriodicCheckpointer max_to_keep must be positive, got {max_to_keep}"
                )
        if max_epoch is not None:
            max_epoch = _as_int("PeriodicCheckpointer max_epoch", max_epoch)
            if max_epoch <= 0:
                raise ValueError(
                    f"PeriodicCheckpointer max_epoch must be positive, got {max_epoch}"
                )
        if not isinstance(file_prefix, str) or not file_prefix:
            raise ValueError(f"file_prefix must be a non-empty str, got {file_prefix!r}")
        if os.path.basename(file_prefix) != file_prefix:
            raise ValueError(f"file_prefix must be a file name, not a path: {file_prefix!r}")
        self.checkpointer = checkpointer
        self.period = period
        self.max_iter = max_iter
        self.max_to_keep = max_to_keep
        # Periodic files this object knows of, oldest first (full paths, as fvcore's).
        self.recent_checkpoints: List[str] = []
        self.path_manager: Any = getattr(checkpointer, "path_manager", None) or LocalPathManager()
        self.file_prefix = file_prefix
        self.max_epoch = max_epoch
        # Both naming styles: a run may switch between them (or a directory hold both).
        self._periodic_name = re.compile(
            re.escape(file_prefix) + r"_(?:\d{7,}|Epoch_\d{5,}_Iter_\d{7,})\.pth"
        )

    def step(self, iteration: int, epoch: Optional[int] = None, **kwargs: Any) -> None:
        """Perform the appropriate action at the given iteration.

        Args:
            iteration (int): the current iteration, ranged in [0, max_iter-1].
            epoch (int): the current epoch (from 0), for epoch-based training: periodic files
                are then named ``{file_prefix}_Epoch_{epoch:05d}_Iter_{iteration:07d}``.
                Without it, it is derived from ``max_epoch`` when that is set. A given epoch
                is also saved with the extra data (as fvcore saves an ``epoch=`` keyword).
            kwargs (Any): extra data to save, same as in :meth:`Checkpointer.save`.
        """
        iteration = _as_int("iteration", iteration)
        if epoch is not None:
            epoch = _as_int("epoch", epoch)
            if epoch < 0:
                raise ValueError(f"PeriodicCheckpointer.step() epoch must be >= 0, got {epoch}")
        additional_state: Dict[str, Any] = {"iteration": iteration}
        if epoch is not None:
            # Saved too, as fvcore saves an `epoch=` keyword with the extra data.
            additional_state["epoch"] = epoch
        additional_state.update(kwargs)

        if (iteration + 1) % self.period == 0:
            self._save_periodic(iteration, additional_state, epoch)

        if self.max_iter is not None and iteration >= self.max_iter - 1:
            self.checkpointer.save(f"{self.file_prefix}_final", **additional_state)

    def save(self, name: str, **kwargs: Any) -> None:
        """Same argument as :meth:`Checkpointer.save`. Use this method to manually save
        checkpoints outside the schedule.

        Args:
            name (str): file name.
            kwargs (Any): extra data to save, same as in :meth:`Checkpointer.save`.
        """
        self.checkpointer.save(name, **kwargs)

    def _epoch_of(self, iteration: int) -> Optional[int]:
        """The epoch of ``iteration`` from ``max_epoch`` (iterations split evenly), or None."""
        if self.max_epoch is None or self.max_iter is None or self.max_iter <= 0:
            return None
        per_epoch = -(-self.max_iter // self.max_epoch)  # ceil
        return min(iteration // per_epoch, self.max_epoch - 1)

    def _name_of(self, iteration: int, epoch: Optional[int] = None) -> str:
        """The name (without ``.pth``) of the periodic checkpoint of ``iteration``:
        ``{file_prefix}_{iteration:07d}``, or with an epoch (given, or derived from
        ``max_epoch``) ``{file_prefix}_Epoch_{epoch:05d}_Iter_{iteration:07d}``."""
        if epoch is None:
            epoch = self._epoch_of(iteration)
        if epoch is None:
            return "{}_{:07d}".format(self.file_prefix, iteration)
        return "{}_Epoch_{:05d}_Iter_{:07d}".format(self.file_prefix, epoch, iteration)

    def _save_periodic(
        self, iteration: int, additional_state: Dict[str, Any], epoch: Optional[int] = None
    ) -> None:
        name = self._name_of(iteration, epoch)
        ckpt = self.checkpointer
        if self.max_to_keep is None or not _saves_to_disk(ckpt):
            ckpt.save(name, **additional_state)
            return
        wait = getattr(ckpt, "wait", None)
        if wait is not None:
            wait()  # the file of an asynchronous save in flight is on disk after this
        path = os.path.join(ckpt.save_dir, name + ".pth")
        before = list(self.recent_checkpoints)
        # In the list before saving, so that the state saved in this very checkpoint (the
        # trainer's, which includes this hook's) lists it.
        if path in self.recent_checkpoints:
            self.recent_checkpoints.remove(path)
        self.recent_checkpoints.append(path)
        doomed = self._select_old_files(path)
        self.recent_checkpoints = [p for p in self.recent_checkpoints if p not in doomed]

        def delete_old() -> None:
            for p in doomed:
                try:
                    self.path_manager.rm(p)
                except OSError as e:
                    logging.getLogger(__name__).warning(f"Cannot delete old checkpoint {p}: {e}")

        try:
            # Old files go once the new one is on disk (after the background write).
            handled = _save_with(ckpt, name, additional_state, on_saved=delete_old)
        except BaseException:
            self.recent_checkpoints = before
            raise
        if not handled:
            # A subclass's save() wrote the file its own way (DINOv2's FSDPCheckpointer names
            # it <name>.rank_<r>.pth): fvcore's bookkeeping, by the file last_checkpoint names.
            self.recent_checkpoints = before + [ckpt.get_checkpoint_file()]
            if len(self.recent_checkpoints) > self.max_to_keep:
                old = self.recent_checkpoints.pop(0)
                if self.path_manager.exists(old) and not old.endswith(
                    f"{self.file_prefix}_final.pth"
                ):
                    self.path_manager.rm(old)

    def _select_old_files(self, new_path: str) -> List[str]:
        """The periodic files to delete so that ``max_to_keep`` remain with ``new_path``."""
        keep = self.max_to_keep or 1
        save_dir = self.checkpointer.save_dir
        try:
            names = self.path_manager.ls(save_dir) if self.path_manager.exists(save_dir) else []
        except OSError:
            names = []
        on_disk = {os.path.join(save_dir, n) for n in names if self._periodic_name.fullmatch(n)}
        listed = [p for p in self.recent_checkpoints if p == new_path or p in on_disk]
        listed_set = set(listed)
        # Files this object does not know of were written before a restart: older than the
        # ones it lists, in the order they were written.
        unlisted = sorted(on_disk - listed_set, key=lambda p: (_mtime_ns(p), p))
        order = unlisted + listed
        self.recent_checkpoints = listed
        if len(order) <= keep:
            return []
        return [p for p in order[:-keep] if p != new_path]

    def state_dict(self) -> Dict[str, Any]:
        """The periodic files this object keeps (basenames, oldest first)."""
        return {"recent_checkpoints": [os.path.basename(p) for p in self.recent_checkpoints]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        recent = (
            state_dict.get("recent_checkpoints", []) if isinstance(state_dict, Mapping) else None
        )
        if not isinstance(recent, list) or not all(isinstance(n, str) for n in recent):
            raise ValueError(
                "PeriodicCheckpointer.load_state_dict() needs {'recent_checkpoints': [str]}"
            )
        save_dir = getattr(self.checkpointer, "save_dir", "")
        self.recent_checkpoints = [os.path.join(save_dir, os.path.basename(n)) for n in recent]


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0
