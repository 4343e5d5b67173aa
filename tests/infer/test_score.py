"""`oomless score`: judge prompt, score parsing, keeping good records, resuming."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from infer_fixtures import RECORDS, read_rows, write_jsonl

from oomless.cli import main
from oomless.dataset.records import RecordError
from oomless.errors import ConfigError
from oomless.runtime.infer.core import (
    DEFAULT_JUDGE_PROMPT,
    Generation,
    InferOptions,
    judge_messages,
    parse_score,
)
from oomless.runtime.infer.jobs import score_file

SCORED = [r for r in RECORDS if "output" in r] + [RECORDS[4]]


@pytest.mark.parametrize("reply, score", [
    ("Score: 4", 4),
    ("score：5", 5),  # full-width colon, as Chinese judges write it
    ("The response is correct but terse.\nScore: 3", 3),
    ("**Score:** 2", 2),
    ("Rating: 1", 1),
    ("I would rate it 4/5.", 4),
    ("4 out of 5", 4),
    ("5", 5),
    (" 3. ", 3),
    ("Score: 7", None),
    ("Score: 4.5", None),
    ("The answer has 3 mistakes.", None),
    ("", None),
    ("no idea", None),
])
def test_parse_score(reply: str, score: int | None) -> None:
    assert parse_score(reply) == score


@given(st.integers(1, 5), st.text(alphabet=st.characters(blacklist_categories=("Nd",)),
                                  max_size=40))
def test_score_line_after_any_reasoning_is_found(score: int, reasoning: str) -> None:
    assert parse_score(f"{reasoning}\nScore: {score}") == score


def test_judge_prompt_holds_request_and_response() -> None:
    (msg,) = judge_messages(RECORDS[0], DEFAULT_JUDGE_PROMPT)
    assert "Reverse the string.\nwinter" in msg["content"] and "retniw" in msg["content"]
    with pytest.raises(RecordError, match="no response to score"):
        judge_messages({"instruction": "x"}, DEFAULT_JUDGE_PROMPT)


class LengthJudge:
    """A judge that follows the rubric mechanically (our Backend protocol, no model):
    the score is the response's length in characters, capped at 5."""

    name = "length-judge"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def generate(self, prompts: list[list[int]]) -> list[Generation]:
        self.calls += 1
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            response = re.search(r"\[Response\]\n(.*?)\n\nReply", text, re.S).group(1)
            out.append(Generation(f"Score: {min(5, max(1, len(response)))}", len(ids), 3))
        return out

    def engine_info(self) -> dict:
        return {"backend": self.name}

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def judge():
    from oomless.runtime.tiny import build_tokenizer

    return LengthJudge(build_tokenizer())


def _opts(model: str = "judge", **kw) -> InferOptions:
    return InferOptions(**{"model": model, "backend": "hf", "cutoff_len": 512,
                           "max_new_tokens": 8, "chunk_size": 2, **kw})


def _expected_kept(records, min_score: int):
    def response(r):
        return r.get("output") or r["conversations"][-1]["value"]
    return [r for r in records if min(5, len(response(r))) >= min_score]


def test_kept_file_holds_the_records_at_or_above_the_threshold(judge, tmp_path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", SCORED)
    out = tmp_path / "scored.jsonl"
    summary = score_file(data, out, _opts(), min_score=4, backend=judge)
    rows = read_rows(out)
    assert [r["score"] for r in rows] == [min(5, len(r["record"].get("output") or "1, 2, 3"))
                                          for r in rows]
    kept = read_rows(tmp_path / "scored.kept.jsonl")
    assert kept == _expected_kept(SCORED, 4) and summary.kept == len(kept)
    assert summary.unparsed == 0 and summary.errors == 0


def test_interrupted_scoring_resumes_and_keeps_input_order(judge, tmp_path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", SCORED)
    out, kept = tmp_path / "scored.jsonl", tmp_path / "clean.jsonl"

    def crash(done: int, todo: int) -> None:
        if done >= 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_file(data, out, _opts(), kept=kept, backend=judge, on_chunk=crash)
    assert len(read_rows(out)) == 4 and not kept.exists()
    summary = score_file(data, out, _opts(), min_score=3, kept=kept, backend=judge)
    assert summary.skipped_done == 4 and summary.written == len(SCORED) - 4
    assert sorted(r["line"] for r in read_rows(out)) == list(range(1, len(SCORED) + 1))
    assert read_rows(kept) == _expected_kept(SCORED, 3)


def test_records_without_a_response_are_errors_not_kept(judge, tmp_path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [RECORDS[0], {"instruction": "only a question"}])
    summary = score_file(data, tmp_path / "s.jsonl", _opts(), min_score=1, backend=judge)
    rows = read_rows(tmp_path / "s.jsonl")
    assert summary.errors == 1 and rows[1]["score"] is None
    assert "no response to score" in rows[1]["error"] and summary.kept == 1


def test_another_judge_prompt_is_another_run(judge, tmp_path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", SCORED[:2])
    out = tmp_path / "s.jsonl"
    score_file(data, out, _opts(), backend=judge)
    with pytest.raises(ConfigError, match="judge_prompt"):
        score_file(data, out, _opts(), template=DEFAULT_JUDGE_PROMPT + " Be strict.",
                   backend=judge)


def test_real_tiny_judge_scores_every_record(tiny_model, tmp_path) -> None:
    """transformers end to end: a random model rarely writes a score; every record is
    still scored or counted as unparsed, and only parsed scores ≥ the threshold are kept."""
    data = write_jsonl(tmp_path / "d.jsonl", SCORED)
    out = tmp_path / "s.jsonl"
    summary = score_file(data, out, _opts(str(tiny_model), max_new_tokens=4, chunk_size=3),
                         min_score=3)
    rows = read_rows(out)
    assert len(rows) == len(SCORED) and all("judge_output" in r for r in rows)
    parsed = [r for r in rows if r["score"] is not None]
    assert summary.unparsed == len(rows) - len(parsed)
    assert summary.kept == sum(1 for r in parsed if r["score"] >= 3)
    assert summary.engine["backend"] == "transformers"


def test_cli_score_checks_the_judge_prompt(tiny_model, tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", SCORED[:3])
    prompt = tmp_path / "judge.txt"
    prompt.write_text("Rate this: {instruction}")
    base = ["score", str(data), "--model", str(tiny_model), "--out", str(tmp_path / "s.jsonl"),
            "--backend", "hf", "--max-new-tokens", "3"]
    assert main([*base, "--judge-prompt", str(prompt)]) == 2
    assert "no '{response}'" in capsys.readouterr().err
    assert main([*base, "--min-score", "6"]) == 2
    assert main([*base, "--min-score", "2", "--kept", str(tmp_path / "k.jsonl")]) == 0
    assert "kept" in capsys.readouterr().out and (tmp_path / "k.jsonl").exists()
