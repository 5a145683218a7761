"""The data cursor on its own: the one epoch rule, the next pass over a finite loader, and
the position a checkpoint saves and a resume restores. SimpleTrainer's use of it is in
test_epochs.py and the resume tests."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from hookloop.checkpoint.rng import get_rng_state, set_rng_state
from hookloop.data import TrainingSampler
from hookloop.data.cursor import DataCursor, ReplayIterator, iters_per_epoch, run_epochs


class Trainer:
    """What the cursor reads of a trainer: SimpleTrainer's names, nothing else."""

    def __init__(self, loader, max_iter=100):
        self.data_loader = loader
        self.iter = 0
        self.max_iter = max_iter
        self._data_loader_iter_obj = None
        self.cursor = DataCursor()

    @property
    def _data_loader_iter(self):
        if self._data_loader_iter_obj is None:
            self._data_loader_iter_obj = self.cursor.new_iterator(self)
        return self._data_loader_iter_obj

    @property
    def iters_per_epoch(self):
        return iters_per_epoch(self.data_loader)

    def step(self):
        """One iteration's batch, as SimpleTrainer.run_step takes it."""
        try:
            return next(self._data_loader_iter)
        except StopIteration:
            return self.cursor.next_epoch(self)


class EpochSampler(list):
    """A finite loader whose order depends on set_epoch, as DistributedSampler's does."""

    def __init__(self, n):
        super().__init__(range(n))
        self.sampler = self
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)
        self[:] = [(x + epoch) % len(self) for x in range(len(self))]


def test_iters_per_epoch_is_the_length_of_a_finite_loader_only():
    assert iters_per_epoch([1, 2, 3]) == 3
    assert iters_per_epoch(x for x in range(3)) is None
    assert iters_per_epoch(itertools.cycle([1])) is None
    assert iters_per_epoch(object()) is None


@pytest.mark.parametrize(
    "per_epoch, max_iter, expected", [(4, 10, 4), (4, 4, None), (None, 10, None), (0, 10, None)]
)
def test_a_run_has_epochs_when_it_spans_more_than_one_pass(per_epoch, max_iter, expected):
    class T:
        iters_per_epoch = per_epoch

    t = T()
    t.max_iter = max_iter
    assert run_epochs(t) == expected
    assert run_epochs(object()) is None  # not a trainer that counts epochs


def test_the_next_pass_advances_the_epoch_and_calls_set_epoch():
    loader = EpochSampler(3)
    t = Trainer(loader)
    seen = []
    for t.iter in range(7):
        seen.append(t.step())
    assert seen == [0, 1, 2, 1, 2, 0, 2]  # epoch e is range(3) rotated by e
    assert t.cursor.epoch == 2 and loader.epochs == [1, 2]


def test_a_generator_has_no_next_epoch_and_an_empty_loader_is_named():
    t = Trainer(x for x in range(2))
    t.step(), t.step()
    with pytest.raises(StopIteration):
        t.step()
    assert t.cursor.epoch == 0
    empty = Trainer([])
    with pytest.raises(ValueError, match=r"the data loader \(list\) yields no batches"):
        empty.step()


def test_a_resume_continues_mid_epoch_at_the_next_batch():
    run = Trainer(EpochSampler(4))
    batches = []
    for run.iter in range(11):
        batches.append(run.step())
    state = run.cursor.state(run)  # a checkpoint at the end of iteration 10
    assert (state["epoch"], state["epoch_batches"]) == (2, 3)  # iterations 8, 9 and 10
    assert set(state) == {"epoch", "epoch_batches", "epoch_rng"}
    for run.iter in range(11, 14):
        batches.append(run.step())

    resumed_run = Trainer(EpochSampler(4))
    resumed_run.iter = 10  # the checkpoint's iteration, as load_state_dict sets it
    resumed_run.cursor.load_state(resumed_run, state, resumed_rng=False)
    assert resumed_run.cursor.epoch == 2
    resumed = [resumed_run.step() for resumed_run.iter in range(11, 14)]
    assert resumed == batches[11:14]
    # A run resumed at the next epoch's boundary starts that epoch.
    again = Trainer(EpochSampler(4))
    again.iter = 11
    again.cursor.load_state(again, {"epoch": 2, "epoch_batches": 4}, resumed_rng=False)
    assert [again.step() for again.iter in range(12, 14)] == batches[12:14]


def test_the_state_of_a_finite_loader_counts_the_batches_of_this_epoch():
    t = Trainer(EpochSampler(4))
    for t.iter in range(6):
        t.step()
    state = t.cursor.state(t)
    assert (state["epoch"], state["epoch_batches"]) == (1, 2)


def test_a_sampler_position_moves_by_the_batches_consumed():
    sampler = TrainingSampler(100, seed=3)
    loader = torch.utils.data.DataLoader(range(100), batch_size=4, sampler=sampler)
    t = Trainer(loader, max_iter=10**6)
    for t.iter in range(5):
        t.step()
    saved = t.cursor.state(t)
    assert saved["sampler"]["position"] == 5 * 4 == sampler.state_dict()["position"]
    after = [t.step() for t.iter in range(5, 8)]

    fresh_sampler = TrainingSampler(100, seed=3)
    fresh = Trainer(
        torch.utils.data.DataLoader(range(100), batch_size=4, sampler=fresh_sampler),
        max_iter=10**6,
    )
    fresh.iter = 4
    fresh.cursor.load_state(fresh, saved, resumed_rng=False)
    again = [fresh.step() for fresh.iter in range(5, 8)]
    assert [b.tolist() for b in again] == [b.tolist() for b in after]


def test_a_loader_that_cannot_be_positioned_is_named_in_one_warning(caplog):
    t = Trainer(itertools.repeat(1))
    with caplog.at_level(logging.WARNING, logger="hookloop.engine.train_loop"):
        t.cursor.load_state(t, {"sampler": {"position": 3}}, resumed_rng=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "(repeat) cannot be resumed" in warnings[0]


@pytest.mark.parametrize("resumed_rng", [True, False])
def test_a_resumed_rng_is_not_moved_by_making_the_iterator(resumed_rng):
    """A DataLoader draws its base seed from torch's RNG when its iterator is made: after a
    resume that restored the RNG, the cursor undoes that draw (the uninterrupted run made it
    at its first iteration, before the RNG state the checkpoint saved)."""
    loader = torch.utils.data.DataLoader(range(8), batch_size=2, shuffle=True)
    t = Trainer(loader)
    t.cursor.load_state(t, None, resumed_rng=resumed_rng)
    before = torch.random.get_rng_state()
    assert t._data_loader_iter is not None
    assert torch.equal(torch.random.get_rng_state(), before) is resumed_rng
    t._data_loader_iter_obj = None
    before = torch.random.get_rng_state()
    assert t._data_loader_iter is not None  # once only: the next iterator draws as usual
    assert not torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("at", [5, 7, 8, 13])
def test_a_shuffling_loader_resumes_to_the_uninterrupted_order(at):
    """DataLoader(shuffle=True) draws each epoch's order from torch's RNG when the epoch
    starts; the checkpoint keeps the random states of that moment, so the resumed epoch has
    the same order whatever the RNG did since (here: dropout-like draws every step)."""
    data = list(range(16))

    def run(resume_from=None):
        loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
        t = Trainer(loader)
        start = 0
        if resume_from is not None:
            state, rng, start = resume_from
            set_rng_state(rng)
            t.iter = start - 1
            t.cursor.load_state(t, state, resumed_rng=True)
        seen, saved = [], None
        for t.iter in range(start, 20):
            seen.append(t.step().tolist())
            torch.rand(3)  # the model's own draws move the stream
            if t.iter == at:
                saved = (t.cursor.state(t), get_rng_state(), at + 1)
        return seen, saved

    torch.manual_seed(0)
    straight, saved = run()
    resumed, _ = run(saved)
    assert resumed == straight[at + 1 :]


def test_a_checkpoint_without_a_position_warns_for_a_resumable_loader(caplog):
    sampler = TrainingSampler(10, seed=0)
    loader = torch.utils.data.DataLoader(range(10), batch_size=2, sampler=sampler)
    t = Trainer(loader, max_iter=10**6)
    with caplog.at_level(logging.WARNING, logger="hookloop.engine.train_loop"):
        t.cursor.load_state(t, None, resumed_rng=False)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "holds no position of the data loader (DataLoader)" in warning


def test_a_generator_resumed_from_a_checkpoint_warns_once(caplog):
    t = Trainer(x for x in range(100))
    with caplog.at_level(logging.WARNING, logger="hookloop.engine.train_loop"):
        t.cursor.load_state(t, {}, resumed_rng=False)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "The data loader (generator) cannot be resumed" in warning


def test_a_replay_iterator_resumes_a_shuffled_loader_where_it_was():
    loader = torch.utils.data.DataLoader(
        range(64),
        batch_size=2,
        sampler=torch.utils.data.RandomSampler(range(64), replacement=True, num_samples=10**4),
    )
    torch.manual_seed(5)
    it = ReplayIterator(loader)
    assert it.state() == {}
    first = [next(it).tolist() for _ in range(3)]
    state = it.state()
    assert state["drawn"] == 3
    rng = get_rng_state()
    rest = [next(it).tolist() for _ in range(4)]

    torch.manual_seed(123)  # another process, another stream until the checkpoint loads
    again = ReplayIterator(loader)
    again.load_state(state)
    set_rng_state(rng)
    before = torch.random.get_rng_state()
    assert [next(again).tolist() for _ in range(4)] == rest
    assert first != rest and again.state()["drawn"] == 7
    # The replay (made under the saved states, 3 batches dropped) put the stream back.
    assert torch.equal(torch.random.get_rng_state(), before)


def test_precise_bn_saves_and_restores_its_data_position():
    from hookloop.engine import hooks

    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    data = [torch.randn(3, 2) for _ in range(20)]
    hook = hooks.PreciseBN(0, model, data, num_iter=4)
    assert hook.state_dict() == {}
    hook.update_stats()
    state = hook.state_dict()
    assert state["data"]["drawn"] == 4
    other = hooks.PreciseBN(0, model, data, num_iter=4)
    other.load_state_dict(state)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    other.update_stats()
    assert [t.data_ptr() for t in seen] == [t.data_ptr() for t in data[4:8]]
