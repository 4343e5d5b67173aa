"""TrainingArguments' own FSDP (``fsdp: "full_shard auto_wrap"``, ``fsdp_config``) is read by
every reader of TrainingArguments-style inputs, never dropped: transformers
TrainingArguments._process_fsdp_args / _apply_legacy_fsdp_to_config (5.23)."""

from __future__ import annotations

import pytest

from oomless.check.checker import CheckOptions, check
from oomless.check.common import training_args_fsdp

WHERE = "f.yaml:{}".format


@pytest.mark.parametrize("fsdp,conf,zero,offload", [
    ("full_shard auto_wrap", {}, 3, "none"),
    (["hybrid_shard", "auto_wrap"], {}, 3, "none"),
    ("shard_grad_op", {}, 2, "none"),
    ("full_shard offload auto_wrap", {}, 3, "all"),
    ("full_shard", {"fsdp_cpu_offload": True}, 3, "all"),
    ("no_shard", {}, 0, "none"),
])
def test_strategy_words_map_to_the_sharding_they_do(fsdp, conf, zero, offload):
    run, notes = training_args_fsdp({"fsdp": fsdp, "fsdp_config": conf}, WHERE, 5)
    assert (run["zero"], run["offload"]) == (zero, offload)
    assert notes and "f.yaml:fsdp" in notes[0]


def test_version_comes_from_fsdp_config_else_the_transformers_release():
    assert training_args_fsdp({"fsdp": "full_shard"}, WHERE, 5)[0]["fsdp"] == {"version": 2}
    v1 = training_args_fsdp({"fsdp": "full_shard"}, WHERE, 4)[0]["fsdp"]
    assert v1["version"] == 1 and v1["use_orig_params"] is True  # transformers' own default
    conf = {"fsdp_version": 1, "backward_prefetch": "backward_pre", "limit_all_gathers": "false",
            "activation_checkpointing": True}
    run, notes = training_args_fsdp({"fsdp": "full_shard", "fsdp_config": conf}, WHERE, 5)
    assert run["fsdp"]["backward_prefetch"] == "BACKWARD_PRE"
    assert run["fsdp"]["limit_all_gathers"] is False and run["grad_ckpt"] is True
    assert training_args_fsdp({"learning_rate": 1e-5}, WHERE, 5) is None


@pytest.mark.parametrize("version,reshard,zero", [
    (2, True, 3), (2, "false", 2), (1, "shard_grad_op", 2), (1, "FULL_SHARD", 3),
])
def test_reshard_after_forward_wins_over_the_strategy_words(version, reshard, zero):
    # _apply_legacy_fsdp_to_config only setdefault()s reshard_after_forward from the words
    conf = {"version": version, "reshard_after_forward": reshard}
    run, notes = training_args_fsdp({"fsdp": "full_shard", "fsdp_config": conf}, WHERE, 5)
    assert run["zero"] == zero and not any("can't tell" in n for n in notes)


def test_a_reshard_after_forward_the_version_refuses_is_said():
    conf = {"version": 1, "reshard_after_forward": True}  # FSDP1 takes a strategy name
    run, notes = training_args_fsdp({"fsdp": True, "fsdp_config": conf}, WHERE, 5)
    assert run["zero"] == 3 and any("can't tell the sharding" in n for n in notes)


def _peak(path, gpu="a100-80gbx8"):
    r = check(CheckOptions(files=(str(path),), gpu=gpu))
    return r, r.device_peak_bytes


def test_a_trl_recipe_with_fsdp_is_sharded(tmp_path):
    body = ("model_name_or_path: meta-llama/Llama-2-7b-hf\nper_device_train_batch_size: 1\n"
            "bf16: true\nmax_length: 2048\noutput_dir: out\n")
    plain, sharded = tmp_path / "sft.yaml", tmp_path / "sft_fsdp.yaml"
    plain.write_text(body)
    sharded.write_text(body + 'fsdp: "full_shard auto_wrap"\n')
    r, with_fsdp = _peak(sharded)
    _r, without = _peak(plain)
    assert r.config["zero"] == 3 and with_fsdp < without / 3
    assert any("FSDP2 full_shard auto_wrap" in a for a in r.assumptions)


def test_a_torchrun_script_with_fsdp_flags_is_sharded(tmp_path):
    # in the form of Stanford Alpaca's README command (tatsu-lab/stanford_alpaca): full
    # fine-tuning of a 7B model on 4 A100-80GB with --fsdp "full_shard auto_wrap"
    script = tmp_path / "train.sh"
    script.write_text(
        "torchrun --nproc_per_node=4 --master_port=29500 train.py \\\n"
        "    --model_name_or_path meta-llama/Llama-2-7b-hf --bf16 True --output_dir out \\\n"
        "    --per_device_train_batch_size 4 --gradient_accumulation_steps 8 \\\n"
        "    --model_max_length 512 --fsdp \"full_shard auto_wrap\" \\\n"
        "    --fsdp_transformer_layer_cls_to_wrap 'LlamaDecoderLayer' --tf32 True\n")
    r, peak = _peak(script, "a100-80gbx4")
    assert r.config["zero"] == 3 and r.exit_code == 0 and peak < r.gpu_memory_bytes


def test_a_llamafactory_yaml_with_fsdp_is_sharded(tmp_path):
    path = tmp_path / "llama2_full_sft.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: sft\ndo_train: true\n"
                    "finetuning_type: full\ndataset: alpaca_en_demo\ntemplate: llama2\n"
                    "cutoff_len: 1024\nper_device_train_batch_size: 1\nbf16: true\n"
                    "output_dir: out\nfsdp: full_shard\nfsdp_config:\n  version: 1\n")
    r, _peak_bytes = _peak(path)
    assert r.config["zero"] == 3 and r.config["fsdp"]["version"] == 1
