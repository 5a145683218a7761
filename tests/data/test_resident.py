"""``hookloop.data.DeviceResidentLoader``: the batches of TrainingSampler + DataLoader, gathered
from tensors kept on the device, with augmentations drawn from counter-based randoms.

Exact resume under a trainer is in tests/engine/test_exact_resume.py (killed child runs)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hookloop.data import (
    DeviceResidentLoader,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    TrainingSampler,
)
from hookloop.engine import SimpleTrainer
from hookloop.utils import comm
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)


@pytest.fixture
def ranks(monkeypatch):
    """Makes this process rank ``r`` of ``w`` for the loader and TrainingSampler alike."""

    def become(r, w):
        monkeypatch.setattr(comm, "get_rank", lambda: r)
        monkeypatch.setattr(comm, "get_world_size", lambda: w)

    return become


def _data(size):
    return torch.arange(size, dtype=torch.float32)[:, None] * 10, torch.arange(size)


def _labels(batches):
    return [b[1].tolist() for b in batches]


@pytest.mark.parametrize("size", [1, 7, 12, 50])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 5, 2**40])
@pytest.mark.parametrize("shuffle", [True, False])
def test_endless_batches_are_training_sampler_and_dataloaders(ranks, size, world, seed, shuffle):
    x, y = _data(size)
    for rank in range(world):
        ranks(rank, world)
        ref = DataLoader(
            TensorDataset(x, y), batch_size=4, sampler=TrainingSampler(size, shuffle, seed)
        )
        ours = DeviceResidentLoader((x, y), 4, shuffle=shuffle, seed=seed, endless=True)
        want = list(itertools.islice(iter(ref), 9))
        got = list(itertools.islice(iter(ours), 9))
        assert _labels(got) == _labels(want)
        assert all(torch.equal(g[0], w[0]) for g, w in zip(got, want))


def _epoch_reference(size, world, rank, seed, shuffle, drop_last, epoch, batch_size):
    """Epoch ``epoch``: TrainingSampler's ``epoch``-th permutation (its stream on one rank),
    this rank's every ``world``-th index of it (cut to the shortest share with drop_last,
    else wrapped around to the longest), batched by DataLoader with ``drop_last``."""
    stream = itertools.islice(iter(_single(TrainingSampler, size, shuffle, seed)), None)
    perm = list(itertools.islice(stream, epoch * size, (epoch + 1) * size))
    per_rank = size // world if drop_last else -(-size // world)
    perm = (perm * 2)[: per_rank * world]
    mine = perm[rank::world]
    x, y = _data(size)
    return _labels(DataLoader(TensorDataset(x, y), batch_size, sampler=mine, drop_last=drop_last))


def _single(cls, *args):
    """``cls(*args)`` made as on one rank."""
    rank, world = comm.get_rank, comm.get_world_size
    comm.get_rank, comm.get_world_size = (lambda: 0), (lambda: 1)
    try:
        return cls(*args)
    finally:
        comm.get_rank, comm.get_world_size = rank, world


@pytest.mark.parametrize("size", [5, 12, 13])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("seed", [0, 9])
def test_epochs_shards_and_drop_last(ranks, size, world, drop_last, seed):
    x, y = _data(size)
    lengths = set()
    for rank in range(world):
        ranks(rank, world)
        if drop_last and size // world < 2:
            with pytest.raises(ValueError, match="no batch per epoch"):
                DeviceResidentLoader((x, y), 2, seed=seed, drop_last=drop_last)
            continue
        loader = DeviceResidentLoader((x, y), 2, seed=seed, drop_last=drop_last)
        lengths.add(len(loader))
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)
            got = _labels(loader)
            assert got == _epoch_reference(size, world, rank, seed, True, drop_last, epoch, 2)
            assert len(got) == len(loader)
    assert len(lengths) <= 1  # every rank runs the same number of iterations per epoch


def test_a_trainer_runs_its_epochs_with_set_epoch():
    """A finite loader under SimpleTrainer: len() is the iterations per epoch, each pass calls
    set_epoch, and the batches are the epochs' in order."""
    x, y = _data(10)
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, batch):
            seen.append(batch[1].tolist())
            return {"loss": ((batch[0].squeeze(1) * self.w) ** 2).mean()}

    loader = DeviceResidentLoader((x, y), 4, seed=1)
    model = Model()
    trainer = SimpleTrainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.0))
    trainer.train(0, 7)  # 3 batches per epoch: 2 epochs and one batch
    assert trainer.iters_per_epoch == 3 and trainer.epoch == 2
    ref = DeviceResidentLoader((x, y), 4, seed=1)
    want = []
    for epoch in range(3):
        ref.sampler.set_epoch(epoch)
        want += _labels(ref)
    assert seen == want[:7]


def test_batches_keep_the_datas_form():
    x, y = _data(6)
    assert torch.equal(next(iter(DeviceResidentLoader(x, 2, shuffle=False))), x[:2])
    batch = next(iter(DeviceResidentLoader({"image": x, "label": y}, 2, shuffle=False)))
    assert list(batch) == ["image", "label"] and batch["label"].tolist() == [0, 1]
    batch = next(iter(DeviceResidentLoader(TensorDataset(x, y), 2, shuffle=False)))
    assert isinstance(batch, list) and batch[1].tolist() == [0, 1]


def test_state_dict_continues_where_it_stopped():
    x, y = _data(11)
    for endless in (False, True):
        a = DeviceResidentLoader((x, y), 3, seed=4, endless=endless)
        it = iter(a)
        first = _labels(itertools.islice(it, 2))
        state = a.state_dict()
        rest = _labels(itertools.islice(it, 2))
        b = DeviceResidentLoader((x, y), 3, seed=99, endless=endless)
        b.load_state_dict(state)
        assert _labels(itertools.islice(iter(b), 2)) == rest
        assert first != rest
    c = DeviceResidentLoader((x, y), 4, seed=4)
    with pytest.raises(ValueError, match="batch_size=3, this loader has batch_size=4"):
        c.load_state_dict(state)


def _images(n=8, c=3, h=6, w=5):
    return torch.arange(n * c * h * w, dtype=torch.float32).reshape(n, c, h, w)


def test_flip_flips_whole_images_and_some_of_them():
    images = _images(64)
    loader = DeviceResidentLoader(
        (images, torch.arange(64)), 64, shuffle=False, seed=2, augment=[RandomHorizontalFlip()]
    )
    out, idx = next(iter(loader))
    flipped = [bool(torch.equal(o, images[i].flip(-1))) for o, i in zip(out, idx)]
    kept = [bool(torch.equal(o, images[i])) for o, i in zip(out, idx)]
    assert all(f or k for f, k in zip(flipped, kept))
    assert 16 < sum(flipped) < 48  # p = 0.5 of 64


def test_crop_takes_a_window_of_the_zero_padded_image():
    images = _images(16) + 1  # no zero inside the images: padding shows as zeros
    loader = DeviceResidentLoader(
        (images, torch.arange(16)), 16, shuffle=False, seed=3, augment=[RandomCrop((6, 5), 2)]
    )
    out, idx = next(iter(loader))
    assert out.shape == images.shape
    offsets = set()
    for o, i in zip(out, idx):
        padded = torch.nn.functional.pad(images[i], (2, 2, 2, 2))
        windows = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if torch.equal(padded[:, dy : dy + 6, dx : dx + 5], o)
        ]
        assert len(windows) == 1
        offsets.add(windows[0])
    assert len(offsets) > 4  # the offsets vary from image to image


def test_normalize_per_channel():
    images = torch.ones(4, 2, 3, 3)
    images[:, 1] = 3.0
    loader = DeviceResidentLoader(
        images, 4, shuffle=False, augment=[Normalize([1.0, 1.0], [1.0, 0.5])]
    )
    out = next(iter(loader))
    assert torch.all(out[:, 0] == 0) and torch.all(out[:, 1] == 4)


def test_augmentations_depend_on_the_seed_and_the_batch_only():
    images = _images(8)

    def loader(seed):
        return DeviceResidentLoader(
            (images, torch.arange(8)),
            4,
            seed=seed,
            augment=[RandomCrop((6, 5), 2), RandomHorizontalFlip()],
        )

    a, b = list(loader(1)), list(loader(1))
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    c = list(loader(2))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))
    # Two epochs of one loader draw different augmentations for the same samples.
    one = loader(1)
    one.sampler.set_epoch(0)
    first = {int(i): img for b in one for img, i in zip(*b)}
    one.sampler.set_epoch(1)
    second = {int(i): img for b in one for img, i in zip(*b)}
    assert any(not torch.equal(first[i], second[i]) for i in first)


def test_a_batch_function_gets_the_batch_and_its_randoms():
    x, y = _data(4)

    def mix(batch, randoms):
        u = randoms.uniform(batch[0].shape[0], 1)
        assert ((0 <= u) & (u < 1)).all()
        return [batch[0] * 0 + u, batch[1]]

    out = next(iter(DeviceResidentLoader((x, y), 4, batch_fn=mix, seed=0)))
    assert out[0].unique().numel() == 4


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        (("nope", 2), {}, TypeError, "takes a tensor"),
        (((torch.zeros(3), torch.zeros(4)), 2), {}, ValueError, "first dimension"),
        ((torch.zeros(0, 2), 2), {}, ValueError, "at least one sample"),
        ((torch.zeros(3), 0), {}, ValueError, "batch_size must be >= 1"),
        ((torch.zeros(3), 2.0), {}, TypeError, "batch_size must be an int"),
        ((torch.zeros(3), 4), {"drop_last": True}, ValueError, "no batch per epoch"),
        ((torch.zeros(3), 2), {"augment": [1]}, TypeError, "augment takes callables"),
        (((torch.zeros(3),), 2), {"augment": [Normalize([0], [1])], "augment_key": 3},
         ValueError, "augment_key 3"),
    ],
)  # fmt: skip
def test_bad_input_is_named(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DeviceResidentLoader(*args, **kwargs)


def test_an_endless_loader_has_no_len():
    loader = DeviceResidentLoader(torch.zeros(3), 2, endless=True)
    with pytest.raises(TypeError, match="no len"):
        len(loader)


@pytest.mark.cuda
def test_a_dataset_larger_than_free_memory_is_refused_naming_both():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    free, _ = torch.cuda.mem_get_info()
    # A host view of one byte that counts as a dataset 1 MiB larger than the free memory: the
    # check comes before any copy.
    fake = torch.zeros(1, dtype=torch.uint8).expand(free + 2**20)
    with pytest.raises(ValueError, match="MiB free on cuda"):
        DeviceResidentLoader(fake, 4, device="cuda")
