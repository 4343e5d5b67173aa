"""Writing files: atomic replacement, fresh folders published whole, guarded appends
(the package docstring, oomless.fileio, says how)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

from ..errors import OutputError


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


def check_output_file(path: str | Path) -> Path:
    """``path`` may be created or replaced: it is absent, a regular file or a symlink
    (replaced, never followed). A folder or a device (``/dev/null``) is refused."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as err:
        raise OutputError(f"cannot write '{path}': {err.strerror}") from None
    if stat.S_ISDIR(mode):
        raise OutputError(f"'{path}' is a folder; give a file name to write to")
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise OutputError(f"'{path}' is not a regular file (a device, pipe or socket); "
                          "give a file name to write to")
    return path


def write_atomic(path: str | Path, data: str | bytes, encoding: str = "utf-8") -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); returns the path."""
    path = check_output_file(path)
    payload = data.encode(encoding) if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise OutputError(f"cannot write '{path}': {err.strerror}") from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; these files are for sharing
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise OutputError(f"cannot write '{path}': {err.strerror or err}") from None
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
        fsync_dir(root)
    old = None
    if final.exists() or final.is_symlink():
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".old"))
        os.replace(final, old / final.name)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def open_append(path: str | Path) -> IO[str]:
    """``path`` opened for appending text (created if absent). A symlink at ``path`` is
    refused (``O_NOFOLLOW``), and so is anything that is not a regular file."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OutputError(f"'{path}' is a symbolic link; oomless does not append "
                              "through links (remove it)") from None
        raise OutputError(f"cannot append to '{path}': {err.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutputError(f"'{path}' is not a regular file; cannot append to it")
    return os.fdopen(fd, "a", encoding="utf-8", newline="")


def cut_torn_tail(path: str | Path) -> int:
    """Truncate ``path`` after its last newline (a line torn by a killed writer).

    Returns the bytes removed (0 when the file ends with a newline or is absent).
    """
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return 0
    except OSError as err:
        raise OutputError(f"cannot repair '{path}': {err.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        end = size
        while end > 0:
            start = max(0, end - 65536)
            chunk = os.pread(fd, end - start, start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
        if end != size:
            os.ftruncate(fd, end)
            os.fsync(fd)
        return size - end
    finally:
        os.close(fd)
