"""``hookloop.checkpoint.DetectionCheckpointer`` (issue 41): detectron2's class, loading
model-zoo ``.pkl`` files (detectron2's format, Caffe2/Detectron1's with C2 names, Python 2's
pickles), ``.pth`` files of fvcore and hookloop and ``?matching_heuristics=True``, with
detectron2's log records (compared with detectron2's own class when its source tree is at
``HOOKLOOP_D2_SRC`` or /tmp/d2src), subclasses overriding ``_load_file``/``_load_model``, and
the checkpoint hooks. A crafted ``.pkl`` runs no code and is refused with a ``ValueError``
naming it (checked in a child process, which must neither crash nor run anything)."""

from __future__ import annotations

import collections
import importlib
import inspect
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import types
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import numpy as np
import pytest
import torch
from hookloop.checkpoint import Checkpointer, DetectionCheckpointer, PeriodicCheckpointer
from hookloop.checkpoint.c2_model_loading import (
    align_and_update_state_dicts,
    convert_basic_c2_names,
)
from hookloop.engine import BestCheckpointer, EvalHook, TrainerBase
from hookloop.engine import hooks as hooks_module
from torch import nn

torch.set_num_threads(1)

ZOO_AUTHOR = "Detectron2 Model Zoo"

# ----------------------------------------------------------------------------------------------
# models and files


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 1, bias=False)
        self.conv1.norm = nn.BatchNorm2d(4)  # type: ignore[assignment]
        self.shortcut = nn.Conv2d(4, 8, 1, bias=False)


class _Backbone(nn.Module):
    """ResNet's names in detectron2: ``stem.conv1(.norm)``, ``res2.0.conv1``, ..."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Module()
        self.stem.conv1 = nn.Conv2d(3, 4, 3, bias=False)
        self.stem.conv1.norm = nn.BatchNorm2d(4)  # type: ignore[assignment]
        self.res2 = nn.ModuleList([_Block()])


class _Detector(nn.Module):
    """A detector's nesting: the ImageNet backbone under ``backbone.bottom_up``, a classifier
    head, a box predictor, and the pixel statistics buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.bottom_up = _Backbone()
        self.head = nn.Module()
        self.head.fc1000 = nn.Linear(4, 5)
        self.roi_heads = nn.Module()
        self.roi_heads.box_predictor = nn.Module()
        self.roi_heads.box_predictor.cls_score = nn.Linear(4, 3)
        self.roi_heads.box_predictor.bbox_pred = nn.Linear(4, 8)
        self.register_buffer("pixel_mean", torch.zeros(3))
        self.register_buffer("pixel_std", torch.ones(3))


def _fresh(cls=_Detector, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def _c2_blobs() -> Dict[str, np.ndarray]:
    """Caffe2 ResNet/Detectron names, with the optimizer's ``_momentum`` blobs, a blob of the
    wrong shape and two that the model does not have."""
    rng = np.random.RandomState(0)

    def f(*shape: int) -> np.ndarray:
        return rng.randn(*shape).astype(np.float32)

    return {
        "conv1_w": f(4, 3, 3, 3),
        "res_conv1_bn_s": f(4),
        "res_conv1_bn_b": f(4),
        "res_conv1_bn_rm": f(4),
        "res_conv1_bn_riv": f(4),
        "res2_0_branch2a_w": f(4, 4, 1, 1),
        "res2_0_branch2a_w_momentum": f(4, 4, 1, 1),
        "res2_0_branch2a_bn_s": f(4),
        "res2_0_branch2a_bn_b": f(4),
        "res2_0_branch1_w": f(8, 4, 3, 3),  # wrong shape: the model's is (8, 4, 1, 1)
        "fc1000_w": f(5, 4),
        "fc1000_b": f(5),
        "fc1000_b_momentum": f(5),
        "cls_score_w": f(3, 4),
        "cls_score_b": f(3),
        "bbox_pred_w": f(12, 4),
        "bbox_pred_b": f(12),
        "extra_w": f(2),
    }


# What detectron2's DetectionCheckpointer logs loading c2.pkl (made of _c2_blobs()) into
# _Detector; logger names without "detectron2."/"hookloop.", "checkpointer" for fvcore's.
C2_RECORDS = [
    ("checkpoint.detection_checkpoint", "INFO", "[DetectionCheckpointer] Loading from {path} ..."),
    ("checkpointer", "INFO", "[Checkpointer] Loading from {path} ..."),
    ("checkpoint.c2_model_loading", "INFO", "Renaming Caffe2 weights ......"),
    (
        "checkpoint.c2_model_loading",
        "INFO",
        "Remove prediction weight for background class in bbox_pred.bias. "
        "The shape changes from (12,) to (8,).",
    ),
    (
        "checkpoint.c2_model_loading",
        "INFO",
        "Remove prediction weight for background class in bbox_pred.weight. "
        "The shape changes from (12, 4) to (8, 4).",
    ),
    (
        "checkpoint.c2_model_loading",
        "INFO",
        "Move classification weights for background class in cls_score.bias "
        "from index 0 to index 2.",
    ),
    (
        "checkpoint.c2_model_loading",
        "INFO",
        "Move classification weights for background class in cls_score.weight "
        "from index 0 to index 2.",
    ),
    (
        "checkpoint.c2_model_loading",
        "WARNING",
        "Shape of res2.0.shortcut.weight in checkpoint is torch.Size([8, 4, 3, 3]), while shape "
        "of backbone.bottom_up.res2.0.shortcut.weight in model is torch.Size([8, 4, 1, 1]).",
    ),
    (
        "checkpoint.c2_model_loading",
        "WARNING",
        "res2.0.shortcut.weight will not be loaded. Please double check and see if this is "
        "desired.",
    ),
    (
        "checkpoint.c2_model_loading",
        "INFO",
        "Following weights matched with submodule model - Total num: 6",
    ),
    (
        "checkpointer",
        "WARNING",
        "Some model parameters or buffers are not found in the checkpoint:\n"
        "backbone.bottom_up.res2.0.conv1.norm.{running_mean, running_var}\n"
        "backbone.bottom_up.res2.0.shortcut.weight",
    ),
    (
        "checkpointer",
        "WARNING",
        "The checkpoint state_dict contains keys that are not used by the model:\n"
        "  extra.weight\n  res2.0.shortcut.weight",
    ),
]


def _write_pkl(path: Path, obj, protocol: int = pickle.DEFAULT_PROTOCOL) -> str:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    return str(path)


def _binstring(data: bytes) -> bytes:
    return b"T" + struct.pack("<i", len(data)) + data


def _python2_pickle(arrays: Dict[str, np.ndarray]) -> bytes:
    """What Python 2's ``pickle.dump(arrays, f, 2)`` wrote for float32 arrays with numpy 1
    (Detectron1's model zoo): byte strings (BINSTRING), ``numpy.core`` names, ints for
    ``dtype``'s flags."""
    out = [b"\x80\x02}"]  # PROTO 2, EMPTY_DICT
    for key, a in arrays.items():
        assert a.dtype == np.float32
        out.append(_binstring(key.encode()))
        # _reconstruct(ndarray, (0,), 'b')
        out.append(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85")
        out.append(_binstring(b"b") + b"\x87R")
        # BUILD (1, shape, dtype('f4', 0, 1) BUILD (3, '<', None, None, None, -1, -1, 0),
        # False, data)
        shape = b"".join(b"J" + struct.pack("<i", d) for d in a.shape)
        out.append(b"(K\x01(" + shape + b"t")
        out.append(b"cnumpy\ndtype\n" + _binstring(b"f4") + b"K\x00K\x01\x87R")
        out.append(b"(K\x03" + _binstring(b"<") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
        out.append(b"\x89" + _binstring(a.tobytes()) + b"tbs")  # NEWFALSE, data; BUILD; SETITEM
    out.append(b".")
    return b"".join(out)


# ----------------------------------------------------------------------------------------------
# log records


def _short_name(name: str) -> str:
    if name in ("hookloop.checkpoint.checkpointer", "fvcore.common.checkpoint"):
        return "checkpointer"
    for prefix in ("hookloop.", "detectron2."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[Tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((_short_name(record.name), record.levelname, record.getMessage()))


_LOGGERS = ("hookloop.checkpoint", "detectron2.checkpoint", "fvcore.common.checkpoint")


@contextmanager
def _recording() -> Iterator[List[Tuple[str, str, str]]]:
    """The checkpoint loggers' records (of hookloop, detectron2 and fvcore), at INFO."""
    handler = _Records()
    saved = []
    for name in _LOGGERS:
        log = logging.getLogger(name)
        saved.append((log, log.level))
        log.setLevel(logging.INFO)
        log.addHandler(handler)
    try:
        yield handler.records
    finally:
        for log, level in saved:
            log.removeHandler(handler)
            log.setLevel(level)


def _load(cls, model: nn.Module, path: str, **kwargs):
    with _recording() as records:
        ret = cls(model).load(path, **kwargs)
    return ret, records


def _fill(records: List[Tuple[str, str, str]], **values: str) -> List[Tuple[str, str, str]]:
    def fill(message: str) -> str:
        for key, value in values.items():
            message = message.replace("{" + key + "}", value)
        return message

    return [(n, lv, fill(m)) for n, lv, m in records]


def _equal_states(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------------------------
# the class


def test_importable_as_detectron2s_and_its_constructor_is_detectron2s(tmp_path):
    import hookloop.checkpoint.detection_checkpoint as module

    assert module.DetectionCheckpointer is DetectionCheckpointer
    assert issubclass(DetectionCheckpointer, Checkpointer)
    params = inspect.signature(DetectionCheckpointer.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in params.values()][1:] == [
        ("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("save_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, ""),
        ("save_to_disk", inspect.Parameter.KEYWORD_ONLY, None),
        ("checkpointables", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty),
    ]
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = DetectionCheckpointer(model, str(tmp_path), optimizer=opt)
    assert ck.save_to_disk is True  # the main process (the only one here)
    assert ck.checkpointables == {"optimizer": opt}
    assert DetectionCheckpointer(model, str(tmp_path), save_to_disk=False).save_to_disk is False
    DetectionCheckpointer(model, str(tmp_path), save_to_disk=False).save("m")
    assert not (tmp_path / "m.pth").exists()


def test_a_detectron2_zoo_pkl_loads_and_logs_its_author(tmp_path):
    src = _fresh()
    weights = {k: v.numpy().copy() for k, v in src.state_dict().items()}
    path = _write_pkl(tmp_path / "zoo.pkl", {"model": weights, "__author__": ZOO_AUTHOR})
    model = _fresh(seed=1)
    ret, records = _load(DetectionCheckpointer, model, path)
    assert _equal_states(model, src)
    assert ret == {"__author__": ZOO_AUTHOR}
    assert records == [
        (
            "checkpoint.detection_checkpoint",
            "INFO",
            f"[DetectionCheckpointer] Loading from {path} ...",
        ),
        ("checkpointer", "INFO", f"[Checkpointer] Loading from {path} ..."),
        ("checkpointer", "INFO", f"Reading a file from '{ZOO_AUTHOR}'"),
    ]


def test_a_zoo_pkl_of_a_backbone_loads_into_a_nested_model_by_matching_heuristics(tmp_path):
    """detectron2's converted torchvision/ImageNet weights: a backbone's keys, with
    ``matching_heuristics``; the model nests the backbone under ``backbone.bottom_up``."""
    backbone = _fresh(_Backbone)
    weights = {k: v.numpy().copy() for k, v in backbone.state_dict().items()}
    path = _write_pkl(
        tmp_path / "r50.pkl",
        {"model": weights, "__author__": "torchvision", "matching_heuristics": True},
    )
    model = _fresh(seed=1)
    ret, records = _load(DetectionCheckpointer, model, path)
    assert _equal_states(model.backbone.bottom_up, backbone)
    assert ret == {"__author__": "torchvision", "matching_heuristics": True}
    assert records[2:4] == [
        ("checkpointer", "INFO", "Reading a file from 'torchvision'"),
        (
            "checkpoint.c2_model_loading",
            "INFO",
            # detectron2's common prefix: the components equal in the first and last names
            "Following weights matched with submodule backbone.bottom_up - Total num: 3",
        ),
    ]
    # pixel_mean/pixel_std are not reported missing (detectron2 filters them).
    missing = [m for n, lv, m in records if m.startswith("Some model parameters")]
    assert missing and "pixel" not in missing[0] and "roi_heads.box_predictor" in missing[0]


def test_a_caffe2_pkl_loads_into_a_nested_model_renamed_and_matched(tmp_path):
    blobs = _c2_blobs()
    path = _write_pkl(tmp_path / "c2.pkl", {"blobs": blobs, "cfg": "MODEL: ..."}, protocol=2)
    model = _fresh()
    before = model.backbone.bottom_up.res2[0].shortcut.weight.clone()
    ret, records = _load(DetectionCheckpointer, model, path)

    assert records == _fill(C2_RECORDS, path=path)
    assert ret == {"__author__": "Caffe2", "matching_heuristics": True}
    bu = model.backbone.bottom_up
    sd = model.state_dict()
    assert torch.equal(bu.stem.conv1.weight, torch.from_numpy(blobs["conv1_w"]))
    assert torch.equal(bu.stem.conv1.norm.weight, torch.from_numpy(blobs["res_conv1_bn_s"]))
    assert torch.equal(
        sd["backbone.bottom_up.stem.conv1.norm.running_var"],
        torch.from_numpy(blobs["res_conv1_bn_riv"]),
    )
    assert torch.equal(bu.res2[0].conv1.weight, torch.from_numpy(blobs["res2_0_branch2a_w"]))
    assert torch.equal(bu.res2[0].conv1.norm.bias, torch.from_numpy(blobs["res2_0_branch2a_bn_b"]))
    assert torch.equal(bu.res2[0].shortcut.weight, before)  # the blob of the wrong shape
    assert torch.equal(model.head.fc1000.weight, torch.from_numpy(blobs["fc1000_w"]))
    assert torch.equal(model.head.fc1000.bias, torch.from_numpy(blobs["fc1000_b"]))
    box = model.roi_heads.box_predictor
    # The background class: C2's first row moves last in cls_score, and goes from bbox_pred.
    assert torch.equal(box.cls_score.weight, torch.from_numpy(blobs["cls_score_w"][[1, 2, 0]]))
    assert torch.equal(box.cls_score.bias, torch.from_numpy(blobs["cls_score_b"][[1, 2, 0]]))
    assert torch.equal(box.bbox_pred.weight, torch.from_numpy(blobs["bbox_pred_w"][4:]))
    assert torch.equal(box.bbox_pred.bias, torch.from_numpy(blobs["bbox_pred_b"][4:]))


def test_an_imagenet_caffe2_pkl_has_no_blobs_entry_and_its_momentum_is_dropped(tmp_path):
    blobs = {k: v for k, v in _c2_blobs().items() if not k.startswith(("cls", "bbox"))}
    path = _write_pkl(tmp_path / "R-50.pkl", blobs, protocol=2)
    model = _fresh()
    _, records = _load(DetectionCheckpointer, model, path)
    assert torch.equal(model.head.fc1000.bias, torch.from_numpy(blobs["fc1000_b"]))
    unexpected = [m for n, lv, m in records if m.startswith("The checkpoint state_dict")]
    assert unexpected == [
        "The checkpoint state_dict contains keys that are not used by the model:\n"
        "  extra.weight\n  res2.0.shortcut.weight"
    ]


def test_a_python2_detectron1_pkl_loads(tmp_path):
    blobs = {k: v for k, v in _c2_blobs().items() if k.startswith(("conv1", "res_conv1", "fc"))}
    data = _python2_pickle(blobs)
    assert b"numpy.core.multiarray" in data and b"_codecs" not in data
    path = tmp_path / "detectron1.pkl"
    path.write_bytes(data)
    model = _fresh()
    DetectionCheckpointer(model).load(str(path))
    assert torch.equal(
        model.backbone.bottom_up.stem.conv1.weight, torch.from_numpy(blobs["conv1_w"])
    )
    assert torch.equal(model.head.fc1000.weight, torch.from_numpy(blobs["fc1000_w"]))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_numpy_data_of_any_pickle_protocol_loads_and_arrays_are_plain(tmp_path, protocol):
    """Protocols 0-2 write bytes through ``_codecs.encode``, 5 arrays through
    ``_frombuffer``: a format, not code, so these load with the default."""
    src = _fresh()
    weights = collections.OrderedDict((k, v.numpy().copy()) for k, v in src.state_dict().items())
    extra = {"scale": np.float64(0.5), "shape": (np.arange(3, dtype=np.int64), b"\x00\x01")}
    obj = {"model": weights, "__author__": "me", "extra": extra}
    path = _write_pkl(tmp_path / "p.pkl", obj, protocol=protocol)
    model = _fresh(seed=1)
    ret = DetectionCheckpointer(model).load(path)
    assert _equal_states(model, src)
    scale, (arange, raw) = ret["extra"]["scale"], ret["extra"]["shape"]
    assert type(scale) is np.float64 and scale == 0.5
    assert type(arange) is np.ndarray and arange.tolist() == [0, 1, 2]
    assert raw == b"\x00\x01"


def test_a_pth_written_by_fvcore_loads(tmp_path):
    fv = pytest.importorskip("fvcore.common.checkpoint")
    src = _fresh()
    opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    fv.Checkpointer(src, str(tmp_path), optimizer=opt).save("fv", iteration=7)
    model = _fresh(seed=1)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    with _recording() as records:
        ret = DetectionCheckpointer(model, str(tmp_path), optimizer=opt2).resume_or_load("x")
    path = str(tmp_path / "fv.pth")
    assert _equal_states(model, src) and ret == {"iteration": 7}
    assert opt2.param_groups[0]["lr"] == 0.1
    assert records == [
        (
            "checkpoint.detection_checkpoint",
            "INFO",
            f"[DetectionCheckpointer] Loading from {path} ...",
        ),
        ("checkpointer", "INFO", f"[Checkpointer] Loading from {path} ..."),
        ("checkpointer", "INFO", f"Loading optimizer from {path} ..."),
    ]


def test_a_hookloop_checkpoint_resumes(tmp_path):
    src = _fresh()
    opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    Checkpointer(src, str(tmp_path), optimizer=opt).save("model_0000009", iteration=9)
    model = _fresh(seed=1)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ck = DetectionCheckpointer(model, str(tmp_path), optimizer=opt2)
    assert ck.resume_or_load("", resume=True) == {"iteration": 9}
    assert _equal_states(model, src) and opt2.param_groups[0]["lr"] == 0.1
    # resume=False loads the model of the given file only.
    model3 = _fresh(seed=2)
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.5)
    ck3 = DetectionCheckpointer(model3, str(tmp_path), optimizer=opt3)
    ret = ck3.resume_or_load(str(tmp_path / "model_0000009.pth"), resume=False)
    assert sorted(ret) == ["iteration", "optimizer"] and ret["iteration"] == 9
    assert _equal_states(model3, src) and opt3.param_groups[0]["lr"] == 0.5


def test_a_bare_state_dict_and_the_matching_heuristics_query(tmp_path):
    backbone = _fresh(_Backbone)
    path = tmp_path / "bare.pth"
    torch.save(backbone.state_dict(), path)
    # Without the query the backbone's keys match nothing of the nested model.
    model = _fresh(seed=1)
    DetectionCheckpointer(model).load(str(path))
    assert not _equal_states(model.backbone.bottom_up, backbone)
    model = _fresh(seed=1)
    ret, records = _load(DetectionCheckpointer, model, f"{path}?matching_heuristics=True")
    assert _equal_states(model.backbone.bottom_up, backbone)
    assert ret == {"matching_heuristics": True}
    assert records[:2] == [
        (
            "checkpoint.detection_checkpoint",
            "INFO",
            f"[DetectionCheckpointer] Loading from {path}?matching_heuristics=True ...",
        ),
        ("checkpointer", "INFO", f"[Checkpointer] Loading from {path} ..."),
    ]
    assert records[2][2].startswith("Following weights matched with submodule backbone.bottom_up")


def test_load_file_outside_load_reads_the_file_as_load_does(tmp_path):
    """TFA's ``test_net.py --eval-all`` calls ``_load_model(_load_file(path))`` itself, for
    each checkpoint of a run: detectron2 asserts that ``_load_file`` runs inside ``load``;
    hookloop's reads the file as ``load`` does for a path without a query."""
    src = _fresh()
    opt = torch.optim.SGD(src.parameters(), lr=0.1)
    Checkpointer(src, str(tmp_path), optimizer=opt).save("model_0000003", iteration=3)
    model = _fresh(seed=1)
    ck = DetectionCheckpointer(model, str(tmp_path))
    loaded = ck._load_file(str(tmp_path / "model_0000003.pth"))
    assert sorted(loaded) == ["iteration", "model", "optimizer"]
    ck._load_model(loaded)
    assert _equal_states(model, src)


def test_an_unsupported_query_is_refused_before_reading_and_load_works_after(tmp_path):
    path = tmp_path / "m.pth"
    src = _fresh()
    torch.save({"model": src.state_dict()}, path)
    ck = DetectionCheckpointer(_fresh(seed=1))
    with pytest.raises(ValueError, match=r"Unsupported query remaining: \{'foo': \['1'\]\}"):
        ck.load(f"{path}?foo=1")
    with pytest.raises(FileNotFoundError):
        ck.load(str(tmp_path / "missing.pth"))
    ck.load(str(path))  # detectron2 asserts here: its URL of the failed load was kept
    assert _equal_states(ck.model, src)


def test_pixel_stats_and_cell_anchors_are_not_reported(tmp_path):
    src = _fresh()
    state = {k: v for k, v in src.state_dict().items() if not k.startswith("pixel_")}
    state["proposal_generator.anchor_generator.cell_anchors.0"] = torch.zeros(3, 4)
    state["other.weight"] = torch.zeros(1)
    torch.save({"model": state}, tmp_path / "old.pth")
    _, records = _load(DetectionCheckpointer, _fresh(seed=1), str(tmp_path / "old.pth"))
    assert records[2:] == [
        (
            "checkpointer",
            "WARNING",
            "The checkpoint state_dict contains keys that are not used by the model:\n"
            "  other.weight",
        )
    ]
    # fvcore's Checkpointer reports both.
    _, records = _load(Checkpointer, _fresh(seed=1), str(tmp_path / "old.pth"))
    assert "pixel_mean" in records[1][2] and "cell_anchors" in records[2][2]


# ----------------------------------------------------------------------------------------------
# align_and_update_state_dicts


def test_c2_names_convert_as_detectron2s():
    assert convert_basic_c2_names(
        ["conv1_w", "res_conv1_bn_s", "res2_0_branch2a_w", "res3_1_branch2c_bn_rm", "pred_b"]
    ) == [
        "stem.conv1.weight",
        "stem.conv1.norm.weight",
        "res2.0.conv1.weight",
        "res3.1.conv3.norm.running_mean",
        "linear.bias",
    ]


def test_one_checkpoint_key_matching_two_model_keys_is_an_error(caplog):
    model = {"teacher.fc.weight": torch.zeros(2), "student.fc.weight": torch.zeros(2)}
    with caplog.at_level(logging.ERROR, logger="hookloop.checkpoint.c2_model_loading"):
        with pytest.raises(ValueError, match="Cannot match one checkpoint key to multiple keys"):
            align_and_update_state_dicts(model, {"fc.weight": torch.ones(2)}, c2_conversion=False)
    assert [r.getMessage() for r in caplog.records] == [
        "Ambiguity found for fc.weight in checkpoint!It matches at least two keys in the model "
        "(teacher.fc.weight and student.fc.weight)."
    ]


def test_keys_match_only_whole_components_and_the_longest_wins():
    model = {
        "a.whatever_conv1.weight": torch.zeros(1),
        "a.b.conv1.weight": torch.zeros(2),
        "x.conv1.weight": torch.zeros(3),
    }
    ckpt = {"conv1.weight": torch.ones(3), "b.conv1.weight": torch.ones(2), "z": torch.ones(1)}
    out = align_and_update_state_dicts(model, ckpt, c2_conversion=False)
    assert list(out) == ["a.b.conv1.weight", "x.conv1.weight", "z"]
    assert out["a.b.conv1.weight"] is ckpt["b.conv1.weight"]


# ----------------------------------------------------------------------------------------------
# subclasses and the hooks


class _TeacherStudent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = _Backbone()
        self.student = _Backbone()


class _RenamingCheckpointer(DetectionCheckpointer):
    """A ``_load_file`` that calls detectron2's and renames keys, a ``_load_model`` that loads
    one backbone's weights into both models of a teacher/student pair, a ``_torch_load`` that
    counts its calls (real repos: semi-supervised detectors' checkpointers)."""

    torch_loads = 0

    def _load_file(self, filename):
        loaded = super()._load_file(filename)
        loaded["model"] = {k.replace("legacy_", ""): v for k, v in loaded["model"].items()}
        return loaded

    def _torch_load(self, f):
        type(self).torch_loads += 1
        return super()._torch_load(f)

    def _load_model(self, checkpoint):
        state = checkpoint.pop("model")
        checkpoint["model"] = {
            f"{who}.{k}": v for who in ("teacher", "student") for k, v in state.items()
        }
        return super()._load_model(checkpoint)


@pytest.mark.parametrize("suffix", [".pkl", ".pth"])
def test_a_subclass_overriding_load_file_and_load_model(tmp_path, suffix):
    backbone = _fresh(_Backbone)
    weights = {f"legacy_{k}": v.numpy().copy() for k, v in backbone.state_dict().items()}
    path = tmp_path / f"w{suffix}"
    if suffix == ".pkl":
        _write_pkl(path, {"model": weights, "__author__": "me"})
    else:
        torch.save({"model": {k: torch.from_numpy(v) for k, v in weights.items()}}, path)
    _RenamingCheckpointer.torch_loads = 0
    model = _fresh(_TeacherStudent, seed=1)
    ret, records = _load(_RenamingCheckpointer, model, str(path))
    assert _equal_states(model.teacher, backbone) and _equal_states(model.student, backbone)
    assert _RenamingCheckpointer.torch_loads == (suffix == ".pth")
    assert [m for n, lv, m in records if lv == "WARNING"] == []


class _Trainer(TrainerBase):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.model.weight.zero_()

    def run_step(self) -> None:
        with torch.no_grad():
            self.model.weight.add_(1)


def test_the_checkpoint_hooks_save_through_it_and_it_resumes(tmp_path):
    trainer = _Trainer()
    ck = DetectionCheckpointer(trainer.model, str(tmp_path), trainer=trainer)
    scores = iter([0.1, 0.9, 0.2])
    trainer.register_hooks(
        [
            EvalHook(2, lambda: {"acc": next(scores)}),
            BestCheckpointer(2, ck, "acc"),
            hooks_module.PeriodicCheckpointer(ck, 3, max_to_keep=1),
        ]
    )
    trainer.train(0, 5)  # periodic at 2; evals at 1, 3, 5: the best is iteration 3's
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".pth"))
    assert names == ["model_0000002.pth", "model_best.pth", "model_final.pth"]
    best = torch.load(tmp_path / "model_best.pth", weights_only=True)
    assert best["iteration"] == 3 and best["model"]["weight"].item() == 4.0

    resumed = _Trainer()
    ck2 = DetectionCheckpointer(resumed.model, str(tmp_path), trainer=resumed)
    ck2.resume_or_load("", resume=True)
    assert resumed.iter == 4 and resumed.model.weight.item() == 5.0

    periodic = PeriodicCheckpointer(ck2, 2, max_iter=4, max_to_keep=1)
    for it in range(4):
        periodic.step(it)
    assert not (tmp_path / "model_0000001.pth").exists()
    assert (tmp_path / "model_0000003.pth").exists() and (tmp_path / "model_final.pth").exists()


def _ddp_worker(out: str) -> None:
    """Rank 1 cannot read the file that rank 0 loads: both warn, rank 1 loads nothing, then
    rank 0's states are broadcast (detectron2's ``need_sync``)."""
    import torch.distributed as dist
    from hookloop.utils import comm

    rank = comm.get_rank()
    model = nn.parallel.DistributedDataParallel(_fresh(seed=1))
    path = os.path.join(out, "weights.pth" if rank == 0 else "only-on-rank-0.pth")
    with _recording() as records:
        DetectionCheckpointer(model).load(path)
    dist.barrier()
    weights = {k: v.tolist() for k, v in model.module.state_dict().items()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"records": records, "weights": weights}, f)


@pytest.mark.slow
def test_a_file_only_rank_0_reads_is_broadcast_to_the_other_ranks(tmp_path, monkeypatch):
    from hookloop.engine import launch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    src = _fresh()
    torch.save({"model": src.state_dict()}, tmp_path / "weights.pth")
    launch(_ddp_worker, 2, dist_url="auto", args=(str(tmp_path),))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = {k: v.tolist() for k, v in src.state_dict().items()}
    assert ranks[0]["weights"] == expected and ranks[1]["weights"] == expected
    warning = (
        "checkpoint.detection_checkpoint",
        "WARNING",
        "Not all workers can read checkpoint {}. Training may fail to fully resume.",
    )
    broadcast = (
        "checkpoint.detection_checkpoint",
        "INFO",
        "Broadcasting model states from main worker ...",
    )
    for rank, path in ((0, "weights.pth"), (1, "only-on-rank-0.pth")):
        records = [tuple(r) for r in ranks[rank]["records"]]
        assert warning[:2] + (warning[2].format(tmp_path / path),) in records
        assert records[-1] == broadcast
    assert ("checkpointer", "INFO", "No checkpoint found. Initializing model from scratch") in [
        tuple(r) for r in ranks[1]["records"]
    ]


# ----------------------------------------------------------------------------------------------
# crafted files: no code runs, nothing crashes, a ValueError names the file


class _RunsShell:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Evals:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w').close()",))


class _CraftedDtype:
    """``numpy.dtype("f8")`` whose BUILD gives it a subarray (numpy takes that state)."""

    def __init__(self, state: tuple) -> None:
        self.state = state

    def __reduce__(self):
        return (np.dtype, ("f8", False, True), self.state)


class _CraftedArray:
    """An array pickled with a crafted dtype in its state."""

    def __init__(self, dtype_state: tuple) -> None:
        self.dtype_state = dtype_state

    def __reduce__(self):
        from numpy._core.multiarray import _reconstruct

        state = (1, (1,), _CraftedDtype(self.dtype_state), False, b"\x00" * 8)
        return (_reconstruct, (np.ndarray, (0,), b"b"), state)


def _zoo(**entries) -> dict:
    return {"model": {"w": np.zeros(2, np.float32)}, "__author__": "x", **entries}


# name -> (what the file holds, a text the error must contain)
CRAFTED: Dict[str, Tuple[Callable[[str], object], str]] = {
    "reduce-os-system": (lambda m: _zoo(x=_RunsShell(m)), ".system"),
    "reduce-os-system-protocol-0": (lambda m: _zoo(x=_RunsShell(m)), ".system"),
    "builtins-eval": (lambda m: {"blobs": {"w": _Evals(m)}}, "builtins.eval"),
    "object-array": (lambda m: {"blobs": {"w": np.array([1, "a"], dtype=object)}}, "dtype object"),
    "structured-dtype": (
        lambda m: {"blobs": {"w": np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])}},
        "numpy dtype",
    ),
    "dtype-state-with-a-subarray": (
        lambda m: {
            "blobs": {"w": _CraftedArray((3, "|", (np.dtype("f4"), (2,)), None, None, 8, 4, 0))}
        },
        "('<f4', (2,))",
    ),
    "dtype-state-with-an-object-field": (
        lambda m: _zoo(
            w=_CraftedArray((3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 63))
        ),
        "dtype object",
    ),
}

_CHILD = r"""
import json, sys
from torch import nn
from hookloop.checkpoint import DetectionCheckpointer

out = {}
for name, path in json.loads(sys.argv[1]).items():
    try:
        DetectionCheckpointer(nn.Linear(2, 2)).load(path)
        out[name] = ["loaded", ""]
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def crafted_results(tmp_path_factory) -> Dict[str, tuple]:
    """Each crafted file loaded in one child process: its exit status, the marker files
    the code would have written, and what each load raised."""
    where = tmp_path_factory.mktemp("crafted")
    paths, markers = {}, {}
    for name, (make, _) in CRAFTED.items():
        markers[name] = where / f"{name}.ran"
        protocol = 0 if name.endswith("protocol-0") else pickle.DEFAULT_PROTOCOL
        paths[name] = _write_pkl(where / f"{name}.pkl", make(str(markers[name])), protocol)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    results = json.loads(proc.stdout) if proc.returncode == 0 else {}
    return {
        name: (proc.returncode, proc.stderr, markers[name], paths[name], results.get(name))
        for name in CRAFTED
    }


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_pkl_runs_no_code_and_is_refused_naming_it(crafted_results, name):
    returncode, stderr, marker, path, result = crafted_results[name]
    assert returncode == 0, stderr  # no crash (a segfault is -11)
    assert not marker.exists()
    kind, message = result
    assert kind == "ValueError", message
    assert path in message and "weights_only=False" in message and "trust" in message
    assert CRAFTED[name][1] in message


def test_the_safeguard_is_real_plain_pickle_would_run_the_code(tmp_path):
    """The files above do what they claim: unpickled as detectron2 does, one runs its code."""
    marker = tmp_path / "ran"
    path = _write_pkl(tmp_path / "evil.pkl", {"blobs": {"w": _Evals(str(marker))}})
    with open(path, "rb") as f:
        pickle.load(f, encoding="latin1")
    assert marker.exists()


def test_the_opt_in_loads_a_trusted_file_as_detectron2_does(tmp_path):
    path = _write_pkl(tmp_path / "trusted.pkl", _zoo(note=collections.Counter(a=1)))
    with pytest.raises(ValueError) as info:
        DetectionCheckpointer(nn.Linear(2, 2)).load(path)
    message = str(info.value)
    assert path in message and "collections.Counter" in message and "weights_only=False" in message
    model = nn.Module()
    model.register_buffer("w", torch.ones(2))
    ret = DetectionCheckpointer(model).load(path, weights_only=False)
    assert ret["note"] == collections.Counter(a=1) and model.w.tolist() == [0.0, 0.0]
    ret = DetectionCheckpointer(model, weights_only=False).load(path)
    assert ret["note"] == collections.Counter(a=1)


def test_a_pkl_that_is_not_a_pickle_is_not_called_unsafe(tmp_path):
    path = tmp_path / "junk.pkl"
    path.write_bytes(b"\x00not a pickle at all")
    with pytest.raises(ValueError) as info:
        DetectionCheckpointer(nn.Linear(2, 2)).load(str(path))
    assert str(path) in str(info.value) and "weights_only=False" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# detectron2's own DetectionCheckpointer, from its source tree


def _d2_root() -> str:
    for root in (os.environ.get("HOOKLOOP_D2_SRC", ""), "/tmp/d2src"):
        if root and os.path.isfile(
            os.path.join(root, "detectron2", "checkpoint", "detection_checkpoint.py")
        ):
            return root
    return ""


@pytest.fixture(scope="module")
def d2():
    """detectron2's ``detectron2.checkpoint.detection_checkpoint`` module, its packages
    registered empty (as tests/compat/backends.py does); removed again afterwards."""
    root = _d2_root()
    if not root:
        pytest.skip("no detectron2 source tree (HOOKLOOP_D2_SRC or /tmp/d2src)")
    pytest.importorskip("fvcore.common.checkpoint")
    pytest.importorskip("iopath")
    added = []
    for name in ("detectron2", "detectron2.utils", "detectron2.checkpoint"):
        if name in sys.modules:
            continue
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = pkg
        added.append(name)
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, pkg)
    before = set(sys.modules)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module("detectron2.checkpoint.detection_checkpoint")
        yield module
    except ImportError as e:
        pytest.skip(f"detectron2's checkpoint module does not import here: {e}")
    finally:
        added += [m for m in set(sys.modules) - before if m.startswith("detectron2")]
        for name in added:
            sys.modules.pop(name, None)


def _case_zoo(tmp_path: Path) -> Tuple[Callable[[], nn.Module], str]:
    weights = {k: v.numpy().copy() for k, v in _fresh().state_dict().items()}
    return _fresh, _write_pkl(tmp_path / "zoo.pkl", {"model": weights, "__author__": ZOO_AUTHOR})


def _case_zoo_backbone(tmp_path: Path):
    weights = {k: v.numpy().copy() for k, v in _fresh(_Backbone).state_dict().items()}
    obj = {"model": weights, "__author__": "torchvision", "matching_heuristics": True}
    return _fresh, _write_pkl(tmp_path / "r50.pkl", obj)


def _case_caffe2(tmp_path: Path):
    return _fresh, _write_pkl(tmp_path / "c2.pkl", {"blobs": _c2_blobs()}, protocol=2)


def _case_python2(tmp_path: Path):
    path = tmp_path / "d1.pkl"
    path.write_bytes(_python2_pickle(_c2_blobs()))
    return _fresh, str(path)


def _case_fvcore(tmp_path: Path):
    import fvcore.common.checkpoint as fv

    fv.Checkpointer(_fresh(), str(tmp_path)).save("fv", iteration=3)
    return (lambda: _fresh(seed=1)), str(tmp_path / "fv.pth")


def _case_query(tmp_path: Path):
    torch.save(_fresh(_Backbone).state_dict(), tmp_path / "bare.pth")
    return (lambda: _fresh(seed=1)), f"{tmp_path / 'bare.pth'}?matching_heuristics=True"


def _case_hookloop(tmp_path: Path):
    model = _fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Checkpointer(model, str(tmp_path), optimizer=opt).save("hl", iteration=3)
    return (lambda: _fresh(seed=1)), str(tmp_path / "hl.pth")


def _case_old_checkpoint(tmp_path: Path):
    state = {k: v for k, v in _fresh().state_dict().items() if not k.startswith("pixel_")}
    state["anchor_generator.cell_anchors.0"] = torch.zeros(3, 4)
    state["head.fc1000.weight"] = torch.zeros(7, 4)
    torch.save({"model": state, "iteration": 5}, tmp_path / "old.pth")
    return (lambda: _fresh(seed=1)), str(tmp_path / "old.pth")


def _case_nothing_matches(tmp_path: Path):
    obj = {"model": {"zzz": np.zeros(1)}, "__author__": "x", "matching_heuristics": True}
    return _fresh, _write_pkl(tmp_path / "none.pkl", obj)


CASES = {
    "detectron2-zoo-pkl": _case_zoo,
    "zoo-pkl-of-a-backbone": _case_zoo_backbone,
    "caffe2-pkl": _case_caffe2,
    "python2-pkl": _case_python2,
    "fvcore-pth": _case_fvcore,
    "query-matching-heuristics": _case_query,
    "hookloop-pth": _case_hookloop,
    "old-checkpoint-pixel-stats-cell-anchors": _case_old_checkpoint,
    "nothing-matches": _case_nothing_matches,
}


@pytest.mark.parametrize("case", list(CASES))
def test_records_weights_and_extra_data_are_detectron2s(d2, tmp_path, case):
    make_model, path = CASES[case](tmp_path)
    theirs, ours = make_model(), make_model()
    ret_theirs, rec_theirs = _load(d2.DetectionCheckpointer, theirs, path)
    ret_ours, rec_ours = _load(DetectionCheckpointer, ours, path)
    assert rec_ours == rec_theirs
    assert _equal_states(ours, theirs)
    assert ret_ours.keys() == ret_theirs.keys()
    if case == "caffe2-pkl":
        assert rec_ours == _fill(C2_RECORDS, path=path)  # the golden records are detectron2's


# Detectron1's names of every part that detectron2 converts (backbones with BN and GN, RPN
# with and without FPN, box, mask, keypoint and DensePose heads).
C2_NAMES = [
    "conv1_w", "res_conv1_bn_s", "res_conv1_bn_b", "res_conv1_bn_rm", "res_conv1_bn_riv",
    "res2_0_branch1_w", "res2_0_branch1_bn_s", "res2_0_branch2a_w", "res2_0_branch2b_bn_rm",
    "res2_0_branch2c_bn_riv", "res3_0_branch2a_bn_running_mean", "res3_0_branch2a_bn_gamma",
    "res3_0_branch2a_bn_beta", "res3_0_branch2a_bn_running_var", "res5_2_branch2c_gn_s",
    "res5_2_branch2c_gn_bias", "bbox_pred_w",
    "bbox_pred_b", "cls_score_w", "cls_score_b", "fc6_w", "fc7_b", "head_conv1_w",
    "head_conv1_gn_s", "fpn_inner_res5_2_sum_w", "fpn_inner_res4_5_sum_lateral_b",
    "fpn_res3_3_sum_w", "fpn_inner_res2_2_sum_lateral_gn_s", "fpn_res2_2_sum_gn_bias",
    "_[mask]_fcn1_w", "mask_fcn_logits_w", "mask_fcn_logits_b", "conv5_mask_w",
    "conv_fcn1_w", "kps_score_lowres_w", "kps_score_w", "body_conv_fcn1_w",
    "AnnIndex_lowres_w", "Index_UV_lowres_b", "U_lowres_w", "V_lowres_b", "pred_w", "pred_b",
    "fc1000_w", "res4_22_branch2b_bn_s", "_mask_fcn2_w",
]  # fmt: skip
# RPN's names with FPN and without (a model has one or the other: they rename alike).
RPN_NAMES = {
    "fpn": ["conv_rpn_fpn2_w", "rpn_bbox_pred_fpn2_w", "rpn_cls_logits_fpn2_b"],
    "c4": ["conv_rpn_w", "rpn_bbox_pred_w", "rpn_cls_logits_b"],
}


@pytest.mark.parametrize("rpn", list(RPN_NAMES))
def test_every_c2_name_converts_as_detectron2_converts_it(d2, rpn):
    ours_module = importlib.import_module("hookloop.checkpoint.c2_model_loading")
    theirs_module = importlib.import_module("detectron2.checkpoint.c2_model_loading")
    torch.manual_seed(0)
    names = C2_NAMES + RPN_NAMES[rpn]
    weights = {k: torch.randn(13, 2) for k in names}
    results = []
    for module in (theirs_module, ours_module):
        with _recording() as records:
            renamed, originals = module.convert_c2_detectron_names(dict(weights))
        results.append((renamed, originals, records))
    (theirs, their_originals, their_records), (ours, our_originals, our_records) = results
    assert list(ours) == list(theirs) and our_originals == their_originals
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert our_records == their_records
    assert ours_module.convert_basic_c2_names(names) == theirs_module.convert_basic_c2_names(names)


def test_two_c2_names_renamed_alike_are_an_error_naming_them():
    from hookloop.checkpoint.c2_model_loading import convert_c2_detectron_names

    with pytest.raises(
        ValueError,
        match="weights 'res2.0.branch2a.w' and 'res2_0_branch2a_w' are both renamed to "
        "'res2.0.conv1.weight'",
    ):
        convert_c2_detectron_names({"res2_0_branch2a_w": 1, "res2.0.branch2a.w": 2})


@pytest.mark.parametrize("case", ["caffe2-pkl", "fvcore-pth"])
def test_a_subclass_behaves_as_the_same_subclass_of_detectron2s(d2, tmp_path, case):
    def subclass(base):
        class Renaming(base):
            def _load_file(self, filename):
                loaded = super()._load_file(filename)
                loaded["model"] = {k.replace("fc1000", "fc"): v for k, v in loaded["model"].items()}
                return loaded

            def _load_model(self, checkpoint):
                checkpoint["model"] = {f"net.{k}": v for k, v in checkpoint["model"].items()}
                return super()._load_model(checkpoint)

        return Renaming

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _fresh()

    make_model, path = CASES[case](tmp_path)
    theirs, ours = Wrapped(), Wrapped()
    _, rec_theirs = _load(subclass(d2.DetectionCheckpointer), theirs, path)
    _, rec_ours = _load(subclass(DetectionCheckpointer), ours, path)
    assert rec_ours == rec_theirs
    assert _equal_states(ours, theirs)
