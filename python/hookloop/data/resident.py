"""A data loader whose data stays on one device: :class:`DeviceResidentLoader`.

Small-model training at thousands of steps per second spends more host time building a
batch with ``DataLoader`` (per-sample indexing, collation, a copy to the device) than the
device spends on the step. When the whole dataset fits in the device's memory, a batch is one
index gather per tensor, on the device, and the augmentations run there too.

The order is :class:`~hookloop.data.TrainingSampler`'s: the e-th epoch is the e-th permutation
of one generator seeded with ``seed`` (the same on every rank), and each rank takes every
``world_size``-th index of it. Finite (the default), ``len()`` is the batches per epoch and the
trainer runs epochs (``set_epoch``, the printer's ``epoch: e/E``); ``endless=True`` batches
TrainingSampler's endless stream of indices, as ``DataLoader(dataset, batch_size,
sampler=TrainingSampler(len(dataset)))`` does.

Randomness is counter-based: a batch's random numbers are a hash of ``seed``, the batch's
number in the run and the element's index, computed on the device. No generator state moves,
so a batch depends only on its position: a resumed run draws exactly the batches of the run
that never stopped, and a CUDA graph can hold the whole computation.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
from torch.utils.data import TensorDataset

from hookloop.utils import comm

__all__ = [
    "DeviceResidentLoader",
    "ResidentBatches",
    "ResidentSampler",
    "RandomCrop",
    "RandomHorizontalFlip",
    "Normalize",
]

# murmur3's 32-bit finalizer constants and a golden-ratio increment: the counter hash.
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_MIX1 = 0x85EBCA6B
_MIX2 = 0xC2B2AE35


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on the low 32 bits of an int64 tensor (every product fits: both
    factors are below 2**32, and int64 arithmetic wraps)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _M32
    x = x ^ (x >> 13)
    x = (x * _MIX2) & _M32
    return x ^ (x >> 16)


class Randoms:
    """The random numbers of one batch: a hash of the seed, the batch's number and an index,
    on the device. ``uniform(n, k)`` gives ``n x k`` numbers in [0, 1); each call within a
    batch gives new ones (the call's position is hashed in too)."""

    def __init__(self, seed: int, batch: torch.Tensor, device: torch.device) -> None:
        self._key = _fmix32(batch.to(torch.int64) * _GOLDEN + (seed & _M32))
        self._device = device
        self._calls = 0

    def uniform(self, *shape: int) -> torch.Tensor:
        self._calls += 1
        n = math.prod(shape)
        index = torch.arange(n, device=self._device, dtype=torch.int64)
        x = _fmix32(index * _GOLDEN + self._key + self._calls * _MIX2)
        x = _fmix32(x ^ (self._key * _MIX1))
        # 24 bits: exact in float32, so the values are the same on every device.
        return ((x >> 8).to(torch.float32) * (1.0 / (1 << 24))).reshape(shape)


class RandomHorizontalFlip:
    """Flips each image of an ``(N, C, H, W)`` batch left-right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"RandomHorizontalFlip p must be in [0, 1], got {p!r}")
        self.p = float(p)

    def __call__(self, images: torch.Tensor, randoms: Randoms) -> torch.Tensor:
        flip = randoms.uniform(images.shape[0]) < self.p
        return torch.where(flip.view(-1, *([1] * (images.dim() - 1))), images.flip(-1), images)


class RandomCrop:
    """A random ``size`` crop of each image of an ``(N, C, H, W)`` batch, padded first by
    ``padding`` pixels of zeros on every side (torchvision's ``RandomCrop(size, padding)``,
    as CIFAR-10 training uses it)."""

    def __init__(self, size: Union[int, Sequence[int]], padding: int = 0) -> None:
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        if h <= 0 or w <= 0:
            raise ValueError(f"RandomCrop size must be positive, got {size!r}")
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"RandomCrop padding must be an int >= 0, got {padding!r}")
        self.size = (int(h), int(w))
        self.padding = padding

    def __call__(self, images: torch.Tensor, randoms: Randoms) -> torch.Tensor:
        if images.dim() != 4:
            raise ValueError(
                f"RandomCrop needs (N, C, H, W) images, got shape {tuple(images.shape)}"
            )
        p = self.padding
        padded = torch.nn.functional.pad(images, (p, p, p, p)) if p else images
        n, c, hp, wp = padded.shape
        h, w = self.size
        if h > hp or w > wp:
            raise ValueError(
                f"RandomCrop size {self.size} is larger than the padded image {(hp, wp)}"
            )
        offsets = randoms.uniform(n, 2)
        dy = (offsets[:, 0] * (hp - h + 1)).to(torch.int64)
        dx = (offsets[:, 1] * (wp - w + 1)).to(torch.int64)
        dev = images.device
        rows = (torch.arange(h, device=dev) + dy[:, None])[:, None, :, None]
        cols = (torch.arange(w, device=dev) + dx[:, None])[:, None, None, :]
        batch = torch.arange(n, device=dev)[:, None, None, None]
        channel = torch.arange(c, device=dev)[None, :, None, None]
        return padded[batch, channel, rows, cols]


class Normalize:
    """``(x - mean) / std`` per channel of an ``(N, C, ...)`` batch."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if len(mean) != len(std) or not len(mean):
            raise ValueError("Normalize needs one mean and one std per channel")
        if any(float(s) == 0.0 for s in std):
            raise ValueError(f"Normalize std must not be 0, got {list(std)}")
        self.mean = [float(m) for m in mean]
        self.std = [float(s) for s in std]

        # (mean, std) per (device, dtype, dims), made at the first batch: a CUDA graph that
        # holds the batch must not capture a copy from the host.
        self._made: Dict[Any, "tuple[torch.Tensor, torch.Tensor]"] = {}

    def __call__(self, images: torch.Tensor, randoms: Randoms) -> torch.Tensor:
        key = (images.device, images.dtype, images.dim())
        made = self._made.get(key)
        if made is None:
            shape = (1, len(self.mean)) + (1,) * (images.dim() - 2)
            dev, dt = images.device, images.dtype
            made = self._made[key] = (
                torch.tensor(self.mean, dtype=dt, device=dev).view(shape),
                torch.tensor(self.std, dtype=dt, device=dev).view(shape),
            )
        mean, std = made
        return (images - mean) / std


Augment = Callable[[torch.Tensor, Randoms], torch.Tensor]


class ResidentSampler:
    """The order of a :class:`DeviceResidentLoader`'s batches: TrainingSampler's permutations
    (one generator seeded with ``seed``, one permutation per epoch) sharded over the ranks.
    ``set_epoch`` picks the epoch the next iterator draws (the trainer calls it at each new
    pass); ``epoch_indices(e)`` is this rank's share of epoch ``e``."""

    def __init__(
        self,
        size: int,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        rank: int,
        world_size: int,
    ) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self._generator: Optional[torch.Generator] = None
        self._drawn = 0  # permutations drawn from the generator so far
        self._recent: Dict[int, torch.Tensor] = {}  # the last permutations drawn

    def set_epoch(self, epoch: int) -> None:
        self.epoch = _index("set_epoch() epoch", epoch, minimum=0)

    def per_rank(self) -> int:
        """Indices each rank takes per epoch: the epoch's share, all ranks equal (the last
        ones are dropped with ``drop_last``, else the permutation wraps around to fill)."""
        if self.drop_last:
            return self.size // self.world_size
        return -(-self.size // self.world_size)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The ``epoch``-th permutation of TrainingSampler's stream (``arange`` unshuffled)."""
        if not self.shuffle:
            return torch.arange(self.size)
        if epoch in self._recent:
            return self._recent[epoch]
        g = self._generator
        if g is None or self._drawn > epoch:
            # Back before the last permutations drawn (a resume): from the seed again.
            g = self._generator = torch.Generator()
            g.manual_seed(self.seed)
            self._drawn = 0
            self._recent.clear()
        while self._drawn <= epoch:
            self._recent[self._drawn] = torch.randperm(self.size, generator=g)
            self._recent.pop(self._drawn - 2, None)
            self._drawn += 1
        return self._recent[epoch]

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's indices of ``epoch``, in order."""
        perm = self.permutation(epoch)
        need = self.per_rank() * self.world_size
        if need > self.size:
            perm = torch.cat([perm, perm[: need - self.size]])
        return perm[:need][self.rank :: self.world_size]


class DeviceResidentLoader:
    """Batches of tensors kept on one device, gathered and augmented there.

    Args:
        data: the dataset: a tensor, a tuple/list of tensors (as ``TensorDataset`` takes
            them), a dict of tensors, or a ``TensorDataset``; every tensor's first dimension
            is the sample. They are moved to ``device`` once.
        batch_size (int): samples per batch, per rank.
        shuffle (bool): a new seeded permutation each epoch (else the dataset's order).
        seed (int): the permutation's and the augmentations' seed; None: one shared random
            seed across ranks (``comm.shared_random_seed()``).
        drop_last (bool): drop the last batch of an epoch when it is smaller.
        endless (bool): an endless stream (TrainingSampler's) instead of epochs: no ``len()``.
        device: where the data lives (default: where it already is).
        augment (list): callables ``(images, randoms) -> images`` applied in order to the
            tensor ``augment_key`` of each batch (``RandomCrop``, ``RandomHorizontalFlip``,
            ``Normalize`` or one's own, drawing from ``randoms.uniform(...)``).
        augment_key: the index (tuple data) or key (dict data) of the tensor to augment.
        batch_fn: a callable ``(batch, randoms) -> batch`` applied last, to the whole batch.

    A batch is what ``DataLoader`` over the same ``TensorDataset`` gives: a list of tensors
    (a dict for dict data, the tensor for a single tensor). ``state_dict()`` records the
    position; a trainer's checkpoint holds it and a resumed run continues with the same
    batches, augmentations included.
    """

    def __init__(
        self,
        data: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: Optional[int] = None,
        drop_last: bool = False,
        endless: bool = False,
        device: Any = None,
        augment: Sequence[Augment] = (),
        augment_key: Union[int, str] = 0,
        batch_fn: Optional[Callable[[Any, Randoms], Any]] = None,
    ) -> None:
        tensors, self._kind, keys = _tensors_of(data)
        size = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
        if size == 0:
            raise ValueError("DeviceResidentLoader needs a dataset with at least one sample")
        for name, t in zip(keys, tensors):
            if t.dim() == 0 or t.shape[0] != size:
                raise ValueError(
                    f"DeviceResidentLoader tensors must share their first dimension (the "
                    f"sample): {keys[0]!r} has {size}, {name!r} has shape {tuple(t.shape)}"
                )
        self.batch_size = _index("batch_size", batch_size, minimum=1)
        if seed is None:
            seed = comm.shared_random_seed()
        seed = _index("seed", seed, minimum=-(2**63))
        self.device = torch.device(device) if device is not None else tensors[0].device
        _check_fits(tensors, self.device)
        self._keys = keys
        self._tensors = [t.to(self.device) for t in tensors]
        self._augment = list(augment)
        for a in self._augment:
            if not callable(a):
                raise TypeError(f"augment takes callables (images, randoms), got {a!r}")
        self._augment_at = _position_of(augment_key, keys, self._kind) if self._augment else 0
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(f"batch_fn must be callable, got {type(batch_fn).__name__}")
        self._batch_fn = batch_fn
        self.endless = bool(endless)
        self.sampler = ResidentSampler(
            size,
            shuffle=bool(shuffle),
            seed=seed,
            drop_last=bool(drop_last),
            rank=comm.get_rank(),
            world_size=comm.get_world_size(),
        )
        if not self.endless and len(self) == 0:
            raise ValueError(
                f"DeviceResidentLoader has no batch per epoch: {self.sampler.per_rank()} "
                f"sample(s) per rank and batch_size={self.batch_size} with drop_last=True"
            )
        # Where the next batch comes from: batches taken in the sampler's epoch (finite), or
        # batches taken in the whole stream (endless).
        self._position = 0

    @property
    def seed(self) -> int:
        return self.sampler.seed

    @property
    def dataset_size(self) -> int:
        return self.sampler.size

    def __len__(self) -> int:
        if self.endless:
            raise TypeError("an endless DeviceResidentLoader has no len()")
        per_rank = self.sampler.per_rank()
        if self.sampler.drop_last:
            return per_rank // self.batch_size
        return -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        it = _Batches()
        if self.endless:
            it.gen = self._endless(it, self._position)
        else:
            it.gen = self._epoch(it, self.sampler.epoch, self._position)
        return it

    def graph_source(self, device: Any) -> Optional["ResidentBatches"]:
        """The batches made from device state alone (:class:`ResidentBatches`), for a CUDA
        graph on ``device`` to hold; None when the data lives on another device."""
        if not _same_device(self.device, torch.device(device)):
            return None
        return ResidentBatches(self)

    # ------------------------------------------------------------------------------------------

    def _epoch(self, it: "_Batches", epoch: int, start: int) -> Iterator[Any]:
        indices: Optional[torch.Tensor] = None  # made at the first batch made, not skipped
        batches = len(self)
        first = epoch * batches  # the batch's number in the run: the augmentations' counter
        for b in range(start, batches):
            self._position = b + 1
            if not it.make:
                yield None
                continue
            if indices is None:
                indices = self.sampler.epoch_indices(epoch).to(self.device)
            chunk = indices[b * self.batch_size : (b + 1) * self.batch_size]
            yield self._batch(chunk, first + b)
        self._position = 0

    def _endless(self, it: "_Batches", start: int) -> Iterator[Any]:
        """TrainingSampler's stream batched: batch k of this rank holds the stream's indices
        at ``(k * batch_size + j) * world_size + rank``."""
        s = self.sampler
        per_batch = self.batch_size * s.world_size
        k = start
        epoch = -1
        perm = torch.empty(0, dtype=torch.int64)
        while True:
            self._position = k + 1
            if not it.make:
                # The permutations held stay valid: the next batch made extends or replaces them.
                yield None
                k += 1
                continue
            lo = k * per_batch + s.rank
            positions = torch.arange(lo, lo + per_batch, s.world_size)
            first_epoch, last_epoch = int(positions[0]) // s.size, int(positions[-1]) // s.size
            if first_epoch != epoch:
                # The permutations this batch reaches into, concatenated from first_epoch on.
                epoch = first_epoch
                perm = torch.cat([s.permutation(e) for e in range(epoch, last_epoch + 1)])
            elif last_epoch >= epoch + perm.numel() // s.size:
                perm = torch.cat([perm, s.permutation(last_epoch)])
            chunk = perm[positions - epoch * s.size].to(self.device)
            yield self._batch(chunk, k)
            k += 1

    def _batch(self, indices: torch.Tensor, number: Union[int, torch.Tensor]) -> Any:
        """The batch of ``indices`` (on the device), augmented with the randoms of batch
        ``number`` (an int, or a device tensor: :class:`ResidentBatches`)."""
        parts = [t.index_select(0, indices) for t in self._tensors]
        if self._augment or self._batch_fn is not None:
            if not isinstance(number, torch.Tensor):
                number = torch.tensor(number, device=self.device)
            randoms = Randoms(self.sampler.seed, number, self.device)
            if self._augment:
                x = parts[self._augment_at]
                for aug in self._augment:
                    x = aug(x, randoms)
                parts[self._augment_at] = x
        batch: Any
        if self._kind == "tensor":
            batch = parts[0]
        elif self._kind == "dict":
            batch = dict(zip(self._keys, parts))
        else:
            batch = parts
        if self._batch_fn is not None:
            batch = self._batch_fn(batch, randoms)
        return batch

    # ------------------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The position of the next batch and what defines the order."""
        s = self.sampler
        return {
            "epoch": s.epoch,
            "position": self._position,
            "endless": self.endless,
            "seed": s.seed,
            "size": s.size,
            "shuffle": s.shuffle,
            "drop_last": s.drop_last,
            "batch_size": self.batch_size,
            "world_size": s.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next iterator continues at the saved position (the saved seed is used)."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"DeviceResidentLoader.load_state_dict() needs a dict, got {type(state).__name__}"
            )
        s = self.sampler
        for key, mine in (
            ("size", s.size),
            ("shuffle", s.shuffle),
            ("drop_last", s.drop_last),
            ("batch_size", self.batch_size),
            ("world_size", s.world_size),
            ("endless", self.endless),
        ):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"DeviceResidentLoader state has {key}={state[key]!r}, this loader has "
                    f"{key}={mine!r}: the saved position means other batches here"
                )
        seed = _index("state seed", state.get("seed", s.seed), minimum=-(2**63))
        if seed != s.seed:
            s.seed, s._generator = seed, None
            s._recent.clear()
        s.set_epoch(state.get("epoch", 0))
        self._position = _index("state position", state.get("position", 0), minimum=0)


class _Batches:
    """A :class:`DeviceResidentLoader`'s iterator: ``next()`` makes the next batch, ``skip()``
    moves past it without making it (:class:`ResidentBatches` makes it on the device) with
    the same bookkeeping: the loader's position, ``StopIteration`` at the end of an epoch."""

    __slots__ = ("make", "gen")

    def __init__(self) -> None:
        self.make = True
        self.gen: Iterator[Any] = iter(())

    def __iter__(self) -> "_Batches":
        return self

    def __next__(self) -> Any:
        return next(self.gen)

    def skip(self) -> None:
        self.make = False
        try:
            next(self.gen)
        finally:
            self.make = True


class ResidentBatches:
    """A :class:`DeviceResidentLoader`'s batches made from device state alone, so that a CUDA
    graph can hold the gather and the augmentations (``CUDAGraphTrainer`` uses it when its
    ``data_loader`` has ``graph_source``).

    Device state, at fixed addresses: ``perm`` (this rank's indices of the current epoch,
    padded to whole batches; endless: the permutations the next batches reach into),
    ``position`` (the batch in it) and ``count`` (the batch's number in the run: the
    augmentations' counter). :meth:`batch` gathers the batch at ``position`` with tensor ops
    only and advances ``position`` and ``count`` on the device.

    The host keeps the order: the loader's iterator moves past each batch (``skip()``, or
    ``next()`` at an epoch's first batch, which the trainer's ``next_epoch`` makes), and
    :meth:`stage` then makes the device state point at that batch where the graph's own
    advance did not (a new epoch's permutation, a resume), between replays."""

    def __init__(self, loader: "DeviceResidentLoader") -> None:
        self._loader = loader
        s = loader.sampler
        dev = loader.device
        if loader.endless:
            # Epochs a batch reaches into, plus one: a batch always fits after a refill.
            self._span = -(-(loader.batch_size * s.world_size) // s.size) + 1
            length = self._span * s.size
            self._stride = s.world_size
        else:
            self._span = 0
            length = len(loader) * loader.batch_size
            self._stride = 1
        self.perm = torch.zeros(length, dtype=torch.int64, device=dev)
        self.position = torch.zeros((), dtype=torch.int64, device=dev)
        self.count = torch.zeros((), dtype=torch.int64, device=dev)
        self.shift = torch.zeros((), dtype=torch.int64, device=dev)
        self._aranges: Dict[int, torch.Tensor] = {}
        self._held: Optional[int] = None  # the epoch (endless: the first) in ``perm``
        self._next: Optional[int] = None  # the batch ``position`` points at, as the host knows

    def stage(self) -> int:
        """After the loader's iterator moved past batch ``k``: the device state points at
        ``k`` (written only where the graph's advance did not put it there; outside any
        capture). Returns ``k``'s size (the graph's signature: a last, smaller batch of an
        epoch is another graph)."""
        loader = self._loader
        s = loader.sampler
        k = loader._position - 1
        size = loader.batch_size
        if loader.endless:
            w = s.world_size
            first = (k * size * w + s.rank) // s.size
            last = (((k + 1) * size - 1) * w + s.rank) // s.size
            held = self._held
            if held is None or first < held or last >= held + self._span:
                perm = torch.cat([s.permutation(e) for e in range(first, first + self._span)])
                self._write(perm)
                self.shift.fill_(s.rank - first * s.size)
                self._held = first
            number = k
        else:
            epoch = s.epoch
            if epoch != self._held:
                self._write(s.epoch_indices(epoch))
                self._held = epoch
                self._next = None
            size = min(size, s.per_rank() - k * size)
            number = epoch * len(loader) + k
        if k != self._next:
            self.position.fill_(k)
            self.count.fill_(number)
        self._next = k + 1
        if size not in self._aranges:
            self._aranges[size] = torch.arange(size, dtype=torch.int64, device=loader.device)
        return size

    def batch(self, size: int) -> Any:
        """The batch of ``size`` at the device position, augmented; then position + 1."""
        loader = self._loader
        at = (self.position * loader.batch_size + self._aranges[size]) * self._stride
        out = loader._batch(self.perm.index_select(0, at + self.shift), self.count)
        self.position.add_(1)
        self.count.add_(1)
        return out

    def _write(self, indices: torch.Tensor) -> None:
        if self.perm.is_cuda:
            indices = indices.pin_memory()
        self.perm[: indices.numel()].copy_(indices, non_blocking=True)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    here = torch.cuda.current_device()
    return (here if a.index is None else a.index) == (here if b.index is None else b.index)


def _index(what: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"DeviceResidentLoader {what} must be an int, got bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"DeviceResidentLoader {what} must be an int, got {type(value).__name__}"
        ) from None
    if number < minimum:
        raise ValueError(f"DeviceResidentLoader {what} must be >= {minimum}, got {number}")
    return number


def _tensors_of(data: Any) -> "tuple[List[torch.Tensor], str, List[Any]]":
    """The dataset's tensors, its kind (tensor/tuple/dict) and the names of its tensors."""
    if isinstance(data, TensorDataset):
        data = tuple(data.tensors)
    if isinstance(data, torch.Tensor):
        return [data], "tensor", [0]
    if isinstance(data, Mapping):
        keys = list(data)
        values = [data[k] for k in keys]
        kind = "dict"
    elif isinstance(data, (tuple, list)):
        values = list(data)
        keys = list(range(len(values)))
        kind = "tuple"
    else:
        raise TypeError(
            "DeviceResidentLoader takes a tensor, a tuple/list or dict of tensors, or a "
            f"TensorDataset; got {type(data).__name__}"
        )
    if not values:
        raise ValueError("DeviceResidentLoader needs at least one tensor")
    for k, v in zip(keys, values):
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                f"DeviceResidentLoader data {k!r} is a {type(v).__name__}, not a tensor"
            )
    return values, kind, keys


def _position_of(key: Any, keys: List[Any], kind: str) -> int:
    if kind == "tensor":
        return 0
    if key not in keys:
        raise ValueError(f"augment_key {key!r} is not one of the data's keys {keys}")
    return keys.index(key)


def _check_fits(tensors: List[torch.Tensor], device: torch.device) -> None:
    """A dataset larger than the device's free memory is a clear error, before any copy."""
    if device.type != "cuda":
        return
    moving = sum(t.numel() * t.element_size() for t in tensors if t.device != device)
    if not moving:
        return
    free, total = torch.cuda.mem_get_info(device)
    if moving > free:
        raise ValueError(
            f"DeviceResidentLoader: the dataset takes {moving / 2**20:.1f} MiB, more than the "
            f"{free / 2**20:.1f} MiB free on {device} (of {total / 2**20:.1f} MiB): keep it "
            "on the host with a DataLoader, or use a smaller dtype or subset"
        )
