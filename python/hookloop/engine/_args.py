"""Argument checks shared by the hooks: an argument of the wrong type or value is a
``TypeError``/``ValueError`` naming the hook and the argument."""

from __future__ import annotations

import operator
import os
from typing import Any, Callable, Optional

__all__ = ["_callable_arg", "_int_arg", "_path_arg"]


def _int_arg(owner: str, name: str, value: Any, minimum: Optional[int] = None) -> int:
    """``value`` as an int (numpy ints accepted, bools not), at least ``minimum``; else a
    ``TypeError``/``ValueError`` naming ``owner``'s argument ``name``."""
    what = f"{owner} {name}"
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _callable_arg(owner: str, name: str, value: Any) -> Callable[..., Any]:
    if not callable(value):
        raise TypeError(f"{owner} {name} must be callable, got {type(value).__name__}")
    return value


def _path_arg(owner: str, name: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{owner} {name} must be a str or os.PathLike, got {type(value).__name__}")
    return os.fspath(value)
