"""``hookloop.data.TrainingSampler``: detectron2's index stream, sharding and resume."""

from __future__ import annotations

import io
import itertools
import logging

import pytest
import torch
from hookloop.data import TrainingSampler
from hookloop.data import samplers as samplers_module
from torch.utils.data import DataLoader

torch.set_num_threads(1)


def reference_stream(size, shuffle, seed):
    """detectron2's infinite stream: one generator seeded once, a permutation per pass."""
    g = torch.Generator()
    g.manual_seed(seed)
    while True:
        if shuffle:
            yield from torch.randperm(size, generator=g).tolist()
        else:
            yield from range(size)


def take(it, n):
    return list(itertools.islice(it, n))


@pytest.fixture
def world(monkeypatch):
    """Pretend to be rank ``r`` of ``n`` processes."""

    def set_world(rank, size):
        monkeypatch.setattr(samplers_module.comm, "get_rank", lambda: rank)
        monkeypatch.setattr(samplers_module.comm, "get_world_size", lambda: size)

    return set_world


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("size,seed", [(1, 0), (7, 3), (10, 12345)])
def test_same_stream_as_detectron2(size, shuffle, seed):
    got = take(iter(TrainingSampler(size, shuffle=shuffle, seed=seed)), 4 * size + 3)
    assert got == take(reference_stream(size, shuffle, seed), 4 * size + 3)
    assert all(type(i) is int for i in got)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_take_interleaved_indices(world, world_size):
    n = 25
    ref = take(reference_stream(7, True, 5), n * world_size)
    for rank in range(world_size):
        world(rank, world_size)
        assert take(iter(TrainingSampler(7, seed=5)), n) == ref[rank::world_size]


def test_seed_none_is_shared_across_ranks(monkeypatch):
    monkeypatch.setattr(samplers_module.comm, "shared_random_seed", lambda: 77)
    assert take(iter(TrainingSampler(9)), 20) == take(reference_stream(9, True, 77), 20)
    assert TrainingSampler(9).state_dict()["seed"] == 77


def test_each_iter_starts_from_the_beginning():
    s = TrainingSampler(5, seed=1)
    first = take(iter(s), 8)
    assert take(iter(s), 8) == first


def test_in_a_data_loader():
    data = list(range(100, 110))
    loader = DataLoader(data, batch_size=3, sampler=TrainingSampler(10, seed=4))
    batches = [b.tolist() for b in take(iter(loader), 5)]
    expected = [100 + i for i in take(reference_stream(10, True, 4), 15)]
    assert batches == [expected[i : i + 3] for i in range(0, 15, 3)]


class RandpermCounter:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = torch.randperm

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(samplers_module.torch, "randperm", counting)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("consumed", [0, 1, 6, 7, 8, 37])
def test_resume_continues_exactly(world, monkeypatch, shuffle, world_size, consumed):
    size = 7
    for rank in range(world_size):
        world(rank, world_size)
        s = TrainingSampler(size, shuffle=shuffle, seed=9)
        it = iter(s)
        head = take(it, consumed)
        state = s.state_dict()
        assert state["position"] == consumed * world_size
        tail = take(it, 20)

        resumed = TrainingSampler(size, shuffle=shuffle, seed=1234)  # the saved seed wins
        resumed.load_state_dict(state)
        counter = RandpermCounter(monkeypatch)
        first = next(iter(resumed))
        # one permutation drawn to continue, not one per permutation consumed
        assert counter.calls == (1 if shuffle else 0)
        monkeypatch.undo()
        world(rank, world_size)
        assert [first] + take(iter(resumed), 20)[1:] == tail
        ref = take(reference_stream(size, shuffle, 9), (consumed + 20) * world_size)
        assert head + tail == ref[rank::world_size]


def test_resume_state_survives_torch_save_weights_only():
    s = TrainingSampler(11, seed=2)
    it = iter(s)
    take(it, 30)
    buf = io.BytesIO()
    torch.save({"sampler": s.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["sampler"]
    resumed = TrainingSampler(11, seed=2)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 25) == take(it, 25)


def test_resume_from_an_earlier_position_than_saved(monkeypatch):
    """A trainer whose DataLoader prefetched sets the position back to what it consumed."""
    size = 10
    s = TrainingSampler(size, seed=3)
    it = iter(s)
    take(it, 53)  # in permutation 5
    state = s.state_dict()
    ref = take(reference_stream(size, True, 3), 100)
    for position, draws in [(47, 1), (41, 1), (12, 2)]:
        # 47 and 41 are in permutation 4, whose generator state is kept; 12 is in
        # permutation 1: the sampler redraws from the seed (1 skipped + the one it uses)
        resumed = TrainingSampler(size, seed=3)
        resumed.load_state_dict({**state, "position": position})
        counter = RandpermCounter(monkeypatch)
        assert next(iter(resumed)) == ref[position]
        assert counter.calls == draws
        monkeypatch.undo()
        assert take(iter(resumed), 20) == ref[position : position + 20]


def test_resume_on_another_world_size_continues_the_global_stream(world, caplog):
    world(0, 2)
    s = TrainingSampler(6, seed=8)
    take(iter(s), 5)  # rank 0 of 2: global position 10
    state = s.state_dict()
    ref = take(reference_stream(6, True, 8), 40)
    caplog.set_level(logging.WARNING, logger="hookloop.data.samplers")
    for rank in range(3):
        world(rank, 3)
        resumed = TrainingSampler(6, seed=8)
        resumed.load_state_dict(state)
        assert take(iter(resumed), 6) == ref[10 + rank : 10 + rank + 18 : 3]
    assert "sharded over 2 rank(s) on 3" in caplog.text


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((0,), ValueError, "positive int. Got 0"),
        ((-3,), ValueError, "positive int"),
        ((1.5,), TypeError, "expects an int"),
        (("3",), TypeError, "expects an int"),
        ((True,), TypeError, "expects an int"),
        ((3, True, "seed"), TypeError, "seed=.*got str"),
        ((3, True, True), TypeError, "seed=.*bool"),
    ],
)
def test_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        TrainingSampler(*args)


def test_bad_state():
    s = TrainingSampler(5, seed=0)
    good = s.state_dict()
    with pytest.raises(TypeError, match="needs a dict"):
        s.load_state_dict([1])
    with pytest.raises(ValueError, match="missing \\['position'\\]"):
        s.load_state_dict({k: v for k, v in good.items() if k != "position"})
    with pytest.raises(ValueError, match="size 6, this sampler has size 5"):
        s.load_state_dict({**good, "size": 6})
    with pytest.raises(ValueError, match="shuffle=False, this sampler has shuffle=True"):
        s.load_state_dict({**good, "shuffle": False})
    with pytest.raises(ValueError, match="position must be an int >= 0"):
        s.load_state_dict({**good, "position": -1})
    with pytest.raises(ValueError, match="epoch_states"):
        s.load_state_dict({**good, "epoch_states": {0: "x"}})


@pytest.mark.parametrize("seed", [2**64, 2**70, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_a_value_error_naming_seed(seed):
    with pytest.raises(ValueError, match=rf"TrainingSampler\(seed=\) must be in .* got {seed}$"):
        TrainingSampler(10, seed=seed)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_the_ends_of_torchs_seed_range_are_accepted(seed):
    assert len(list(itertools.islice(iter(TrainingSampler(10, seed=seed)), 5))) == 5
