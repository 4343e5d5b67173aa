"""--stack, --transformers-version, --quant-storage and the band through the CLI."""

from __future__ import annotations

import json

from oomless.cli import main


def estimate_json(capsys, *argv):
    rc = main(["estimate", *argv, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_stack_flags_reach_the_estimate(capsys):
    base = ["llama-3.2-3b", "--method", "lora", "--lora-targets", "q_proj,v_proj",
            "--batch-size", "4", "--seq-len", "768"]
    hf = estimate_json(capsys, *base)
    loop = estimate_json(capsys, *base, "--stack", "custom-loop")
    old = estimate_json(capsys, *base, "--stack", "custom-loop", "--transformers-version", "4.45")
    assert hf["config"]["stack"] == "hf-trainer" and loop["config"]["stack"] == "custom-loop"
    assert hf["peak_allocated_bytes"] < loop["peak_allocated_bytes"] < old["peak_allocated_bytes"]
    assert old["config"]["stack_options"]["transformers_version"] == "4.45"
    assert any("custom-loop" in a for a in loop["assumptions"])


def test_table_shows_the_band_and_a_three_valued_verdict(capsys):
    rc = main(["estimate", "qwen2.5-7b", "--method", "qlora", "--grad-ckpt", "--gpu", "4090"])
    out = capsys.readouterr().out
    assert rc == 0 and "FITS on rtx-4090" in out and "uncertainty band" in out and "–" in out


def test_unknown_stack_is_a_user_error(capsys):
    assert main(["estimate", "qwen2.5-7b", "--stack", "deepspeed-chat"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_qlora_zero3_needs_a_float_quant_storage(capsys):
    rc = main(["estimate", "llama-2-70b", "--method", "qlora", "--zero", "3", "--gpu", "4090x2",
               "--quant-storage", "uint8"])
    err = capsys.readouterr().err
    assert rc == 2 and "quantization.storage: bfloat16" in err and "Traceback" not in err


def test_qlora_zero3_shards_the_packed_weights(capsys):
    args = ["llama-2-70b", "--method", "qlora", "--grad-ckpt", "--attn", "flash",
            "--batch-size", "2", "--seq-len", "2048", "--lora-r", "8"]
    single = estimate_json(capsys, *args, "--gpu", "a100-80gb")
    two = estimate_json(capsys, *args, "--zero", "3", "--gpu", "a100-40gbx2")
    assert two["config"]["quantization"]["storage"] is None  # bfloat16 under ZeRO-3
    off = estimate_json(capsys, *args, "--zero", "3", "--offload", "all",
                        "--quant-storage", "bfloat16", "--gpu", "4090x2")
    w1, w2 = single["components"]["weights"], two["breakdown"]["backward"]["weights"]
    assert w1 / 2 < w2 < w1 * 0.55  # halved, plus the replicated absmax
    assert "weights" not in off["breakdown"]["backward"] and off["host_ram_bytes"] > w1
    assert two["verdict"] == "fits" and off["verdict"] == "fits"


def test_plan_keeps_the_stated_stack(capsys):
    rc = main(["plan", "llama-3.1-8b-instruct", "--gpu", "4090", "--method", "qlora",
               "--seq-len", "4096", "--stack", "trl", "--stack-version", "0.12",
               "--transformers-version", "4.46", "--top", "2", "--json"])
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert rc == 0 and plans
    for p in plans:
        assert p["config"]["stack"] == "trl"
        assert p["config"]["stack_options"]["stack_version"] == "0.12"
