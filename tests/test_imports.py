"""The import graph of the project: no cycles, and the orchestration layer imports at module top.

Read from the source (no module is executed): an edge ``a -> b`` is a module-level import of ``b``
by ``a`` (``from x.y import z`` is an import of ``x.y.z`` when that is a module, else of ``x.y``), and
an import of ``x.y.z`` is one of the packages ``x`` and ``x.y`` too: Python runs their ``__init__``
first, so a package whose ``__init__`` imports its own modules is in a cycle with each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mage_jax", "experiments")
ORCHESTRATION = (
    "mage_jax/config.py",
    "mage_jax/generate/constraints.py",
    "mage_jax/progress.py",
    "mage_jax/training",
    "mage_jax/rollout",
    "mage_jax/evaluation/evaluator.py",
    "mage_jax/evaluation/report.py",
    "mage_jax/models/sharding.py",
    "mage_jax/models/transformer.py",
    "experiments/common.py",
    "experiments/environments.py",
    "experiments/presets.py",
    "experiments/kuhn_poker.py",
    "experiments/evaluate.py",
    "experiments/baselines.py",
    "experiments/suite.py",
    "experiments/table1.py",
    "experiments/ablations",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(tree: ast.AST, modules: dict[str, Path], *, top_level: bool) -> list[str]:
    nodes = tree.body if top_level else [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                                                     ast.AsyncFunctionDef))]
    found: list[str] = []
    for node in nodes if top_level else [n for f in nodes for n in ast.walk(f)]:
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{a.name}" for a in node.names]
    resolved = [m for m in (_resolve(n, modules) for n in found if n.split(".")[0] in PACKAGES) if m]
    return [".".join(m.split(".")[:i]) for m in resolved for i in range(1, m.count(".") + 2)]


def test_the_project_has_no_import_cycle():
    modules = _modules()
    graph = {name: set(_imports(ast.parse(path.read_text()), modules, top_level=True)) - {name}
             for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_orchestration_layer_imports_project_modules_at_module_top():
    modules = _modules()
    late = {}
    for path in modules.values():
        rel = str(path.relative_to(ROOT))
        if any(rel == o or rel.startswith(o + "/") for o in ORCHESTRATION):
            inside = _imports(ast.parse(path.read_text()), modules, top_level=False)
            if inside:
                late[rel] = inside
    assert late == {}


def test_nothing_outside_the_tests_imports_from_them():
    """Support code the tests share with benchmarks and notebooks lives in ``mage_jax.testing``."""
    found = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert found == []
