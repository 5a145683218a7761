"""Checkpoints cross between hookloop and the real fvcore both ways: a run checkpointed by a
detectron2/fvcore trainer resumes under hookloop (and back), and ``PeriodicCheckpointer`` leaves
the same files. fvcore is a test dependency (the "test" extra)."""

from __future__ import annotations

import os

import pytest
import torch
from hookloop.checkpoint import Checkpointer, PeriodicCheckpointer
from torch import nn

fvcore_checkpoint = pytest.importorskip("fvcore.common.checkpoint")

torch.set_num_threads(1)

BOTH_WAYS = [
    pytest.param(fvcore_checkpoint.Checkpointer, Checkpointer, id="fvcore-to-hookloop"),
    pytest.param(Checkpointer, fvcore_checkpoint.Checkpointer, id="hookloop-to-fvcore"),
]


def _trained(seed: int):
    """A model with buffers (BatchNorm) and an optimizer with momentum state, one step in."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def _equal_states(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_states(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("saver, loader", BOTH_WAYS)
def test_a_run_checkpointed_by_one_resumes_under_the_other(tmp_path, saver, loader):
    model, opt = _trained(0)
    saver(model, str(tmp_path), optimizer=opt).save("model_0000009", iteration=9)

    fresh, fresh_opt = _trained(1)
    assert not _equal_states(fresh.state_dict(), model.state_dict())
    ckpt = loader(fresh, str(tmp_path), optimizer=fresh_opt)
    assert ckpt.has_checkpoint()
    assert ckpt.get_checkpoint_file() == os.path.join(str(tmp_path), "model_0000009.pth")
    extra = ckpt.resume_or_load("", resume=True)

    assert extra == {"iteration": 9}
    assert _equal_states(fresh.state_dict(), model.state_dict())
    assert _equal_states(fresh_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("saver, loader", BOTH_WAYS)
def test_weights_load_across_a_dataparallel_prefix(tmp_path, saver, loader):
    # detectron2 checkpoints of DistributedDataParallel models carry "module." in every key.
    model, _ = _trained(0)
    wrapped = nn.DataParallel(model)
    path = tmp_path / "model_final.pth"
    saver(wrapped, str(tmp_path)).save("model_final")

    fresh, _ = _trained(1)
    extra = loader(fresh).load(str(path))
    assert extra == {}
    assert _equal_states(fresh.state_dict(), model.state_dict())


def test_periodic_checkpointer_leaves_the_files_fvcore_leaves(tmp_path):
    def files(periodic_cls, checkpointer_cls, where):
        where.mkdir()  # fvcore does not create it (detectron2's setup does); hookloop would
        model, _ = _trained(0)
        periodic = periodic_cls(
            checkpointer_cls(model, str(where)), period=3, max_iter=11, max_to_keep=2
        )
        for iteration in range(11):
            periodic.step(iteration)
        return sorted(os.listdir(where)), (where / "last_checkpoint").read_text()

    hookloop_files = files(PeriodicCheckpointer, Checkpointer, tmp_path / "hookloop")
    fvcore_files = files(
        fvcore_checkpoint.PeriodicCheckpointer, fvcore_checkpoint.Checkpointer, tmp_path / "fv"
    )
    assert hookloop_files == fvcore_files
    assert hookloop_files == (
        ["last_checkpoint", "model_0000005.pth", "model_0000008.pth", "model_final.pth"],
        "model_final.pth",
    )
