"""The harness's layers (harness/__init__.py): every module imports only from its own layer or the layers below
it, and no modules import each other in a circle. Read from the source (ast), function-level imports included.
And the domain layer (frozen dataclasses and pure rules) imports no module that starts processes or threads, at
run time (imports for type checking only, under `if TYPE_CHECKING:`, do not count there)."""

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


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def _nodes(tree: ast.AST, runtime: bool) -> list[ast.AST]:
    """Every node of `tree`; with `runtime`, less the bodies of `if TYPE_CHECKING:` blocks."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if runtime and _type_checking_block(node):
            assert isinstance(node, ast.If)
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def external_imports(source: str) -> set[str]:
    """The top-level names of the modules outside the harness that `source` imports at run time."""
    found: set[str] = set()
    for node in _nodes(ast.parse(source), runtime=True):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"harness"}


def imports_of(module: str, source: str, *, runtime: bool = False) -> set[str]:
    """The harness modules that `source` imports (with `runtime`: not counting `if TYPE_CHECKING:` blocks)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _nodes(ast.parse(source), runtime):
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


def graph(*, runtime: bool = False) -> dict[str, set[str]]:
    return {m: imports_of(m, p.read_text(), runtime=runtime) for m, p in MODULES.items()}


# what starts processes or threads, or handles signals: the runners' business (harness.tools.runners, .cgroup, ...)
PROCESS_MODULES = {"subprocess", "multiprocessing", "threading", "signal", "concurrent", "asyncio", "pty"}


def process_importers() -> dict[str, set[str]]:
    """The harness modules that import a process module at run time, and which."""
    out = {m: external_imports(p.read_text()) & PROCESS_MODULES for m, p in MODULES.items()}
    return {m: found for m, found in out.items() if found}


def process_paths(g: dict[str, set[str]], starts: list[str], importers: dict[str, set[str]]) -> list[str]:
    """For each module reachable from `starts` in `g` that imports a process module: the chain of imports to it."""
    parent: dict[str, str | None] = {s: None for s in starts}
    todo = list(starts)
    while todo:
        m = todo.pop(0)
        for t in sorted(g.get(m, ())):
            if t not in parent:
                parent[t] = m
                todo.append(t)
    bad = []
    for m in sorted(parent):
        if m in importers:
            chain, at = [m], parent[m]
            while at is not None:
                chain.append(at)
                at = parent[at]
            bad.append(" -> ".join(reversed(chain)) + f" (imports {', '.join(sorted(importers[m]))})")
    return bad


def domain_modules() -> list[str]:
    return sorted(m for m in MODULES if m not in DATA and m not in TOP and layer_of(m) == "domain")


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


def test_the_domain_layer_imports_no_process_code() -> None:
    """The domain layer is values and pure rules: neither it nor anything it imports (at run time) starts a process,
    a thread or a signal handler; the requests it builds are harness.tools.requests's value types, which the runners
    (harness.tools.runners) carry out."""
    assert domain_modules(), "no domain modules found"
    assert "harness.tools.runners" in process_importers()  # the check sees the runners' subprocess
    assert process_paths(graph(runtime=True), domain_modules(), process_importers()) == []


def test_a_process_import_in_the_domain_is_found() -> None:
    g = graph(runtime=True)
    g["harness.domain.plan"] = g["harness.domain.plan"] | imports_of(
        "harness.domain.plan", "from harness.tools.runners import run_tool", runtime=True)
    bad = process_paths(g, domain_modules(), process_importers())
    assert any(line.startswith("harness.domain.plan -> harness.tools.runners") for line in bad), bad
    # an import for type checking only is no run-time dependency
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.tools.runners import run_tool\n"
    assert imports_of("harness.domain.plan", src, runtime=True) == set()
    assert imports_of("harness.domain.plan", src) == {"harness.tools.runners"}


def test_a_circle_is_found() -> None:
    g = graph()
    g["harness.orchestration.executor"] = g["harness.orchestration.executor"] | {"harness.orchestration.compare"}
    assert any(c[0] == c[-1] and "harness.orchestration.compare" in c for c in cycles(g))
