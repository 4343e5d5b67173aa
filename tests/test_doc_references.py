"""Docs and docstrings name code that exists (issue 18, item 9).

Read without importing anything: every ``oomless.x.y`` name in a docstring, README.md
or docs/*.md resolves to a module and, past it, to a name the module's source defines;
every repository path (``src/oomless/...``, ``tests/...``, ``benchmarks/...``,
``docs/...``) exists; and a path a docstring gives into one of oomless' own packages
(``memory/states.py``, ``runtime/train/loop.py``) exists under src/oomless, unless the
line names the other project the file belongs to (``transformers models/llama/...``).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "oomless"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

DOTTED = re.compile(r"(?<![\w./-])oomless(?:\.[A-Za-z_]\w*)+(?!\.?\w)")
FILE_SUFFIXES = ("yaml", "yml", "json", "jsonl", "py", "md", "html", "log", "txt")
REPO_PATH = re.compile(r"(?<![\w./-])((?:src/oomless|tests|benchmarks|docs)/[\w./-]*\w)")
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
PACKAGE_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(SUBPACKAGES)})/[\w/]*\w\.py)\b")
# a path on the same line after one of these names is that project's file
FOREIGN = re.compile(
    r"transformers|peft|\btrl\b|bitsandbytes|deepspeed|accelerate|torch|vllm|vLLM|"
    r"LLaMA-Factory|llamafactory|axolotl|ms-swift|unsloth|THUDM|GLM|Liger|liger|flash|"
    r"gptq|awq|aqlm|hqq|LLaVA|llava|aten|ATen", re.IGNORECASE)


def _docstrings() -> list[tuple[str, str]]:
    """(where, text) of every docstring of src/oomless."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                          | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    line = getattr(node, "lineno", 1)
                    out.append((f"{path.relative_to(ROOT)}:{line}", doc))
    return out


def _texts() -> list[tuple[str, str]]:
    return _docstrings() + [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
                            for p in DOCS]


@cache
def _defined(path: Path) -> dict[str, ast.AST | None]:
    """Top-level names a module's source defines or imports (classes keep their node)."""
    names: dict[str, ast.AST | None] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = None
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
    return names


def _class_has(node: ast.ClassDef, name: str) -> bool:
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and \
                item.name == name:
            return True
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and \
                item.target.id == name:
            return True
        if isinstance(item, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in item.targets):
            return True
    return False


def resolves(dotted: str) -> bool:
    """``oomless.a.b.name.attr``: the longest module prefix, then names in its source."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT / "src" / Path(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            rest = parts[cut:]
            break
    else:
        return False
    if not rest:
        return True
    names = _defined(module)
    if rest[0] not in names:
        sub = module.parent / rest[0]
        return module.name == "__init__.py" and (sub.with_suffix(".py").is_file()
                                                 or (sub / "__init__.py").is_file())
    node = names[rest[0]]
    if len(rest) == 1:
        return True
    return isinstance(node, ast.ClassDef) and len(rest) == 2 and _class_has(node, rest[1])


def _problems() -> list[str]:
    out = []
    for where, text in _texts():
        for m in DOTTED.finditer(text):
            name = m.group(0)
            if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                continue  # a file name (oomless.yaml), not code
            if not resolves(name):
                out.append(f"{where}: {name}")
        for m in REPO_PATH.finditer(text):
            if not (ROOT / m.group(1)).exists():
                out.append(f"{where}: {m.group(1)}")
        if where.endswith(".md"):
            continue
        for m in PACKAGE_PATH.finditer(text):
            line_start = text.rfind("\n", 0, m.start()) + 1
            if FOREIGN.search(text[line_start:m.start()]):
                continue
            if not (PACKAGE / m.group(1)).exists():
                out.append(f"{where}: {m.group(1)}")
    return out


def test_every_name_and_path_in_docs_and_docstrings_exists():
    assert _problems() == []


@pytest.mark.parametrize(("name", "ok"), [
    ("oomless.config.RunConfig", True), ("oomless.config.RunConfig.replace", True),
    ("oomless.memory.states", True), ("oomless.memory", True),
    ("oomless.config.NoSuchThing", False), ("oomless.no_such_module", False),
    ("oomless.config.RunConfig.no_such_method", False),
])
def test_the_resolver_tells_names_apart(name, ok):
    assert resolves(name) == ok
