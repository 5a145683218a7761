"""Metric storage and writers, mirroring ``detectron2.utils.events``.

The state of :class:`EventStorage` and :class:`HistoryBuffer` lives in Rust (``hookloop._core``);
this module adds what needs Python: the context-manager stack behind
:func:`get_event_storage`, ``name_scope``, and turning image/histogram tensors into data.
torch is imported only when an image or histogram is put.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, List

from hookloop import _core

__all__ = [
    "get_event_storage",
    "has_event_storage",
    "EventStorage",
    "HistoryBuffer",
    "EventWriter",
]

logger = logging.getLogger(__name__)

HistoryBuffer = _core.HistoryBuffer

_CURRENT_STORAGE_STACK: List["EventStorage"] = []


class NoEventStorageError(RuntimeError, AssertionError):
    """Raised by :func:`get_event_storage` outside any ``with EventStorage(...)`` block.

    Also an ``AssertionError``, which is what detectron2 raises there.
    """


def get_event_storage() -> "EventStorage":
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


class EventStorage(_core.EventStorage):
    """The user-facing class that stores metrics during training.

    Use it as a context manager: ``with EventStorage(start_iter) as storage: ...``; code inside
    reaches it with :func:`get_event_storage`. Scalars (``put_scalar``/``put_scalars``), their
    histories and smoothing live in Rust and are safe to put from several threads. Images and
    histograms wait for a TensorBoard writer, at most ``max_images``/``max_histograms`` of them
    (older ones are dropped first, with one warning in the log).

    Args:
        start_iter (int): the iteration number to start with.
        max_length (int): entries kept per scalar history (fvcore's default, 1e6).
        max_images (int): images held until a writer takes them.
        max_histograms (int): histograms held until a writer takes them.
    """

    def __enter__(self) -> "EventStorage":
        _CURRENT_STORAGE_STACK.append(self)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if not _CURRENT_STORAGE_STACK or _CURRENT_STORAGE_STACK[-1] is not self:
            raise RuntimeError("EventStorage contexts must be exited in the order entered")
        _CURRENT_STORAGE_STACK.pop()

    @contextmanager
    def name_scope(self, name: str) -> Iterator[None]:
        """Scalars put inside this context get the prefix ``name + "/"``."""
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
        _check_chw(img_name, img_tensor)
        if self._put_image(img_name, img_tensor):
            logger.warning(
                "EventStorage holds more than %d images that no writer took; dropping the "
                "oldest. Add a TensorboardXWriter or stop calling put_image.",
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
        if isinstance(bins, bool) or not isinstance(bins, int) or bins <= 0:
            raise ValueError(f"put_histogram('{hist_name}') bins must be a positive int, got {bins!r}")
        if hist_tensor.numel() == 0:
            raise ValueError(f"put_histogram('{hist_name}') got an empty tensor")
        t = hist_tensor.detach().float()
        ht_min, ht_max = t.min().item(), t.max().item()
        hist_counts = torch.histc(t, bins=bins)
        hist_edges = torch.linspace(start=ht_min, end=ht_max, steps=bins + 1, dtype=torch.float32)
        dropped = self._put_histogram(
            hist_name,
            ht_min,
            ht_max,
            float(t.numel()),
            float(t.sum()),
            float(torch.sum(t**2)),
            hist_edges[1:].tolist(),
            hist_counts.tolist(),
        )
        if dropped:
            logger.warning(
                "EventStorage holds more histograms than its bound that no writer took; "
                "dropping the oldest. Add a TensorboardXWriter or stop calling put_histogram."
            )


def _check_chw(img_name: str, img: Any) -> None:
    shape = getattr(img, "shape", None)
    if shape is None:
        raise TypeError(
            f"put_image('{img_name}') needs a tensor or array of shape (C, H, W), "
            f"got {type(img).__name__}"
        )
    if len(shape) != 3 or shape[0] not in (1, 3, 4) or shape[1] == 0 or shape[2] == 0:
        raise ValueError(
            f"put_image('{img_name}') needs a (C, H, W) image with C in (1, 3, 4), "
            f"got shape {tuple(shape)}"
        )


class EventWriter:
    """Base class for writers that obtain events from :class:`EventStorage` and process them.

    Subclass it in Python with ``write()`` and ``close()``; native writers subclass it too.
    """

    def write(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
