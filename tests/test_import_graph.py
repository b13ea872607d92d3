"""The package's layers, enforced: every import runs down them (lazy imports inside functions
included: an import hidden in a function is still an arrow), and none runs in a circle.

A module may import its own package's modules and any module on a lower floor; never a
floor above, and never a neighbour on its own floor. So, among others: nothing below the
engine imports it; `parallel/` (communication only) imports neither `models/` nor the
engine; `server/` and `router/` do not import each other. docs/architecture.md draws the
same floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mci

ROOT = Path(mci.__file__).parent

# Top to bottom. Each name is a package of mci (all its modules) or a top-level module.
FLOORS = (
    ("mci.__main__",),  # python -m mci
    ("mci", "mci.cli"),  # the public face (Engine, EngineConfig, SamplingParams); the commands
    ("mci.ray_serve", "mci.workflow"),  # Ray Serve deployments; compound workflows
    ("mci.replicas",),  # N servers behind the router (--dp-size, Ray Serve replicas)
    ("mci.server", "mci.router", "mci.bench"),  # HTTP front ends, and the load generator
    ("mci.engine",),  # THE engine: API, core step, loop, builder, commands, multi-rank
    ("mci.disaggregation",),  # prefill/decode workers' KV handoff (fills scheduler/handoff.py)
    ("mci.scheduler", "mci.runner"),  # the plan of a step; the step on the model
    ("mci.speculative",),  # drafters (MTP runs the model's module)
    ("mci.plan", "mci.tools"),  # memory plans and checkpoint tools, from the model's layout
    ("mci.models",),
    ("mci.layers",),
    ("mci.parallel", "mci.kernels"),  # communication only; the C kernels
    ("mci.cache",),
    ("mci.core",),  # Request, SamplingParams, batches, outputs, request ids
    ("mci.grammar",),
    ("mci.tenancy",),  # tenants: keys, weights, quotas, residency (server, router read it)
    (
        "mci.tokenizer",
        "mci.model_config",
        "mci.config_fields",
        "mci.process_tuning",
        "mci.process_memory",
        "mci.loopback",
        "mci.tracing",
        "mci.http_stream",
    ),
    ("mci.errors",),
)
FLOOR_OF = {unit: i for i, units in enumerate(FLOORS) for unit in units}


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
        # `from mci.server import requests` imports the module mci.server.requests
        found |= {n for n in names if n in modules and n != "mci"}
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    graph = {m: _imports(p, modules) - {m} for m, p in files.items()}
    return {m: deps - packages for m, deps in graph.items()}


def _unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: mci.engine.core -> mci.engine."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_every_module_has_a_floor():
    unplaced = sorted({_unit(m) for m in _graph()} - set(FLOOR_OF))
    assert not unplaced, f"place these in FLOORS (and docs/architecture.md): {unplaced}"


def test_every_import_runs_down_the_floors():
    wrong = []
    for module, deps in sorted(_graph().items()):
        mine = _unit(module)
        for dep in sorted(deps):
            theirs = _unit(dep)
            if theirs == mine:
                continue
            if FLOOR_OF[theirs] == FLOOR_OF[mine]:
                wrong.append(f"{module} -> {dep}: neighbours on one floor")
            elif FLOOR_OF[theirs] < FLOOR_OF[mine]:
                wrong.append(f"{module} -> {dep}: runs back up the floors")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
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
