"""Crafted checkpoints (issue 42): loading one runs no code and reads no memory outside the
arrays it holds. Each file is loaded in a child process, by ``Checkpointer`` (``.pth``,
torch's weights-only unpickler) and by ``DetectionCheckpointer`` (``.pkl``, the model-zoo
unpickler), also with numpy's own classes allowed by the program as hookloop 06d76c0 allowed
them: the child must exit normally (no segfault), no marker file may appear, and each load
must raise a ``ValueError`` naming the file and what it holds.

The dtype-state file is what hookloop 06d76c0 loaded: an ``int64`` dtype whose BUILD gives it
a sub-array of objects, so that an array rebuilt from the file's bytes holds pointers the
file chose. :func:`test_the_dtype_state_file_is_dangerous_without_the_checks` shows that
torch's unpickler with numpy's classes allowed rebuilds it and the process then crashes.
"""

from __future__ import annotations

import copyreg
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
from torch import nn

try:
    from numpy._core.multiarray import _reconstruct, scalar  # numpy >= 2
except ImportError:  # pragma: no cover (numpy 1.x)
    from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]

pytestmark = pytest.mark.slow  # spawns processes

# A pointer no process has mapped (x86-64 takes no such address): a read from it crashes.
_POINTER = b"\x41" * 8


class _Dtype:
    """``numpy.dtype(code, False, True)``, then a BUILD with ``state`` (if given)."""

    def __init__(self, code: str, state: Any = None) -> None:
        self.code, self.state = code, state

    def __reduce__(self):
        args = (self.code, False, True)
        return (np.dtype, args) if self.state is None else (np.dtype, args, self.state)


class _Array:
    """An array as numpy pickles it, with the dtype and data given."""

    def __init__(self, dtype: Any, shape: tuple, data: Any) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data

    def __reduce__(self):
        return (
            _reconstruct,
            (np.ndarray, (0,), b"b"),
            (1, self.shape, self.dtype, False, self.data),
        )


class _Scalar:
    def __init__(self, dtype: Any, data: bytes) -> None:
        self.dtype, self.data = dtype, data

    def __reduce__(self):
        return (scalar, (self.dtype, self.data))


class _NewNdarray:
    """``numpy.ndarray.__new__(numpy.ndarray, shape, dtype)`` (pickle's NEWOBJ)."""

    @property  # type: ignore[misc]
    def __class__(self):  # pickle checks that NEWOBJ's class is the object's
        return np.ndarray

    def __reduce__(self):
        return (copyreg.__newobj__, (np.ndarray, (1,), _Dtype("f8")))


class _System:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w').close()",))


def _object_subarray_int64() -> _Dtype:
    # flags 0: numpy is not told that the dtype holds objects.
    return _Dtype("i8", (3, "|", (_Dtype("O8"), (1,)), None, None, 8, 8, 0))


# name -> (what the file holds in its extra data or in the scheduler's state, given the
# marker its code would write; a text the error must contain, naming what it holds)
CASES: Dict[str, Tuple[Callable[[str], Any], str]] = {
    "dtype-state-object-subarray": (
        lambda m: _Array(_object_subarray_int64(), (), _POINTER),
        "numpy dtype int64 with a pickled state that is not numpy's for it (a sub-array ('|O'",
    ),
    "dtype-state-object-subarray-in-scheduler-state": (
        lambda m: {"scheduler": {"base_lrs": [_Array(_object_subarray_int64(), (), _POINTER)]}},
        "numpy dtype int64 with a pickled state",
    ),
    "dtype-state-object-subarray-flagged": (
        lambda m: _Array(
            _Dtype("i8", (3, "|", (_Dtype("O8"), (1,)), None, None, 8, 8, 63)), (), _POINTER
        ),
        "a sub-array ('|O', (1,))",
    ),
    "scalar-of-a-crafted-dtype": (
        lambda m: _Scalar(_object_subarray_int64(), _POINTER),
        "numpy dtype int64 with a pickled state",
    ),
    "int64-dtype-with-fields-outside-its-element": (
        lambda m: _Array(
            _Dtype("i8", (3, "|", None, ("a",), {"a": (_Dtype("f8"), 4096)}, 8, 1, 0)),
            (2,),
            b"\x00" * 16,
        ),
        "numpy dtype int64 with a pickled state that is not numpy's for it (fields {'a': dtype "
        "float64 at offset 4096}",
    ),
    "structured-dtype-with-fields-outside-its-element": (
        lambda m: _Array(
            _Dtype(
                "V8",
                (
                    3,
                    "|",
                    None,
                    ("a", "b"),
                    {"a": (_Dtype("i8"), 0), "b": (_Dtype("i8"), 1 << 20)},
                    8,
                    1,
                    0,
                ),
            ),
            (1,),
            b"\x00" * 8,
        ),
        "a numpy structured array (numpy dtype |V8 with fields ('a', 'b'))",
    ),
    "structured-dtype-with-an-object-field": (
        lambda m: _Array(
            _Dtype("V8", (3, "|", None, ("a",), {"a": (_Dtype("O8"), 0)}, 8, 1, 63)),
            (1,),
            _POINTER,
        ),
        "a numpy structured array",
    ),
    "object-array": (lambda m: np.array([1, "a"], dtype=object), "a numpy object array"),
    "string-array": (lambda m: np.array(["ab", "c"]), "a numpy string array (numpy dtype <U2)"),
    "datetime-array": (
        lambda m: np.array(["2020-01-01"], dtype="M8[D]"),
        "a numpy datetime array",
    ),
    "numpy-str-scalar": (lambda m: np.str_("ab"), "a numpy.str_ scalar (dtype <U2)"),
    "numpy-datetime64-scalar": (
        lambda m: np.datetime64("2020-01-01"),
        "a numpy.datetime64 scalar",
    ),
    "ndarray-called-directly": (lambda m: _NewNdarray(), "numpy.ndarray called directly"),
    # Protocol 2 names them posix.system and __builtin__.eval.
    "reduce-os-system": (lambda m: _System(m), "system, which only arbitrary unpickling"),
    "reduce-builtins-eval": (lambda m: _Eval(m), "eval, which only arbitrary unpickling"),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(2, 2)


def _contents(name: str, marker: str) -> dict:
    held = CASES[name][0](marker)
    entries = held if isinstance(held, dict) else {"x": held}
    return {"model": _model().state_dict(), **entries}


def _zoo_contents(name: str, marker: str) -> dict:
    held = CASES[name][0](marker)
    entries = held if isinstance(held, dict) else {"x": held}
    weights = {k: v.numpy() for k, v in _model().state_dict().items()}
    return {"model": weights, "__author__": "crafted", **entries}


# numpy's classes and functions as hookloop 06d76c0 allowed them (and as a program may allow
# them itself with torch.serialization.add_safe_globals).
_NUMPY_AS_06D76C0 = r"""
import numpy as np
try:
    from numpy._core import multiarray
except ImportError:
    from numpy.core import multiarray
NUMPY_AS_06D76C0 = [np.ndarray, np.dtype]
NUMPY_AS_06D76C0 += sorted({type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDG"}, key=repr)
for name in ("scalar", "_reconstruct"):
    NUMPY_AS_06D76C0 += [
        (getattr(multiarray, name), f"numpy.{m}.multiarray.{name}") for m in ("_core", "core")
    ]
"""

_CHILD = (
    _NUMPY_AS_06D76C0
    + r"""
import json, sys
import torch
from torch import nn
from hookloop.checkpoint import Checkpointer, DetectionCheckpointer

out = {}
for label, loader, path, program_allows_numpy in json.loads(sys.argv[1]):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    cls = DetectionCheckpointer if loader == "DetectionCheckpointer" else Checkpointer
    before = torch.serialization.get_safe_globals()
    if program_allows_numpy:
        torch.serialization.add_safe_globals(NUMPY_AS_06D76C0)
    try:
        extra = cls(model, scheduler=scheduler).load(path)
        out[label] = ["loaded", ""]
        # What a resume and a log line do next: each reads what the file made.
        print(label, repr(extra), flush=True)
        optimizer.step()
        scheduler.step()
        out[label] = ["loaded", repr(extra)]
    except Exception as e:
        out[label] = [type(e).__name__, str(e)]
    after = torch.serialization.get_safe_globals()
    expected = before + (NUMPY_AS_06D76C0 if program_allows_numpy else [])
    out[label].append(set(map(repr, after)) == set(map(repr, expected)))
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)
print("RESULTS", json.dumps(out))
"""
)


def _child_env() -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> Dict[str, Any]:
    """Every crafted file, written here (pickling runs nothing of them) and loaded in one
    child: its exit status and output, each load's result, and the markers."""
    where = tmp_path_factory.mktemp("crafted")
    loads: List[list] = []
    markers: Dict[str, Path] = {}
    for name in CASES:
        markers[name] = where / f"{name}.ran"
        pth = where / f"{name}.pth"
        torch.save(_contents(name, str(markers[name])), pth)
        pkl = where / f"{name}.pkl"
        with open(pkl, "wb") as f:
            pickle.dump(_zoo_contents(name, str(markers[name])), f, protocol=2)
        loads += [
            [f"{name}.pth", "Checkpointer", str(pth), False],
            [f"{name}.pth/program-allows-numpy", "Checkpointer", str(pth), True],
            [f"{name}.pkl", "DetectionCheckpointer", str(pkl), False],
            [f"{name}.pkl/to-Checkpointer", "Checkpointer", str(pkl), False],
        ]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(loads)],
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=600,
    )
    results_line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    results = json.loads(results_line[-1][len("RESULTS ") :]) if results_line else {}
    paths = {label: path for label, _, path, _ in loads}
    return {"proc": proc, "results": results, "markers": markers, "paths": paths}


def test_the_child_neither_crashed_nor_ran_anything(crafted):
    proc = crafted["proc"]
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert [p.name for p in crafted["markers"].values() if p.exists()] == []
    assert len(crafted["results"]) == 4 * len(CASES)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(
    "how",
    [".pth", ".pth/program-allows-numpy", ".pkl"],
    ids=["Checkpointer", "program-allows-numpy", "DetectionCheckpointer"],
)
def test_each_file_is_refused_naming_it_and_what_it_holds(crafted, name, how):
    label = name + how
    assert label in crafted["results"], crafted["proc"].stderr[-2000:]
    kind, message, safe_globals_restored = crafted["results"][label]
    assert kind == "ValueError", message
    assert crafted["paths"][label] in message
    assert CASES[name][1] in message
    assert "weights_only=False" in message and "trust" in message
    assert safe_globals_restored  # the program's own allowed globals, as they were


@pytest.mark.parametrize("name", list(CASES))
def test_a_pkl_given_to_checkpointer_points_to_detection_checkpointer(crafted, name):
    """Never the advice to unpickle it unsafely."""
    label = f"{name}.pkl/to-Checkpointer"
    kind, message, _ = crafted["results"][label]
    assert kind == "ValueError", message
    assert crafted["paths"][label] in message
    assert "DetectionCheckpointer" in message and "weights_only=False" not in message


_DANGER = (
    _NUMPY_AS_06D76C0
    + r"""
import sys
import torch
torch.serialization.add_safe_globals(NUMPY_AS_06D76C0)
loaded = torch.load(sys.argv[1], weights_only=True)
print("rebuilt", loaded["x"].dtype.subdtype[0], loaded["x"].dtype.hasobject, flush=True)
print(repr(loaded["x"]), flush=True)
print("survived", flush=True)
"""
)


def test_the_dtype_state_file_is_dangerous_without_the_checks(tmp_path):
    """torch's unpickler with numpy's classes allowed (hookloop 06d76c0's loader) rebuilds an
    array of objects that numpy does not know holds objects, from the file's bytes: printing
    it dereferences the file's pointer and the process dies by a signal."""
    path = tmp_path / "dtype-state.pth"
    torch.save(_contents("dtype-state-object-subarray", str(tmp_path / "m")), path)
    proc = subprocess.run(
        [sys.executable, "-c", _DANGER, str(path)],
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=300,
    )
    assert "rebuilt object False" in proc.stdout, proc.stderr[-2000:]
    assert "survived" not in proc.stdout
    assert proc.returncode in (-signal.SIGSEGV, -signal.SIGBUS), proc.returncode
