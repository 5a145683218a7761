"""``hookloop.checkpoint.Checkpointer``: fvcore's loading rules, atomic and background saves."""

from __future__ import annotations

import copy
import errno
import logging
import os
import re
import stat
import subprocess
import sys
from collections import OrderedDict
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from hookloop.checkpoint import Checkpointer, _IncompatibleKeys
from torch import nn

torch.set_num_threads(1)

LOGGER = "hookloop.checkpoint.checkpointer"


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))


def _complex_model() -> nn.Module:
    m = nn.Module()
    m.block1 = nn.Module()
    m.block1.layer1 = nn.Linear(2, 3)
    m.layer2 = nn.Linear(3, 2)
    m.res = nn.Module()
    m.res.layer2 = nn.Linear(3, 2)
    return m


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Counter:
    """A checkpointable that is not a module."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


# ----------------------------------------------------------------------------------------------
# fvcore's cases


@pytest.mark.parametrize("wrap_trained", [False, True])
@pytest.mark.parametrize("wrap_fresh", [False, True])
@pytest.mark.parametrize("same_dir", [False, True])
def test_load_with_and_without_dataparallel(tmp_path, wrap_trained, wrap_fresh, same_dir):
    trained, fresh = _model(), _model()
    t = nn.DataParallel(trained) if wrap_trained else trained
    f = nn.DataParallel(fresh) if wrap_fresh else fresh
    Checkpointer(t, save_dir=str(tmp_path / "a")).save("checkpoint_file")
    other = tmp_path / ("a" if same_dir else "b")
    other.mkdir(exist_ok=True)
    fresh_ckpt = Checkpointer(f, save_dir=str(other))
    assert fresh_ckpt.has_checkpoint() is same_dir
    expected = str(tmp_path / "a" / "checkpoint_file.pth")
    assert fresh_ckpt.get_checkpoint_file() == (expected if same_dir else "")
    assert fresh_ckpt.load(expected) == {}
    for p, q in zip(trained.parameters(), fresh.parameters()):
        assert p is not q
        assert torch.equal(p, q)


def test_checkpointables_round_trip(tmp_path):
    counter, opt_model = Counter(7), _model()
    opt = torch.optim.SGD(opt_model.parameters(), lr=0.1, momentum=0.9)
    opt_model(torch.ones(1, 2)).sum().backward()
    opt.step()
    ckpt = Checkpointer(opt_model, str(tmp_path), counter=counter, optimizer=opt)
    ckpt.save("c", iteration=12, note="hi")

    model2 = _model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    counter2 = Counter()
    extra = Checkpointer(model2, str(tmp_path), counter=counter2, optimizer=opt2).load(
        str(tmp_path / "c.pth")
    )
    assert extra == {"iteration": 12, "note": "hi"}
    assert counter2.n == 7
    assert _same_params(opt_model, model2)
    assert opt2.state_dict()["param_groups"][0]["lr"] == 0.1
    buf1 = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], buf1)


def test_load_only_named_checkpointables(tmp_path):
    Checkpointer(_model(), str(tmp_path), a=Counter(1), b=Counter(2)).save("c")
    a, b = Counter(), Counter()
    extra = Checkpointer(_model(), str(tmp_path), a=a, b=b).load(
        str(tmp_path / "c.pth"), checkpointables=["b"]
    )
    assert (a.n, b.n) == (0, 2)
    assert extra == {"a": {"n": 1}}
    with pytest.raises(KeyError, match="'zzz'"):
        Checkpointer(_model(), str(tmp_path), a=a).load(str(tmp_path / "c.pth"), ["zzz"])
    # "model" among the names, as fvcore allows (Probabilistic Teacher's resume, evaluation
    # scripts' load(best, checkpointables=["model"])): the model is always loaded, first.
    model, a, b = _model(), Counter(), Counter()
    extra = Checkpointer(model, str(tmp_path), a=a, b=b).load(
        str(tmp_path / "c.pth"), checkpointables=["model", "a"]
    )
    assert (a.n, b.n) == (1, 0) and extra == {"b": {"n": 2}}
    saved = torch.load(tmp_path / "c.pth", weights_only=True)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_resume_or_load(tmp_path):
    src = _model()
    Checkpointer(src, str(tmp_path / "init")).save("init")
    init_path = str(tmp_path / "init" / "init.pth")

    # Nothing in save_dir: the path gives initial weights, checkpointables stay as they are.
    counter, model = Counter(5), _model()
    out = tmp_path / "out"
    ckpt = Checkpointer(model, str(out), counter=counter)
    assert ckpt.resume_or_load(init_path, resume=True) == {}
    assert counter.n == 5
    assert _same_params(src, model)

    # With a checkpoint in save_dir: resume from it, checkpointables included.
    counter.n = 9
    ckpt.save("model_0000009", iteration=9)
    counter2, model2 = Counter(), _model()
    ckpt2 = Checkpointer(model2, str(out), counter=counter2)
    assert ckpt2.resume_or_load(init_path, resume=True) == {"iteration": 9}
    assert counter2.n == 9
    # resume=False loads the given path and only the model.
    counter3 = Counter()
    Checkpointer(_model(), str(out), counter=counter3).resume_or_load(init_path, resume=False)
    assert counter3.n == 0


def test_load_empty_path_starts_from_scratch(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert Checkpointer(_model(), str(tmp_path)).load("") == {}
    assert "Initializing model from scratch" in caplog.text


def test_get_all_checkpoint_files_and_tag(tmp_path):
    ckpt = Checkpointer(_model(), str(tmp_path))
    ckpt.save("b")
    ckpt.save("a")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "dir.pth").mkdir()
    assert ckpt.get_all_checkpoint_files() == [str(tmp_path / "a.pth"), str(tmp_path / "b.pth")]
    assert ckpt.get_checkpoint_file() == str(tmp_path / "a.pth")
    ckpt.tag_last_checkpoint("b.pth")
    assert ckpt.get_checkpoint_file() == str(tmp_path / "b.pth")
    assert (tmp_path / "last_checkpoint").read_text() == "b.pth"


def test_save_without_dir_or_disabled_writes_nothing(tmp_path):
    Checkpointer(_model(), "").save("x")
    Checkpointer(_model(), str(tmp_path), save_to_disk=False).save("x")
    assert os.listdir(tmp_path) == []


def test_load_reused_params():
    class Model(nn.Module):
        def __init__(self, has_y: bool) -> None:
            super().__init__()
            self.x = nn.Linear(10, 10)
            if has_y:
                self.y = self.x

    model = Model(has_y=False)
    model.x.bias.data.fill_(5.0)
    data = {"model": model.state_dict()}
    new_model = Model(has_y=True)
    ckpt = Checkpointer(new_model)
    ckpt.logger = logger = MagicMock()
    incompatible = ckpt._load_model(data)
    assert sorted(incompatible.missing_keys) == ["y.bias", "y.weight"]
    ckpt._log_incompatible_keys(incompatible)
    assert torch.equal(new_model.y.bias, torch.full((10,), 5.0))
    logger.info.assert_not_called()
    logger.warning.assert_not_called()


def test_load_lazy_module(tmp_path):
    m1, m2 = nn.Sequential(nn.LazyLinear(10)), nn.Sequential(nn.LazyLinear(10))
    m1(torch.randn(4, 2, 4, 4))  # initialize m1, but not m2
    Checkpointer(m1, str(tmp_path)).save("checkpoint_file")
    fresh = Checkpointer(m2, str(tmp_path))
    fresh.load(fresh.get_checkpoint_file())
    assert torch.equal(m1[0].weight, m2[0].weight)


# ----------------------------------------------------------------------------------------------
# loading rules


def _messages(caplog, level=None):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and (level is None or r.levelno == level)
    ]


def test_shape_mismatch_is_skipped_with_fvcores_warnings(tmp_path, caplog):
    src = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))
    Checkpointer(src, str(tmp_path)).save("c")
    dst = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    before = copy.deepcopy(dst[1].state_dict())
    caplog.set_level(logging.INFO, logger=LOGGER)
    Checkpointer(dst, str(tmp_path)).load(str(tmp_path / "c.pth"))
    assert torch.equal(dst[0].weight, src[0].weight)
    assert torch.equal(dst[1].weight, before["weight"])  # skipped, not half-loaded
    # fvcore's: one warning per skipped key, then the missing keys (a warning too)
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 3
    assert warnings[0] == (
        "Skip loading parameter '1.weight' to the model due to incompatible shapes: (4, 3) in "
        "the checkpoint but (1, 3) in the model! You might want to double check if this is "
        "expected."
    )
    assert "'1.bias' to the model due to incompatible shapes: (4,) in the" in warnings[1]
    # the skipped keys are then missing: listed once, grouped by module
    assert warnings[2].endswith("checkpoint:\n1.{bias, weight}")


def test_missing_and_unexpected_keys_grouped_by_module(caplog):
    model = _complex_model()
    sd = OrderedDict()
    sd["layer1.weight"] = torch.rand(3, 2)
    sd["layer1.bias"] = torch.rand(3)
    sd["layer2.weight"] = torch.rand(2, 3)
    sd["layer2.bias"] = torch.rand(2)
    sd["res.layer2.weight"] = torch.rand(2, 3)
    sd["res.layer2.bias"] = torch.rand(2)
    sd["extra"] = torch.rand(1)
    ckpt = Checkpointer(model)
    caplog.set_level(logging.INFO, logger=LOGGER)
    incompatible = ckpt._load_model({"model": sd})
    assert isinstance(incompatible, _IncompatibleKeys)
    assert sorted(incompatible.missing_keys) == ["block1.layer1.bias", "block1.layer1.weight"]
    assert sorted(incompatible.unexpected_keys) == ["extra", "layer1.bias", "layer1.weight"]
    assert incompatible.incorrect_shapes == []
    ckpt._log_incompatible_keys(incompatible)
    missing, unexpected = _messages(caplog)
    assert missing == (
        "Some model parameters or buffers are not found in the checkpoint:\n"
        "block1.layer1.{bias, weight}"
    )
    assert unexpected == (
        "The checkpoint state_dict contains keys that are not used by the model:\n"
        "  layer1.{bias, weight}\n  extra"  # fvcore's order: the checkpoint's, not sorted
    )
    assert torch.equal(model.res.layer2.weight, sd["res.layer2.weight"])


def test_checkpoint_with_module_prefix_into_plain_model_keeps_metadata():
    src = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    sd = nn.DataParallel(src).state_dict()
    assert all(k.startswith("module.") for k in sd)
    assert "module.1" in sd._metadata
    dst = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    incompatible = Checkpointer(dst)._load_model({"model": sd})
    assert incompatible.missing_keys == [] and incompatible.unexpected_keys == []
    assert "1" in sd._metadata and "module.1" not in sd._metadata
    assert _same_params(src, dst)


def test_plain_checkpoint_into_model_whose_keys_have_module_prefix():
    class Holder(nn.Module):  # not a DataParallel, so the Checkpointer cannot unwrap it
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    src = nn.Linear(2, 2)
    dst = Holder()
    incompatible = Checkpointer(dst)._load_model({"model": src.state_dict()})
    assert incompatible.missing_keys == [] and incompatible.unexpected_keys == []
    assert torch.equal(dst.module.weight, src.weight)
    # and a checkpoint of such a model loads into it unchanged
    back = Holder()
    Checkpointer(back)._load_model({"model": dst.state_dict()})
    assert _same_params(back, dst)


def test_numpy_arrays_in_checkpoint(tmp_path):
    src = _model()
    arrays = {k: v.numpy().copy() for k, v in src.state_dict().items()}
    torch.save({"model": arrays, "iteration": 3}, tmp_path / "np.pth")
    dst = _model()
    assert Checkpointer(dst).load(str(tmp_path / "np.pth")) == {"iteration": 3}
    assert _same_params(src, dst)


def test_unsupported_value_in_model_state():
    with pytest.raises(ValueError, match="Unsupported type found in checkpoint! 0.weight"):
        Checkpointer(_model())._load_model({"model": {"0.weight": "oops"}})


def test_model_load_state_dict_returning_incompatible_keys_or_none():
    class Custom:
        def __init__(self, result):
            self.result = result
            self.loaded = None

        def state_dict(self):
            return {"w": torch.zeros(2)}

        def load_state_dict(self, sd, strict=True):
            self.loaded = dict(sd)
            return self.result

    torch_result = nn.Linear(1, 1).load_state_dict({}, strict=False)  # torch's _IncompatibleKeys
    for result in (torch_result, None):
        m = Custom(result)
        out = Checkpointer(m)._load_model({"model": {"w": np.ones(2, dtype=np.float32)}})
        assert torch.equal(m.loaded["w"], torch.ones(2))
        expected_missing = ["bias", "weight"] if result is not None else []
        assert sorted(out.missing_keys) == expected_missing


def test_subclass_extension_points(tmp_path):
    calls = []

    class MyCheckpointer(Checkpointer):
        def _load_file(self, f):
            calls.append(("file", os.path.basename(f)))
            return {"model": {k: v.numpy() for k, v in _model().state_dict().items()}, "x": 1}

        def _load_model(self, checkpoint):
            calls.append(("model", sorted(checkpoint)))
            return super()._load_model(checkpoint)

        def _log_incompatible_keys(self, incompatible):
            calls.append(("log", incompatible.missing_keys))

    (tmp_path / "weights.pkl").write_bytes(b"anything")
    extra = MyCheckpointer(_model()).load(str(tmp_path / "weights.pkl"))
    assert extra == {"x": 1}
    assert calls == [("file", "weights.pkl"), ("model", ["model", "x"]), ("log", [])]


# ----------------------------------------------------------------------------------------------
# bad input


def test_checkpointable_without_state_dict_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="checkpointable 'thing'.*has no state_dict"):
        Checkpointer(_model(), str(tmp_path), thing=object())
    ckpt = Checkpointer(_model(), str(tmp_path))
    with pytest.raises(TypeError, match="has no load_state_dict"):

        class HalfCheckpointable:
            def state_dict(self):
                return {}

        ckpt.add_checkpointable("half", HalfCheckpointable())
    with pytest.raises(TypeError, match="model"):
        Checkpointer(object(), str(tmp_path))
    ckpt.add_checkpointable("c", Counter())
    with pytest.raises(KeyError, match="already used"):
        ckpt.add_checkpointable("c", Counter())
    with pytest.raises(ValueError, match="'model'"):
        ckpt.add_checkpointable("model", Counter())


def test_load_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "nope.pth")
    with pytest.raises(FileNotFoundError, match="nope.pth") as info:
        Checkpointer(_model()).load(missing)
    assert info.value.filename == missing


@pytest.mark.parametrize(
    "content",
    [b"", b"not a checkpoint at all", b"PK\x03\x04truncated zip"],
    ids=["empty", "garbage", "truncated"],
)
def test_load_corrupt_file_names_it(tmp_path, content):
    path = tmp_path / "bad.pth"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"Cannot load checkpoint .*bad\.pth"):
        Checkpointer(_model()).load(str(path))


def test_load_truncated_real_checkpoint(tmp_path):
    Checkpointer(_model(), str(tmp_path)).save("good")
    data = (tmp_path / "good.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.pth.*corrupt"):
        Checkpointer(_model()).load(str(tmp_path / "cut.pth"))


def test_load_file_without_model_entry(tmp_path):
    torch.save({"optimizer": {}}, tmp_path / "nomodel.pth")
    with pytest.raises(ValueError, match=r"nomodel\.pth has no 'model' entry"):
        Checkpointer(_model()).load(str(tmp_path / "nomodel.pth"))
    torch.save([1, 2], tmp_path / "list.pth")
    with pytest.raises(ValueError, match=r"list\.pth holds a list"):
        Checkpointer(_model()).load(str(tmp_path / "list.pth"))


@pytest.mark.parametrize("name", ["a/b", "", "..", 3])
def test_save_bad_name(tmp_path, name):
    with pytest.raises(ValueError, match="checkpoint name"):
        Checkpointer(_model(), str(tmp_path)).save(name)


# ----------------------------------------------------------------------------------------------
# atomic saves


def _files(d):
    return sorted(os.listdir(d))


def test_save_into_dir_under_a_regular_file_fails_cleanly(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    save_dir = blocker / "ckpt"
    with pytest.raises(OSError, match=r"Cannot write checkpoint .*file/ckpt/m\.pth") as info:
        Checkpointer(_model(), str(save_dir)).save("m")
    assert info.value.filename == str(save_dir / "m.pth")
    assert _files(tmp_path) == ["file"]


def test_save_into_read_only_dir_fails_cleanly(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    ckpt = Checkpointer(_model(), str(tmp_path))
    ckpt.save("first")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OSError, match="second.pth"):
            ckpt.save("second")
    finally:
        tmp_path.chmod(0o700)
    assert _files(tmp_path) == ["first.pth", "last_checkpoint"]
    assert ckpt.get_checkpoint_file() == str(tmp_path / "first.pth")


def test_disk_full_during_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model = _model()
    ckpt = Checkpointer(model, str(tmp_path))
    ckpt.save("first")
    first = (tmp_path / "first.pth").read_bytes()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match=r"second\.pth: No space left on device") as info:
        ckpt.save("second")
    assert info.value.errno == errno.ENOSPC
    # replacing an existing file fails the same way and keeps its old content
    with torch.no_grad():
        model[0].weight.add_(1)
    with pytest.raises(OSError, match="first.pth"):
        ckpt.save("first")
    monkeypatch.undo()
    assert _files(tmp_path) == ["first.pth", "last_checkpoint"]
    assert (tmp_path / "first.pth").read_bytes() == first
    assert ckpt.get_checkpoint_file() == str(tmp_path / "first.pth")


def _record_durability(monkeypatch, directory):
    """Records, in order, the fsyncs (``("fsync", "file" or "dir", path)``) and renames
    (``("rename", src, dst)``) of paths in ``directory``. A temporary file's path is written
    ``tmp(<target basename>)``. The fd of each fsync is told apart by ``os.fstat``; its path is
    the one ``os.open`` (which ``tempfile.mkstemp`` calls) opened it with."""
    directory = os.fspath(directory)
    events, paths = [], {}
    real_open, real_fsync = os.open, os.fsync
    real_replace, real_rename = os.replace, os.rename

    def name(path):
        path = os.fspath(path)
        tmp = re.fullmatch(r"\.(.+)\.[^.~]*~\d+~\w+\.tmp", os.path.basename(path))
        return f"tmp({tmp[1]})" if tmp and os.path.dirname(path) == directory else path

    def open_(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        paths[fd] = os.fspath(path)
        return fd

    def fsync(fd):
        path = paths.get(fd, "")
        if path == directory or os.path.dirname(path) == directory:
            kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
            events.append(("fsync", kind, name(path)))
        return real_fsync(fd)

    def rename(real):
        def renamed(src, dst, *args, **kwargs):
            if os.path.dirname(os.fspath(dst)) == directory:
                events.append(("rename", name(src), name(dst)))
            return real(src, dst, *args, **kwargs)

        return renamed

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", rename(real_replace))
    monkeypatch.setattr(os, "rename", rename(real_rename))
    return events


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_fsync_the_file_then_rename_then_fsync_the_directory(
    tmp_path, monkeypatch, async_save
):
    """docs/resume.md: the temporary file is fsynced, renamed, and the directory fsynced,
    for the checkpoint and then for last_checkpoint. Without the directory's fsync a crash
    of the machine can lose the rename: the new name, or the file, is gone after reboot."""
    ckpt = Checkpointer(_model(), str(tmp_path), async_save=async_save)
    ckpt.save("first")  # creates the directory's files: the next save replaces both names
    ckpt.wait()
    events = _record_durability(monkeypatch, tmp_path)
    ckpt.save("first")
    ckpt.wait()
    monkeypatch.undo()

    def atomic(target):
        tmp = f"tmp({target})"
        return [
            ("fsync", "file", tmp),
            ("rename", tmp, str(tmp_path / target)),
            ("fsync", "dir", str(tmp_path)),
        ]

    assert events == atomic("first.pth") + atomic("last_checkpoint")
    assert _files(tmp_path) == ["first.pth", "last_checkpoint"]


def test_unpicklable_extra_leaves_no_partial_file(tmp_path):
    ckpt = Checkpointer(_model(), str(tmp_path))
    ckpt.save("first")
    with pytest.raises(Exception, match="lambda|pickle"):
        ckpt.save("second", fn=lambda: 0)
    assert _files(tmp_path) == ["first.pth", "last_checkpoint"]
    assert ckpt.get_checkpoint_file() == str(tmp_path / "first.pth")


def test_stale_temporary_files_of_killed_saves_are_removed(tmp_path):
    from hookloop.checkpoint._fileio import _host

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = child.pid  # gone, and reaped
    here = _host()
    names = [
        f".m.pth.{here}~{dead}~abc_1.tmp",  # killed while saving m
        f".other.pth.{here}~{dead}~abc_2.tmp",  # killed while saving another file
        f".other.pth.{here}~{os.getpid()}~abc_3.tmp",  # a live process is writing it
        f".other.pth.elsewhere~{dead}~abc_4.tmp",  # another host's: its pids mean nothing
        ".unrelated.tmp",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"half")
    Checkpointer(_model(), str(tmp_path)).save("m")
    assert _files(tmp_path) == sorted(names[2:] + ["last_checkpoint", "m.pth"])


def test_save_creates_save_dir(tmp_path):
    ckpt = Checkpointer(_model(), str(tmp_path / "a" / "b"))
    ckpt.save("m")
    assert ckpt.get_checkpoint_file() == str(tmp_path / "a" / "b" / "m.pth")


# ----------------------------------------------------------------------------------------------
# async_save


def _loaded(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_same_state(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_state(x, y)
    else:
        assert a == b


def test_async_save_gives_the_same_checkpoint_as_sync(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    counter = Counter(3)
    sync = Checkpointer(model, str(tmp_path / "sync"), optimizer=opt, counter=counter)
    asyn = Checkpointer(
        model, str(tmp_path / "async"), async_save=True, optimizer=opt, counter=counter
    )
    sync.save("m", iteration=4)
    asyn.save("m", iteration=4)
    # The training thread changes the weights right away: the async checkpoint must not see it.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100)
    asyn.wait()
    a, b = _loaded(tmp_path / "sync" / "m.pth"), _loaded(tmp_path / "async" / "m.pth")
    _assert_same_state(a, b)
    assert a["model"]._metadata == b["model"]._metadata
    assert asyn.get_checkpoint_file() == str(tmp_path / "async" / "m.pth")
    assert _files(tmp_path / "async") == ["last_checkpoint", "m.pth"]


def test_async_save_error_surfaces_at_next_save(tmp_path):
    ckpt = Checkpointer(_model(), str(tmp_path), async_save=True)
    ckpt.save("first")
    ckpt.save("second", fn=lambda: 0)  # pickling fails on the background thread
    with pytest.raises(Exception, match="lambda|pickle"):
        ckpt.save("third")
    ckpt.wait()  # raised once
    assert _files(tmp_path) == ["first.pth", "last_checkpoint"]
    assert ckpt.get_checkpoint_file() == str(tmp_path / "first.pth")
    ckpt.save("fourth")
    ckpt.wait()
    assert ckpt.get_checkpoint_file() == str(tmp_path / "fourth.pth")


def test_async_save_io_error_surfaces_at_wait(tmp_path):
    save_dir = tmp_path / "ckpt"
    ckpt = Checkpointer(_model(), str(save_dir), async_save=True)
    save_dir.parent.joinpath("ckpt").write_text("now a regular file")
    ckpt.save("m")
    with pytest.raises(OSError, match=r"ckpt/m\.pth"):
        ckpt.wait()
    ckpt.wait()


def test_load_waits_for_async_save(tmp_path):
    src = _model()
    ckpt = Checkpointer(src, str(tmp_path), async_save=True)
    ckpt.save("m")
    dst = _model()
    # load() of the same checkpointer waits for the file it is writing
    ckpt_dst = Checkpointer(dst, str(tmp_path))
    ckpt.load(str(tmp_path / "m.pth"))
    ckpt_dst.load(str(tmp_path / "m.pth"))
    assert _same_params(src, dst)


class RecordingPathManager:
    """A project's own path manager (as detectron2's iopath one): local files through it."""

    def __init__(self):
        self.opened = []

    def open(self, path, mode="r", **kwargs):
        self.opened.append((os.path.basename(path), mode))
        return open(path, mode, **kwargs)

    def exists(self, path):
        return os.path.exists(path)

    def isfile(self, path):
        return os.path.isfile(path)

    def ls(self, path):
        return os.listdir(path)

    def mkdirs(self, path):
        os.makedirs(path, exist_ok=True)

    def rm(self, path):
        os.remove(path)

    def get_local_path(self, path, **kwargs):
        return path


def test_custom_path_manager_local_saves_stay_atomic(tmp_path):
    ckpt = Checkpointer(_model(), str(tmp_path))
    ckpt.path_manager = pm = RecordingPathManager()
    ckpt.save("m")
    assert ckpt.get_checkpoint_file() == str(tmp_path / "m.pth")
    assert ckpt.get_all_checkpoint_files() == [str(tmp_path / "m.pth")]
    # the writes went through the atomic path, the reads through the path manager
    assert pm.opened == [("last_checkpoint", "r")]


def test_custom_path_manager_for_urls(tmp_path):
    ckpt = Checkpointer(_model(), "mem://bucket")
    written = {}

    class Remote(RecordingPathManager):
        def open(self, path, mode="r", **kwargs):
            import io

            buf = io.BytesIO() if "b" in mode else io.StringIO()
            buf.close = lambda: written.__setitem__(path, buf.getvalue())
            return buf

    ckpt.path_manager = Remote()
    ckpt.save("m")
    assert set(written) == {"mem://bucket/m.pth", "mem://bucket/last_checkpoint"}
    assert written["mem://bucket/last_checkpoint"] == "m.pth"


def test_disk_full_while_writing_is_an_os_error(tmp_path, monkeypatch):
    ckpt = Checkpointer(nn.Linear(100, 100), str(tmp_path))
    ckpt.save("first")
    real_fdopen = os.fdopen

    class Full:
        """A file on a disk that fills up after 1000 bytes."""

        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    try:
        with pytest.raises(OSError, match=r"second\.pth: No space left on device") as info:
            ckpt.save("second")
    finally:
        monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert _files(tmp_path) == ["first.pth", "last_checkpoint"]
    assert ckpt.get_checkpoint_file() == str(tmp_path / "first.pth")


def test_save_dir_types(tmp_path):
    assert Checkpointer(_model(), None).save_dir == ""
    assert Checkpointer(_model(), tmp_path).save_dir == str(tmp_path)
    with pytest.raises(TypeError, match="save_dir must be a str or path, got int"):
        Checkpointer(_model(), 3)


# ----------------------------------------------------------------------------------------------
# Damaged files: always a ValueError naming the path (OSError is kept for real I/O errors)


def _saved(tmp_path):
    model = torch.nn.Linear(30, 30)
    Checkpointer(model, str(tmp_path)).save("model_x")
    return tmp_path / "model_x.pth"


@pytest.mark.parametrize("sixteenths", range(16))
def test_a_truncated_checkpoint_is_a_value_error_naming_it(tmp_path, sixteenths):
    data = _saved(tmp_path).read_bytes()
    cut = tmp_path / "cut.pth"
    cut.write_bytes(data[: len(data) * sixteenths // 16])
    with pytest.raises(ValueError, match=re.escape(str(cut))):
        Checkpointer(torch.nn.Linear(30, 30)).load(str(cut))


@pytest.mark.parametrize("kind", ["last byte cut", "random bytes", "a directory", "model a str"])
def test_other_damaged_checkpoints_are_value_errors_naming_them(tmp_path, kind):
    bad = tmp_path / "bad.pth"
    if kind == "last byte cut":
        bad.write_bytes(_saved(tmp_path).read_bytes()[:-1])
    elif kind == "random bytes":
        bad.write_bytes(np.random.default_rng(0).bytes(5000))
    elif kind == "a directory":
        bad.mkdir()
    else:
        torch.save({"model": "weights.pkl"}, bad)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        Checkpointer(torch.nn.Linear(30, 30)).load(str(bad))


def test_a_binary_last_checkpoint_is_a_value_error_naming_it(tmp_path):
    (tmp_path / "last_checkpoint").write_bytes(b"\xff\xfe\x00model")
    ckpt = Checkpointer(torch.nn.Linear(30, 30), str(tmp_path))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "last_checkpoint"))):
        ckpt.resume_or_load("", resume=True)


def test_load_takes_a_bytes_path_and_names_bad_checkpointables(tmp_path):
    path = _saved(tmp_path)
    model = torch.nn.Linear(30, 30)
    ckpt = Checkpointer(model, str(tmp_path), optimizer=torch.optim.SGD(model.parameters(), 0.1))
    assert ckpt.load(os.fsencode(path), checkpointables=[]) == {}
    for bad in (123, "optimizer"):
        with pytest.raises(TypeError, match="checkpointables"):
            ckpt.load(str(path), checkpointables=bad)


def test_max_to_keep_with_a_save_of_the_subclasss_own(tmp_path):
    """A subclass whose ``save()`` writes the file its own way, without
    ``Checkpointer.save`` (DINOv2's FSDPCheckpointer: ``<name>.rank_0.pth`` and a
    ``last_checkpoint`` pointer of its own naming): ``max_to_keep`` deletes the files that
    ``get_checkpoint_file()`` names after each save, as fvcore does."""
    from hookloop.checkpoint import PeriodicCheckpointer

    class RankFiles(Checkpointer):
        def save(self, name, **kwargs):
            path = os.path.join(self.save_dir, f"{name}.rank_0.pth")
            torch.save({"model": self.model.state_dict(), **kwargs}, path)
            self.tag_last_checkpoint(os.path.basename(path))

    periodic = PeriodicCheckpointer(RankFiles(_model(), str(tmp_path)), 2, 8, max_to_keep=2)
    for it in range(8):
        periodic.step(it)
    assert sorted(os.listdir(tmp_path)) == [
        "last_checkpoint",
        "model_0000005.rank_0.pth",
        "model_0000007.rank_0.pth",
        "model_final.rank_0.pth",
    ]
    assert periodic.recent_checkpoints == [
        str(tmp_path / "model_0000005.rank_0.pth"),
        str(tmp_path / "model_0000007.rank_0.pth"),
    ]
