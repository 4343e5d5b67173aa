"""`oomless diagnose` on damaged logs: real out-of-memory messages hard-wrapped at random
widths (mid-word), two ranks interleaved mid-line, truncated after the request, and
reworded without an exception class. The event, its rank and its numbers survive."""

from __future__ import annotations

import re

from diagnose_fixtures import read_fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomless.diagnose import diagnose_text

DAMAGE = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Real logs with one complete allocator message (PyTorch 2.x and 1.x wording)
SOURCES = ["seed002_torch2.log", "seed002_torch1.log", "real/glm4_785_glm4v_4x4090_rank3.log",
           "real/glm4_408_glm4v_rank5_other_process_sigterm.log",
           "real/xtuner_963_llava_llama3_8b_30gib_alloc.log",
           "real/trl_1626_custom_dpo_20gib_no_traceback.log",
           "real/chatglm3_finetuning_13_4090.log", "real/chatglm_finetuning_23_v100_lora.log",
           "real/llamafactory_6800_qwen2vl_full_dpo_8xv100_cross_entropy.log"]
KEYS = ("requested_bytes", "total_bytes", "free_bytes")


def _numbers(text: str) -> list[tuple[int | None, dict]]:
    found = diagnose_text(text).findings
    return [(f.event.rank, {k: f.event.numbers.get(k) for k in KEYS}) for f in found]


ORIGINAL = {name: _numbers(read_fixture(name)) for name in SOURCES}


def test_the_sources_hold_one_complete_message():
    for name, found in ORIGINAL.items():
        assert len(found) == 1 and None not in found[0][1].values(), name


def _wrap(text: str, width: int) -> str:
    lines = []
    for line in text.split("\n"):
        lines += [line[i:i + width] for i in range(0, max(len(line), 1), width)]
    return "\n".join(lines)


@DAMAGE
@given(st.sampled_from(SOURCES), st.integers(12, 160))
def test_hard_wrapped_mid_word_keeps_event_and_numbers(name, width):
    assert _numbers(_wrap(read_fixture(name), width)) == ORIGINAL[name]


@DAMAGE
@given(st.sampled_from(SOURCES), st.data())
def test_a_space_replaced_by_a_line_break_keeps_the_numbers(name, data):
    text = read_fixture(name)
    start = text.find("out of memory")
    spaces = [i for i, c in enumerate(text) if c == " " and start <= i < start + 300]
    for i in data.draw(st.lists(st.sampled_from(spaces), max_size=4, unique=True)):
        text = text[:i] + "\n" + text[i + 1:]
    assert _numbers(text) == ORIGINAL[name]


def _message(name: str) -> str:
    """The source's allocator message as one line (wrapped originals joined)."""
    text = read_fixture(name)
    start = text.find("CUDA out of memory")
    end = text.find("\n\n", start)
    flat = " ".join(line.split("]: ", 1)[-1] if line.startswith("[rank") else line
                    for line in text[start:end if end > 0 else None].splitlines())
    return flat.split(" If reserved", 1)[0].split(" See documentation", 1)[0]


@DAMAGE
@given(st.sampled_from(SOURCES), st.sampled_from(SOURCES), st.data())
def test_two_ranks_interleaved_mid_line(first, second, data):
    a = f"[rank0]: torch.OutOfMemoryError: {_message(first)}"
    b = f"[rank1]: torch.OutOfMemoryError: {_message(second)}"
    cut = data.draw(st.integers(len("[rank0]: ") + 1, len(a) - 1))
    log = f"step 3\n{a[:cut]}{b}\n{a[cut:]}\n"
    found = sorted(_numbers(log), key=lambda rn: rn[0])
    assert found == [(0, ORIGINAL[first][0][1]), (1, ORIGINAL[second][0][1])]


@DAMAGE
@given(st.sampled_from(SOURCES), st.integers(0, 3))
def test_truncated_after_the_request_keeps_it(name, extra):
    message = _message(name)
    end = re.search(r"Tried to allocate [\d.]+ \w+", message).end()
    found = _numbers(f"Traceback (most recent call last):\n{message[:end + extra]}")
    assert [n["requested_bytes"] for _r, n in found] == [ORIGINAL[name][0][1]["requested_bytes"]]


@DAMAGE
@given(st.sampled_from(SOURCES), st.text(st.characters(codec="ascii", categories=("L", "Nd", "Zs")),
                                         max_size=30))
def test_mid_line_message_without_an_exception_class(name, before):
    found = _numbers(f"step {len(before)} {before} failed: {_message(name)}\n")
    assert [n for _r, n in found] == [ORIGINAL[name][0][1]]


def test_a_cut_right_after_the_device_word_keeps_each_rank_once():
    """The rest of rank 0's line starts with 'out of memory' (no device word): it is
    dated at its own line, not at the line break before it, so rank 1 is not read twice."""
    a = f"[rank0]: torch.OutOfMemoryError: {_message('seed002_torch2.log')}"
    b = f"[rank1]: torch.OutOfMemoryError: {_message('seed002_torch1.log')}"
    cut = a.index("CUDA ") + len("CUDA ")
    found = sorted(_numbers(f"step 3\n{a[:cut]}{b}\n{a[cut:]}\n"), key=lambda rn: rn[0])
    assert found == [(0, ORIGINAL["seed002_torch2.log"][0][1]),
                     (1, ORIGINAL["seed002_torch1.log"][0][1])]
