"""Checkpoints load with torch's weights-only unpickler by default (issue 35): a crafted file
runs no code; every state hookloop saves, files of earlier hookloop versions and numpy data
load; what needs arbitrary unpickling is refused naming the file and the opt-in
(``weights_only=False``), which loads it."""

from __future__ import annotations

import copy
import io
import os
import pickle
import re
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hookloop.checkpoint import Checkpointer
from torch import nn

torch.set_num_threads(1)

# Saved by _run(out, trackers=True) with the code of 5783ca4 (the branch point of the safe
# default), so that files of earlier versions are known to load; how it was made:
#   git worktree add /tmp/old 5783ca4 && cp python/hookloop/_core*.so /tmp/old/python/hookloop/
#   cd /tmp/old && PYTHONPATH=python:tests/checkpoint python3 -c \
#     "from test_safe_load import _run; _run(__import__('pathlib').Path('/tmp/o'), True)"
# then model_0000009.pth (whose queue for an unreachable MLflow holds scalars, images and
# histograms) copied here.
EARLIER = Path(__file__).with_name("data") / "hookloop_5783ca4_model_0000009.pth"
MAX_ITER = 12


class _RunsCode:
    """Unpickled, it makes the directory ``marker``: proof that the file's code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class _Note:
    """A class of the program's own in a checkpoint's extra data: arbitrary unpickling."""

    def __init__(self, text: str) -> None:
        self.text = text


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))


def _crafted(tmp_path: Path, **save_args) -> tuple:
    marker = tmp_path / "code_ran"
    path = tmp_path / "crafted.pth"
    torch.save({"model": _model().state_dict(), "x": _RunsCode(str(marker))}, path, **save_args)
    return path, marker


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-format"])
def test_a_crafted_file_runs_no_code_and_the_error_names_it_and_the_opt_in(tmp_path, zipped):
    path, marker = _crafted(tmp_path, _use_new_zipfile_serialization=zipped)
    with pytest.raises(ValueError) as info:
        Checkpointer(_model()).load(str(path))
    assert not marker.exists()
    message = str(info.value)
    assert str(path) in message and "weights_only=False" in message
    assert "posix.mkdir" in message or "os.mkdir" in message
    assert "trust" in message


def test_resuming_from_a_crafted_last_checkpoint_runs_no_code(tmp_path):
    path, marker = _crafted(tmp_path)
    (tmp_path / "last_checkpoint").write_text(path.name)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        Checkpointer(_model(), str(tmp_path)).resume_or_load("", resume=True)
    assert not marker.exists()


def test_the_opt_in_unpickles_what_the_file_holds(tmp_path):
    path, marker = _crafted(tmp_path)
    Checkpointer(_model()).load(str(path), weights_only=False)
    assert marker.is_dir()  # what weights_only=False means: the file's code runs

    Checkpointer(_model(), str(tmp_path)).save("noted", note=_Note("kept"))
    noted = str(tmp_path / "noted.pth")
    with pytest.raises(ValueError, match=r"noted\.pth.*_Note.*weights_only=False"):
        Checkpointer(_model()).load(noted)
    assert Checkpointer(_model(), weights_only=False).load(noted)["note"].text == "kept"
    assert Checkpointer(_model()).load(noted, weights_only=False)["note"].text == "kept"
    resumed = Checkpointer(_model(), str(tmp_path)).resume_or_load("", weights_only=False)
    assert resumed["note"].text == "kept"
    # The per-call choice lasts one call.
    ckpt = Checkpointer(_model())
    ckpt.load(noted, weights_only=False)
    with pytest.raises(ValueError, match="weights_only=False"):
        ckpt.load(noted)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_weights_only_must_be_a_bool(tmp_path, bad):
    with pytest.raises(TypeError, match="weights_only must be a bool"):
        Checkpointer(_model(), weights_only=bad)
    Checkpointer(_model(), str(tmp_path)).save("m")
    with pytest.raises(TypeError, match="weights_only must be a bool"):
        Checkpointer(_model()).load(str(tmp_path / "m.pth"), weights_only=bad)


def test_numpy_scalars_and_arrays_load_and_object_arrays_do_not(tmp_path):
    """An evaluator's numpy metrics in the extra data, and numpy arrays (which fvcore's format
    takes in ``model``) are data; an object array is not."""
    extra = {"ap": np.float64(0.5), "n": np.int64(3), "hist": np.arange(4, dtype=np.uint8)}
    Checkpointer(_model(), str(tmp_path)).save("np", **extra)
    loaded = Checkpointer(_model()).load(str(tmp_path / "np.pth"))
    assert loaded["ap"] == 0.5 and type(loaded["ap"]) is np.float64
    assert loaded["n"] == 3 and np.array_equal(loaded["hist"], extra["hist"])

    torch.save({"model": {}, "o": np.array([{"a": 1}], dtype=object)}, tmp_path / "obj.pth")
    with pytest.raises(ValueError, match=r"obj\.pth.*a numpy object array.*weights_only=False"):
        Checkpointer(_model()).load(str(tmp_path / "obj.pth"))


# numpy data as checkpoints hold it: an evaluator's metrics, arrays of every plain dtype. (Not
# an empty array: protocol 2 pickles b"" as builtins.bytes(), which torch's unpickler refuses.)
_NUMPY_DATA = {
    "ap": np.float64(0.5),
    "n": np.int64(3),
    "ok": np.bool_(True),
    "f32": np.float32(1.5),
    "z": np.complex128(1 - 2j),
    "ints": np.arange(6, dtype=np.int32).reshape(2, 3),
    "u8": np.arange(4, dtype=np.uint8),
    "floats": np.linspace(0, 1, 5),
    "halves": np.ones(3, dtype=np.float16),
    "bools": np.array([True, False]),
    "zero_d": np.array(2.5),
    "zero_d_int": np.array(7),
    "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    "big_endian": np.arange(3, dtype=">i4"),
    "dtype": np.dtype("f4"),
    "nested": [np.float64(1.0), (np.arange(2), {"x": np.array(True)})],
}


def _same(loaded, expected) -> bool:
    """As numpy's own unpickling gives it: the same type, dtype, shape and values."""
    if isinstance(expected, (list, tuple)):
        return type(loaded) is type(expected) and all(map(_same, loaded, expected))
    if isinstance(expected, dict):
        return loaded.keys() == expected.keys() and all(
            _same(loaded[k], expected[k]) for k in expected
        )
    if isinstance(expected, np.dtype):
        return loaded == expected
    mine = pickle.loads(pickle.dumps(expected, protocol=2))
    return (
        type(loaded) is type(mine)
        and loaded.dtype == mine.dtype
        and np.shape(loaded) == np.shape(mine)
        and np.array_equal(loaded, mine)
    )


@pytest.mark.parametrize("names", ["numpy 2", "numpy 1"])
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-format"])
def test_numpy_data_loads_as_numpy_unpickles_it(tmp_path, names, zipped):
    """numpy 1.x pickles name ``numpy.core.multiarray``, numpy 2's ``numpy._core`` (only the
    legacy format holds the pickle as plain bytes that can be renamed)."""
    if names == "numpy 1" and zipped:
        pytest.skip("the zip format's pickle cannot be renamed in place")
    buf = io.BytesIO()
    torch.save({"model": {}, **_NUMPY_DATA}, buf, _use_new_zipfile_serialization=zipped)
    data = buf.getvalue()
    if names == "numpy 1":
        assert b"numpy._core.multiarray" in data
        data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    (tmp_path / "np.pth").write_bytes(data)
    loaded = Checkpointer(_model()).load(str(tmp_path / "np.pth"), checkpointables=[])
    assert _same(loaded, _NUMPY_DATA)
    # Nothing of hookloop's stand-ins is left in what a load returns.
    assert b"hookloop" not in pickle.dumps(loaded)
    copied = copy.deepcopy(loaded)
    assert _same(copied, _NUMPY_DATA)


def _load_as_06d76c0(path: Path):
    """torch.load with numpy's classes allowed, as hookloop 06d76c0 loaded (for data that
    is not crafted, which it rebuilt as numpy does)."""
    from numpy._core import multiarray

    allowed = [np.ndarray, np.dtype]
    allowed += sorted({type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDG"}, key=repr)
    for name in ("scalar", "_reconstruct"):
        allowed.append((getattr(multiarray, name), f"numpy._core.multiarray.{name}"))
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-format"])
def test_every_pickle_protocol_loads_as_it_did_before_the_checks(tmp_path, protocol, zipped):
    """torch's weights-only unpickler reads only protocol 2 (torch.save's default): each
    protocol loads (the same data) exactly when it loaded with numpy's classes allowed."""
    path = tmp_path / "np.pth"
    torch.save(
        {"model": {}, **_NUMPY_DATA},
        path,
        pickle_protocol=protocol,
        _use_new_zipfile_serialization=zipped,
    )
    try:
        before = _load_as_06d76c0(path)
    except pickle.UnpicklingError:
        before = None
    if before is None:
        with pytest.raises(ValueError, match="Unsupported operand"):
            Checkpointer(_model()).load(str(path), checkpointables=[])
    else:
        loaded = Checkpointer(_model()).load(str(path), checkpointables=[])
        assert _same(loaded, _NUMPY_DATA)
    assert (before is not None) == (protocol == 2)


def test_a_model_zoo_pkl_given_to_checkpointer_points_to_detection_checkpointer(tmp_path):
    """Never to weights_only=False, which would run the file's code and then fail on its
    format."""
    path = tmp_path / "R-50.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": {"w": np.zeros(2, np.float32)}, "__author__": "x"}, f, protocol=2)
    with pytest.raises(ValueError) as info:
        Checkpointer(_model()).load(str(path))
    message = str(info.value)
    assert str(path) in message and "DetectionCheckpointer" in message
    assert "weights_only=False" not in message
    # A file of torch.save named .pkl is a checkpoint like any other.
    torch.save({"model": _model().state_dict(), "note": _Note("x")}, tmp_path / "saved.pkl")
    with pytest.raises(ValueError, match=r"saved\.pkl.*_Note.*weights_only=False"):
        Checkpointer(_model()).load(str(tmp_path / "saved.pkl"))


def test_another_threads_torch_load_during_a_load_is_refused_as_torch_refuses_it(
    tmp_path, monkeypatch
):
    """torch's allowlist is one for the process: while a hookloop load holds numpy's names in
    it, a plain ``torch.load(weights_only=True)`` on another thread meets them refused."""
    torch.save({"a": np.arange(3)}, tmp_path / "plain.pth")
    Checkpointer(_model(), str(tmp_path)).save("ckpt", a=np.arange(3))
    with pytest.raises(pickle.UnpicklingError) as outside:
        torch.load(tmp_path / "plain.pth", weights_only=True)

    real_load = torch.load
    seen: dict = {}

    def other_thread() -> None:
        try:
            seen["result"] = real_load(tmp_path / "plain.pth", weights_only=True)
        except BaseException as e:  # noqa: BLE001 (whatever it raises is the finding)
            seen["error"] = e

    def load_while_another_thread_loads(*args, **kwargs):
        if not seen:  # the hookloop load's own torch.load, its allowance in place
            seen["allowed"] = [
                g[1] for g in torch.serialization.get_safe_globals() if isinstance(g, tuple)
            ]
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load_while_another_thread_loads)
    extra = Checkpointer(_model()).load(str(tmp_path / "ckpt.pth"))
    assert np.array_equal(extra["a"], np.arange(3))
    assert "numpy._core.multiarray._reconstruct" in seen["allowed"]
    assert "result" not in seen
    error = seen["error"]
    assert type(error) is type(outside.value)
    refusal = "GLOBAL numpy._core.multiarray._reconstruct was not an allowed global"
    assert refusal in str(outside.value) and refusal in str(error)
    assert "Weights only load failed" in str(error)


def test_loads_on_two_threads_each_keep_their_allowance(tmp_path, monkeypatch):
    """A load that finishes does not take numpy's names from one still running."""
    Checkpointer(_model(), str(tmp_path)).save("ckpt", a=np.arange(3))
    before = set(torch.serialization.get_safe_globals())
    real_load = torch.load
    second_inside, first_done = threading.Event(), threading.Event()

    def load(*args, **kwargs):
        if threading.current_thread().name == "second":
            second_inside.set()
            first_done.wait(30)  # the first load has come and gone meanwhile
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    results: dict = {}

    def run() -> None:
        try:
            results[threading.current_thread().name] = Checkpointer(_model()).load(
                str(tmp_path / "ckpt.pth")
            )["a"]
        except BaseException as e:  # noqa: BLE001 (whatever it raises is the finding)
            results[threading.current_thread().name] = e

    second = threading.Thread(target=run, name="second")
    second.start()
    assert second_inside.wait(30)
    first = threading.Thread(target=run, name="first")
    first.start()
    first.join(30)
    first_done.set()
    second.join(30)
    assert np.array_equal(results["first"], np.arange(3)), results["first"]
    assert np.array_equal(results["second"], np.arange(3)), results["second"]
    assert set(torch.serialization.get_safe_globals()) == before


def test_numpy_data_pickled_by_numpy_1_loads(tmp_path):
    """numpy 1.x pickles name ``numpy.core.multiarray``, numpy 2's ``numpy._core``."""
    buf = io.BytesIO()
    extra = {"ap": np.float64(0.5), "a": np.arange(3)}
    torch.save({"model": {}, **extra}, buf, _use_new_zipfile_serialization=False)
    assert b"numpy._core.multiarray" in buf.getvalue()  # a plain pickle: the name is its text
    old = buf.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    (tmp_path / "np1.pth").write_bytes(old)
    loaded = Checkpointer(_model()).load(str(tmp_path / "np1.pth"), checkpointables=[])
    assert loaded["ap"] == 0.5 and np.array_equal(loaded["a"], extra["a"])


def test_the_programs_own_safe_globals_are_left_as_they_were(tmp_path):
    Checkpointer(_model(), str(tmp_path)).save("np", ap=np.float64(0.5))
    before = list(torch.serialization.get_safe_globals())  # torch adds some of its own
    Checkpointer(_model()).load(str(tmp_path / "np.pth"))
    # The same globals (torch keeps no order that a restore could keep: its own DTensor
    # entries come back in another order after a load, depending on earlier tests).
    assert set(torch.serialization.get_safe_globals()) == set(before)
    # One of those a load adds, allowed by the program before: still allowed after.
    torch.serialization.add_safe_globals([np.ndarray, _Note])
    try:
        Checkpointer(_model()).load(str(tmp_path / "np.pth"))
        assert set(torch.serialization.get_safe_globals()) == {*before, np.ndarray, _Note}
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    # Outside a load, numpy scalars are refused as torch refuses them.
    buf = io.BytesIO()
    torch.save({"ap": np.float64(0.5)}, buf)
    buf.seek(0)
    with pytest.raises(Exception, match="scalar"):
        torch.load(buf, weights_only=True)


@pytest.mark.parametrize("entry", ["adam", 3, None])
def test_an_entry_that_is_not_a_state_names_the_file_and_the_key(tmp_path, entry):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.save({"model": model.state_dict(), "optimizer": entry}, tmp_path / "str_opt.pth")
    with pytest.raises(ValueError, match=r"str_opt\.pth: its 'optimizer' entry"):
        Checkpointer(model, optimizer=opt).load(str(tmp_path / "str_opt.pth"))


def test_a_trainer_entry_whose_optimizer_is_a_str_names_the_file_and_the_key(tmp_path):
    from hookloop.engine import SimpleTrainer

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = SimpleTrainer(model, [], opt)
    state = {"iteration": 4, "optimizer": "sgd"}
    torch.save({"model": model.state_dict(), "trainer": state}, tmp_path / "t.pth")
    with pytest.raises(ValueError, match=r"t\.pth: its 'trainer' entry.*'str' object"):
        Checkpointer(model, trainer=trainer).load(str(tmp_path / "t.pth"))


# ----------------------------------------------------------------------------------------------
# Every state hookloop saves is data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(out: Path, trackers: bool, amp: bool = False, train: bool = True):
    """A SimpleTrainer (or AMPTrainer) with every stateful hook of hookloop's (the LR
    schedule, PreciseBN's data position, the evaluation, best checkpoint and early stopping
    records, the writers' states: with ``trackers``, an MLflow and a W&B run and a queue of
    scalars, images and histograms for an MLflow server that is down), a resumable loader
    and the storage's history, trained (if ``train``) ``MAX_ITER`` iterations with periodic,
    best and final checkpoints in ``out``. Returns the trainer and its BestCheckpointer."""
    from fvcore.common.param_scheduler import CosineParamScheduler
    from hookloop.data import TrainingSampler
    from hookloop.engine import AMPTrainer, HookBase, SimpleTrainer, hooks
    from hookloop.engine.extra_hooks import EarlyStopping
    from hookloop.solver.lr_scheduler import LRMultiplier, WarmupParamScheduler
    from hookloop.utils.events import JSONWriter, TensorboardXWriter

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, batch):
            x, y = batch
            return {"loss": ((self.net(x) - y) ** 2).mean()}

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=TrainingSampler(64, seed=1))
    bn_loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

    class Inputs:
        def __iter__(self):
            return (x for x, _ in bn_loader)

    trainer = (AMPTrainer if amp else SimpleTrainer)(model, loader, opt)
    schedule = WarmupParamScheduler(CosineParamScheduler(1.0, 0.0), 0.1, 0.25)
    checkpointer = Checkpointer(model, str(out), trainer=trainer)
    best = hooks.BestCheckpointer(5, checkpointer, "acc")
    scores = iter(np.linspace(0.1, 0.9, 100))

    class Visualize(HookBase):
        def after_step(self) -> None:
            self.trainer.storage.put_image("img", torch.rand(3, 4, 4))
            self.trainer.storage.put_histogram("hist", torch.randn(10), bins=4)

    writers = [JSONWriter(str(out / "metrics.json")), TensorboardXWriter(str(out))]
    if trackers:
        from hookloop.utils.events import MLflowWriter
        from hookloop.utils.wandb_writer import WandbWriter

        writers += [
            MLflowWriter(
                f"sqlite:///{out}/mlflow.db",
                experiment_name="safe-load",
                artifact_location=str(out / "artifacts"),
            ),
            WandbWriter(dir=str(out)),
            MLflowWriter(f"http://127.0.0.1:{_free_port()}", run_id="0123abcd", close_timeout=0),
        ]
    trainer.register_hooks(
        [
            hooks.IterationTimer(),
            hooks.LRScheduler(opt, LRMultiplier(opt, schedule, MAX_ITER)),
            hooks.PreciseBN(5, net, Inputs(), 2),
            # numpy metrics, as evaluators return them
            hooks.EvalHook(5, lambda: {"acc": np.float64(next(scores)), "n": np.int64(2)}),
            best,
            EarlyStopping("acc", patience=100),
            Visualize(),
            hooks.PeriodicWriter(writers, period=5),
            hooks.PeriodicCheckpointer(checkpointer, 5, max_iter=MAX_ITER, max_to_keep=2),
        ]
    )
    if train:
        trainer.train(0, MAX_ITER)
    return trainer, best


def _isolate_trackers(tmp_path, monkeypatch) -> None:
    from utils import wandb_env  # tests/utils

    wandb_env.isolate(tmp_path, monkeypatch)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")


@pytest.mark.slow
# mlflow's and wandb's own deprecations (as in tests/utils/test_mlflow_writer.py).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("amp", [False, True], ids=["SimpleTrainer", "AMPTrainer"])
def test_every_state_hookloop_saves_loads_with_weights_only(tmp_path, monkeypatch, amp):
    """Not even numpy is needed: ``torch.load(weights_only=True)`` with no allowed globals."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    _isolate_trackers(tmp_path, monkeypatch)
    _run(tmp_path, trackers=True, amp=amp)
    files = sorted(tmp_path.glob("*.pth"))
    assert [f.name for f in files] == [
        "model_0000004.pth",
        "model_0000009.pth",
        "model_best.pth",
        "model_final.pth",
    ]
    for f in files:
        state = torch.load(f, weights_only=True)
        assert state["trainer"]["iteration"] in (4, 9, MAX_ITER - 1, MAX_ITER)  # best: at 12
    state = torch.load(tmp_path / "model_0000009.pth", weights_only=True)
    pending = state["trainer"]["hookloop_hooks"]["PeriodicWriter"]["writers"]["4:MLflowWriter"]
    assert any(("image", "img") in row[2] for row in pending["pending"])


def test_a_file_of_an_earlier_version_loads_and_resumes(tmp_path, caplog):
    """A checkpoint that hookloop 5783ca4 saved with every stateful hook and the trackers'
    queues (see EARLIER) loads with the default and the run continues from it."""
    assert torch.load(EARLIER, weights_only=True)["trainer"]["iteration"] == 9
    trainer, best = _run(tmp_path, trackers=False, train=False)
    extra = Checkpointer(trainer.model, trainer=trainer).load(str(EARLIER))
    assert extra == {"iteration": 9}
    assert trainer.iter == 9
    assert best.best_iter == 9 and best.best_metric == pytest.approx(0.1 + 0.8 / 99)
    trainer.train(10, MAX_ITER)
    final = torch.load(tmp_path / "model_final.pth", weights_only=True)
    assert final["trainer"]["iteration"] == MAX_ITER - 1
