"""`diagnose` reads a log of any size with bounded memory and lists every OOM in it
(oomless.diagnose.stream)."""

from __future__ import annotations

import io
import sys
import tracemalloc

import pytest
from diagnose_fixtures import FIXTURES, GiB

from oomless.diagnose import diagnose_log, diagnose_text
from oomless.diagnose import stream as S

OOM = (FIXTURES / "seed002_torch2.log").read_text()
OOM_LINE = next(i for i, line in enumerate(OOM.splitlines(), 1) if "Tried to allocate" in line)
STEPS = "".join(f"{{'loss': 1.{i % 10}, 'learning_rate': 2e-05, 'epoch': 0.0{i % 10}}}\n"
                f"  3%|▎         | {i}/4156 [00:{i % 60:02d}<10:00,  1.2it/s]\n"
                for i in range(1000))


def _big_log(path, size_bytes: int) -> int:
    """An OOM (6.56 GiB request), ``size_bytes`` of training progress, another OOM
    (2 GiB); returns the log line of the second message."""
    lines = 0
    with path.open("w") as f:
        f.write(OOM)
        lines += OOM.count("\n")
        while f.tell() < size_bytes:
            f.write(STEPS)
            lines += STEPS.count("\n")
        f.write(OOM.replace("6.56 GiB", "2.00 GiB"))
    return lines + OOM_LINE


def _requests(d) -> list[tuple[int, float]]:
    return [(f.event.line, round(f.event.numbers["requested_bytes"] / GiB, 2))
            for f in d.findings if f.event.kind == "cuda_oom"]


@pytest.mark.slow
def test_a_50_mb_log_lists_both_ooms_with_bounded_memory(tmp_path):
    log = tmp_path / "train.log"
    second = _big_log(log, 50 * 2**20)
    tracemalloc.start()
    try:
        d = diagnose_log(str(log))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert _requests(d) == [(OOM_LINE, 6.56), (second, 2.0)]
    assert d.findings[0].event.phase == d.findings[1].event.phase == "backward"
    assert "long log" in d.notes[0]
    # the excerpt of this log is small: the peak is the chunk being read (stream.py's
    # docstring: about 24 bytes per chunk byte), far below the 50 MB of the log
    assert peak < 32 * S.CHUNK_BYTES < 50 * 2**20 / 4


def test_the_excerpt_keeps_the_traceback_and_the_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "WHOLE_BYTES", 0)
    log = tmp_path / "train.log"
    second = _big_log(log, 2 * 2**20)
    whole = diagnose_text(log.read_text())
    part = diagnose_log(str(log))
    assert _requests(part) == _requests(whole) == [(OOM_LINE, 6.56), (second, 2.0)]
    assert [f.event.frames for f in part.findings] == [f.event.frames for f in whole.findings]
    assert part.hints.micro_batch_size == whole.hints.micro_batch_size == 8


def test_the_same_message_again_much_later_is_a_second_event():
    again = OOM + STEPS + OOM  # a run restarted and failed the same way
    assert len(diagnose_text(again).findings) == 2
    retry = OOM + OOM  # a retry loop: one event, counted twice
    (only,) = diagnose_text(retry).findings
    assert only.event.occurrences == 2


def test_a_line_longer_than_a_chunk_is_cut_not_held(monkeypatch):
    monkeypatch.setattr(S, "CHUNK_BYTES", 1000)
    raw = ("x" * 50_000 + "\r\n" + "\r".join(["step"] * 5) + "\n" + OOM).encode()
    ex = S.excerpt(io.BytesIO(raw))
    assert max(map(len, ex.lines)) <= S.LINE_CHARS
    assert ex.total_lines == len(raw.decode().splitlines())
    d = diagnose_text(ex.text, line_numbers=ex.numbers)
    assert [f.event.line for f in d.findings if f.event.kind == "cuda_oom"] == [6 + OOM_LINE]


def test_standard_input_is_spooled_not_held(monkeypatch):
    class Stdin:
        buffer = io.BytesIO(OOM.encode())

    monkeypatch.setattr(sys, "stdin", Stdin())
    monkeypatch.setattr(S, "WHOLE_BYTES", 0)
    assert _requests(diagnose_log("-")) == [(OOM_LINE, 6.56)]


def test_an_unreadable_log_is_one_clear_error(tmp_path):
    from oomless.diagnose.io import LogReadError

    with pytest.raises(LogReadError, match="cannot read log"):
        diagnose_log(str(tmp_path / "missing.log"))
