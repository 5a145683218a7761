"""The import graph of the tree has no circles: no two files import each other, directly or
through a loop, in the Python package or in either Rust crate; and the extension imports
nothing of the package: what it calls in Python is handed to it by the module that owns it
(``_core._register_*``), and those edges are listed here (:data:`INJECTED`).

An edge is any import a file makes, wherever it sits (a function-level or ``TYPE_CHECKING``
import counts: it is a dependency all the same). Python: ``import a.b`` and ``from a import b``
inside ``hookloop``, resolved to the module's file (a package to its ``__init__.py``). Rust:
every ``crate::a::b`` and ``super::x`` path in a file (``use`` or inline), resolved to the
deepest module file it names; ``mod x;`` declarations are ownership, not imports, and a path
inside a file's own inline ``mod tests { ... }`` that names the file itself is no edge.
Injected: a call ``_core._register_<x>(...)`` in a module is an edge from the extension
(``hookloop._core``) to that module; a module that registers imports nothing of the package
but the extension, so each such pair is the graph's only circle."""

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


def _package_files() -> Dict[str, Path]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.pyi")}
    files.update({_module_name(p): p for p in PACKAGE.rglob("*.py")})
    return files


def injected_edges() -> Graph:
    """The extension's edges to the modules that hand it callables: every module that calls
    ``_core._register_<x>(...)``."""
    graph: Graph = {}
    for name, path in _package_files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("_register_")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "_core"
            ):
                graph.setdefault("hookloop._core", set()).add(name)
    return graph


#: What the extension calls in the package, by the module that registers it at its import.
INJECTED: Graph = {"hookloop._core": {"hookloop.utils._tensors"}}

_RUST_IMPORT = re.compile(
    r'\bimport(?:_bound)?\s*\(\s*(?:\w+\s*,\s*)?(?:intern!\s*\(\s*\w+\s*,\s*)?"([^"]*)"'
)


def rust_imports(src_dir: Path) -> Dict[str, Set[str]]:
    """The Python modules each file of a PyO3 crate imports by name (``py.import("x")``,
    ``PyModule::import(py, "x")``, with or without ``intern!``)."""
    out: Dict[str, Set[str]] = {}
    for path in sorted(src_dir.rglob("*.rs")):
        src = _COMMENT.sub("", path.read_text())
        names = set(_RUST_IMPORT.findall(src))
        if names:
            out[str(path.relative_to(src_dir))] = names
    return out


def python_graph() -> Graph:
    # An extension module is a node by its stub (`_core.pyi`); its edges are injected_edges().
    files = _package_files()
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


def test_the_extension_imports_nothing_of_the_package():
    """What Rust calls in the package is handed to it (``_core._register_*``): no import."""
    crate = ROOT / "rust" / "hookloop-py" / "src"
    imports = rust_imports(crate)
    assert imports, "the scan finds the extension's imports (sys, numpy, logging)"
    ours = {f: {n for n in names if n.split(".")[0] == "hookloop"} for f, names in imports.items()}
    assert {f: n for f, n in ours.items() if n} == {}


def test_the_extensions_edges_are_the_registrations_listed_and_close_no_other_circle():
    """With the registrations' edges, the only circles are the extension with each module
    that registers into it: a registrant imports nothing of the package but the extension."""
    injected = injected_edges()
    assert injected == INJECTED
    graph = python_graph()
    for module, deps in injected.items():
        graph[module] |= deps
    pairs = sorted(sorted(["hookloop._core", m]) for m in INJECTED["hookloop._core"])
    assert circles(graph) == pairs


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
