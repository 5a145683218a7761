"""The storage stack (which :class:`EventStorage` is current) and the writer base: what the
writers in :mod:`hookloop.utils.events` and :mod:`hookloop.utils.trackers` share, in a module
of its own so that neither imports the other."""

import weakref
from typing import Any, Dict, List, Mapping, Optional

__all__ = [
    "EventWriter",
    "NoEventStorageError",
    "get_event_storage",
    "has_event_storage",
    "writer_protocol",
]

# The EventStorage objects of the open ``with`` blocks, innermost last.
_CURRENT_STORAGE_STACK: List[Any] = []


class NoEventStorageError(RuntimeError, AssertionError):
    """Raised by :func:`get_event_storage` outside any ``with EventStorage(...)`` block.

    Also an ``AssertionError``, which is what detectron2 raises there.
    """


def get_event_storage() -> Any:
    """The :class:`EventStorage` of the innermost ``with EventStorage(...)`` block.

    Raises:
        NoEventStorageError: when no storage is active.
    """
    if not _CURRENT_STORAGE_STACK:
        raise NoEventStorageError(
            "get_event_storage() has to be called inside a 'with EventStorage(...)' context!"
        )
    return _CURRENT_STORAGE_STACK[-1]


def has_event_storage() -> bool:
    """Whether a storage is active (so :func:`get_event_storage` would succeed)."""
    return len(_CURRENT_STORAGE_STACK) > 0


class EventWriter:
    """Base class for writers that obtain events from :class:`EventStorage` and process them.

    Subclass it in Python with ``write()`` and ``close()``; native writers subclass it too.

    Beyond those two, :class:`~hookloop.engine.hooks.PeriodicWriter` calls the optional
    methods below, which do nothing here; a writer overrides the ones it needs. This is the
    whole protocol between hookloop and a writer:

    - ``_bind_trainer(trainer)``: in ``before_train``, the trainer (a weak proxy), for a writer
      that shows the trainer's state (``CommonMetricPrinter``: the epoch).
    - ``_resume_from(start_iter)``: in ``before_train``, the iteration the run starts at; a
      writer drops what an earlier run wrote for later iterations (``JSONWriter``'s lines,
      TensorBoard's purge marker) or does not write them again (the trackers).
    - ``_media_reader``: a writer that takes the storage's images and histograms sets its
      reader id here (``_core._new_reader_id()``) and reads with
      ``storage._take_images(reader)``; every such writer gets each one.
      ``_subscribe_media(storage)`` (in ``before_train``) registers it with the storage, and
      ``_unsubscribe_media()`` (after ``close()``) forgets it, so that nothing waits for a
      closed writer. A writer that reads in ``write()`` without ``PeriodicWriter`` calls
      ``_note_media_storage(storage)`` there, so that its ``close()`` can unsubscribe too.
    - ``_state_dict()`` and ``_load_state_dict(state)``: a state that goes into the trainer's
      checkpoint with ``PeriodicWriter``'s (the trackers' run ids); an empty dict is none.

    ``PeriodicWriter`` also takes an object that is not an EventWriter but has ``write()``
    and ``close()``: it gets the defaults (see :func:`writer_protocol`).
    """

    # The reader id of a writer that takes the storage's images and histograms (see above).
    _media_reader: Optional[int] = None

    def write(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _bind_trainer(self, trainer: Any) -> None:
        pass

    def _resume_from(self, start_iter: int) -> None:
        pass

    def _state_dict(self) -> Dict[str, Any]:
        return {}

    def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def _subscribe_media(self, storage: Any) -> None:
        """Registers ``_media_reader`` (when set) with ``storage``: from now on each image
        and histogram put stays queued until this writer has it too."""
        reader = self._media_reader
        if reader is not None:
            storage._subscribe(reader)
            self._note_media_storage(storage)

    def _note_media_storage(self, storage: Any) -> None:
        """Remembers (weakly) a storage this writer reads images from, for
        ``_unsubscribe_media``."""
        seen = self.__dict__.get("_media_storages")
        if seen is None:
            seen = self.__dict__["_media_storages"] = weakref.WeakSet()
        seen.add(storage)

    def _unsubscribe_media(self) -> None:
        """Forgets ``_media_reader`` in every storage it read from (a closed writer): no
        image waits for it any more. Safe to call more than once."""
        reader = self._media_reader
        seen = self.__dict__.get("_media_storages")
        if reader is None or not seen:
            return
        for storage in list(seen):
            storage._unsubscribe(reader)
        seen.clear()


# What a writer that is not an EventWriter gets for the optional methods: the defaults.
_DEFAULTS = EventWriter()


def writer_protocol(writer: Any) -> EventWriter:
    """``writer`` itself when it is an :class:`EventWriter`, else an EventWriter whose optional
    methods do nothing: the object ``PeriodicWriter`` calls them on, so that a duck-typed
    writer (any object with ``write()`` and ``close()``) works as it does in a hand-written
    loop."""
    return writer if isinstance(writer, EventWriter) else _DEFAULTS
