"""Guarding what a command writes: never over one of its inputs, never over a file
oomless did not write unless ``--force`` (then the old file is kept as ``NAME.orig``)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import OomlessError, OutputError
from .reading import read_json
from .writing import write_atomic, write_json_atomic

ORIG = ".orig"


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name the same file (also through links, or both absent and equal)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def refuse_inputs(out: str | Path, inputs: Any, flag: str) -> None:
    """An ``OutputError`` when ``out`` is one of ``inputs`` (oomless never writes over one)."""
    for source in inputs:
        if source and same_file(out, source):
            raise OutputError(f"{flag} '{out}' is an input of this command ('{source}'); "
                              "oomless never writes over its inputs: choose another path")


def keep_orig(path: str | Path) -> Path:
    """Move an existing file or folder aside to ``PATH.orig`` (``.orig.1``, ... when taken)."""
    path = Path(path)
    orig, n = path.with_name(path.name + ORIG), 0
    while orig.exists() or orig.is_symlink():
        n += 1
        orig = path.with_name(f"{path.name}{ORIG}.{n}")
    os.replace(path, orig)
    return orig


def sha256_file(path: str | Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_folder(path: str | Path, flag: str) -> Path:
    """``path`` as an existing folder (created when absent); a file there is an error."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{flag} '{path}' is a file, not a folder; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"{flag}: cannot create the folder '{path}': {err.strerror}") from None
    return path


class OutputFolder:
    """A folder a command writes a set of entries into (``plan --out``, ``demo --out``).

    ``.oomless-files.json`` lists what the command wrote (a SHA-256 per file,
    ``"dir"`` for folders): a rerun replaces those entries while they are
    unchanged. Anything else — a same-named file the user wrote or edited, other
    files — makes :meth:`prepare` refuse, unless ``force``: then entries it would
    replace, and stale entries whose names it may write (``known``), are moved to
    ``NAME.orig``; unrelated files are left alone.
    """

    MANIFEST = ".oomless-files.json"

    def __init__(self, path: str | Path, force: bool, flag: str) -> None:
        self.path = ensure_folder(path, flag)
        self.force, self.flag = force, flag
        self.written: dict[str, str] = {}
        manifest = self.path / self.MANIFEST
        previous: Any = {}
        if manifest.is_file():
            with contextlib.suppress(OomlessError):
                previous = read_json(manifest, "manifest")
        self.previous: dict[str, str] = previous if isinstance(previous, dict) else {}

    def _ours(self, name: str) -> bool:
        entry, record = self.path / name, self.previous.get(name)
        if record == ORIG:  # a user's file this command moved aside: kept, never replaced
            return True
        if record == "dir":
            return entry.is_dir() and not entry.is_symlink()
        return (isinstance(record, str) and entry.is_file() and not entry.is_symlink()
                and sha256_file(entry) == record)

    def prepare(self, names: list[str], known: tuple[str, ...] = ()) -> None:
        """Before writing ``names``: refuse, or (force) move aside what is in the way."""
        present = sorted(e.name for e in os.scandir(self.path) if e.name != self.MANIFEST
                         and not (e.name.startswith(".") and e.name.endswith((".tmp", ".old"))))
        foreign = [n for n in present if not self._ours(n)]
        in_way = [n for n in foreign if n in names or n in known]
        if foreign and not self.force:
            listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more"
                                               if len(foreign) > 5 else "")
            raise OutputError(
                f"{self.flag} '{self.path}' holds files oomless did not write ({listed}); "
                "choose an empty or new folder, or pass --force (files oomless would "
                f"replace are then kept as NAME{ORIG}; others are left alone)")
        for name in in_way:
            self.written[keep_orig(self.path / name).name] = ORIG
        for name in present:
            if name not in foreign and name not in names and name in known:
                self._remove(self.path / name)  # our own stale file of an earlier run

    @staticmethod
    def _remove(entry: Path) -> None:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()

    def write(self, name: str, data: str | bytes) -> Path:
        path = write_atomic(self.path / name, data)
        self.written[name] = sha256_file(path)
        return path

    def own_dir(self, name: str) -> Path:
        """Record a folder this command made (its content is the command's)."""
        self.written[name] = "dir"
        return self.path / name

    def finish(self) -> None:
        kept = {n: ORIG for n, r in self.previous.items() if r == ORIG
                and (self.path / n).exists()}
        write_json_atomic(self.path / self.MANIFEST, {**kept, **self.written})
