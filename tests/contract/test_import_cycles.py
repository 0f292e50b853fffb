"""No import cycles between the modules of a package, read from the source with ``ast``.

A cycle makes the import order matter (whichever module is imported first sees
the other half-initialised) and usually means two modules share one job. The
graph has an edge ``a -> b`` for every import of ``b`` that runs when ``a`` is
imported: statements at module level, including those under ``if`` / ``try``
and ``if TYPE_CHECKING:`` (a typing-only cycle still ties the two modules
together) and in class bodies. Imports inside functions are deliberate lazy
imports and are left out. ``from pkg import name`` points at ``pkg.name`` when
that is a module, else at ``pkg`` (its ``__init__``); the implicit import of a
parent package is not an edge (every submodule has it).

No package has a cycle, and this test keeps it so.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "hp_core": ROOT / "packages/hp-core/src/hp_core",
    "hp_dtensor": ROOT / "packages/hp-dtensor/src/hp_dtensor",
    "hp_fsdp": ROOT / "packages/hp-fsdp/src/hp_fsdp",
    "hp_pipeline": ROOT / "packages/hp-pipeline/src/hp_pipeline",
    "hp_testing": ROOT / "packages/hp-testing/src/hp_testing",
    "hp_torchtitan": ROOT / "packages/hp-torchtitan/src/hp_torchtitan",
}


def _modules() -> dict[str, Path]:
    """Every module of every package by dotted name (a package is its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _module_level(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (not those inside functions)."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``node``, in module ``name``, imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    base = node.module or ""
    if node.level:
        anchor = name.split(".") if is_package else name.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    out = set()
    for alias in node.names:
        child = f"{base}.{alias.name}"
        if child in known:
            out.add(child)
        elif base in known:
            out.add(base)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports at import time."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in _module_level(tree):
            edges |= _targets(name, path.name == "__init__.py", node, known)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def _show(component: frozenset[str]) -> str:
    return "{" + ", ".join(sorted(component)) + "}"


def test_the_graph_sees_a_planted_cycle() -> None:
    """The detector itself: a two-module and a three-module cycle are found, a chain is not."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.d"}, "p.d": {"p.e"}, "p.e": {"p.c"}, "p.f": {"p.a"}}
    assert cycles(graph) == {frozenset({"p.a", "p.b"}), frozenset({"p.c", "p.d", "p.e"})}
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == set()


def test_edges_follow_python_import_rules() -> None:
    """Lazy imports in functions are left out; TYPE_CHECKING and relative imports are edges."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from .c import thing\n"
        "if TYPE_CHECKING:\n"
        "    from p.d import D\n"
        "def lazy():\n"
        "    from p.e import E\n"
    )
    known = {"p", "p.a", "p.b", "p.c", "p.d", "p.e"}
    edges: set[str] = set()
    for node in _module_level(ast.parse(source)):
        edges |= _targets("p.a", False, node, known)
    assert edges == {"p.b", "p.c", "p.d"}


def test_no_package_has_an_import_cycle() -> None:
    found = sorted(map(_show, cycles(import_graph())))
    assert not found, (
        f"import cycles: {found}; break them (move the shared part into a module both import, or "
        "import lazily inside the function that needs it)"
    )
