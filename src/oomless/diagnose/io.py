"""Reading a log: a file or standard input, any bytes, never a decoding error."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import OomlessError


class LogReadError(OomlessError):
    """A log file that cannot be read."""


def read_log(source: str) -> str:
    """Text of ``source`` ('-' for standard input); undecodable bytes become U+FFFD."""
    if source == "-":
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    else:
        path = Path(source)
        try:
            data = path.read_bytes()
        except OSError as err:
            reason = err.strerror or type(err).__name__
            raise LogReadError(
                f"cannot read log '{source}': {reason}; give a log or traceback file, or '-' "
                "to read standard input (e.g. `python train.py 2>&1 | oomless diagnose -`)"
            ) from None
    return data.decode("utf-8", errors="replace")
