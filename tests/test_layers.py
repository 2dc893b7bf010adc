"""The harness's layers (harness/__init__.py): every module imports only from its own layer or the layers below
it, and no modules import each other in a circle. Read from the source (ast), function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "harness"
# top to bottom; a module may import its own layer and the ones after it
LAYERS = ("cli", "orchestration", "report", "domain", "tools", "parsers", "stats", "core")
TOP = {"harness": "cli", "harness.__main__": "cli"}  # the package's own entry points sit with the CLI
DATA = {"harness.profiles"}  # packaged data (hardware profiles): imports nothing


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> str:
    if module in TOP:
        return TOP[module]
    parts = module.split(".")
    if module in DATA or len(parts) < 2 or parts[1] not in LAYERS:
        raise AssertionError(f"{module} is in no layer: put it under harness/<layer>/ ({', '.join(LAYERS)})")
    return parts[1]


def imports_of(module: str, source: str) -> set[str]:
    """The harness modules that `source` imports."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` depends on pkg.mod; `from pkg import name` on pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            # the longest harness module that the name is, or is inside of
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    return {m: imports_of(m, p.read_text()) for m, p in MODULES.items()}


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, targets in g.items():
        if m in DATA:
            bad += [f"{m} (data) imports {t}" for t in sorted(targets)]
            continue
        rank = LAYERS.index(layer_of(m))
        for t in sorted(targets):
            if t in DATA or t == "harness":
                continue
            if LAYERS.index(layer_of(t)) < rank:
                bad.append(f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)}), a layer above it")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of imports found by a depth-first search (each reported once, from its first module)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                found.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    return found


def test_every_module_is_in_a_layer() -> None:
    for m in MODULES:
        if m not in DATA:
            layer_of(m)


def test_each_layer_imports_only_downward() -> None:
    assert upward_imports(graph()) == []


def test_no_import_circle() -> None:
    assert cycles(graph()) == []


@pytest.mark.parametrize(("module", "source", "problem"), [
    ("harness.report.tables", "from harness.orchestration.compare import compare", "a layer above it"),
    ("harness.core.sizes", "def f():\n    from harness.cli import main", "a layer above it"),
])
def test_an_upward_import_is_found(module: str, source: str, problem: str) -> None:
    g = graph()
    g[module] = g[module] | imports_of(module, source)
    assert any(problem in line for line in upward_imports(g))


def test_a_circle_is_found() -> None:
    g = graph()
    g["harness.orchestration.executor"] = g["harness.orchestration.executor"] | {"harness.orchestration.compare"}
    assert any(c[0] == c[-1] and "harness.orchestration.compare" in c for c in cycles(g))
