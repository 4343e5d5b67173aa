"""Docs and docstrings name code that exists (issue 18, item 9).

Read without importing anything: every ``oomless.x.y`` name in a docstring, README.md
or docs/*.md resolves to a module and, past it, to a name the module's source defines;
every repository path (``src/oomless/...``, ``tests/...``, ``benchmarks/...``,
``docs/...``) exists; and a path a docstring gives into one of oomless' own packages
(``memory/states.py``, ``runtime/train/loop.py``) exists under src/oomless, unless the
line names the other project the file belongs to (``transformers models/llama/...``).

Sphinx roles (``:func:``, ``:class:``, ``:mod:``, ``:meth:``, ``:data:``, ...) resolve
as Sphinx's Python domain looks them up: an ``oomless.`` name as above; a bare name in
the docstring's class, then its module; a name with a leading dot in the module, then
in each package above it. A name a module imports resolves where it is defined. A name
outside oomless (``tempfile.mkstemp``) must be installed: a standard-library name is
looked up attribute by attribute, another package's only by its top-level module.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
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
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`([^`]+)`")
# a path on the same line after one of these names is that project's file
FOREIGN = re.compile(
    r"transformers|peft|\btrl\b|bitsandbytes|deepspeed|accelerate|torch|vllm|vLLM|"
    r"LLaMA-Factory|llamafactory|axolotl|ms-swift|unsloth|THUDM|GLM|Liger|liger|flash|"
    r"gptq|awq|aqlm|hqq|LLaVA|llava|aten|ATen", re.IGNORECASE)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _docstrings() -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    """(where, text, module, enclosing classes) of every docstring of src/oomless."""
    out = []

    def visit(node: ast.AST, path: Path, module: str, classes: tuple[str, ...]) -> None:
        doc = ast.get_docstring(node, clean=False)  # type: ignore[arg-type]
        if doc:
            line = getattr(node, "lineno", 1)
            out.append((f"{path.relative_to(ROOT)}:{line}", doc, module, classes))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, path, module, (*classes, child.name))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, path, module, classes)

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), path, _module_name(path), ())
    return out


def _texts() -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    return _docstrings() + [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"), None, ())
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


@cache
def _imported(path: Path) -> dict[str, str]:
    """{name: dotted name of what it stands for} of a module's top-level imports."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                out[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name \
                    or alias.name.split(".")[0]
    return out


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
    imported = _imported(module)
    if rest[0] in imported and len(rest) > 1:  # a name imported here: where it is defined
        return _exists(".".join([imported[rest[0]], *rest[1:]]))
    if rest[0] not in names:
        sub = module.parent / rest[0]
        return module.name == "__init__.py" and (sub.with_suffix(".py").is_file()
                                                 or (sub / "__init__.py").is_file())
    node = names[rest[0]]
    if len(rest) == 1:
        return True
    return isinstance(node, ast.ClassDef) and len(rest) == 2 and _class_has(node, rest[1])


def _foreign(dotted: str) -> bool:
    """A name outside oomless: a standard-library one attribute by attribute, another
    package's by its top-level module being installed (it is not imported)."""
    top, *attrs = dotted.split(".")
    if top not in sys.stdlib_module_names:
        return importlib.util.find_spec(top) is not None
    obj = importlib.import_module(top)
    for attr in attrs:
        if not hasattr(obj, attr):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{attr}")
            except (ImportError, AttributeError):
                return False
        else:
            obj = getattr(obj, attr)
    return True


def _exists(dotted: str) -> bool:
    return resolves(dotted) if dotted.split(".")[0] == "oomless" else _foreign(dotted)


def resolves_role(target: str, module: str | None, classes: tuple[str, ...] = ()) -> bool:
    """A Sphinx role's target, looked up as the Python domain does (module docstring)."""
    name = target.lstrip("~!").removesuffix("()")
    if name.startswith("oomless."):
        return resolves(name)
    if module is None:  # README.md and docs/: only full names
        return _foreign(name) if not name.startswith(".") else False
    parts = module.split(".")
    if name.startswith("."):
        return any(resolves(".".join(parts[:cut]) + name) for cut in range(len(parts), 0, -1))
    scopes = [".".join((module, *classes[:cut])) for cut in range(len(classes), -1, -1)]
    if any(resolves(f"{scope}.{name}") for scope in scopes):
        return True
    return _foreign(name)


def _problems() -> list[str]:
    out = []
    for where, text, module, classes in _texts():
        for m in ROLE.finditer(text):
            if not resolves_role(m.group(1), module, classes):
                out.append(f"{where}: {m.group(0)}")
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


@pytest.mark.parametrize(("target", "module", "classes", "ok"), [
    ("write_atomic", "oomless.fileio", (), True),
    ("~oomless.fileio.OutputFolder", None, (), True),
    ("prepare", "oomless.fileio.guarding", ("OutputFolder",), True),
    ("OutputFolder.prepare", "oomless.fileio.guarding", (), True),
    (".guarding", "oomless.fileio", (), True),
    (".writing.write_atomic", "oomless.fileio.reading", (), True),
    ("oomless.config.RunConfig.replace", None, (), True),  # re-exported by the package
    ("tempfile.mkstemp", "oomless.fileio", (), True),
    ("no_such_function", "oomless.fileio", (), False),
    ("prepare", "oomless.fileio.guarding", (), False),  # a method, outside its class
    (".no_such_module", "oomless.fileio", (), False),
    ("tempfile.no_such_function", "oomless.fileio", (), False),
    ("oomless.fileio.no_such", None, (), False),
    ("write_atomic", None, (), False),  # docs/ name code in full
])
def test_the_role_resolver_follows_sphinx_lookup(target, module, classes, ok):
    assert resolves_role(target, module, classes) == ok
