"""No module of the package imports itself in a circle, directly or through others (lazy
imports inside functions included: a circle hidden in a function is still a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import mci

ROOT = Path(mci.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        # `from mci.server import protocol` imports the module mci.server.protocol
        found |= {n for n in names if n in modules and n != "mci" and not n.endswith("__init__")}
    return found


def test_no_import_cycles():
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    graph = {m: _imports(p, modules) - {m} for m, p in files.items()}
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    graph = {m: deps - packages for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert len(graph) > 40  # the walk saw the package
