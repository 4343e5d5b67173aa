"""A log as clean lines: launcher and logger prefixes removed, rank of each line kept.

Multi-process launchers prefix every line: torch ≥ 2.2 writes ``[rank3]:``,
``torchrun --tee`` writes ``[default3]:``, vLLM workers ``(VllmWorkerProcess
pid=532)``, loggers add levels and timestamps. Messages that wrap across
lines only match once those prefixes are gone, so patterns run on the joined
clean text and positions map back to lines here.

Ranks writing to one stream interleave: a line of rank 1 can start in the
middle of a line of rank 0, whose rest then continues on the next line. Such a
line is split at the second prefix, and an unprefixed line right after it is
given to the interrupted rank (``CleanLine.cut`` marks the interrupted piece,
so that its continuation joins it without a line break, see
:meth:`LogText.streams`).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
# Prefixes, tried again and again at the start of a line until none matches.
_RANK = re.compile(r"\[(?:rank|default|Rank |RANK )(\d{1,5})\]:?\s?")
_WORKER = re.compile(r"\((?:[A-Za-z][\w-]*)\s+pid=(\d+)(?:,\s*ip=[\w.:]+)?\)\s*")
_PREFIXES = (
    # vLLM/glog-ish: "INFO 03-01 10:09:22 [model_runner.py:1110] " or "... model_runner.py:1110] "
    re.compile(r"(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL)\s+\d\d-\d\d\s+[\d:.]+\s+\[?[\w./-]+:\d+\]\s?"),
    # glog: "E0813 08:21:22.980000 1245483 torch/distributed/...py:984] "
    re.compile(r"[IWEF]\d{4}\s+[\d:.]+\s+\d+\s+[\w./-]+:\d+\]\s?"),
    # ISO or bracketed timestamps: "[2024-06-17 13:18:29,371] ", "2024-06-17T13:18:29.371Z "
    re.compile(r"\[?\d{4}-\d\d-\d\d[ T_][\d:.,]+(?:Z|[+-]\d\d:?\d\d)?\]?\s?"),
    # "[WARNING] ", "[stage3.py:2236:step] "
    re.compile(r"\[(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL)\]\s?"),
    re.compile(r"\[[\w./-]+:\d+:\w+\]\s?"),
    # rich tracebacks draw boxes: "│ /path/file.py:176 in to │"
    re.compile(r"[│┃|]\s"),
)
_BOX_END = re.compile(r"\s*[│┃]\s*$")
# Cheap test first: most lines of a long log carry none of the prefixes above.
_MAYBE_PREFIX = re.compile(
    r"\s*(?:[\[(│┃|]|(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL)\s|[IWEF]\d{4}\s|\d{4}-\d\d-)"
)
_MAX_PREFIX_ROUNDS = 8


_MID_RANK = re.compile(r"\[(?:rank|default)\d{1,5}\]:")


@dataclass(frozen=True)
class CleanLine:
    text: str
    rank: int | None
    pid: int | None
    raw: int = 0  # 0-based index of the log line this piece comes from
    cut: bool = False  # interrupted by another rank's line: its rest is on a later line


def clean_line(raw: str) -> CleanLine:
    """Strip escape codes and known prefixes; remember rank and worker pid."""
    text = _ANSI.sub("", raw) if "\x1b" in raw else raw
    text = text.replace("\x00", "").rstrip("\r")
    if not _MAYBE_PREFIX.match(text):
        return CleanLine(text, None, None)
    rank: int | None = None
    pid: int | None = None
    for _ in range(_MAX_PREFIX_ROUNDS):
        stripped = text.lstrip()
        m = _RANK.match(stripped)
        if m:
            rank = int(m.group(1)) if rank is None else rank
            text = stripped[m.end():]
            continue
        m = _WORKER.match(stripped)
        if m:
            pid = int(m.group(1)) if pid is None else pid
            text = stripped[m.end():]
            continue
        for prefix in _PREFIXES:
            m = prefix.match(stripped)
            if m and m.end() > 0:
                text = stripped[m.end():]
                break
        else:
            break
    return CleanLine(_BOX_END.sub("", text), rank, pid)


def _split_interleaved(raw_lines: list[str], numbers: list[int] | None = None) -> list[CleanLine]:
    out: list[CleanLine] = []
    interrupted: int | None = None  # rank of the last piece another rank's line cut short
    for index, raw in enumerate(raw_lines):
        number = numbers[index] - 1 if numbers is not None else index
        starts = [m.start() for m in _MID_RANK.finditer(raw) if m.start() > 0] \
            if "]:" in raw else []
        pieces = [raw[a:b] for a, b in zip([0, *starts], [*starts, len(raw)], strict=True)]
        for i, piece in enumerate(pieces):
            line = clean_line(piece)
            if i == 0 and line.rank is None and interrupted is not None:
                line = CleanLine(line.text, interrupted, line.pid)  # the rest of a cut line
                interrupted = None
            cut = i == 0 and len(pieces) > 1
            out.append(CleanLine(line.text, line.rank, line.pid, number, cut))
        if len(pieces) > 1:
            interrupted = out[-len(pieces)].rank
    return out


class LogText:
    """Clean lines of a log, their joined text, and position → line mapping.

    ``numbers``: the 1-based log line of each line of ``raw`` when ``raw`` is an
    excerpt of a longer log (diagnose/stream.py); by default its own numbering."""

    def __init__(self, raw: str, numbers: list[int] | None = None) -> None:
        raw_lines = raw.splitlines()
        if numbers is not None and len(numbers) != len(raw_lines):
            numbers = None  # the excerpt's lines held line breaks of their own
        self.lines: list[CleanLine] = _split_interleaved(raw_lines, numbers)
        self.text = "\n".join(line.text for line in self.lines)
        self._starts: list[int] = []
        pos = 0
        for line in self.lines:
            self._starts.append(pos)
            pos += len(line.text) + 1

    def line_index(self, pos: int) -> int:
        """0-based index of the line holding character ``pos`` of ``text``."""
        if not self._starts:
            return 0
        return max(0, bisect.bisect_right(self._starts, pos) - 1)

    def raw_number(self, line: int) -> int:
        """The 1-based log line of the 1-based clean line ``line``."""
        if 1 <= line <= len(self.lines):
            return self.lines[line - 1].raw + 1
        return max(1, line)

    def streams(self) -> dict[int | None, tuple[str, list[int], list[int]]]:
        """Per rank: the rank's lines joined without line breaks (wrapped and interleaved
        messages become whole again), the start of each piece in it, and the clean-line
        index of each piece. A line without a rank prefix goes with the rank of the line
        before it (a wrapped line's rest carries no prefix). Patterns for this text
        separate words by ``\\s*``."""
        out: dict[int | None, tuple[list[str], list[int], list[int]]] = {}
        rank = None
        for index, line in enumerate(self.lines):
            rank = line.rank if line.rank is not None else rank
            parts, starts, indices = out.setdefault(rank, ([], [], []))
            starts.append(sum(map(len, parts)) if not starts else starts[-1] + len(parts[-1]))
            parts.append(line.text)
            indices.append(index)
        return {rank: ("".join(parts), starts, indices) for rank, (parts, starts, indices)
                in out.items()}

    def rank_at(self, index: int) -> int | None:
        if 0 <= index < len(self.lines):
            return self.lines[index].rank
        return None

    def pid_at(self, index: int) -> int | None:
        if 0 <= index < len(self.lines):
            return self.lines[index].pid
        return None

    def same_stream(self, index: int, rank: int | None, pid: int | None) -> bool:
        """Whether line ``index`` may belong to the process that wrote (rank, pid)."""
        line = self.lines[index]
        if rank is not None and line.rank is not None and line.rank != rank:
            return False
        return not (pid is not None and line.pid is not None and line.pid != pid)


def squeeze(text: str, limit: int = 600) -> str:
    """Whitespace-normalised text, cut to ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _windows(text: str, words: tuple[str, ...], before: int, after: int) -> list[tuple[int, int]]:
    """Merged ranges around every occurrence of ``words``, starting at a line start."""
    ranges: list[tuple[int, int]] = []
    for word in words:
        i = text.find(word)
        while i >= 0:
            start = text.rfind("\n", 0, max(0, i - before)) + 1
            ranges.append((start, min(len(text), i + len(word) + after)))
            i = text.find(word, i + len(word) + after // 2)
    ranges.sort()
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def scan(pattern: re.Pattern[str], text: str, words: tuple[str, ...],
         before: int = 400, after: int = 2500) -> Iterator[re.Match[str]]:
    """``pattern.finditer`` restricted to the neighbourhood of ``words``.

    Long logs hold hundreds of thousands of lines and few errors; scanning
    only near a keyword keeps a regex pass proportional to the errors. Every
    pattern passed here matches within ``before``/``after`` characters of
    one of its words.
    """
    for start, end in _windows(text, words, before, after):
        yield from pattern.finditer(text, start, end)
