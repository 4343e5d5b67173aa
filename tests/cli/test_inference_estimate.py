"""`oomless estimate --inference`: a table a person can read, fractions that are fractions,
a plain statement when max_num_seqs cannot be held, and engine arguments that name a
model vLLM can load and agree byte for byte with `oomless infer --engine-args`."""

from __future__ import annotations

import json

import pytest

from oomless.cli import main


def _json_block(text: str) -> str:
    start = text.index("{\n")
    return text[start: text.index("\n}", start) + 2]


def test_the_budget_is_a_table_and_says_what_it_holds(capsys):
    assert main(["estimate", "qwen2.5-7b-instruct", "--inference", "--gpu", "a100-80gb",
                 "--seq-len", "2048", "--max-new-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "component" in out and "KV cache" in out and "budget" in out
    assert "bytes:" not in out and "FITS" in out
    assert "256 sequences of 2,560 tokens" in out


def test_max_num_seqs_that_no_utilization_holds_is_said(capsys):
    argv = ["estimate", "qwen2.5-7b-instruct", "--inference", "--gpu", "rtx-4090",
            "--seq-len", "8192", "--max-new-tokens", "1024"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu_memory_utilization"] <= 0.95
    assert data["required_utilization"] is None and data["holds_max_num_seqs"] is False
    assert data["required_bytes"] > data["total_memory_bytes"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    held = int(data["max_concurrency"])
    assert "FITS" in out and "not all 256 sequences at once" in out
    assert f"lower max_num_seqs to {held}" in out


def test_required_utilization_is_a_fraction_when_it_fits(capsys):
    assert main(["estimate", "qwen2.5-0.5b-instruct", "--inference", "--gpu", "a100-80gb",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert 0 < data["required_utilization"] <= data["gpu_memory_utilization"] <= 0.95
    assert data["holds_max_num_seqs"] is True


@pytest.mark.parametrize("model,hf_id,remote", [
    ("qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct", False),
    ("glm-4-9b-chat", "THUDM/glm-4-9b-chat", True),
])
def test_estimate_and_infer_print_the_same_engine_arguments(capsys, model, hf_id, remote):
    assert main(["estimate", model, "--inference", "--gpu", "rtx-a6000", "--seq-len", "1024",
                 "--max-new-tokens", "512", "--max-num-seqs", "64"]) == 0
    estimated = _json_block(capsys.readouterr().out)
    assert main(["infer", "--engine-args", "-m", model, "--gpu", "rtx-a6000", "--cutoff-len",
                 "1024", "--max-new-tokens", "512", "--max-num-seqs", "64"]) == 0
    printed = _json_block(capsys.readouterr().out)
    assert estimated == printed
    args = json.loads(printed)
    assert args["model"] == hf_id and args["trust_remote_code"] is remote


def test_the_library_entry_takes_the_flags_defaults_and_gives_the_clis_numbers(capsys):
    """oomless.api.estimate_inference is what `estimate --inference` (and the web page)
    call: its options' defaults are the flags', and a caller from Python gets the same
    engine arguments and budget as the command."""
    from dataclasses import asdict

    from oomless.api import InferenceOptions, estimate_inference
    from oomless.cli import build_parser
    from oomless.cli._options import inference_options, run_config_from_args

    args = build_parser().parse_args(["estimate", "qwen2.5-7b-instruct", "--inference",
                                      "--gpu", "l40sx2", "--seq-len", "2048"])
    assert inference_options(args) == InferenceOptions()
    inf = estimate_inference(run_config_from_args(args), InferenceOptions())
    assert main(["estimate", "qwen2.5-7b-instruct", "--inference", "--gpu", "l40sx2",
                 "--seq-len", "2048", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["engine_args"] == inf.engine_args
    assert printed["suggested_parallel"] == inf.suggested_parallel
    assert {k: printed[k] for k in asdict(inf.budget)} == json.loads(
        json.dumps(inf.budget.to_dict()))
