"""The usage corpus, run differentially: each pattern against hookloop and against the
reference engine (``compat.d2``), and, when ``HOOKLOOP_D2_SRC`` names a detectron2 source tree,
the reference against detectron2's own engine. Everything observable must be equal
(``compat.harness``), except what ``compat.harness.ADDITIONS`` masks."""

from __future__ import annotations

import os
from typing import Any, List

import pytest

from compat import corpus
from compat.backends import d2src_dir
from compat.harness import PATTERNS, Observation, Pattern, observe

corpus.load()

needs_d2src = pytest.mark.skipif(
    not d2src_dir(), reason="HOOKLOOP_D2_SRC does not name a detectron2 source tree"
)


def first_difference(a: Any, b: Any, where: str = "") -> List[str]:
    """Where ``a`` and ``b`` first differ, as a path and the two values."""
    if type(a) is not type(b) and not (
        isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))
    ):
        return [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return [f"{where}[{k!r}] only in {'first' if k in a else 'second'}"]
            d = first_difference(a[k], b[k], f"{where}[{k!r}]")
            if d:
                return d
        if list(a) != list(b):
            return [f"{where}: key order {list(a)} != {list(b)}"]
        return []
    if isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        if len(a) != len(b):
            extra = a[len(b)] if len(a) > len(b) else b[len(a)]
            return [f"{where}: length {len(a)} != {len(b)} (next: {extra!r})"]
        return []
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def assert_same(p: Pattern, a: Observation, b: Observation, names: str) -> None:
    diff = first_difference(a.as_dict(), b.as_dict())
    assert not diff, f"{p.name} ({p.repo}: {p.source}) differs, {names}: {diff[0]}"


def _run(p: Pattern, engine: str, tmp_path: Any) -> Observation:
    out = os.path.join(str(tmp_path), engine)
    os.makedirs(out)
    return observe(p, engine, out)


@pytest.mark.parametrize("p", PATTERNS, ids=lambda p: p.name)
def test_hookloop_matches_reference(p: Pattern, tmp_path: Any) -> None:
    assert_same(
        p, _run(p, "hookloop", tmp_path), _run(p, "reference", tmp_path), "hookloop vs reference"
    )


@needs_d2src
@pytest.mark.parametrize("p", PATTERNS, ids=lambda p: p.name)
def test_reference_matches_detectron2(p: Pattern, tmp_path: Any) -> None:
    assert_same(
        p, _run(p, "reference", tmp_path), _run(p, "d2src", tmp_path), "reference vs detectron2"
    )


@needs_d2src
@pytest.mark.parametrize("p", PATTERNS, ids=lambda p: p.name)
def test_hookloop_matches_detectron2(p: Pattern, tmp_path: Any) -> None:
    assert_same(
        p, _run(p, "hookloop", tmp_path), _run(p, "d2src", tmp_path), "hookloop vs detectron2"
    )


def test_the_corpus_covers_enough_real_usage() -> None:
    """At least 60 patterns from at least 25 public repositories, each naming its source."""
    repos = {p.repo for p in PATTERNS}
    assert len(PATTERNS) >= 60, len(PATTERNS)
    assert len(repos) >= 25, sorted(repos)
    for p in PATTERNS:
        assert p.func.__doc__ and p.source, f"{p.name} does not say where it comes from"
        assert "/" in p.repo, p.repo


def test_the_harness_sees_a_difference(tmp_path: Any) -> None:
    """A pattern that records something engine-specific is reported as different: the
    comparison can fail."""
    from compat.harness import Recorder

    def probe(E: Any, R: Recorder) -> None:
        """Records the engine's name."""
        R.rec(E.name)

    p = Pattern(probe, "hookloop/hookloop", "self-test")
    a, b = _run(p, "hookloop", tmp_path), _run(p, "reference", tmp_path)
    assert first_difference(a.as_dict(), b.as_dict())
