"""The package's import graph (issue #26): no cycles, and arrows that run down the rooms.

The graph is read from the source with `ast`, not by importing: every `import` and
`from ... import` of a module counts, at module level, inside functions and under
`TYPE_CHECKING` alike, since each of them is an arrow a reader (and a type checker)
follows. `from .pkg import name` points at the module `pkg.name` where one exists, else
at `pkg`. Importing a module also runs its packages' `__init__`; those implicit arrows are
left out, so a package that re-exports its modules is not a cycle with each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "p2psync"

#: Rooms only the runtime, the tools and the entry points above the library use.
ABOVE_THE_LIBRARY = {"worlds", "bench", "planner", "conformance", "integrations", "cli", "demo"}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The package modules one import statement of `module` points at."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "p2psync"]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    if origin.split(".")[0] != "p2psync":
        return []
    return [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source."""
    found = modules()
    known = set(found)
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(t for t in targets(name, path.name == "__init__.py", node, known) if t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def room(module: str) -> str:
    """The top-level room of a module ("core", "trainer", ..., "cli"); the package itself: ""."""
    return module.split(".")[1] if "." in module else ""


def arrows() -> list[tuple[str, str]]:
    """Every import of one room by another, as (importer, imported) module pairs."""
    return sorted((a, b) for a, imported in import_graph().items() for b in imported if room(a) != room(b))


def broken(allowed: dict[str, set[str]]) -> list[str]:
    """The arrows out of each room of `allowed` to a room it may not import."""
    return [f"{a} -> {b}" for a, b in arrows() if room(a) in allowed and room(b) not in allowed[room(a)]]


def test_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "p2psync.core.types" in graph["p2psync.core.layout"]  # a module-level import
    assert "p2psync.core.plugins" in graph["p2psync.worlds.world"]  # one inside a function


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles in p2psync/: " + "; ".join(" <-> ".join(c) for c in found)


def test_core_imports_only_core() -> None:
    assert not broken({"core": set()})


def test_layouts_and_transports_import_only_core() -> None:
    assert not broken({"layouts": {"core"}, "transports": {"core"}})


def test_trainer_and_engine_never_import_each_other() -> None:
    assert not [f"{a} -> {b}" for a, b in arrows() if {room(a), room(b)} == {"trainer", "engine"}]


def test_the_library_does_not_import_what_stands_above_it() -> None:
    library = ("core", "trainer", "engine", "layouts", "transports")
    assert not [f"{a} -> {b}" for a, b in arrows() if room(a) in library and room(b) in ABOVE_THE_LIBRARY]
