"""hookloop.nn.precise_bn: BN running statistics become the true averages over the batches."""

from __future__ import annotations

import pytest
import torch
from hookloop.nn import get_bn_modules, update_bn_stats
from hookloop.nn import precise_bn as precise_bn_module
from torch import nn

torch.set_num_threads(1)


def _batches(n, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Each batch has its own scale and offset, so that averaging matters.
    return [torch.randn(shape, generator=g) * (1 + i) + 3 * i for i in range(n)]


def _expected(batches, dims):
    """fvcore's estimate: the population mean and (biased) variance of all samples."""
    channels = batches[0].shape[1]
    samples = torch.cat([b.transpose(0, 1).reshape(channels, -1) for b in batches], dim=1)
    return samples.mean(1), samples.var(1, unbiased=False)


def test_bn1d_stats_are_the_population_mean_and_variance():
    bn = nn.BatchNorm1d(3)
    batches = _batches(6, (8, 3))
    update_bn_stats(bn, batches, num_iters=6)
    mean, var = _expected(batches, 0)
    torch.testing.assert_close(bn.running_mean, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.running_var, var, rtol=1e-5, atol=1e-5)
    assert bn.momentum == 0.1  # restored


def test_conv_bn2d_stats_over_num_iters_batches_only():
    # fvcore-style usage: a conv net, an endless loader, num_iters batches of it.
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU())
    batches = _batches(10, (4, 2, 6, 6), seed=1)
    update_bn_stats(model, iter(batches), num_iters=7)
    with torch.no_grad():
        features = [model[0](b) for b in batches[:7]]
    mean, var = _expected(features, (0, 2, 3))
    bn = model[1]
    torch.testing.assert_close(bn.running_mean, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.running_var, var, rtol=1e-5, atol=1e-5)
    assert bn.momentum is None
    assert not any(p.grad is not None for p in model.parameters())  # ran under no_grad


def test_a_layer_skipped_in_some_batches_averages_its_own_calls():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.always = nn.BatchNorm1d(2)
            self.sometimes = nn.BatchNorm1d(2)

        def forward(self, x):
            y = self.always(x)
            if x[0, 0] > 10:  # only the later, shifted batches
                self.sometimes(x)
            return y

    model = Branchy()
    batches = _batches(6, (5, 2), seed=2)
    used = [b for b in batches if b[0, 0] > 10]
    assert 0 < len(used) < len(batches)
    update_bn_stats(model, batches, num_iters=6)
    torch.testing.assert_close(model.always.running_mean, _expected(batches, 0)[0])
    mean, var = _expected(used, 0)
    torch.testing.assert_close(model.sometimes.running_mean, mean)
    torch.testing.assert_close(model.sometimes.running_var, var)


def test_short_loader_raises_and_leaves_stats_unchanged():
    bn = nn.BatchNorm1d(2, momentum=0.3)
    bn.running_mean.fill_(5.0)
    with pytest.raises(
        AssertionError,
        match=r"^update_bn_stats is meant to run for 4 iterations, but the dataloader stops at 1 "
        r"iterations\.$",
    ):
        update_bn_stats(bn, _batches(2, (4, 2)), num_iters=4)
    assert torch.equal(bn.running_mean, torch.full((2,), 5.0))
    assert torch.equal(bn.running_var, torch.ones(2))
    assert bn.momentum == 0.3
    assert not bn._forward_pre_hooks  # its batch-size hook is gone


def test_a_layer_reused_in_one_forward_is_refused_as_in_fvcore():
    bn = nn.BatchNorm1d(2)
    with pytest.raises(AssertionError, match="Some BN layers are reused"):
        update_bn_stats(nn.Sequential(bn, bn), _batches(2, (4, 2)), num_iters=2)
    assert torch.equal(bn.running_mean, torch.zeros(2))


def test_model_without_training_bn_is_left_alone():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2).eval())
    before = model[1].running_mean.clone()
    update_bn_stats(model, iter(()), num_iters=3)  # nothing to do: the loader is not read
    assert torch.equal(model[1].running_mean, before)


def test_bn_without_running_stats_is_skipped():
    model = nn.Sequential(nn.BatchNorm1d(2, track_running_stats=False), nn.BatchNorm1d(2))
    batches = _batches(3, (4, 2), seed=3)
    update_bn_stats(model, batches, num_iters=3)
    with torch.no_grad():
        mean, var = _expected([model[0](b) for b in batches], 0)
    torch.testing.assert_close(model[1].running_mean, mean)
    torch.testing.assert_close(model[1].running_var, var)


def test_get_bn_modules_finds_training_bn_of_every_kind():
    kinds = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2)]
    others = [nn.GroupNorm(1, 2), nn.InstanceNorm2d(2), nn.LayerNorm(2), nn.BatchNorm2d(2).eval()]
    model = nn.ModuleList(kinds + others)
    assert get_bn_modules(model) == kinds
    assert set(precise_bn_module.BN_MODULE_TYPES) >= {type(m) for m in kinds}


def test_progress_tqdm(capsys):
    pytest.importorskip("tqdm")
    bn = nn.BatchNorm1d(2)
    update_bn_stats(bn, _batches(3, (4, 2)), num_iters=3, progress="tqdm")
    assert "3/3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"model": "model"}, TypeError, "model"),
        ({"data_loader": 3}, TypeError, "data_loader"),
        ({"num_iters": 0}, ValueError, "num_iters"),
        ({"num_iters": 2.0}, TypeError, "num_iters"),
        ({"num_iters": True}, TypeError, "num_iters"),
        ({"progress": "bar"}, ValueError, "progress"),
    ],
)
def test_update_bn_stats_rejects_bad_arguments(kwargs, error, match):
    args = {"model": nn.BatchNorm1d(2), "data_loader": [], "num_iters": 1, **kwargs}
    with pytest.raises(error, match=match):
        update_bn_stats(**args)
    with pytest.raises(TypeError, match="model"):
        get_bn_modules(object())
