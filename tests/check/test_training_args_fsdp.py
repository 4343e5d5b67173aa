"""TrainingArguments' own FSDP (``fsdp: "full_shard auto_wrap"``, ``fsdp_config``) is read by
every reader of TrainingArguments-style inputs, never dropped, as the transformers release
runs it: TrainingArguments._process_fsdp_args (and 5.10.0 on, _apply_legacy_fsdp_to_config)
of the released wheels 4.57.6, 5.0.0rc0-rc2, 5.0.0, 5.3.0-5.6.0, 5.9.0-5.11.0, 5.13.0, 5.23.0
(common.TA_FSDP_RELEASES), and the installed transformers and accelerate themselves."""

from __future__ import annotations

import pytest
from packaging.version import Version

from oomless.check.checker import CheckOptions, check
from oomless.check.common import (
    STAGE_OF_FSDP_STRATEGY,
    TA_FSDP_RELEASES,
    ta_fsdp_release,
    training_args_fsdp,
    transformers_release,
)

WHERE = "f.yaml:{}".format


NOW = "5.23.0"  # the release the project pins (requirements-ci.txt)


@pytest.mark.parametrize("release,fsdp,conf,zero,offload", [
    (NOW, "full_shard auto_wrap", {}, 3, "none"),
    (NOW, "shard_grad_op", {}, 2, "none"),
    (NOW, "full_shard offload auto_wrap", {}, 3, "all"),
    (NOW, "full_shard", {"fsdp_cpu_offload": True}, 3, "all"),
    ("5.3.0", ["hybrid_shard", "auto_wrap"], {}, 3, "none"),  # FSDP1: the word is the strategy
    ("5.3.0", "no_shard", {}, 0, "none"),
    ("4.57.6", "shard_grad_op", {}, 2, "none"),  # FSDP_SHARDING_STRATEGY from the word
])
def test_strategy_words_map_to_the_sharding_they_do(release, fsdp, conf, zero, offload):
    run, notes = training_args_fsdp({"fsdp": fsdp, "fsdp_config": conf}, WHERE, release)
    assert (run["zero"], run["offload"]) == (zero, offload)
    assert notes and "f.yaml:fsdp" in notes[0] and len(notes) == 1


# the FSDP version without fsdp_config "version", at each side of each release that changed
# it (read from the released wheels: common.TA_FSDP_RELEASES)
@pytest.mark.parametrize("release,version", [
    ("4.57.6", 1), ("5.0.0rc0", 1), ("5.0.0rc1", 1), ("5.0.0", 1), ("5.9.0", 1),
    ("5.10.0", 2), ("5.10.1", 2), ("5.16.1", 2), (NOW, 2),
])
def test_version_without_fsdp_config_is_the_releases_default(release, version):
    run, notes = training_args_fsdp({"fsdp": "full_shard"}, WHERE, release)
    assert run["fsdp"]["version"] == version
    assert f"fsdp_config has no version: transformers {release} runs FSDP{version}" in notes[0]
    if version == 1:
        assert run["fsdp"]["use_orig_params"] is True  # transformers' own default


@pytest.mark.parametrize("release,version", [("4.57.6", 1), ("5.0.0rc0", 1), ("5.0.0rc1", 2)])
def test_fsdp_config_version_is_read_from_5_0_0rc1(release, version):
    # 4.57.6 hands accelerate environment variables without a version; 5.0.0rc0 reads
    # fsdp_config["fsdp_version"] after stripping the "fsdp_" prefix: both run FSDP1
    run, notes = training_args_fsdp({"fsdp": "full_shard", "fsdp_config": {"version": 2}},
                                    WHERE, release)
    assert run["fsdp"]["version"] == version
    said = "does not read fsdp_config.version 2 (read from 5.0.0rc1 on)" in notes[0]
    assert said == (version == 1) and ("can't tell" in notes[0]) == said


def test_fsdp_config_keys_are_read():
    conf = {"fsdp_version": 1, "backward_prefetch": "backward_pre", "limit_all_gathers": "false",
            "activation_checkpointing": True}
    run, notes = training_args_fsdp({"fsdp": "full_shard", "fsdp_config": conf}, WHERE, NOW)
    assert run["fsdp"]["version"] == 1 and run["fsdp"]["backward_prefetch"] == "BACKWARD_PRE"
    assert run["fsdp"]["limit_all_gathers"] is False and run["grad_ckpt"] is True
    assert training_args_fsdp({"learning_rate": 1e-5}, WHERE, NOW) is None


# FSDP2 `fsdp: full_shard` without reshard_after_forward: 5.0.0rc1-5.3 pass the words to
# FSDP1 only and default reshard_after_forward to false; 5.4.0 on takes its default from them
@pytest.mark.parametrize("release,zero,said", [
    ("5.0.0rc1", 2, True), ("5.3.0", 2, True), ("5.4.0", 3, False), (NOW, 3, False)])
def test_fsdp2_sharding_from_the_words_by_release(release, zero, said):
    conf = {"version": 2}
    run, notes = training_args_fsdp({"fsdp": "full_shard", "fsdp_config": conf}, WHERE, release)
    assert run["zero"] == zero
    assert any("reshard_after_forward alone, default false" in n for n in notes) == said


@pytest.mark.parametrize("release,zero,said", [
    ("5.4.0", 3, "reshards after forward for every fsdp word but shard_grad_op"),
    ("5.9.0", 3, "reshards after forward for every fsdp word but shard_grad_op"),
    ("5.10.0", 0, "refuses fsdp no_shard with FSDP2"),
])
def test_fsdp1_only_words_with_fsdp2(release, zero, said):
    run, notes = training_args_fsdp({"fsdp": "no_shard", "fsdp_config": {"version": 2}}, WHERE,
                                    release)
    assert run["zero"] == zero and any(said in n for n in notes)


@pytest.mark.parametrize("release,reshard,zero", [
    ("5.0.0rc1", True, 3), ("5.3.0", "false", 2), (NOW, True, 3), (NOW, "false", 2)])
def test_fsdp2_reshard_after_forward_wins_over_the_words(release, reshard, zero):
    # 5.0.0rc1-5.3 read it as it stands, 5.4.0 on only setdefault() it from the words
    conf = {"version": 2, "reshard_after_forward": reshard}
    run, notes = training_args_fsdp({"fsdp": "full_shard", "fsdp_config": conf}, WHERE, release)
    assert run["zero"] == zero and len(notes) == 1


@pytest.mark.parametrize("release,fsdp,reshard,zero", [
    ("4.57.6", "shard_grad_op", None, 2), ("5.3.0", "shard_grad_op", None, 2),
    ("5.3.0", "full_shard", "shard_grad_op", 3), ("5.4.0", "shard_grad_op", None, 3),
    (NOW, "shard_grad_op", None, 3), (NOW, "full_shard", "shard_grad_op", 3),
])
def test_fsdp1_shards_as_accelerates_sharding_strategy(release, fsdp, reshard, zero):
    # Accelerator.prepare_model prefers the plugin's sharding_strategy, which transformers
    # sets from the words before 5.4.0 and the plugin defaults to FULL_SHARD after
    conf = {"version": 1, **({"reshard_after_forward": reshard} if reshard else {})}
    run, notes = training_args_fsdp({"fsdp": fsdp, "fsdp_config": conf}, WHERE, release)
    assert run["zero"] == zero
    assert any("prefers it over reshard_after_forward" in n for n in notes) == (zero != 2)


def test_every_release_row_is_a_release_boundary():
    for row in TA_FSDP_RELEASES:
        assert ta_fsdp_release(row.since) is row
    assert [Version(r.since) for r in TA_FSDP_RELEASES] == sorted(
        Version(r.since) for r in TA_FSDP_RELEASES)
    assert ta_fsdp_release("5.9.0").default_version == 1 == ta_fsdp_release("5.10.0rc0").default_version
    assert ta_fsdp_release("5.0.0rc0").reads_config is False


def _real_stage(fsdp, conf):
    """(FSDP version, ZeRO stage) of the plugin the installed transformers' TrainingArguments
    and accelerate's FullyShardedDataParallelPlugin build: the sharding Accelerator.prepare_model
    hands FSDP1 (``sharding_strategy or reshard_after_forward``), FSDP2's reshard_after_forward.
    sync_module_states is turned off: only it needs a GPU, it does not touch the sharding."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", fsdp=fsdp, fsdp_config=dict(conf))
    plugin = FullyShardedDataParallelPlugin(**{**args.fsdp_plugin_args,
                                               "sync_module_states": False})
    if plugin.fsdp_version == 2:
        return 2, 3 if plugin.reshard_after_forward else 2
    strategy = plugin.sharding_strategy or plugin.reshard_after_forward
    return 1, STAGE_OF_FSDP_STRATEGY[strategy.name.lower()]


@pytest.mark.parametrize("fsdp,conf", [
    ("full_shard auto_wrap", {}), ("shard_grad_op", {}), (True, {}),
    ("full_shard", {"version": 2, "reshard_after_forward": False}),
    ("shard_grad_op", {"fsdp_version": 2, "fsdp_reshard_after_forward": "true"}),
    ("full_shard", {"version": 1}), ("shard_grad_op", {"version": 1}),
    ("full_shard", {"version": 1, "reshard_after_forward": "shard_grad_op"}),
])
def test_the_reading_is_what_the_installed_transformers_and_accelerate_build(
        fsdp, conf, monkeypatch):
    pytest.importorskip("accelerate")
    for name in ("FSDP_VERSION", "FSDP_SHARDING_STRATEGY", "FSDP_RESHARD_AFTER_FORWARD"):
        monkeypatch.delenv(name, raising=False)  # what no launcher set
    # TrainingArguments writes this one; monkeypatch takes it back after the test
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    release = transformers_release()
    run, _notes = training_args_fsdp({"fsdp": fsdp, "fsdp_config": conf}, WHERE, release)
    assert (run["fsdp"]["version"], run["zero"]) == _real_stage(fsdp, conf)


def test_fsdp1_only_words_with_fsdp2_are_refused_as_said(monkeypatch):
    from transformers import TrainingArguments

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")

    release = transformers_release()
    _run, notes = training_args_fsdp({"fsdp": "hybrid_shard"}, WHERE, release)
    refused = any("refuses fsdp hybrid_shard with FSDP2" in n for n in notes)
    if not refused:
        pytest.skip(f"transformers {release} does not refuse it")
    with pytest.raises(ValueError, match="only available with FSDP1"):
        TrainingArguments(output_dir="unused", fsdp="hybrid_shard")


def test_a_reshard_after_forward_the_version_refuses_is_said():
    conf = {"version": 1, "reshard_after_forward": True}  # FSDP1 takes a strategy name
    run, notes = training_args_fsdp({"fsdp": True, "fsdp_config": conf}, WHERE, NOW)
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
