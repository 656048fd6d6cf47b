"""The layering of the code, read from the source (ast; nothing is imported).

- engine/ has no import cycle: module A imports module B, directly or through others, and B
  imports A. Imports inside functions count: a deferred import is still a dependency, and
  a cycle hidden in a function body is a circle all the same (it only moves the failure to
  the first call). Imports under `if TYPE_CHECKING:` do not count: they never run, and are
  the way to name a type from a module that depends on this one.
- nothing in engine/ imports server/ (the server is built on the engine, not the reverse);
- nothing in kernels/ imports engine/ (kernels are the bottom layer: tensors in, tensors out).

An edge goes to the module named: `import a.b.c` and `from a.b import c` (c a module) are
edges to a.b.c, `from a.b import name` (name not a module) is an edge to a.b (its
__init__). The parent packages Python also runs on the way are not edges: `engine/__init__`
itself imports only light modules and loads `LLM` on first use (`engine.__getattr__`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_under(packages: tuple[str, ...], root: Path) -> dict[str, Path]:
    """{dotted module name: path} of every .py file under the given top-level packages."""
    return {module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes anywhere in the tree (function bodies too), less `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from (n for child in node.orelse for n in _imports_in(child))
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules `name` (at `path`) imports: every dotted target, whether in `known` or not."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        if node.level:  # relative: from .x import y
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            out.add(sub if sub in known else target)
    return out


def import_graph(*packages: str, root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """{module: the modules it imports}, for every module under `packages`; targets outside
    them (torch, server, ...) are kept as they are named."""
    modules = modules_under(packages, root)
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] among the graph's own modules, or None (depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in graph:
                continue
            if color[nxt] == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color[nxt] == WHITE and (found := visit(nxt)):
                return found
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE and (found := visit(node)):
            return found
    return None


def crossings(graph: dict[str, set[str]], forbidden: str) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                  if t == forbidden or t.startswith(forbidden + "."))


# ---- the rules -----------------------------------------------------------------------------------


def test_engine_has_no_import_cycle() -> None:
    graph = import_graph("engine")
    assert len(graph) > 40 and "engine.quantization.rtn" in graph  # the walk found the tree
    cycle = find_cycle(graph)
    assert cycle is None, "engine/ import cycle: " + " -> ".join(cycle)


def test_engine_does_not_import_server() -> None:
    assert crossings(import_graph("engine"), "server") == []


def test_kernels_do_not_import_engine() -> None:
    assert crossings(import_graph("kernels"), "engine") == []


# ---- the checker itself ----------------------------------------------------------------------------


def _graph_of(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return import_graph("pkg", root=tmp_path)


@pytest.mark.parametrize("body_b", [
    "from pkg import a\n",  # a submodule, by from-import
    "def f():\n    import pkg.a\n",  # deferred, inside a function
    "from . import a\n",  # relative
])
def test_checker_sees_cycles(tmp_path: Path, body_b: str) -> None:
    graph = _graph_of(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import thing\n", "pkg/b.py": body_b})
    assert find_cycle(graph) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_checker_ignores_type_checking_imports(tmp_path: Path) -> None:
    graph = _graph_of(tmp_path, {
        "pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\nelse:\n    import os\n",
    })
    assert graph["pkg.b"] == {"typing", "os"} and find_cycle(graph) is None
