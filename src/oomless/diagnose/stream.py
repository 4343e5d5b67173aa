"""Reading a log of any size with bounded memory: the lines around every error.

A log up to :data:`WHOLE_BYTES` is read whole. A longer one is read in
:data:`CHUNK_BYTES` pieces and only these lines are kept, with their line
numbers in the log:

- the first :data:`HEAD_LINES` (the command line, the arguments printed at start);
- every line that can start an event (:data:`TRIGGER_WORDS`), with the
  :data:`BEFORE_LINES` before it (a traceback, read back by
  :func:`oomless.diagnose.phase.traceback_before`, runs at most that far) and the
  :data:`AFTER_LINES` after it (a wrapped message, launcher lines);
- lines that name run settings (:data:`HINT_WORDS`), at most :data:`HINT_LINES` of them.

Every line is cut at :data:`LINE_CHARS` characters. The memory bound: the
look-back window (``BEFORE_LINES × LINE_CHARS`` characters) plus the kept lines,
which stop growing at :data:`EXCERPT_CHARS` characters; events past that are
counted and said, not read. The excerpt is then diagnosed like a short log, with
the log's own line numbers. With these values the excerpt holds at most about
13 M characters whatever the log's size, and the chunk being read costs about
24 bytes per byte of :data:`CHUNK_BYTES` (6 MB); a 50 MB log peaks at 6.4 MB
measured by tracemalloc (tests/diagnose/test_diagnose_stream.py), where reading it
whole took more than 100 MB, and is read at about 30 MB/s on one core.
"""

from __future__ import annotations

import codecs
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .io import LogReadError
from .phase import _MAX_LOOKBACK

WHOLE_BYTES = 16 * 2**20  # read whole below this (the old behaviour, exactly)
CHUNK_BYTES = 2**18
LINE_CHARS = 8192
HEAD_LINES = 300
BEFORE_LINES = _MAX_LOOKBACK
AFTER_LINES = 300
HINT_LINES = 2000
EXCERPT_CHARS = 8 * 2**20

# Words of every event pattern (diagnose/parse.py, vllm.py, host.py, repair.py), lower
# case: a line without any of them starts no event. Plain substrings: ``in`` on a
# lower-cased chunk is much faster than one regular expression over it.
TRIGGER_WORDS = (
    "out of memory", "out_of_memory", "outofmemory", "oom-kill", "oom_kill", "oom kill",
    "oomkilled", "killed", "sigkill", "signal 9", "exitcode", "exit code", "return code",
    "exit status", "capac", "exceed", "can't allocate", "not enough memory", "cache blocks",
    "stored in kv cache", "to serve at least one request", "kv cache needed",
    "free memory on device", "nccl warn", "ncclunhandled", "cublas_status_alloc_failed",
    "cudaerrormemoryallocation", "warming up sampler", "root cause")
# Settings and progress that hints.py and vllm.py read anywhere in the log.
HINT_WORDS = (
    "batch_size", "batch size", "gradient_accumulation", "zero_", "zero1", "zero2", "zero3",
    "zero-", '"stage"', "max_model_len", "max_num_seqs", "gpu_memory_utilization",
    "max_new_tokens", "cutoff_len", "max_seq_len", "model_max_length", "gradient_checkpointing",
    "world_size", "num_processes", "total_gpu_memory", "weights take", "weights took",
    "loading took", "kv cache", "blocks:", "maximum concurrency", "cache flushes",
    "running evaluation", "running prediction")


def _has(text: str, words: tuple[str, ...]) -> bool:
    lower = text.lower()
    return any(w in lower for w in words)


@dataclass
class Excerpt:
    """The kept lines of a long log and their 1-based line numbers in it."""

    lines: list[str] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    total_lines: int = 0
    chars: int = 0
    dropped_events: int = 0  # trigger lines past EXCERPT_CHARS
    whole: bool = False

    def keep(self, number: int, text: str) -> None:
        self.lines.append(text)
        self.numbers.append(number)
        self.chars += len(text) + 1

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


# the characters str.splitlines breaks at
_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def _raw_lines(stream: BinaryIO) -> Iterator[list[str]]:
    """The log's lines (as ``str.splitlines`` splits them), a chunk at a time, each cut
    at LINE_CHARS; a line longer than a chunk is never held whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    carry = ""
    while True:
        data = stream.read(CHUNK_BYTES)
        text = carry + decoder.decode(data, final=not data)
        if not text:
            return
        lines = text.splitlines()
        carry = ""
        if data and lines and (text[-1] not in _BREAKS or text[-1] == "\r"):
            # the last line goes on in the next chunk ("\r" may be half of "\r\n")
            carry = lines.pop()[:LINE_CHARS] + ("\r" if text[-1] == "\r" else "")
        if lines and max(map(len, lines)) > LINE_CHARS:
            lines = [line[:LINE_CHARS] for line in lines]
        yield lines
        if not data:
            return


def excerpt(stream: BinaryIO) -> Excerpt:
    """The lines of a long log that ``diagnose`` reads (see the module docstring)."""
    out = Excerpt()
    before: deque[tuple[int, str]] = deque(maxlen=BEFORE_LINES)
    after = 0  # lines still to keep after the last trigger
    hints = 0
    number = 0
    for lines in _raw_lines(stream):
        block = "\n".join(lines)
        busy = after > 0 or number < HEAD_LINES or _has(block, TRIGGER_WORDS) or (
            hints < HINT_LINES and _has(block, HINT_WORDS))
        if not busy:
            before.extend(enumerate(lines, number + 1))
            number += len(lines)
            continue
        for text in lines:
            number += 1
            full = out.chars > EXCERPT_CHARS
            if _has(text, TRIGGER_WORDS):
                if full:
                    out.dropped_events += 1
                    continue
                while before:
                    out.keep(*before.popleft())
                out.keep(number, text)
                after = AFTER_LINES
            elif (after > 0 or number <= HEAD_LINES) and not full:
                out.keep(number, text)
                after -= 1
            elif hints < HINT_LINES and _has(text, HINT_WORDS):
                hints += 1
                out.keep(number, text)  # never in `before`: kept once
            else:
                before.append((number, text))
    out.total_lines = number
    if out.numbers != sorted(out.numbers):  # a hint line kept before a trigger's window
        pairs = sorted(zip(out.numbers, out.lines, strict=True))
        out.numbers, out.lines = [n for n, _ in pairs], [t for _, t in pairs]
    return out


def _whole(data: bytes) -> Excerpt:
    lines = data.decode("utf-8", errors="replace").splitlines()
    return Excerpt(lines, list(range(1, len(lines) + 1)), len(lines), whole=True)


def read_excerpt(source: str) -> Excerpt:
    """The log at ``source`` ('-': standard input, spooled to a temporary file) as an
    excerpt (the whole log when it is at most WHOLE_BYTES)."""
    if source == "-":
        stdin = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else None
        if stdin is None:
            data = sys.stdin.read().encode()
            return _whole(data)
        with tempfile.TemporaryFile() as spool:
            shutil.copyfileobj(stdin, spool, CHUNK_BYTES)
            spool.seek(0)
            return _from_stream(spool, os.fstat(spool.fileno()).st_size)
    path = Path(source)
    try:
        with path.open("rb") as f:
            return _from_stream(f, os.fstat(f.fileno()).st_size)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise LogReadError(
            f"cannot read log '{source}': {reason}; give a log or traceback file, or '-' "
            "to read standard input (e.g. `python train.py 2>&1 | oomless diagnose -`)"
        ) from None


def _from_stream(f: BinaryIO, size: int) -> Excerpt:
    if size <= WHOLE_BYTES:
        return _whole(f.read())
    return excerpt(f)


def excerpt_notes(ex: Excerpt) -> list[str]:
    if ex.whole:
        return []
    notes = [f"long log ({ex.total_lines} lines): read the {len(ex.lines)} lines around its "
             "errors and the lines that name settings"]
    if ex.dropped_events:
        notes.append(f"{ex.dropped_events} more error line(s) past the first "
                     f"{EXCERPT_CHARS // 2**20} MiB of excerpt were not read")
    return notes
