"""The folder tree reads as the data flow, and the imports keep it so.

ModelSpec + RunConfig → estimate → MemoryEstimate → plan/check → train/measure →
report/diagnose. Every import is read (module level, inside functions, under
TYPE_CHECKING): no import circle, no import that runs back up the flow, at most
20 modules in one package folder, and no source file pointing outside the
repository.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "oomless"

# Rank in the data flow; a module may import only modules of its rank or lower.
# A new top-level module or package must be placed here on purpose.
RANKS = {
    "oomless": 0, "oomless.errors": 0, "oomless.units": 0, "oomless.fileio": 0,
    "oomless.knobs": 0, "oomless.data": 0, "oomless.limits": 0, "oomless.yamlfile": 0,
    "oomless.config": 1, "oomless.result": 1,
    "oomless.models": 2,
    "oomless.dataset": 3,
    "oomless.memory": 4, "oomless.allocator": 4,
    "oomless.api": 5,
    "oomless.planner": 6,
    "oomless.check": 7, "oomless.diagnose": 7, "oomless.report": 7,
    "oomless.runtime": 8, "oomless.supervise": 8,
    "oomless.hf": 9, "oomless.cli": 9, "oomless.ui": 9, "oomless.__main__": 9,
}
MAX_UPWARD_IMPORTS = 1  # the issue allows one; today there are none
MAX_MODULES_PER_FOLDER = 20


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        out[name] = (path, is_pkg)
    return out


def _targets(name: str, is_pkg: bool, node: ast.AST, modules: dict) -> list[str]:
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names]
    else:
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        found = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix
                 for a in node.names]
    out = []
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target.startswith("oomless") and target != name:
            out.append(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, (path, is_pkg) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(_targets(name, is_pkg, node, modules))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def rank(module: str) -> int:
    best = max((k for k in RANKS if module == k or module.startswith(k + ".")), key=len,
               default=None)
    if best is None:
        pytest.fail(f"module {module} has no place in the data flow: add it to RANKS "
                    "in tests/test_layout.py")
    return RANKS[best]


def test_no_import_circle():
    assert _cycles(import_graph()) == []


def test_imports_follow_the_data_flow():
    graph = import_graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if rank(b) > rank(a))
    assert len(upward) <= MAX_UPWARD_IMPORTS, upward


def test_the_pure_core_never_imports_the_runtime():
    graph = import_graph()
    core = [m for m in graph if rank(m) < RANKS["oomless.runtime"]]
    bad = sorted(f"{m} -> {t}" for m in core for t in graph[m]
                 if t.startswith("oomless.runtime"))
    assert bad == []


def test_package_folders_stay_small():
    sizes = {str(d.relative_to(SRC)): sum(1 for p in d.glob("*.py") if p.name != "__init__.py")
             for d in PACKAGE.rglob("*") if d.is_dir() and (d / "__init__.py").exists()}
    assert {d: n for d, n in sizes.items() if n > MAX_MODULES_PER_FOLDER} == {}


def test_source_points_nowhere_outside_the_repository():
    bad = [str(p.relative_to(SRC)) for p in PACKAGE.rglob("*.py")
           if "REFERENCE.md" in (text := p.read_text(encoding="utf-8")) or "../shared" in text]
    assert bad == []


def test_the_checker_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
