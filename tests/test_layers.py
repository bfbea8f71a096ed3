"""servops' import graph has no circles: no module imports one that (directly or through others)
imports it back, so every module can be read, tested and changed with only what lies below it.

What counts as an import, decided here once:
- every `import` statement of a module, at module level or inside a function (a function-level
  import defers the load, not the dependency: the module still needs the other to do its job);
- `from . import x` and `from .pkg import x` depend on the module `pkg.x` where that is a
  module, else on the package `pkg` (its __init__.py);
- only servops' own modules: servops/**.py, a package's __init__ and the host-side programs of
  servops/remote/ included.
The graph is read from the source (ast), nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "servops"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}."""
    paths = {module_name(p): p for p in sorted(package.rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in paths else module
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in paths:  # `import servops.a.b` names servops.a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.setdefault(target, node.lineno)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found)


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    edges = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in component if b in graph[a]]
    return " <-> ".join(component) + ":\n    " + "\n    ".join(edges)


def test_the_graph_is_read_as_documented():
    graph = import_graph()
    assert "servops.engines" in graph and "servops.engines.sglang" in graph  # packages are modules too
    assert "servops.errors" in graph["servops.deploy"]  # `from .errors import ...`
    # a function-level import counts (launchcheck imports output inside its printers)
    assert "servops.output" in graph["servops.launchcheck"]


def test_the_cycle_finder_finds_a_circle_through_three_modules():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "c -> a (line 3)" in describe(graph, ["a", "b", "c"])


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles in servops/:\n" + "\n".join(describe(graph, c) for c in found)
