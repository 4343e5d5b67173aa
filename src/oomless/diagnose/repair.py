"""Messages damaged on their way into the log, read again.

Terminals and issue trackers hard-wrap long lines (mid-word: "Tried to allo" /
"cate 6.56 GiB"); ranks writing to one stream interleave mid-line. The normal
pass (:mod:`.parse`) then finds the event but not its numbers, or misses it.
Here every rank's lines are joined without breaks (:meth:`.text.LogText.streams`)
and read with patterns whose words may run together; an event found there
completes the normal pass's event at the same place, or is added when the
normal pass found none.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from .events import CUDA_OOM, OomEvent
from .parse import (
    bare_fields,
    bare_torch_pattern,
    malloc_async_fields,
    malloc_async_pattern,
    torch1_fields,
    torch1_pattern,
    torch2_fields,
    torch2_pattern,
)
from .text import LogText, scan, squeeze

_JOINED = ((torch2_pattern(r"\s*"), torch2_fields), (torch1_pattern(r"\s*"), torch1_fields),
           (malloc_async_pattern(r"\s*"), malloc_async_fields))
_BARE = bare_torch_pattern(r"\s*")
_WORDS = ("memory",)


def _stream_events(text: str, starts: list[int], indices: list[int],
                   rank: int | None) -> list[tuple[OomEvent, int]]:
    """(event, last clean-line index of its message) for one rank's joined text."""
    out: list[tuple[OomEvent, int]] = []
    taken: list[tuple[int, int]] = []

    def add(m, build) -> None:
        first = indices[bisect.bisect_right(starts, m.start()) - 1]
        last = indices[bisect.bisect_right(starts, max(m.start(), m.end() - 1)) - 1]
        kind, source, extra = build(m, text)
        out.append((OomEvent(kind=kind, source=source, line=first + 1,
                             message=squeeze(m.group(0)), rank=rank, **extra), last))
        taken.append((m.start(), m.end()))

    for pattern, build in _JOINED:
        for m in scan(pattern, text, _WORDS):
            add(m, build)
    for m in scan(_BARE, text, _WORDS):
        if not any(a <= m.start() < b for a, b in taken):
            add(m, bare_fields)
    return out


def joined_events(log: LogText) -> list[tuple[OomEvent, int]]:
    out: list[tuple[OomEvent, int]] = []
    for rank, (text, starts, indices) in log.streams().items():
        if "emory" in text:
            out += _stream_events(text, starts, indices, rank)
    return out


def _same(normal: OomEvent, joined: OomEvent, last: int) -> bool:
    return normal.kind == CUDA_OOM and (normal.rank == joined.rank or normal.rank is None) \
        and joined.line <= normal.line <= last + 1


def repair(log: LogText, events: list[OomEvent]) -> list[OomEvent]:
    """``events`` with numbers the joined text reads better, and events only it finds."""
    out = list(events)
    for joined, last in joined_events(log):
        at = next((i for i, e in enumerate(out) if _same(e, joined, last)), None)
        if at is None:
            out.append(joined)
            continue
        normal = out[at]
        if len(joined.numbers) > len(normal.numbers):
            out[at] = replace(normal, numbers=joined.numbers, message=joined.message,
                              source=joined.source, rank=joined.rank,
                              device=normal.device if normal.device is not None else joined.device,
                              processes=joined.processes or normal.processes)
    return out
