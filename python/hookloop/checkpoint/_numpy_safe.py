"""numpy data in a checkpoint, rebuilt without trusting the file: what both loaders use
(torch's weights-only unpickler in :class:`~hookloop.checkpoint.Checkpointer`, the model-zoo
unpickler of :class:`~hookloop.checkpoint.DetectionCheckpointer`).

A pickle rebuilds an array as ``_reconstruct(ndarray, (0,), b"b")`` followed by a BUILD whose
state holds a ``numpy.dtype(code, align, copy)`` (itself followed by a BUILD of the dtype's
state) and the raw bytes; a scalar as ``scalar(dtype, bytes)``. :data:`GLOBALS` maps numpy's
names for those to the objects below, which stand in for numpy's own:

* ``numpy.dtype`` is :class:`_DtypeSpec`, which keeps a dtype parsed from its type code and
  takes only the state numpy writes for that dtype: a BUILD never reaches numpy's
  ``dtype.__setstate__``, so a file cannot give a dtype a sub-array, fields, objects or an item
  size of its choosing;
* ``numpy.ndarray`` is :class:`_ArrayBeingLoaded`, whose BUILD admits a plain dtype (bools and
  numbers) and data of exactly the array's size before numpy sees the bytes;
* numpy's functions are :class:`Global` wrappers that check their arguments the same way.

All of them refuse outside :func:`loading` on the calling thread: torch's allowlist of
globals is process-wide, so another thread's ``torch.load`` meets them too and is refused as
torch refuses numpy's names. What is refused raises :class:`Refused`, naming what the file
holds.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import threading
from typing import Any, Callable, Dict, Iterator, Optional, cast

import numpy as np

try:
    from numpy._core import multiarray as _multiarray  # numpy >= 2
    from numpy._core import numeric as _numeric
except ImportError:  # pragma: no cover (numpy 1.x)
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]
    from numpy.core import numeric as _numeric  # type: ignore[no-redef]

__all__ = ["GLOBALS", "TORCH_GLOBALS", "Global", "Refused", "loading", "plain_data", "refusal_in"]

# Booleans, signed and unsigned integers, floats, complex numbers.
_PLAIN_KINDS = frozenset("biufc")
# The type codes numpy writes in pickles (``f8``, ``b1``, ``U3``, ``M8``, ``O8``, ``V4``).
_CODE = re.compile(r"[biufcUSMmOV][0-9]{1,10}")
# numpy 2 supports up to 64 dimensions, numpy 1 up to 32.
_MAXDIMS = 64 if int(np.__version__.split(".")[0]) >= 2 else 32
_KIND_WORDS = {
    "U": "string",
    "S": "bytes",
    "M": "datetime",
    "m": "timedelta",
    "O": "object",
    "V": "structured",
}


class Refused(pickle.UnpicklingError):
    """What a loader refuses: ``clause`` says what the file holds, as in "Cannot load
    checkpoint PATH with weights_only=True: <clause>"."""

    def __init__(self, clause: str) -> None:
        super().__init__(f"Weights only load failed: {clause}")
        self.clause = clause


def refuse_global(name: str) -> Refused:
    return Refused(f"it holds {name}, which only arbitrary unpickling can rebuild")


def _refuse(what: str) -> Refused:
    return Refused(
        f"it holds {what}; of numpy's data, only scalars, arrays and dtypes of bools and "
        "numbers load"
    )


def refusal_in(error: BaseException) -> Optional[Refused]:
    """The :class:`Refused` that ``error`` is, or that it was raised from (torch's
    unpickler raises its own error in place of the one it caught)."""
    seen = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        if isinstance(e, Refused):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


# ----------------------------------------------------------------------------------------------
# Only on the thread of a load


_local = threading.local()


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Within this, on this thread, the objects of :data:`GLOBALS` rebuild numpy data."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _check_loading(name: str) -> None:
    if getattr(_local, "depth", 0) <= 0:
        # torch's own words for a global it does not allow, which this is for that load.
        raise pickle.UnpicklingError(
            f"Unsupported global: GLOBAL {name} was not an allowed global by default "
            "(hookloop allows it only to its own checkpoint loads, on their thread)"
        )


# ----------------------------------------------------------------------------------------------
# dtypes


def _is_plain(dtype: np.dtype) -> bool:
    return (
        dtype.kind in _PLAIN_KINDS
        and not dtype.hasobject
        and dtype.names is None
        and dtype.fields is None
        and dtype.subdtype is None
    )


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 120 else text[:117] + "..."


def _spec_text(obj: Any, code: bool) -> str:
    if isinstance(obj, _DtypeSpec):
        return repr(obj._dtype.str) if code else str(obj._dtype)
    return f"a {type(obj).__name__}"


def _state_problems(state: Any, dtype: np.dtype) -> str:
    """What in a dtype's pickled state is not what numpy writes for ``dtype`` ("" if none).
    Only exact ints, strs and None compare equal: the state may hold tensors and arrays."""
    if not (
        type(state) is tuple
        and (
            (len(state) == 8 and type(state[0]) is int and state[0] == 3)
            or (len(state) == 9 and type(state[0]) is int and state[0] == 4 and state[8] is None)
        )
    ):
        return f"the state {_short(state)}"
    _, endian, subarray, names, fields, elsize, alignment, flags = state[:8]
    problems = []
    if subarray is not None:
        if type(subarray) is tuple and len(subarray) == 2:
            problems.append(f"a sub-array ({_spec_text(subarray[0], True)}, {_short(subarray[1])})")
        else:
            problems.append(f"a sub-array {_short(subarray)}")
    if names is not None or fields is not None:
        if type(fields) is dict:
            described = ", ".join(
                f"{k!r}: dtype {_spec_text(v[0], False)} at offset {_short(v[1])}"
                if type(v) is tuple and len(v) >= 2
                else f"{k!r}: {_short(v)}"
                for k, v in fields.items()
            )
            problems.append(f"fields {{{described}}}")
        else:
            problems.append(f"fields {_short(fields)} named {_short(names)}")
    if not (type(elsize) is int and elsize == -1 and type(alignment) is int and alignment == -1):
        problems.append(f"an item size of {_short(elsize)} and alignment of {_short(alignment)}")
    if not (type(flags) is int and flags == dtype.flags):
        problems.append(f"flags {_short(flags)}")
    endians = "|" if dtype.itemsize == 1 else "<>="
    if not (type(endian) is str and len(endian) == 1 and endian in endians):
        problems.append(f"the byte order {_short(endian)}")
    return ", ".join(problems)


class _DtypeSpec:
    """What ``numpy.dtype`` unpickles as: a dtype parsed from its type code
    (``dtype("f8", False, True)``), whose BUILD takes only the state numpy writes for it (a
    byte order, no sub-array, fields or item size). The array or scalar that uses it gets
    a dtype numpy made from the code, never one whose state the file set.

    A code of another kind (strings, datetimes, objects, structured) is kept to be named by
    the array or scalar that uses it, and refused there."""

    __slots__ = ("_dtype", "_names")
    __hash__ = None  # type: ignore[assignment]

    _dtype: np.dtype
    _names: Any

    def __new__(cls, code: Any = None, align: Any = False, copy: Any = True) -> _DtypeSpec:
        _check_loading("numpy.dtype")
        if isinstance(code, bytes):
            code = code.decode("latin1")
        if (
            cls is not _DtypeSpec
            or not isinstance(code, str)
            or not _CODE.fullmatch(code)
            or type(align) not in (bool, int)
            or type(copy) not in (bool, int)
        ):
            raise _refuse(f"numpy.dtype({_short(code)}, {_short(align)}, {_short(copy)})")
        try:
            dtype = np.dtype(code)
        except (TypeError, ValueError):
            raise _refuse(f"numpy dtype {code!r}") from None
        self = object.__new__(cls)
        self._dtype = dtype
        self._names = None
        return self

    def __setstate__(self, state: Any) -> None:
        dtype = self._dtype
        if not _is_plain(dtype):
            # Never applied: only its field names are kept, to name what is refused.
            if type(state) is tuple and len(state) >= 5 and type(state[3]) is tuple:
                self._names = state[3]
            return
        problems = _state_problems(state, dtype)
        if problems:
            raise _refuse(
                f"numpy dtype {dtype} with a pickled state that is not numpy's for it ({problems})"
            )
        if dtype.itemsize > 1 and state[1] in "<>":
            ordered = dtype.newbyteorder(state[1])
            self._dtype = dtype if ordered.isnative else ordered

    def plain(self, use: str) -> np.dtype:
        """The dtype, for an array or scalar (``use``), if it is one of bools or numbers."""
        dtype = self._dtype
        if _is_plain(dtype):
            return dtype
        if use == "scalar":
            raise _refuse(f"a numpy.{dtype.type.__name__} scalar (dtype {dtype})")
        word = _KIND_WORDS.get(dtype.kind, dtype.kind)
        fields = f" with fields {_short(self._names)}" if self._names else ""
        raise _refuse(f"a numpy {word} {use} (numpy dtype {dtype}{fields})")


def _dtype_for(dtype: Any, use: str) -> np.dtype:
    """The plain dtype that an array or scalar of the file is rebuilt with."""
    if isinstance(dtype, _DtypeSpec):
        return dtype.plain(use)
    if isinstance(dtype, np.dtype) and _is_plain(dtype):
        # Not from a file (it has no way to make one): copy.deepcopy of a loaded array.
        plain = np.dtype(dtype.str)
        if plain.itemsize == dtype.itemsize:
            return plain
    raise _refuse(f"a numpy {use} whose dtype is {_short(dtype)}")


def _code_dtype(code: Any) -> np.dtype:
    """The dummy dtype of ``_reconstruct(ndarray, (0,), b"b")``."""
    if isinstance(code, bytes):
        code = code.decode("latin1")
    if type(code) is not str or code != "b":
        raise _refuse(f"numpy's _reconstruct with the dtype {_short(code)}")
    return np.dtype("b")


# ----------------------------------------------------------------------------------------------
# arrays and scalars


def _nbytes(shape: Any, dtype: np.dtype, what: str) -> int:
    """The size of an array of ``shape``, which must be one numpy makes: numpy's own
    ``__setstate__`` takes more dimensions than it supports, and fills their strides with
    what lies past its arrays."""
    if (
        type(shape) is not tuple
        or len(shape) > _MAXDIMS
        or not all(type(n) is int and n >= 0 for n in shape)
    ):
        raise _refuse(f"a numpy {what} of shape {_short(shape)}")
    nonzero = dtype.itemsize
    for d in shape:
        nonzero *= max(d, 1)
    if nonzero >= 2**63:
        raise _refuse(f"a numpy {what} of shape {_short(shape)}")
    return 0 if 0 in shape else nonzero


def _raw(data: Any, nbytes: int, what: str) -> Any:
    """``data`` as the bytes of an array or scalar of ``nbytes`` bytes (a str is how Python
    2's pickles hold them, decoded as latin-1)."""
    if isinstance(data, str):
        try:
            data = data.encode("latin1")
        except UnicodeEncodeError:
            raise _refuse(f"numpy {what} data that is not latin-1 text") from None
    if not isinstance(data, (bytes, bytearray)):
        # A list is what arrays of objects pickle as.
        raise _refuse(f"numpy {what} data that is a {type(data).__name__}")
    if len(data) != nbytes:
        raise _refuse(f"numpy {what} data of {len(data)} bytes where its shape takes {nbytes}")
    return data


class _ArrayBeingLoaded(np.ndarray):
    """What ``numpy.ndarray`` unpickles as: the array that ``_reconstruct`` makes and the
    BUILD after it fills. Its ``__setstate__`` admits a plain dtype and data of exactly the
    array's size before numpy sees them. :func:`plain_data` turns these into ``ndarray``
    views."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _ArrayBeingLoaded:
        _check_loading("numpy.ndarray")
        raise _refuse("numpy.ndarray called directly, not through numpy's _reconstruct")

    def __setstate__(self, state: Any) -> None:
        # (version, shape, dtype, is_fortran, data); numpy 1.0's pickles have no version.
        if type(state) is not tuple or len(state) not in (4, 5):
            raise _refuse(f"a numpy array state that is not numpy's: {_short(state)}")
        shape, dtype, is_fortran, data = state[-4:]
        plain = _dtype_for(dtype, "array")
        data = _raw(data, _nbytes(shape, plain, "array"), "array")
        if type(is_fortran) not in (bool, int):
            raise _refuse(f"a numpy array whose order is {_short(is_fortran)}")
        checked: Any = (1, shape, plain, bool(is_fortran), data)
        super().__setstate__(checked)


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> _ArrayBeingLoaded:
    if subtype is not _ArrayBeingLoaded:
        raise _refuse(f"numpy's _reconstruct of {_short(subtype)}")
    if not (type(shape) is tuple and len(shape) == 1 and type(shape[0]) is int and shape[0] == 0):
        raise _refuse(f"numpy's _reconstruct with the shape {_short(shape)}")
    return cast(
        _ArrayBeingLoaded, _multiarray._reconstruct(_ArrayBeingLoaded, (0,), _code_dtype(dtype))
    )


def _scalar(dtype: Any, data: Any = None) -> Any:
    plain = _dtype_for(dtype, "scalar")
    return _multiarray.scalar(plain, _raw(data, plain.itemsize, "scalar"))


def _frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    """Arrays in pickles of protocol 5 (their buffer in-band)."""
    plain = _dtype_for(dtype, "array")
    if isinstance(buffer, pickle.PickleBuffer):
        buffer = bytes(buffer)
    data = _raw(buffer, _nbytes(shape, plain, "array"), "array")
    if type(order) is not str or order not in ("C", "F"):
        raise _refuse(f"a numpy array whose order is {_short(order)}")
    array: np.ndarray = _numeric._frombuffer(data, plain, shape, order)  # type: ignore[attr-defined]
    return array


class Global:
    """A numpy function as a pickle names it (``name``): ``function`` (one of the checking
    functions above), callable only within :func:`loading`."""

    __slots__ = ("name", "_function")

    def __init__(self, name: str, function: Callable[..., Any]) -> None:
        self.name = name
        self._function = function

    def __call__(self, *args: Any) -> Any:
        _check_loading(self.name)
        return self._function(*args)

    def __setstate__(self, state: Any) -> None:
        # Python's unpickler would otherwise set the attributes a BUILD names.
        raise _refuse(f"a BUILD of the function {self.name}")

    def __repr__(self) -> str:
        return f"<{self.name}, as hookloop's loaders rebuild it>"


# numpy's names (numpy 1's pickles name numpy.core, numpy 2's numpy._core) -> the objects
# that stand in for them. torch's weights-only unpickler cannot read pickles of protocol 5,
# where _frombuffer appears: TORCH_GLOBALS leaves it out.
GLOBALS: Dict[str, Any] = {"numpy.ndarray": _ArrayBeingLoaded, "numpy.dtype": _DtypeSpec}
for _core in ("core", "_core"):
    for _name, _function in (
        ("multiarray._reconstruct", _reconstruct),
        ("multiarray.scalar", _scalar),
        ("numeric._frombuffer", _frombuffer),
    ):
        _full = f"numpy.{_core}.{_name}"
        GLOBALS[_full] = Global(_full, _function)
TORCH_GLOBALS = [(obj, name) for name, obj in GLOBALS.items() if "_frombuffer" not in name]


# ----------------------------------------------------------------------------------------------
# What a load returns


def plain_data(obj: Any, done: Optional[Dict[int, Any]] = None) -> Any:
    """``obj`` with its arrays being loaded turned into ``ndarray`` views and its dtypes into
    numpy's (dicts, an ``OrderedDict``'s attributes and lists changed in place, tuples
    rebuilt). An object of :data:`GLOBALS` that was named but never called (``numpy.ndarray``
    itself) is refused."""
    if done is None:
        done = {}
    if isinstance(obj, _ArrayBeingLoaded):
        return obj.view(np.ndarray)
    if isinstance(obj, _DtypeSpec):
        return obj.plain("dtype")
    if isinstance(obj, Global):
        raise _refuse(f"{obj.name} itself, not data")
    if obj is _ArrayBeingLoaded or obj is _DtypeSpec:
        raise _refuse(f"the type numpy.{'ndarray' if obj is _ArrayBeingLoaded else 'dtype'}")
    if not isinstance(obj, (dict, list, tuple)):
        return obj
    if id(obj) in done:
        return done[id(obj)]
    if isinstance(obj, tuple):
        items = [plain_data(v, done) for v in obj]
        out = obj if all(a is b for a, b in zip(items, obj)) else tuple(items)
        done[id(obj)] = out
        return out
    done[id(obj)] = obj  # before its items: a list may hold itself
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            obj[k] = plain_data(v, done)
        if hasattr(obj, "__dict__"):  # an OrderedDict's BUILD sets attributes
            plain_data(vars(obj), done)
    else:
        obj[:] = [plain_data(v, done) for v in obj]
    return obj
