"""`infer` and `score` never write over their input or a file they did not write, and
continue an output only on the input it was made from."""

from __future__ import annotations

from pathlib import Path

import pytest
from infer_fixtures import RECORDS, write_jsonl

from oomless.cli import main


def _argv(command: str, data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [command, str(data), "--model", str(model), "--out", str(out), "--backend", "hf",
            "--cutoff-len", "32", "--max-new-tokens", "2", "--chunk-size", "5", *extra]


@pytest.mark.parametrize("extra", [(), ("--overwrite",), ("--force",)])
def test_infer_out_equal_to_the_input_is_refused(tiny_model, dataset, capsys, extra):
    before = dataset.read_bytes()
    assert main(_argv("infer", dataset, tiny_model, dataset, *extra)) == 2
    assert "is an input of this command" in capsys.readouterr().err
    assert dataset.read_bytes() == before


def test_score_kept_equal_to_the_input_or_the_output_is_refused(tiny_model, dataset, tmp_path,
                                                               capsys):
    before = dataset.read_bytes()
    out = tmp_path / "scores.jsonl"
    for kept in (dataset, out):
        assert main(_argv("score", dataset, tiny_model, out, "--kept", str(kept))) == 2
        assert "--kept" in capsys.readouterr().err
    assert dataset.read_bytes() == before


def test_an_output_of_another_dataset_is_not_continued(tiny_model, dataset, tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    assert main(_argv("infer", dataset, tiny_model, out, "--limit", "4")) == 0
    other = write_jsonl(tmp_path / "other.jsonl", list(reversed(RECORDS)))
    assert main(_argv("infer", other, tiny_model, out)) == 2
    assert "holds results of another input" in capsys.readouterr().err
    grown = write_jsonl(tmp_path / "grown.jsonl", RECORDS + RECORDS[:2])  # appended records
    dataset.rename(tmp_path / "moved.jsonl")
    grown.rename(dataset)
    assert main(_argv("infer", dataset, tiny_model, out)) == 0
    assert "8 written, 4 already done" in capsys.readouterr().out


def test_a_file_oomless_did_not_write_is_kept_unless_forced(tiny_model, dataset, tmp_path,
                                                           capsys):
    out = tmp_path / "mine.jsonl"
    out.write_text('{"my": "notes"}\n')
    assert main(_argv("infer", dataset, tiny_model, out)) == 2
    assert "was not written by oomless" in capsys.readouterr().err
    assert main(_argv("infer", dataset, tiny_model, out, "--force")) == 0
    assert (tmp_path / "mine.jsonl.orig").read_text() == '{"my": "notes"}\n'
    kept = tmp_path / "kept.jsonl"
    kept.write_text("user data\n")
    score = tmp_path / "scores.jsonl"
    assert main(_argv("score", dataset, tiny_model, score, "--kept", str(kept))) == 2
    assert "was not written by oomless score" in capsys.readouterr().err
    assert kept.read_text() == "user data\n"


def test_a_model_that_is_not_on_disk_fails_fast_offline(dataset, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert main(_argv("infer", dataset, Path("qwen2.5-0.5b-instruct"), out)) == 2
    assert "local Hugging Face cache" in capsys.readouterr().err
