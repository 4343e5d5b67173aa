"""`oomless demo`: offline plan → train → report on the tiny model; the loss falls."""

from __future__ import annotations

import json

from oomless.cli import main


def test_demo_runs_end_to_end_and_tells_what_to_run_next(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    run = out / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"] - 1.0
    assert summary["effective_batch"] == 8 and summary["micro_batch_size"] == 2
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "oom"] == [10]
    for name in ("memlog.jsonl", "report.html", "final/adapter_model.safetensors",
                 "token_stats.json", "estimate.json"):
        assert (run / name).is_file(), name
    assert (out / "oomless.yaml").is_file() and (out / "tiny-qwen2" / "tokenizer.json").is_file()
    assert "1/3 plan" in text and "2/3 train" in text and "3/3 report" in text
    assert "oomless train plan/oomless.yaml" in text


def test_demo_config_is_a_valid_train_config(tmp_path):
    from oomless.config import load_run_config
    from oomless.runtime.demo import prepare_demo

    files = prepare_demo(tmp_path / "d")
    cfg = load_run_config(files.config_file)
    assert cfg == files.config and cfg.method == "lora"
    assert len(files.eval_file.read_text().splitlines()) == 16
