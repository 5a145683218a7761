"""The storage stack (which :class:`EventStorage` is current) and the writer base: what the
writers in :mod:`hookloop.utils.events` and :mod:`hookloop.utils.trackers` share, in a module
of its own so that neither imports the other."""

from typing import Any, List, Optional

__all__ = [
    "EventWriter",
    "NoEventStorageError",
    "get_event_storage",
    "has_event_storage",
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
    """

    # A writer that takes the storage's images and histograms sets its reader id here
    # (``_core._new_reader_id()``) and reads with ``storage._take_images(reader)``: every such
    # writer gets each one (``PeriodicWriter`` subscribes it before training).
    _media_reader: Optional[int] = None

    def write(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
