"""`estimate --lengths/--data` and `check --steps`: a run over variable-length data
through the caching-allocator model, from the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomless.cli import main

# a real transformers config, small enough to trace in seconds (qwen2 architecture)
TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


@pytest.mark.slow
def test_estimate_lengths_prints_the_run_as_json(tiny_model: Path, capsys) -> None:
    rc = main(["estimate", str(tiny_model), "--method", "lora", "--batch-size", "2",
               "--lengths", "100,200,400", "--steps", "12", "--order", "sorted",
               "--gpu", "rtx-4090", "--json"])
    assert rc == 0
    run = json.loads(capsys.readouterr().out)["extra"]["run"]
    # sorted, batch 2: [100, 200] then [400] (the last, short batch), again each epoch
    assert run["traced_lengths"] == [96, 200, 400] and run["steps"] == 12
    assert [r[1] for r in run["default"]["curve"]] == [200, 400] * 6
    default = run["default"]
    assert default["high_water_bytes"] >= default["peak_allocated_bytes"]
    assert run["verdict"] == "fits" and run["expandable_segments"]["oom_step"] is None
    assert len(default["curve"]) == 12 and [r[0] for r in default["curve"]] == list(range(12))


def test_lengths_must_be_a_list_of_token_counts(capsys) -> None:
    assert main(["estimate", "qwen2.5-0.5b", "--lengths", "100,abc"]) == 2
    assert "expected token lengths such as 180,420,768" in capsys.readouterr().err


def test_check_steps_needs_the_data(tmp_path: Path, capsys) -> None:
    f = tmp_path / "oomless.yaml"
    f.write_text("model: qwen2.5-0.5b\nmethod: lora\nseq_len: 512\n")
    rc = main(["check", str(f), "--gpu", "rtx-4090", "--steps", "10"])
    assert rc == 2
    assert "--steps replays a run over the training data: give --data FILE" in \
        capsys.readouterr().err


def test_bad_alloc_conf_stops_before_any_trace(capsys) -> None:
    assert main(["estimate", "qwen2.5-0.5b", "--lengths", "10,20",
                 "--alloc-conf", "max_split_size_mb:8"]) == 2
    assert "max_split_size_mb:8 is too small" in capsys.readouterr().err


def test_plan_steps_needs_the_data(capsys) -> None:
    assert main(["plan", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--steps", "10"]) == 2
    assert "give --data FILE" in capsys.readouterr().err


def test_lengths_as_percentiles_are_upper_bounds_of_1000_samples() -> None:
    from collections import Counter

    from oomless.cli._options import lengths_list

    assert Counter(lengths_list("p50=180,p90=420,max=768")) == {180: 500, 420: 400, 768: 100}
    assert lengths_list("300,100") == [300, 100]
    for bad in ("p50=180,p90=100,max=768", "p50=180,p90=420", "q5=1,max=3", "0,5"):
        with pytest.raises(Exception, match="percentiles such as p50=180"):
            lengths_list(bad)
