"""QLoRA on several GPUs: ZeRO-3 / FSDP families are planned and written, upper bound first."""

from __future__ import annotations

import json

import yaml

from oomless.cli import main
from oomless.config import load_run_config


def test_plan_shards_qlora_70b_over_two_24gb_cards_and_writes_it(tmp_path, capsys):
    out_dir = tmp_path / "plan"
    rc = main(["plan", "llama-2-70b", "--method", "qlora", "--gpu", "4090x2", "--seq-len",
               "2048", "--effective-batch", "8", "--top", "3", "--json", "--out", str(out_dir)])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["plans"]
    best = data["plans"][0]
    assert best["config"]["method"] == "qlora" and best["config"]["zero"] == 3
    memory = best["gpu_memory_bytes"]
    for p in data["plans"]:
        assert p["device_peak_bytes"] <= p["budget_bytes"] and p["high_bytes"] <= memory
    cfg = load_run_config(out_dir / "oomless.yaml")
    assert cfg.method == "qlora" and cfg.zero == 3 and cfg.quant_storage == "bfloat16"
    ds = json.loads((out_dir / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    lf = yaml.safe_load((out_dir / "llamafactory.yaml").read_text())
    assert lf["quantization_bit"] == 4


def test_stated_uint8_storage_keeps_qlora_off_zero3(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("model: llama-2-70b\nmethod: qlora\nquantization: {storage: uint8}\n")
    rc = main(["plan", str(run), "--gpu", "4090x2", "--seq-len", "2048", "--effective-batch",
               "8", "--json"])
    data = json.loads(capsys.readouterr().out)
    considered = [p["config"] for p in data["plans"]] + [m["config"] for m in data["misses"]]
    assert considered and all(c["zero"] != 3 for c in considered)
    assert rc in (0, 1)
