"""The import graph of `tuner`: no module below the CLI imports `tuner.cli`, and no import circle.

The graph is read from the source with `ast` (nothing is imported): every `import tuner...` / `from tuner... import`
statement in tuner/**/*.py, at module level AND inside functions (deferred imports are how this project imports
heavy things, and a deferred import still makes the two modules depend on each other). An arrow goes to the deepest
module the statement names (`from tuner.quality.gate import digest` -> tuner.quality.gate; `from tuner.quality import kld` ->
tuner.quality.kld); the parent packages Python also runs on the way are not arrows.

What counts as a circle: any cycle of such arrows, function-level ones included (stricter than module level only,
which tuner also meets). Not arrows: the registries' names of lazily loaded modules (tuner.engines.registry's
engine and quality modules, tuner.export's targets, tuner.cli's commands). A registry names its plugins as text
so that it sits below them: tuner.quality.template finds an engine's scoring steps (and its baseline's) through the
registry, so no scorer imports the dispatcher (tuner.quality.gate) that sits above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tuner"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str) -> set[tuple[str, int]]:
    """(imported tuner module, line) for every tuner import statement in module `name`, at any depth."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target not in MODULES and "." in target:  # `import tuner.x.y` of a name, not a module
                target = target.rpartition(".")[0]
            if target.split(".")[0] == "tuner" and target in MODULES and target != name:
                found.add((target, node.lineno))
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_reader_sees_deferred_imports() -> None:
    """tuner.quality.gate imports tuner.quality.kld only inside functions: the graph has that arrow, at those lines."""
    top_level = {node.lineno for node in ast.parse(MODULES["tuner.quality.gate"].read_text()).body}
    kld_lines = {line for target, line in GRAPH["tuner.quality.gate"] if target == "tuner.quality.kld"}
    assert kld_lines and not kld_lines & top_level
    assert len(MODULES) > 30 and sum(len(e) for e in GRAPH.values()) > 150


def test_nothing_below_the_cli_imports_the_cli() -> None:
    """Library code never imports the CLI layer (tuner/__main__.py, the entry point, may)."""
    climbing = sorted(f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {t}"
                      for m, edges in GRAPH.items() for t, line in edges
                      if (t == "tuner.cli" or t.startswith("tuner.cli."))
                      and not (m == "tuner.cli" or m.startswith("tuner.cli.") or m == "tuner.__main__"))
    assert not climbing, "\n".join(climbing)


def test_no_import_circle() -> None:
    graph = {m: {t for t, _ in edges} for m, edges in GRAPH.items()}
    found = cycles(graph)
    detail = [" <-> ".join(c) + ": " + "; ".join(
        f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {t}"
        for m in c for t, line in sorted(GRAPH[m]) if t in c) for c in found]
    assert not found, "\n".join(detail)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
])
def test_the_cycle_finder_finds_circles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert sorted(cycles(graph)) == expected
