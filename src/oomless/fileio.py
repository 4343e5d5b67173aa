"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Every file oomless writes for later reading (run files, checkpoints' JSON,
plan files, logs rewritten on resume, reports) goes through here:

1. the data goes to a temporary file created by :func:`tempfile.mkstemp` in the
   target's own folder — an unpredictable name opened with ``O_CREAT | O_EXCL``,
   so a symlink planted at a predictable ``NAME.tmp`` is never followed;
2. the file is flushed and fsync'ed, then ``os.replace``d over the target (atomic
   on POSIX within one file system);
3. the folder is fsync'ed so that the rename itself survives a crash.

Folders (checkpoints, final weights) are built the same way with
:func:`tempfile.mkdtemp` and published with :func:`publish_dir`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or a new entry in ``folder`` durable (no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some file systems refuse fsync on folders
            os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: str | bytes, encoding: str = "utf-8") -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); returns the path."""
    path = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; these files are for sharing
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    """``obj`` as JSON (UTF-8, a final newline), written atomically."""
    return write_atomic(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def new_temp_dir(parent: str | Path, name: str) -> Path:
    """A fresh, uniquely named folder inside ``parent`` to build ``name`` in."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".tmp"))


def publish_dir(tmp: str | Path, final: str | Path) -> Path:
    """Move a finished temporary folder to ``final``, replacing an older ``final``.

    The old folder is first renamed aside, so at every moment ``final`` is either
    the complete old folder or the complete new one (never a half-deleted one).
    """
    tmp, final = Path(tmp), Path(final)
    for root, _dirs, files in os.walk(tmp):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".old"))
        os.replace(final, old / final.name)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
