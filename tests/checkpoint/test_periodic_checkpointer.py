"""``hookloop.checkpoint.PeriodicCheckpointer`` (the non-hook form): schedule and max_to_keep."""

from __future__ import annotations

import os

import pytest
import torch
from hookloop.checkpoint import Checkpointer, PeriodicCheckpointer
from torch import nn

torch.set_num_threads(1)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))


def _pth(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".pth"))


@pytest.mark.parametrize("wrap", [False, True])
def test_periodic_checkpointer_schedule(tmp_path, wrap):
    model = nn.DataParallel(_model()) if wrap else _model()
    periodic = PeriodicCheckpointer(Checkpointer(model, str(tmp_path)), 10, 99)
    for iteration in range(100):
        periodic.step(iteration)
        path = tmp_path / "model_{:07d}.pth".format(iteration)
        assert path.exists() is ((iteration + 1) % 10 == 0)
    assert (tmp_path / "model_final.pth").exists()
    assert torch.load(tmp_path / "model_final.pth", weights_only=False)["iteration"] == 99


def test_periodic_checkpointer_max_to_keep_fvcore(tmp_path):
    ckpt = Checkpointer(_model(), str(tmp_path))
    periodic = PeriodicCheckpointer(ckpt, 10, 99, max_to_keep=3)
    for _ in range(2):
        paths = []
        for iteration in range(100):
            periodic.step(iteration)
            if (iteration + 1) % 10 == 0:
                paths.append(tmp_path / "model_{:07d}.pth".format(iteration))
        assert not any(p.exists() for p in paths[:-3])
        assert all(p.exists() for p in paths[-3:])
    assert _pth(tmp_path) == [
        "model_0000079.pth",
        "model_0000089.pth",
        "model_0000099.pth",
        "model_final.pth",
    ]


def _other_owners(tmp_path):
    names = ["model_final.pth", "model_best.pth", "other_0000009.pth", "model_ema_0000009.pth"]
    for n in names:
        torch.save({"model": {}}, tmp_path / n)
    return names


@pytest.mark.parametrize("with_state", [False, True])
def test_max_to_keep_deletes_files_from_before_a_restart(tmp_path, with_state):
    others = _other_owners(tmp_path)
    first = PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path)), 10, max_to_keep=3)
    for iteration in range(50):
        first.step(iteration)
    assert first.recent_checkpoints == [str(tmp_path / f"model_{i:07d}.pth") for i in (29, 39, 49)]
    state = first.state_dict()
    assert state == {"recent_checkpoints": [f"model_{i:07d}.pth" for i in (29, 39, 49)]}

    # A new process: a fresh PeriodicCheckpointer, with or without the saved keep-list.
    second = PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path)), 10, max_to_keep=3)
    if with_state:
        second.load_state_dict(state)
    second.step(59)
    assert _pth(tmp_path) == sorted(
        others + ["model_0000039.pth", "model_0000049.pth", "model_0000059.pth"]
    )
    second.step(69)
    assert _pth(tmp_path) == sorted(
        others + ["model_0000049.pth", "model_0000059.pth", "model_0000069.pth"]
    )


def test_max_to_keep_counts_the_saved_file_in_its_own_state(tmp_path):
    class Probe:
        """A checkpointable that records the keep-list at save time (as the trainer's state
        records the hook's)."""

        def state_dict(self):
            return periodic.state_dict()

        def load_state_dict(self, sd):
            pass

    ckpt = Checkpointer(_model(), str(tmp_path), probe=Probe())
    periodic = PeriodicCheckpointer(ckpt, 1, max_to_keep=2)
    periodic.step(0)
    periodic.step(1)
    saved = torch.load(tmp_path / "model_0000001.pth", weights_only=False)
    assert saved["probe"] == {"recent_checkpoints": ["model_0000000.pth", "model_0000001.pth"]}


def test_max_to_keep_with_a_failed_save_keeps_older_files(tmp_path, monkeypatch):
    ckpt = Checkpointer(_model(), str(tmp_path))
    periodic = PeriodicCheckpointer(ckpt, 1, max_to_keep=1)
    periodic.step(0)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="model_0000001.pth"):
        periodic.step(1)
    monkeypatch.undo()
    assert _pth(tmp_path) == ["model_0000000.pth"]
    assert ckpt.get_checkpoint_file() == str(tmp_path / "model_0000000.pth")
    assert periodic.recent_checkpoints == [str(tmp_path / "model_0000000.pth")]


def test_async_max_to_keep_deletes_after_the_new_file_is_written(tmp_path):
    ckpt = Checkpointer(_model(), str(tmp_path), async_save=True)
    periodic = PeriodicCheckpointer(ckpt, 1, max_iter=4, max_to_keep=1)
    for i in range(4):
        periodic.step(i, note=i)
        # The pointer names a file that exists at every moment we can observe.
        ckpt_file = ckpt.get_checkpoint_file()
        assert ckpt_file == "" or os.path.exists(ckpt_file)
    ckpt.wait()
    assert _pth(tmp_path) == ["model_0000003.pth", "model_final.pth"]
    assert torch.load(tmp_path / "model_0000003.pth", weights_only=False)["note"] == 3


def test_step_passes_extra_data(tmp_path):
    periodic = PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path)), 2)
    periodic.step(1, epoch=7, note="x")
    # An epoch names the file, and is saved with the extra data as fvcore's keyword was.
    saved = torch.load(tmp_path / "model_Epoch_00007_Iter_0000001.pth", weights_only=False)
    assert (saved["epoch"], saved["note"], saved["iteration"]) == (7, "x", 1)
    periodic.save("manual", a=1)
    assert (tmp_path / "manual.pth").exists()


def test_no_save_dir_means_no_files_and_no_errors(tmp_path):
    periodic = PeriodicCheckpointer(Checkpointer(_model(), ""), 1, 3, max_to_keep=1)
    for i in range(3):
        periodic.step(i)
    assert periodic.recent_checkpoints == []


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"period": 0}, ValueError, "period must be positive"),
        ({"period": -2}, ValueError, "period must be positive"),
        ({"period": "10"}, TypeError, "period must be an int"),
        ({"period": 1.5}, TypeError, "period must be an int"),
        ({"max_to_keep": 0}, ValueError, "max_to_keep must be positive"),
        ({"max_iter": "5"}, TypeError, "max_iter must be an int"),
        ({"file_prefix": ""}, ValueError, "file_prefix"),
        ({"file_prefix": "a/b"}, ValueError, "file_prefix"),
        ({"max_epoch": 0}, ValueError, "max_epoch must be positive"),
        ({"max_epoch": 2.0}, TypeError, "max_epoch must be an int"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, exc, match):
    args = {"period": 1, **kwargs}
    with pytest.raises(exc, match=match):
        PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path)), **args)


def test_bad_checkpointer_and_state():
    with pytest.raises(TypeError, match="checkpointer with save"):
        PeriodicCheckpointer(object(), 1)
    periodic = PeriodicCheckpointer(Checkpointer(_model(), ""), 1)
    with pytest.raises(ValueError, match="recent_checkpoints"):
        periodic.load_state_dict({"recent_checkpoints": [1]})
    with pytest.raises(TypeError, match="iteration must be an int"):
        periodic.step("3")
    with pytest.raises(TypeError, match="epoch must be an int"):
        periodic.step(3, epoch=1.0)
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        periodic.step(3, epoch=-1)


# ----------------------------------------------------------------------------------------------
# epoch-based names (xmodaler / cvpods runners)


def test_epoch_names_periodic_files_and_the_final_one_stays_final(tmp_path):
    periodic = PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path)), 5, max_iter=20)
    for iteration in range(20):
        periodic.step(iteration, epoch=iteration // 8)
    assert _pth(tmp_path) == [
        "model_Epoch_00000_Iter_0000004.pth",
        "model_Epoch_00001_Iter_0000009.pth",
        "model_Epoch_00001_Iter_0000014.pth",
        "model_Epoch_00002_Iter_0000019.pth",
        "model_final.pth",
    ]
    assert (tmp_path / "last_checkpoint").read_text() == "model_final.pth"
    final = torch.load(tmp_path / "model_final.pth", weights_only=False)
    assert (final["iteration"], final["epoch"]) == (19, 2)


def test_max_epoch_derives_the_epoch_when_step_is_not_told(tmp_path):
    # 22 iterations in 4 epochs: ceil(22 / 4) = 6 iterations each (the last one shorter).
    periodic = PeriodicCheckpointer(
        Checkpointer(_model(), str(tmp_path)), 4, max_iter=22, max_epoch=4, file_prefix="m"
    )
    for iteration in range(22):
        periodic.step(iteration)
    assert _pth(tmp_path) == [
        "m_Epoch_00000_Iter_0000003.pth",
        "m_Epoch_00001_Iter_0000007.pth",
        "m_Epoch_00001_Iter_0000011.pth",
        "m_Epoch_00002_Iter_0000015.pth",
        "m_Epoch_00003_Iter_0000019.pth",
        "m_final.pth",
    ]
    # Without max_iter there is nothing to split: detectron2's names.
    periodic = PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path / "b")), 4, max_epoch=4)
    periodic.step(3)
    assert _pth(tmp_path / "b") == ["model_0000003.pth"]


def test_max_to_keep_counts_both_naming_styles(tmp_path):
    others = _other_owners(tmp_path)
    # A run that saved iteration-style files, then a restart that names them by epoch.
    first = PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path)), 10, max_to_keep=3)
    for iteration in range(30):
        first.step(iteration)
    second = PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path)), 10, max_to_keep=3)
    second.load_state_dict(first.state_dict())
    second.step(39, epoch=3)
    assert _pth(tmp_path) == sorted(
        others + ["model_0000019.pth", "model_0000029.pth", "model_Epoch_00003_Iter_0000039.pth"]
    )
    # A third process without the keep-list: older files of both styles go, oldest first.
    third = PeriodicCheckpointer(Checkpointer(_model(), str(tmp_path)), 10, max_to_keep=2)
    third.step(49, epoch=4)
    assert _pth(tmp_path) == sorted(
        others + ["model_Epoch_00003_Iter_0000039.pth", "model_Epoch_00004_Iter_0000049.pth"]
    )
    assert third.state_dict() == {"recent_checkpoints": ["model_Epoch_00004_Iter_0000049.pth"]}
    ckpt = Checkpointer(_model(), str(tmp_path))
    assert ckpt.get_checkpoint_file() == str(tmp_path / "model_Epoch_00004_Iter_0000049.pth")
