"""Runs every corpus pattern on every backend and prints the table of tests/compat/README.md.

    cd tests && HOOKLOOP_D2_SRC=/path/to/tree python -m compat.report > /tmp/table.md

Each row names a pattern, its repository and the three comparisons: ``same`` when the two
observations are equal, ``differs: <where>`` when they are not, ``-`` when detectron2's source
is not there (``HOOKLOOP_D2_SRC``). The exit status is 1 when any comparison differs.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Dict, List

from compat import corpus
from compat.backends import d2src_dir
from compat.harness import PATTERNS, Observation, Pattern, observe
from compat.test_corpus import first_difference

PAIRS = (("hookloop", "reference"), ("reference", "d2src"), ("hookloop", "d2src"))


def _compare(a: Observation, b: Observation) -> str:
    diff = first_difference(a.as_dict(), b.as_dict())
    return f"differs: {diff[0][:80]}" if diff else "same"


def rows() -> List[Dict[str, str]]:
    """One dict per pattern: name, repo, and the verdict of each pair in :data:`PAIRS`."""
    corpus.load()
    engines = ["hookloop", "reference"] + (["d2src"] if d2src_dir() else [])
    table = []
    for p in PATTERNS:
        with tempfile.TemporaryDirectory() as tmp:
            seen = {}
            for e in engines:
                out = os.path.join(tmp, e)
                os.makedirs(out)
                seen[e] = observe(p, e, out)
        row = {"pattern": p.name, "repo": p.repo}
        for a, b in PAIRS:
            row[f"{a} vs {b}"] = _compare(seen[a], seen[b]) if a in seen and b in seen else "-"
        table.append(row)
    return table


def markdown(table: List[Dict[str, str]], patterns: List[Pattern]) -> str:
    header = ["pattern", "repository"] + [f"{a} vs {b}" for a, b in PAIRS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table:
        cells = [f"`{row['pattern']}`", row["repo"]] + [row[f"{a} vs {b}"] for a, b in PAIRS]
        lines.append("| " + " | ".join(cells) + " |")
    repos = {p.repo for p in patterns}
    lines.append("")
    lines.append(f"{len(patterns)} patterns from {len(repos)} repositories.")
    return "\n".join(lines)


def main() -> int:
    table = rows()
    print(markdown(table, PATTERNS))
    return int(any(v.startswith("differs") for row in table for v in row.values()))


if __name__ == "__main__":
    sys.exit(main())
