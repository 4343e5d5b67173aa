"""No input makes diagnose crash: random text, and real messages mutated."""

from __future__ import annotations

import io
import json

from diagnose_fixtures import FIXTURES, all_fixture_logs, read_fixture, real_logs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from oomless.config import load_run_config
from oomless.diagnose import diagnose_text
from oomless.diagnose.render import render

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOGS = {name: read_fixture(name) for name in [*all_fixture_logs(), *real_logs()]}
CONFIG = load_run_config(FIXTURES / "seed002_oomless.yaml")
# Pieces that steer mutations into the parsers' corners: units, signs, huge and empty numbers.
TOKENS = ["0", "-1", "00", "9" * 30, ".", "0.00 bytes", "GiB", "MiB", "bytes", "(", ")", ";", ",",
          "\n", "\x00", "\x1b[31m", "[rank7]: ", "nan", "inf", "1e99", " is free.", "Process 1 has",
          "0/0 GiB", "(0, 0 GiB)", "KV cache (0)", "exitcode  : -9 (pid: 0)", "│ "]


def check(text: str, cfg=None) -> None:
    diagnosis = diagnose_text(text, cfg)
    data = json.loads(json.dumps(diagnosis.to_dict(), allow_nan=False))
    assert data["found"] == bool(diagnosis.findings)
    for f in diagnosis.findings:
        assert f.event.line >= 1
        for fix in f.fixes:
            assert fix.summary
    out = io.StringIO()
    render(diagnosis, Console(file=out, width=100))
    assert out.getvalue()


@FUZZ
@given(st.text())
def test_random_text(text):
    check(text)


@FUZZ
@given(st.binary().map(lambda b: b.decode("utf-8", errors="replace")))
def test_random_bytes(text):
    check(text)


@st.composite
def mutated(draw):
    text = LOGS[draw(st.sampled_from(sorted(LOGS)))]
    for _ in range(draw(st.integers(1, 6))):
        if not text:
            break
        at = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "digits", "truncate", "duplicate"]))
        if op == "insert":
            piece = draw(st.one_of(st.sampled_from(TOKENS), st.text(max_size=20)))
            text = text[:at] + piece + text[at:]
        elif op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 80)):]
        elif op == "digits":
            digits = draw(st.from_regex(r"\d{1,20}", fullmatch=True))
            end = at
            while end < len(text) and (text[end].isdigit() or text[end] == "."):
                end += 1
            text = text[:at] + digits + text[end:]
        elif op == "truncate":
            text = text[:at]
        else:
            text = text[:at] + text[:at] + text[at:]
    return text


@FUZZ
@given(mutated())
def test_mutated_real_messages(text):
    check(text)


@FUZZ
@given(mutated())
def test_mutated_real_messages_with_a_config(text):
    check(text, CONFIG)


def test_every_fixture_renders_with_a_config():
    for text in LOGS.values():
        check(text, CONFIG)
