"""Where a trainer is in its data: the epochs of a finite loader, and the position a
checkpoint saves and a resume restores.

:class:`DataCursor` is ``SimpleTrainer``'s collaborator for its data loader. The iterator
itself stays in the trainer's ``_data_loader_iter_obj`` (detectron2's name: code that sets it
to None gets a fresh iterator); the cursor keeps the rest. :func:`run_epochs` is the one rule
for whether a run has epochs, which the console printer and ``PeriodicCheckpointer`` read.
"""

from __future__ import annotations

import itertools
import logging
import types
from collections.abc import Iterator
from typing import Any, Dict, Mapping, Optional

import torch

from hookloop.checkpoint.rng import get_rng_state, set_rng_state
from hookloop.utils import comm

__all__ = ["DataCursor", "iters_per_epoch", "run_epochs"]

# The trainer's logger: its records come from the trainer's work (filters match by name).
logger = logging.getLogger("hookloop.engine.train_loop")

# Iterables that never have a length (the infinite loaders detectron2-style code passes).
_NO_LEN = frozenset({itertools.cycle, itertools.count, itertools.repeat, types.GeneratorType})

_END = object()


def iters_per_epoch(loader: Any) -> Optional[int]:
    """``len(loader)`` when the loader has a length, else None."""
    if type(loader) in _NO_LEN:
        return None  # asked at every write: no TypeError raised and caught each time
    try:
        return len(loader)
    except TypeError:
        return None


def run_epochs(trainer: Any) -> Optional[int]:
    """The iterations per epoch when ``trainer`` runs epochs (its ``iters_per_epoch``, a
    finite loader's length, is known and ``max_iter`` spans more than one pass), else None."""
    per_epoch = getattr(trainer, "iters_per_epoch", None)
    if not per_epoch:
        return None  # the common case, an endless loader: asked at every console line
    max_iter = getattr(trainer, "max_iter", None)
    if max_iter is None or int(max_iter) <= int(per_epoch):
        return None
    return int(per_epoch)


class DataCursor:
    """The data position of one trainer over its ``data_loader``.

    Attributes:
        epoch (int): the epoch of a finite loader (0 for the first pass; an infinite loader
            stays at 0).
    """

    def __init__(self) -> None:
        self.epoch = 0
        # Batches taken in the current epoch before this train() (from a resumed checkpoint),
        # and the first iteration of the current epoch in this run.
        self._batches_before = 0
        self._epoch_start_iter = 0
        # Where the sampler started, and at which iteration, when the iterator was made.
        self._start: Optional[Dict[str, Any]] = None
        self._start_iter = 0
        # The RNG was restored from a checkpoint: making the iterator must not move it.
        self._resumed_rng = False
        # A finite loader's random states when its current epoch's iterator was made: a
        # shuffling sampler (DataLoader(shuffle=True)) draws the epoch's order from them.
        self._epoch_rng: Optional[Dict[str, Any]] = None

    def new_iterator(self, trainer: Any) -> Any:
        """A new iterator over ``trainer.data_loader``, made at ``trainer.iter``."""
        loader = trainer.data_loader
        # Where the sampler starts, before a prefetching loader moves it on: a checkpoint
        # records the position of the batches actually consumed from here.
        self._start = _sampler_state(loader)
        self._start_iter = trainer.iter
        if iters_per_epoch(loader) is not None:
            self._epoch_rng = get_rng_state()
        if not self._resumed_rng:
            return iter(loader)
        # A DataLoader draws its base seed from torch's RNG when its iterator is made. An
        # uninterrupted run made it at the first iteration; a resumed run must not shift the
        # RNG stream it restored, so that draw is undone.
        rng = torch.random.get_rng_state()
        it = iter(loader)
        torch.random.set_rng_state(rng)
        self._resumed_rng = False
        return it

    def next_epoch(self, trainer: Any) -> Any:
        """The first batch of the next pass over a finite loader: ``epoch`` advances and the
        sampler's ``set_epoch(epoch)`` is called when it has one (detectron2-style runners).
        A one-shot iterator (a generator) has no next epoch: its ``StopIteration`` ends
        training, as in detectron2."""
        loader = trainer.data_loader
        if isinstance(loader, Iterator):  # asked without iter(): a DataLoader's draws a seed
            raise StopIteration
        self.epoch += 1
        self._epoch_start_iter = trainer.iter
        self._batches_before = 0
        _set_epoch(loader, self.epoch)
        trainer._data_loader_iter_obj = None
        try:
            return next(trainer._data_loader_iter)
        except StopIteration:
            raise ValueError(
                f"the data loader ({type(loader).__name__}) yields no batches"
            ) from None

    def state(self, trainer: Any) -> Dict[str, Any]:
        """The data position for a checkpoint saved at the end of iteration ``trainer.iter``:
        the loader's own ``state_dict()`` when it has one, else its sampler's state moved on
        by the batches consumed since the iterator was created (one per iteration); and for a
        finite loader the epoch and the batches taken in it."""
        loader = trainer.data_loader
        data: Dict[str, Any] = {}
        own = getattr(loader, "state_dict", None)
        if callable(own):
            data["loader"] = own()
        elif getattr(trainer, "_data_loader_iter_obj", None) is not None and self._start:
            batch_size = _batch_size(loader)
            if batch_size is not None and "position" in self._start:
                batches = trainer.iter + 1 - self._start_iter
                state = dict(self._start)
                state["position"] += batches * batch_size * comm.get_world_size()
                data["sampler"] = state
        if trainer.iters_per_epoch is not None:
            data["epoch"] = self.epoch
            data["epoch_batches"] = (
                self._batches_before + trainer.iter + 1 - max(self._epoch_start_iter, 0)
            )
            if self._epoch_rng is not None:
                data["epoch_rng"] = self._epoch_rng
        return data

    def load_state(
        self, trainer: Any, data: Optional[Mapping[str, Any]], resumed_rng: bool
    ) -> None:
        """Restores :meth:`state`'s position (``data``, None when the checkpoint has none);
        ``resumed_rng``: the checkpoint restored the RNG streams, which making the next
        iterator must not move."""
        if data and "epoch" in data:
            # The iterator is made here, under the epoch's random states, which are then put
            # back: the next iterator (the next epoch's) draws as in the uninterrupted run.
            self._resume_epoch(
                trainer, int(data["epoch"]), int(data["epoch_batches"]), data.get("epoch_rng")
            )
            return
        self._load_position(trainer, data or {})
        self._resumed_rng = resumed_rng

    def _resume_epoch(
        self, trainer: Any, epoch: int, batches: int, epoch_rng: Optional[Mapping[str, Any]]
    ) -> None:
        """Continues a finite loader at ``batches`` into ``epoch``: the sampler gets
        ``set_epoch(epoch)`` (so a seeded sampler repeats that epoch's order), the iterator is
        made under the random states the epoch's iterator was made under (so a shuffling
        sampler draws the same order, and a DataLoader the same workers' seed), and the
        batches already used are drawn and dropped (a finite loader has no position to seek
        to). The restored random streams are then put back: the drawing does not move them."""
        self.epoch = epoch
        _set_epoch(trainer.data_loader, epoch)
        trainer._data_loader_iter_obj = None
        self._resumed_rng = False
        _replayed(lambda: trainer._data_loader_iter, epoch_rng, batches)
        self._batches_before = batches
        self._epoch_start_iter = trainer.iter + 1  # the first iteration of the resumed run

    def _load_position(self, trainer: Any, data: Mapping[str, Any]) -> None:
        loader = trainer.data_loader
        own = getattr(loader, "load_state_dict", None)
        sampler = _sampler(loader)
        if "loader" in data and callable(own):
            own(data["loader"])
        elif "sampler" in data and sampler is not None and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(data["sampler"])
        elif not data and (callable(own) or hasattr(sampler, "load_state_dict")):
            logger.warning(
                f"The checkpoint holds no position of the data loader ({type(loader).__name__}) "
                "(it was saved without one, by detectron2 or before the loader was used); "
                "training continues with its data from its current position."
            )
            return
        else:
            logger.warning(
                f"The data loader ({type(loader).__name__}) cannot be resumed: it has no "
                "state_dict() and no resumable sampler (hookloop.data.TrainingSampler); "
                "training continues with its data from its current position."
            )
            return
        trainer._data_loader_iter_obj = None


def _replayed(make: Any, rng_at_start: Optional[Mapping[str, Any]], drawn: int) -> Any:
    """The iterator ``make()`` returns, as it was after ``drawn`` items: made under the random
    states ``rng_at_start`` (when given), those items drawn and dropped (fewer if it runs out:
    its next ``next()`` then says so, as it did then). The random streams are put back after,
    so the replay does not move them."""
    now = get_rng_state()
    try:
        if rng_at_start is not None:
            set_rng_state(rng_at_start)
        it = make()
        for _ in range(drawn):
            if next(it, _END) is _END:
                break
    finally:
        set_rng_state(now)
    return it


def _set_epoch(loader: Any, epoch: int) -> None:
    set_epoch = getattr(_sampler(loader), "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _sampler(loader: Any) -> Any:
    """The sampler that orders a loader's data: a DataLoader's ``batch_sampler.sampler`` or
    ``sampler``, or the loader itself when it is a sampler."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if sampler is None:
        sampler = getattr(loader, "sampler", None)
    return sampler


def _sampler_state(loader: Any) -> Optional[Dict[str, Any]]:
    sampler = _sampler(loader)
    state_dict = getattr(sampler, "state_dict", None)
    return dict(state_dict()) if callable(state_dict) else None


def _batch_size(loader: Any) -> Optional[int]:
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


class ReplayIterator:
    """An iterator over ``loader`` that a checkpoint can put back where it was: it keeps the
    random states of the moment it made its iterator and the count of items drawn since. A
    resumed one makes the iterator again under those states (a shuffling sampler draws the
    same order, a DataLoader the same workers' seed) and draws and drops that many items; the
    random streams are then put back, so the drawing does not move them. Made lazily, at the
    first ``next()``, as detectron2's hooks make theirs. ``PreciseBN``'s data."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._it: Any = None  # made at the first next()
        self._rng: Optional[Dict[str, Any]] = None
        self._drawn = 0
        self._resume: Optional[Dict[str, Any]] = None

    def __iter__(self) -> "ReplayIterator":
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._make()
        item = next(self._it)
        self._drawn += 1
        return item

    def state(self) -> Dict[str, Any]:
        """``{"rng": ..., "drawn": n}``; empty before the first ``next()``."""
        if self._resume is not None:
            return dict(self._resume)
        if self._it is None:
            return {}
        return {"rng": self._rng, "drawn": self._drawn}

    def load_state(self, state: Optional[Mapping[str, Any]]) -> None:
        """Puts the iterator back at :meth:`state`'s position at its next ``next()``; an empty
        state starts it afresh."""
        self._it = None
        self._resume = dict(state) if state else None

    def _make(self) -> None:
        resume, self._resume = self._resume, None
        if resume is None:
            self._rng = get_rng_state()
            self._it = iter(self._loader)
            self._drawn = 0
            return
        self._rng = resume["rng"]
        self._it = _replayed(lambda: iter(self._loader), self._rng, int(resume["drawn"]))
        self._drawn = int(resume["drawn"])
