"""No import cycle among ``posttrain``'s modules, read from their source (no import runs).

A module's imports are the ``import`` statements it runs when it is imported: those at its
top level, inside top-level ``if`` / ``try`` blocks too, but not those under ``if
TYPE_CHECKING`` nor inside functions or classes (an import a function runs when called is
the usual way to reach a module that imports this one). ``from package import name`` is an
import of the submodule ``package.name`` where there is one, else of ``package``. The
import of a module's parent packages, which Python runs first, is not counted: a package's
``__init__`` that re-exports its submodules would otherwise be in a cycle with each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

PENDING: set[tuple[str, str]] = set()
"""Imports left out of the graph until their modules are changed (none now)."""


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module under ``src``: its dotted name -> (file, whether it is a package)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = path.name == "__init__.py"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _run_at_import(body: list[ast.stmt]):
    """The import statements of ``body`` that run when the module is imported."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            test = node.test
            if not ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")):
                yield from _run_at_import(node.body)
            yield from _run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse,
                          node.finalbody):
                yield from _run_at_import(block)
        elif isinstance(node, ast.With):
            yield from _run_at_import(node.body)


def import_graph() -> dict[str, set[str]]:
    """Each module -> the modules of this source tree its import runs."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, package) in modules.items():
        here = name.split(".") if package else name.split(".")[:-1]
        targets: set[str] = set()
        for node in _run_at_import(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:  # relative: from the package ``level - 1`` above this one's
                up = here[:len(here) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) through each strongly
    connected group of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the first (by name) module of a strongly connected group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError("a strongly connected group without a cycle")


def test_the_checker_finds_a_cycle_and_reads_imports_as_python_runs_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ntry:\n    import z\n"
                     "except ImportError:\n    z = None\ndef f():\n    import w\n")
    assert [a.name for n in _run_at_import(tree.body) for a in n.names] == ["x", "z"]


def test_no_import_cycle_among_posttrain_modules():
    graph = import_graph()
    for a, b in PENDING:
        graph.get(a, set()).discard(b)
    assert "posttrain.rollout.types" in graph  # (the tree was found)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


MAX_LINES = 450
"""A module longer than this holds more than one room of the house (docs/design.md)."""


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(SRC)): n for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
