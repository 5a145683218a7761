"""The usage corpus: each module registers patterns with ``compat.harness.pattern``.

Importing this package imports every module in it (``load()``)."""

from __future__ import annotations

import importlib
import pkgutil


def load() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
