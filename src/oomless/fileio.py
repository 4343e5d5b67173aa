"""Files: atomic writes, guarded appends, and reads that fail with a message.

Writing (:func:`write_atomic`, used for every file oomless writes): the data goes
to a temporary file from :func:`tempfile.mkstemp` in the target's folder (an
unpredictable name opened ``O_CREAT | O_EXCL``: a symlink planted at ``NAME.tmp``
is never followed), is fsync'ed and ``os.replace``d over the target (a folder or a
device such as ``/dev/null`` is refused), then the folder is fsync'ed. Folders
(checkpoints, final weights) are built with :func:`new_temp_dir` and published
with :func:`publish_dir`; logs are appended through :func:`open_append`
(``O_NOFOLLOW``).

Reading: :func:`read_text` (a regular file, UTF-8; a bad byte names the file and
line), :func:`parse_json` (every JSON failure becomes the caller's error class)
and :func:`read_jsonl` (JSON-lines logs split on ``\\n`` only; a torn last line
is skipped and reported).

Guarding: nothing replaces one of a command's inputs (:func:`refuse_inputs`) or a
file oomless did not write unless ``--force``, and then the old file is kept as
``NAME.orig`` (:func:`keep_orig`, :class:`OutputFolder`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .errors import OomlessError, OutputError

# Configuration files (YAML, JSON) are small; a bigger one is refused before parsing.
MAX_CONFIG_BYTES = 16 * 2**20


# ---- writing ------------------------------------------------------------------------
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


# ---- reading ------------------------------------------------------------------------
def read_bytes(path: str | Path, what: str, error: type[OomlessError] = OomlessError,
               max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file; missing, a folder, a device, unreadable or (with
    ``max_bytes``) too big are ``error``s that name the file."""
    p = Path(path)
    try:
        info = os.stat(p)
    except OSError as err:
        reason = "not found" if isinstance(err, FileNotFoundError) else err.strerror
        raise error(f"{what} '{p}': {reason}") from None
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{what} '{p}' is a folder; expected a file")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what} '{p}' is not a regular file (a device, pipe or socket)")
    if max_bytes is not None and info.st_size > max_bytes:
        raise error(f"{what} '{p}' is {info.st_size:,} bytes; a file of this kind is at "
                    f"most {max_bytes:,} bytes")
    try:
        with open(p, "rb") as fh:
            return fh.read() if max_bytes is None else fh.read(max_bytes + 1)[:max_bytes]
    except OSError as err:
        raise error(f"cannot read {what} '{p}': {err.strerror}") from None


def decode_utf8(data: bytes, where: str, what: str,
                error: type[OomlessError] = OomlessError) -> str:
    """UTF-8 text (a leading byte-order mark dropped); other bytes name the line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise error(f"{where}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x}); "
                    f"save the {what} as UTF-8") from None
    return text.removeprefix("\ufeff")


def read_text(path: str | Path, what: str, error: type[OomlessError] = OomlessError,
              max_bytes: int | None = None) -> str:
    """A regular file's UTF-8 text; every failure is an ``error`` naming the file."""
    return decode_utf8(read_bytes(path, what, error, max_bytes), str(path), what, error)


def parse_json(text: str, where: str, what: str,
               error: type[OomlessError] = OomlessError) -> Any:
    """``json.loads`` whose every failure is an ``error`` naming ``where`` and the line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{where}:{err.lineno}: not valid JSON ({err.msg} at column "
                    f"{err.colno}); expected {what}") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply; expected {what}") from None
    except ValueError as err:  # e.g. an integer longer than Python's 4300-digit limit
        raise error(f"{where}: unreadable JSON ({err}); expected {what}") from None


def read_json(path: str | Path, what: str, error: type[OomlessError] = OomlessError,
              max_bytes: int | None = MAX_CONFIG_BYTES) -> Any:
    """A JSON file (size-bounded, UTF-8) parsed; failures are ``error``s naming it."""
    return parse_json(read_text(path, what, error, max_bytes), str(path), what, error)


def split_lines(text: str) -> Iterator[tuple[int, str]]:
    """(1-based line, text) of every non-blank line, split on ``\\n`` only.

    ``str.splitlines`` would also break at U+2028, U+2029, U+0085, \\x1c-\\x1e
    and \\v, which JSON allows inside strings: line numbers would drift and
    records would be cut in two.
    """
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip(" \t\r"):
            yield number, line.removesuffix("\r")


@dataclass
class JsonLines:
    """What a JSON-lines log holds: the objects, a torn last line, bad lines."""

    rows: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    torn_line: int | None = None  # a last line cut by a killed writer (skipped)
    bad: list[str] = field(default_factory=list)  # "PATH:LINE: reason" of other lines

    def objects(self) -> list[dict[str, Any]]:
        return [obj for _, obj in self.rows]


def parse_jsonl(text: str, where: str) -> JsonLines:
    """Parse JSON-lines text: one object a line; see :func:`read_jsonl`."""
    out = JsonLines()
    ends_cleanly = text.endswith("\n")
    last = text.count("\n") + 1
    for number, line in split_lines(text):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            if number == last and not ends_cleanly:
                out.torn_line = number
                continue
            out.bad.append(f"{where}:{number}: not valid JSON")
            continue
        if not isinstance(obj, dict):
            out.bad.append(f"{where}:{number}: expected a JSON object, got {type(obj).__name__}")
            continue
        out.rows.append((number, obj))
    return out


def read_jsonl(path: str | Path, what: str,
               error: type[OomlessError] = OomlessError) -> JsonLines:
    """A JSON-lines log (memlog, events, results): objects with their line numbers.

    A last line without its newline that does not parse is a write cut short by
    a crash: it is skipped and reported in ``torn_line``. Other unreadable lines
    are listed in ``bad``; the caller decides whether they are fatal.
    """
    data = read_bytes(path, what, error)
    text = data.decode("utf-8", errors="replace")
    return parse_jsonl(text, str(path))


# ---- guarding ------------------------------------------------------------------------
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
