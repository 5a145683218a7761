#!/usr/bin/env python
"""Training-loop overhead: hookloop against a pure-Python detectron2-style baseline.

    python benches/bench_overhead.py [--quick] [--json out.json]

A thin wrapper: the measurements live in ``lab.overhead`` (``benches/lab/overhead.py``); see
there and ``benches/README.md`` for what each section measures.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import hookloop  # noqa: F401  (the smoke test patches hookloop.BUILD_PROFILE through it)
from lab import overhead
from lab.overhead import (  # noqa: F401  (the names the smoke test uses)
    SECTIONS,
    Config,
    Row,
    Stat,
    format_table,
    json_parity_run,
    make_stack_trainer,
    run_all,
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return overhead.main(argv, command=os.path.relpath(os.path.abspath(__file__)))


if __name__ == "__main__":
    sys.exit(main())
