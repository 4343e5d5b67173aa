"""Reading files: regular files only, UTF-8, JSON and JSON-lines, every failure the
caller's error class naming the file and line."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import OomlessError

# Configuration files (YAML, JSON) are small; a bigger one is refused before parsing.
MAX_CONFIG_BYTES = 16 * 2**20


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
