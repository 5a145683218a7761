"""Samplers, mirroring ``detectron2.data.samplers``."""

from __future__ import annotations

import logging
import operator
from typing import Any, Dict, Iterator, Mapping, Optional

import torch
from torch.utils.data.sampler import Sampler

from hookloop.utils import comm

__all__ = ["TrainingSampler"]

logger = logging.getLogger(__name__)


class TrainingSampler(Sampler[int]):
    """In training, we only care about the "infinite stream" of training data. So this
    sampler produces an infinite stream of indices and all workers cooperate to correctly
    shuffle the indices and sample different indices.

    The samplers in each worker effectively produces ``indices[worker_id::num_workers]``
    where ``indices`` is an infinite stream of indices consisting of
    ``shuffle(range(size)) + shuffle(range(size)) + ...`` (if shuffle is True) or
    ``range(size) + range(size) + ...`` (if shuffle is False). The stream is detectron2's:
    the same seed gives the same indices.

    Note that this sampler does not shard based on pytorch DataLoader worker id. A sampler
    passed to pytorch DataLoader is used only with map-style dataset and will not be executed
    inside workers. But if this sampler is used in a way that it gets execute inside a
    dataloader worker, then extra work needs to be done to shard its outputs based on worker
    id. This is required so that workers don't produce identical data.

    Resuming: :meth:`state_dict` records the position in the stream (``position``: how many
    indices all ranks together have taken, so it is the same on every rank) and the random
    generator's state at the start of the current and the previous permutation. After
    :meth:`load_state_dict`, a new iterator continues at that position with one permutation
    drawn, not by drawing and dropping the consumed indices. A DataLoader takes indices ahead
    of the batches it returns (prefetching); a trainer that knows how many batches it
    consumed can set ``position`` to ``batches * batch_size * world_size`` before loading.
    """

    def __init__(self, size: int, shuffle: bool = True, seed: Optional[int] = None) -> None:
        """
        Args:
            size (int): the total number of data of the underlying dataset to sample from
            shuffle (bool): whether to shuffle the indices or not
            seed (int): the initial seed of the shuffle. Must be the same across all workers.
                If None, will use a random seed shared among workers (require
                synchronization among all workers).
        """
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"TrainingSampler(size=) expects an int. Got type {type(size)}.")
        if size <= 0:
            raise ValueError(f"TrainingSampler(size=) expects a positive int. Got {size}.")
        if seed is None:
            seed = comm.shared_random_seed()
        elif isinstance(seed, bool):
            raise TypeError("TrainingSampler(seed=) expects an int or None, got bool")
        else:
            try:
                seed = operator.index(seed)
            except TypeError:
                raise TypeError(
                    f"TrainingSampler(seed=) expects an int or None, got {type(seed).__name__}"
                ) from None
            if not -(2**63) <= seed < 2**64:
                # detectron2's fails at the first batch, in torch.Generator.manual_seed.
                raise ValueError(
                    "TrainingSampler(seed=) must be in [-2**63, 2**64) (what "
                    f"torch.Generator.manual_seed takes), got {seed}"
                )
        self._size = size
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._rank = comm.get_rank()
        self._world_size = comm.get_world_size()
        # Global stream positions: where a new iterator starts, and where the live one is
        # (this rank's next index is the one at position + rank).
        self._start = 0
        self._position = 0
        # Generator state at the start of permutation e, for the last few permutations.
        self._epoch_states: Dict[int, torch.Tensor] = {}

    def __iter__(self) -> Iterator[int]:
        return self._indices(self._start)

    def _indices(self, start: int) -> Iterator[int]:
        size, step = self._size, self._world_size
        self._position = start
        epoch = start // size
        g = torch.Generator()
        if self._shuffle:
            self._seek(g, epoch)
        nxt = start + self._rank  # stream position of this rank's next index
        while True:
            base = epoch * size
            if self._shuffle:
                perm = torch.randperm(size, generator=g).tolist()
                # The state at the start of the next permutation: what a state_dict() taken
                # when this one is used up needs.
                self._remember(epoch + 1, g.get_state())
            else:
                perm = list(range(size))
            local = nxt - base
            if local < size:
                taken = perm[local::step]
                for i in taken:
                    self._position += step
                    yield i
                nxt += len(taken) * step
            epoch += 1

    def _seek(self, g: torch.Generator, epoch: int) -> None:
        """Puts ``g`` where it was at the start of permutation ``epoch``."""
        state = self._epoch_states.get(epoch)
        if state is not None:
            g.set_state(state)
            return
        g.manual_seed(self._seed)
        self._remember(0, g.get_state())
        if epoch:
            logger.info(
                f"TrainingSampler: no generator state for permutation {epoch}; drawing "
                f"{epoch} permutation(s) of {self._size} to get there"
            )
        for _ in range(epoch):
            torch.randperm(self._size, generator=g)

    def _remember(self, epoch: int, state: torch.Tensor) -> None:
        # Kept: the permutation in use, the next one and the previous one (a DataLoader's
        # prefetching may put the consumed position there).
        self._epoch_states[epoch] = state
        for e in [e for e in self._epoch_states if e < epoch - 2]:
            del self._epoch_states[e]

    def state_dict(self) -> Dict[str, Any]:
        """Where the stream is: ``position`` (indices taken by all ranks together), the
        generator states to continue from there, and what defines the stream."""
        return {
            "size": self._size,
            "shuffle": self._shuffle,
            "seed": self._seed,
            "world_size": self._world_size,
            "position": self._position,
            "epoch_states": {e: s.clone() for e, s in self._epoch_states.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Makes the next iterator continue where the saved one stopped. The saved seed is
        used (a sampler made with ``seed=None`` gets a new random one each run)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"TrainingSampler.load_state_dict() needs a dict, got {type(state_dict).__name__}"
            )
        missing = {"size", "shuffle", "seed", "position"} - set(state_dict)
        if missing:
            raise ValueError(f"TrainingSampler state is missing {sorted(missing)}")
        if state_dict["size"] != self._size:
            raise ValueError(
                f"TrainingSampler state is for a dataset of size {state_dict['size']}, "
                f"this sampler has size {self._size}"
            )
        if bool(state_dict["shuffle"]) != self._shuffle:
            raise ValueError(
                f"TrainingSampler state has shuffle={bool(state_dict['shuffle'])}, "
                f"this sampler has shuffle={self._shuffle}"
            )
        position = state_dict["position"]
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"TrainingSampler state position must be an int >= 0: {position!r}")
        epoch_states = state_dict.get("epoch_states", {})
        if not isinstance(epoch_states, Mapping) or not all(
            isinstance(s, torch.Tensor) for s in epoch_states.values()
        ):
            raise ValueError("TrainingSampler state epoch_states must map ints to tensors")
        saved_ws = state_dict.get("world_size", self._world_size)
        if saved_ws != self._world_size:
            logger.warning(
                f"TrainingSampler: resuming a stream sharded over {saved_ws} rank(s) on "
                f"{self._world_size}: each rank continues from the same global position"
            )
        self._seed = int(state_dict["seed"])
        self._start = self._position = position
        self._epoch_states = {int(e): s.clone() for e, s in epoch_states.items()}
