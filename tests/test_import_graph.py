"""The import graph of the tree has no circles: no two files import each other, directly or
through a loop, in the Python package or in either Rust crate.

An edge is any import a file makes, wherever it sits (a function-level or ``TYPE_CHECKING``
import counts: it is a dependency all the same). Python: ``import a.b`` and ``from a import b``
inside ``hookloop``, resolved to the module's file (a package to its ``__init__.py``). Rust:
every ``crate::a::b`` and ``super::x`` path in a file (``use`` or inline), resolved to the
deepest module file it names; ``mod x;`` declarations are ownership, not imports, and a path
inside a file's own inline ``mod tests { ... }`` that names the file itself is no edge."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "hookloop"
CRATES = [ROOT / "rust" / "hookloop-core" / "src", ROOT / "rust" / "hookloop-py" / "src"]

Graph = Dict[str, Set[str]]


def circles(graph: Graph) -> List[List[str]]:
    """The strongly connected components with more than one file (Tarjan's algorithm), each
    sorted: every one is a set of files that import each other, directly or in a loop."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# --- Python -----------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_graph() -> Graph:
    # An extension module is a node by its stub (`_core.pyi`): it imports nothing of ours.
    files = {_module_name(p): p for p in PACKAGE.rglob("*.pyi")}
    files.update({_module_name(p): p for p in PACKAGE.rglob("*.py")})
    graph: Graph = {name: set() for name in files}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # `from a import b` imports a.b when b is a module, else a.
                targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
                targets = [t for t in targets[:-1] if t in files] or [mod]
            for t in targets:
                if not t.startswith("hookloop"):
                    continue
                dep = resolve(t)
                if dep is not None and dep != name:
                    graph[name].add(dep)
    return graph


# --- Rust -------------------------------------------------------------------------------------

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_STRING = re.compile(r'r#*"(?:.|\n)*?"#*|"(?:\\.|[^"\\])*"')
_INLINE_MOD = re.compile(r"\bmod\s+\w+\s*\{")
_PATH = re.compile(r"\b(crate|super)((?:::\w+)+)")


def _strip(src: str) -> str:
    """The source without comments, string literals or char literals that could hold a path."""
    src = _COMMENT.sub(lambda m: " " * len(m.group()), src)
    return _STRING.sub(lambda m: '""' + " " * (len(m.group()) - 2), src)


def _inline_spans(src: str) -> List[tuple[int, int]]:
    spans = []
    for m in _INLINE_MOD.finditer(src):
        depth, i = 0, m.end() - 1
        while i < len(src):
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            if depth == 0:
                break
            i += 1
        spans.append((m.start(), i))
    return spans


def rust_graph(src_dir: Path) -> Graph:
    files = {p.relative_to(src_dir): p for p in src_dir.rglob("*.rs")}

    def module_of(rel: Path) -> List[str]:
        parts = list(rel.with_suffix("").parts)
        if parts[-1] in ("mod", "lib"):
            parts.pop()
        return parts

    by_module = {tuple(module_of(rel)): str(rel) for rel in files}
    graph: Graph = {str(rel): set() for rel in files}

    def resolve(path: List[str]) -> str | None:
        for n in range(len(path), -1, -1):
            hit = by_module.get(tuple(path[:n]))
            if hit is not None:
                return hit
        return None

    for rel, path in files.items():
        src = _strip(path.read_text())
        here = module_of(rel)
        inline = _inline_spans(src)
        for m in _PATH.finditer(src):
            segs = m.group(2).split("::")[1:]
            if m.group(1) == "crate":
                target = segs
            else:
                # `super` inside an inline module of this file is this file's module.
                nested = any(a < m.start() < b for a, b in inline)
                target = (here if nested else here[:-1]) + segs
            dep = resolve(target)
            if dep is not None and dep != str(rel):
                graph[str(rel)].add(dep)
    return graph


# --- the tests --------------------------------------------------------------------------------


def test_the_python_package_has_no_import_circles():
    graph = python_graph()
    assert "hookloop.engine.train_loop" in graph and graph["hookloop.engine.train_loop"]
    assert circles(graph) == []


@pytest.mark.parametrize("crate", CRATES, ids=lambda p: p.parent.name)
def test_a_rust_crate_has_no_import_circles(crate):
    graph = rust_graph(crate)
    assert any(graph.values())
    assert circles(graph) == []


def test_the_checker_finds_circles_and_resolves_paths(tmp_path):
    """The checker itself: a loop of three, a direct pair, a package's relative import, and
    Rust's crate/super paths with an inline test module."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []

    src = tmp_path / "src"
    (src / "fmt").mkdir(parents=True)
    (src / "lib.rs").write_text("pub mod fmt;\npub mod error;\n")
    (src / "fmt" / "mod.rs").write_text("mod sum;\npub use sum::total;\n")
    (src / "fmt" / "sum.rs").write_text(
        "use crate::error::Error; // crate::fmt in a comment is no edge\n"
        'const S: &str = "super::x";\n'
        "#[cfg(test)]\nmod tests {\n    use super::*;\n}\n"
    )
    (src / "error.rs").write_text("pub struct Error(crate::fmt::Repr);\n")
    graph = rust_graph(src)
    assert graph["fmt/sum.rs"] == {"error.rs"}
    assert graph["error.rs"] == {"fmt/mod.rs"}
    assert circles(graph) == []
    (src / "fmt" / "mod.rs").write_text("mod sum;\nuse super::error::Error;\n")
    (src / "fmt" / "sum.rs").write_text("use super::Thing;\n")
    assert circles(rust_graph(src)) == [["error.rs", "fmt/mod.rs"]]
