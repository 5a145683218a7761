"""The README and docs/: every relative link resolves to a file of the tree (and a ``#anchor``
to a heading of that file), the README stays a five-minute read, and the commands it names
exist (the Makefile's targets, the benchmark scripts)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "benches" / "README.md", ROOT / "benches" / "RESULTS.md"]
PAGES.append(ROOT / "tests" / "compat" / "README.md")

# [text](target): the target up to the first space or closing parenthesis.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(page: Path) -> list:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))  # code blocks hold no links
    return _LINK.findall(text)


def _anchors(page: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    out = set()
    for heading in re.findall(r"^#+\s+(.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_the_docs_exist():
    names = {p.name for p in DOCS}
    assert {
        "README.md",
        "differences.md",
        "performance.md",
        "distributed.md",
        "default_trainer.md",
        "resume.md",
    } <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_every_doc_is_linked_from_the_index():
    linked = {t.partition("#")[0] for t in _links(ROOT / "docs" / "README.md")}
    assert {p.name for p in DOCS if p.name != "README.md"} <= linked


def test_readme_is_short_and_links_the_docs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for doc in ("differences.md", "performance.md", "resume.md", "default_trainer.md"):
        assert f"docs/{doc}" in readme


def test_the_commands_the_docs_name_exist():
    """``make X`` targets are the Makefile's, ``benches/*.py`` scripts are in benches/."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\bmake ([a-z][\w-]*)", text):
            assert target in targets, f"{page.name}: make {target}"
        for script in re.findall(r"\bbenches/(\w+\.py)\b", text):
            assert (ROOT / "benches" / script).exists(), f"{page.name}: benches/{script}"
