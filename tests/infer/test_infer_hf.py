"""`oomless infer` with the transformers backend on CPU and the tiny model:
outputs, resumability after a crash, torn lines, settings guard, record keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from infer_fixtures import RECORDS, read_rows, write_jsonl

from oomless.cli import main
from oomless.errors import ConfigError, DataError
from oomless.runtime.infer.core import InferOptions, encode_prompt, prompt_messages
from oomless.runtime.infer.hf import HFBackend
from oomless.runtime.infer.jobs import infer_file


class Crash(RuntimeError):
    """Stands for a kill or an OOM right after a chunk was written."""


def _opts(model: Path, **kw) -> InferOptions:
    base = dict(model=str(model), backend="hf", cutoff_len=48, max_new_tokens=6, chunk_size=4)
    return InferOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> HFBackend:
    return HFBackend(_opts(tiny_model, batch_size=3))


def _crash_after(chunks: int):
    def on_chunk(done: int, todo: int) -> None:
        on_chunk.calls += 1
        if on_chunk.calls == chunks:
            raise Crash(f"killed after {done} of {todo}")
    on_chunk.calls = 0
    return on_chunk


def test_every_record_gets_a_row_with_its_label(backend, tiny_model, dataset, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    summary = infer_file(dataset, out, _opts(tiny_model), backend=backend)
    rows = read_rows(out)
    assert summary.written == len(RECORDS) == len(rows) and summary.errors == 0
    assert [r["line"] for r in rows] == list(range(1, len(RECORDS) + 1))
    assert rows[0]["label"] == "retniw" and rows[2]["label"] is None and rows[3]["label"] is None
    assert rows[4]["label"] == "1, 2, 3"
    assert all(0 < r["completion_tokens"] <= 6 and r["prompt_tokens"] > 0 for r in rows)


def test_batched_left_padded_generation_equals_one_by_one(backend, tiny_model) -> None:
    """Batching (sorted by length, left padding) must not change a greedy answer."""
    import torch

    opts = _opts(tiny_model)
    prompts = [encode_prompt(backend.tokenizer, prompt_messages(r)[0], opts)[0] for r in RECORDS]
    batched = backend.generate(prompts)
    model, tok = backend.model, backend.tokenizer
    for ids, gen in zip(prompts, batched, strict=True):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        alone = out[0, len(ids):].tolist()
        stop = next((i for i, t in enumerate(alone) if t in {tok.pad_token_id, tok.eos_token_id}),
                    len(alone))
        assert gen.text == tok.decode(alone[:stop], skip_special_tokens=True)


def test_crash_after_a_chunk_then_rerun_loses_and_repeats_nothing(
        backend, tiny_model, dataset, tmp_path) -> None:
    reference = tmp_path / "reference.jsonl"
    infer_file(dataset, reference, _opts(tiny_model), backend=backend)
    out = tmp_path / "out.jsonl"
    with pytest.raises(Crash):
        infer_file(dataset, out, _opts(tiny_model), backend=backend, on_chunk=_crash_after(1))
    assert len(read_rows(out)) == 4, "the finished chunk is on disk"
    summary = infer_file(dataset, out, _opts(tiny_model), backend=backend)
    assert summary.skipped_done == 4 and summary.written == len(RECORDS) - 4
    rows = read_rows(out)
    assert sorted(r["line"] for r in rows) == list(range(1, len(RECORDS) + 1))
    assert rows == read_rows(reference), "same results as a run that never crashed"
    again = infer_file(dataset, out, _opts(tiny_model), backend=backend)
    assert again.written == 0 and len(read_rows(out)) == len(RECORDS)


def test_a_line_torn_by_a_crash_is_cut_and_redone(backend, tiny_model, dataset, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    infer_file(dataset, out, _opts(tiny_model, limit=5), backend=backend)
    text = out.read_text()
    out.write_text(text + text.splitlines()[0][:25])  # half of a sixth line, no newline
    summary = infer_file(dataset, out, _opts(tiny_model), backend=backend)
    rows = read_rows(out)
    assert summary.written == len(RECORDS) - 5
    assert [r["line"] for r in rows] == list(range(1, len(RECORDS) + 1))


def test_other_settings_are_refused_until_overwrite(backend, tiny_model, dataset,
                                                    tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    infer_file(dataset, out, _opts(tiny_model, limit=2), backend=backend)
    with pytest.raises(ConfigError, match=r"max_new_tokens 6 → 7.*--overwrite"):
        infer_file(dataset, out, _opts(tiny_model, max_new_tokens=7), backend=backend)
    summary = infer_file(dataset, out, _opts(tiny_model, max_new_tokens=7), overwrite=True,
                         backend=backend)
    assert summary.written == len(RECORDS) == len(read_rows(out))


def test_records_keyed_by_id_field(backend, tiny_model, tmp_path) -> None:
    records = [{**r, "uid": f"r{i}"} for i, r in enumerate(RECORDS[:5])]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "out.jsonl"
    infer_file(data, out, _opts(tiny_model, id_field="uid", limit=3), backend=backend)
    # the file is reordered: keys by id still find what is done
    write_jsonl(data, list(reversed(records)))
    summary = infer_file(data, out, _opts(tiny_model, id_field="uid"), backend=backend)
    assert summary.skipped_done == 3 and summary.written == 2
    assert sorted(r["uid"] for r in read_rows(out)) == [f"r{i}" for i in range(5)]
    write_jsonl(data, records + [records[0]])
    with pytest.raises(DataError, match=r"d.jsonl:6: id 'r0' repeats line 1"):
        infer_file(data, out, _opts(tiny_model, id_field="uid"), backend=backend)
    write_jsonl(data, RECORDS[:2])
    with pytest.raises(DataError, match=r"d.jsonl:1: no 'uid' field"):
        infer_file(data, out, _opts(tiny_model, id_field="uid"), backend=backend)


def test_bad_records_become_error_rows(backend, tiny_model, tmp_path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n{not json\n" + json.dumps({"colour": "red"})
                    + "\n" + json.dumps({"prompt": ""}) + "\n")
    out = tmp_path / "out.jsonl"
    summary = infer_file(data, out, _opts(tiny_model), backend=backend)
    rows = {r["line"]: r for r in read_rows(out)}
    assert summary.errors == 3 and "predict" in rows[1]
    assert "invalid JSON" in rows[2]["error"] and "unknown record format" in rows[3]["error"]
    assert "'prompt' is empty" in rows[4]["error"]


def test_long_prompts_keep_their_end(backend, tiny_model) -> None:
    opts = _opts(tiny_model, cutoff_len=16)
    msgs = [{"role": "user", "content": "word " * 200 + "Final question?"}]
    ids, truncated = encode_prompt(backend.tokenizer, msgs, opts)
    full, _ = encode_prompt(backend.tokenizer, msgs, _opts(tiny_model, cutoff_len=10_000))
    assert truncated and ids == full[-16:]


@pytest.mark.parametrize("record, prompt, label", [
    ({"prompt": "hi", "output": "yo"}, [("user", "hi")], "yo"),
    ({"instruction": "a", "input": "b"}, [("user", "a\nb")], None),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]},
     [("user", "q")], "r"),
    ({"conversations": [{"from": "human", "value": "q"}]}, [("user", "q")], None),
])
def test_prompt_messages_of_each_format(record, prompt, label) -> None:
    msgs, answer = prompt_messages(record)
    assert [(m["role"], m["content"]) for m in msgs] == prompt and answer == label


def test_cli_infer(tiny_model, dataset, tmp_path, capsys) -> None:
    out = tmp_path / "cli.jsonl"
    argv = ["infer", str(dataset), "--model", str(tiny_model), "--out", str(out), "--backend",
            "hf", "--cutoff-len", "48", "--max-new-tokens", "4", "--chunk-size", "5"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"{len(RECORDS)} written, 0 already done" in captured.out
    assert "5/10 records written" in captured.err
    assert main(argv) == 0 and "0 written, 10 already done" in capsys.readouterr().out
    assert main([*argv, "--top-p", "0"]) == 2
    assert "--top-p: expected a finite number in (0, 1], got 0" in capsys.readouterr().err
    missing = ["infer", str(dataset), "--model", str(tmp_path / "nope"), "--out", str(out),
               "--backend", "hf", "--overwrite"]
    assert main(missing) == 2


def test_gpu_batch_size_follows_the_memory_model() -> None:
    from oomless.memory import estimate_generate
    from oomless.models.catalog import resolve_model
    from oomless.runtime.infer.hf import FREE_MEMORY_MARGIN, batch_size_for
    from oomless.units import GiB

    spec = resolve_model("qwen2.5-7b-instruct").spec
    opts = InferOptions(model="qwen2.5-7b-instruct", cutoff_len=1024, max_new_tokens=512)
    sizes = [batch_size_for(spec, free * GiB, opts) for free in (18, 24, 40, 80)]
    assert sizes == sorted(sizes) and sizes[0] >= 1 and sizes[-1] > sizes[0]
    for free, batch in zip((18, 24, 40, 80), sizes, strict=True):
        budget = free * GiB * (1 - FREE_MEMORY_MARGIN)
        if batch > 1:
            assert estimate_generate(spec, batch, 1024, 512).device_peak_bytes <= budget
        if batch < 256:
            assert estimate_generate(spec, batch * 2, 1024, 512).device_peak_bytes > budget


@pytest.mark.slow
def test_killed_process_then_rerun_loses_and_repeats_nothing(tiny_model, tmp_path) -> None:
    """A real crash: SIGKILL the CLI once a chunk is on disk, then run it again."""
    import os
    import signal
    import subprocess
    import sys
    import time

    records = RECORDS * 6
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-c", "from oomless.cli import run; run()", "infer", str(data),
            "--model", str(tiny_model), "--out", str(out), "--backend", "hf",
            "--cutoff-len", "48", "--max-new-tokens", "24", "--chunk-size", "2",
            "--batch-size", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and (not out.exists() or out.read_text().count("\n") < 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        pytest.skip("the run finished before it could be killed")
    before = len(read_rows(out))
    assert 2 <= before < len(records)
    subprocess.run(argv, env=env, check=True, capture_output=True)
    lines = [r["line"] for r in read_rows(out)]
    assert sorted(lines) == list(range(1, len(records) + 1)), "nothing lost, nothing twice"
