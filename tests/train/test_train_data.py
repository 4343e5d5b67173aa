"""Data loading: formats, masking, truncation, packing, and every bad-record case."""

from __future__ import annotations

import json

import pytest

from oomless.config import DataConfig
from oomless.dataset.records import (
    IGNORE_INDEX,
    load_examples,
    pack_examples,
    record_to_messages,
    token_length_stats,
)
from oomless.errors import DataError
from oomless.runtime.tiny import demo_data_path


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


ALPACA = {"instruction": "Reverse the string.", "input": "apple", "output": "elppa"}
SHAREGPT = {"conversations": [{"from": "human", "value": "Reverse the string.\napple"},
                              {"from": "gpt", "value": "elppa"}]}
MESSAGES = {"messages": [{"role": "user", "content": "Reverse the string.\napple"},
                         {"role": "assistant", "content": "elppa"}]}


def test_three_formats_give_the_same_tokens(tmp_path, tiny_tokenizer):
    seqs = []
    for i, rec in enumerate((ALPACA, SHAREGPT, MESSAGES)):
        loaded = load_examples(_jsonl(tmp_path / f"{i}.jsonl", [rec]), tiny_tokenizer,
                               DataConfig(), seq_len=128)
        seqs.append((loaded.examples[0].input_ids, loaded.examples[0].labels))
    assert seqs[0] == seqs[1] == seqs[2]


def test_labels_mask_prompt_and_keep_the_response(tmp_path, tiny_tokenizer):
    ex = load_examples(_jsonl(tmp_path / "a.jsonl", [ALPACA]), tiny_tokenizer,
                       DataConfig(), 128).examples[0]
    n_prompt = ex.labels.index(next(t for t in ex.labels if t != IGNORE_INDEX))
    assert n_prompt == ex.prompt_tokens > 0
    response = tiny_tokenizer.decode(ex.input_ids[n_prompt:])
    assert response.startswith("elppa<|im_end|>")
    assert list(ex.labels[n_prompt:]) == list(ex.input_ids[n_prompt:])


def test_multi_turn_history_trains_on_every_assistant_turn(tmp_path, tiny_tokenizer):
    rec = {"system": "Be brief.", "history": [["2 + 2", "4"], ["3 + 3", "6"]],
           "instruction": "5 + 5", "output": "10"}
    ex = load_examples(_jsonl(tmp_path / "h.jsonl", [rec]), tiny_tokenizer,
                       DataConfig(), 256).examples[0]
    labelled = tiny_tokenizer.decode([t for t in ex.labels if t != IGNORE_INDEX])
    assert labelled.replace("\n", "") == "4<|im_end|>6<|im_end|>10<|im_end|>"


def test_json_and_parquet_inputs(tmp_path, tiny_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.json").write_text(json.dumps([ALPACA, ALPACA], indent=1))
    pq.write_table(pa.Table.from_pylist([ALPACA] * 3), tmp_path / "d.parquet")
    assert len(load_examples(tmp_path / "d.json", tiny_tokenizer, DataConfig(), 128).examples) == 2
    assert len(load_examples(tmp_path / "d.parquet", tiny_tokenizer, DataConfig(), 128).examples) == 3


def test_truncation_respects_input_and_output_budgets(tmp_path, tiny_tokenizer):
    rec = {"instruction": "word " * 60, "output": "answer " * 40}
    cfg = DataConfig(max_input_length=20, max_output_length=7)
    ex = load_examples(_jsonl(tmp_path / "t.jsonl", [rec]), tiny_tokenizer, cfg, 512).examples[0]
    assert (ex.prompt_tokens, ex.response_tokens, ex.truncated) == (20, 7, True)
    long_answer = {"instruction": "x", "output": "answer " * 40}
    ex2 = load_examples(_jsonl(tmp_path / "t2.jsonl", [long_answer]), tiny_tokenizer,
                        DataConfig(), seq_len=30).examples[0]
    assert len(ex2) == 30 and ex2.truncated and ex2.response_tokens > 0


def test_packing_keeps_every_token_and_restarts_positions(tiny_tokenizer):
    loaded = load_examples(demo_data_path(), tiny_tokenizer, DataConfig(), 128)
    packed = pack_examples(loaded.examples, 128)
    assert all(len(p) <= 128 for p in packed)
    assert sum(len(p) for p in packed) == sum(len(e) for e in loaded.examples)
    assert [n for p in packed for n in p.lines] == list(range(1, 201))
    first = packed[0]
    assert first.position_ids.count(0) == len(first.lines)


def test_stats_file_and_percentiles(tmp_path, tiny_tokenizer):
    loaded = load_examples(demo_data_path(), tiny_tokenizer, DataConfig(), 128, run_dir=tmp_path)
    written = json.loads((tmp_path / "token_stats.json").read_text())
    assert written["total"] == token_length_stats(loaded.examples)["total"]
    t = written["total"]
    assert t["count"] == 200 and t["p50"] <= t["p95"] <= t["p99"] <= t["max"]


BAD_CASES = [
    ("{not json", "invalid JSON"),
    ([1, 2], "must be a JSON object"),
    ({"text": "hello"}, "unknown record format"),
    ({"instruction": "", "output": "x"}, "'instruction' is missing or empty"),
    ({"instruction": "x"}, "'output' is missing or empty"),
    ({"instruction": "x", "output": 3}, "'output' must be a string"),
    ({"instruction": "x", "output": "y", "history": "no"}, "'history' must be a list"),
    ({"instruction": "x", "output": "y", "history": [["a"]]}, r"'history\[0\]' must be a pair"),
    ({"conversations": []}, "'conversations' must be a non-empty list"),
    ({"conversations": [{"from": "human"}]}, "must be an object with 'from' and 'value'"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown from 'robot'"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "must end with an assistant turn"),
    ({"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
     "turn 1 is 'assistant', expected 'user'"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]},
     "content must be a non-empty string"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]},
                   {"role": "assistant", "content": "y"}]}, "content parts of type"),
    ({"instruction": "x", "output": "y", "images": ["a.png"]}, "need a vision-language model"),
    ({"instruction": "word " * 100, "output": "y"}, "no response tokens left after truncation"),
]


@pytest.mark.parametrize(("record", "reason"), BAD_CASES)
def test_every_bad_record_is_reported_with_line_and_reason(tmp_path, tiny_tokenizer, record, reason):
    path = _jsonl(tmp_path / "bad.jsonl", [ALPACA, "", record])
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: .*{reason}"):
        load_examples(path, tiny_tokenizer, DataConfig(), seq_len=32)


def test_format_mismatch_is_a_bad_record(tmp_path, tiny_tokenizer):
    path = _jsonl(tmp_path / "m.jsonl", [MESSAGES])
    with pytest.raises(DataError, match=r"m\.jsonl:1: record looks like 'messages'.*'alpaca'"):
        load_examples(path, tiny_tokenizer, DataConfig(format="alpaca"), 128)


def test_skip_writes_every_rejected_record_with_reason(tmp_path, tiny_tokenizer):
    records = [ALPACA, "{oops", {"instruction": "x"}, SHAREGPT, {"text": "t"}]
    path = _jsonl(tmp_path / "mix.jsonl", records)
    loaded = load_examples(path, tiny_tokenizer, DataConfig(on_bad_record="skip"), 128,
                           run_dir=tmp_path / "run")
    assert [e.lines for e in loaded.examples] == [(1,), (4,)]
    rejected = [json.loads(x) for x in (tmp_path / "run" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"].split(" ")[0]) for r in rejected] == [
        (2, "invalid"), (3, "'output'"), (5, "unknown")]
    assert rejected[1]["record"] == {"instruction": "x"}
    stats = json.loads((tmp_path / "run" / "token_stats.json").read_text())
    assert (stats["records"], stats["rejected"]) == (5, 3)


def test_error_lists_every_bad_record_not_only_the_first(tmp_path, tiny_tokenizer):
    path = _jsonl(tmp_path / "many.jsonl", [{"x": i} for i in range(4)] + [ALPACA])
    with pytest.raises(DataError, match=r"(?s)4 bad record.*many\.jsonl:1.*many\.jsonl:4") as info:
        load_examples(path, tiny_tokenizer, DataConfig(), 128)
    assert "on_bad_record: skip" in str(info.value)


@pytest.mark.parametrize(("name", "content", "reason"), [
    ("missing.jsonl", None, "not found"),
    ("d.csv", "a,b\n", "unsupported extension"),
    ("obj.json", '{"instruction": "x"}', "must hold an array"),
    ("broken.json", '[{"instruction": "x", "output": "y"}, {"instr', "invalid JSON"),
    ("empty.jsonl", "\n\n", "no usable records"),
])
def test_file_level_errors(tmp_path, tiny_tokenizer, name, content, reason):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=reason):
        load_examples(path, tiny_tokenizer, DataConfig(), 128)


def test_json_array_lines_point_at_the_record(tmp_path, tiny_tokenizer):
    path = tmp_path / "arr.json"
    path.write_text("[\n" + json.dumps(ALPACA) + ",\n\n" + json.dumps({"instruction": "q"}) + "\n]")
    with pytest.raises(DataError, match=r"arr\.json:4: 'output'"):
        load_examples(path, tiny_tokenizer, DataConfig(), 128)


def test_record_to_messages_auto_detects():
    assert record_to_messages(SHAREGPT) == record_to_messages(MESSAGES) == record_to_messages(ALPACA)


def test_one_rejected_file_per_input_always_written_with_the_raw_line(tmp_path, tiny_tokenizer):
    run = tmp_path / "run"
    skip = DataConfig(on_bad_record="skip")
    train_file = _jsonl(tmp_path / "t.jsonl", [ALPACA, "{not json", {"text": "x"}])
    eval_file = _jsonl(tmp_path / "e.jsonl", [ALPACA, {"instruction": "q"}])
    load_examples(train_file, tiny_tokenizer, skip, 128, run_dir=run)
    load_examples(eval_file, tiny_tokenizer, skip, 128, run, "eval_token_stats.json")
    train_rows = [json.loads(x) for x in (run / "rejected.jsonl").read_text().splitlines()]
    eval_rows = [json.loads(x) for x in (run / "eval_rejected.jsonl").read_text().splitlines()]
    assert [r["line"] for r in train_rows] == [2, 3] and [r["line"] for r in eval_rows] == [2]
    assert train_rows[0]["raw"] == "{not json" and train_rows[0]["record"] is None
    _jsonl(train_file, [ALPACA])  # fixed: the stale rejected file does not survive
    load_examples(train_file, tiny_tokenizer, skip, 128, run_dir=run)
    assert (run / "rejected.jsonl").read_text() == ""
    _jsonl(train_file, ["{a", "{b"])  # every record rejected: still written, then the error
    with pytest.raises(DataError, match=r"no usable records \(all 2 rejected\)"):
        load_examples(train_file, tiny_tokenizer, skip, 128, run_dir=run)
    assert [json.loads(x)["raw"] for x in (run / "rejected.jsonl").read_text().splitlines()] \
        == ["{a", "{b"]
