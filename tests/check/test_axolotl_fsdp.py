"""axolotl's FSDP (``fsdp:`` words, ``fsdp_config:``, ``fsdp_version``) is read as the
TrainingArguments axolotl builds from it — axolotl-ai-cloud/axolotl 067b021 (0.18):
utils/schemas/validation.py (prefix, version), utils/schemas/fsdp.py FSDPConfig,
core/builders/base.py, utils/trainer.py setup_fsdp_envs — through the one reading of
TrainingArguments' FSDP (oomless.check.common.training_args_fsdp), on axolotl's own
example files (tests/fixtures/real_configs/axolotl, provenance in its README)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from oomless.api import estimate
from oomless.check.checker import CheckOptions, check
from oomless.check.common import training_args_fsdp, transformers_release
from oomless.check.readers_axolotl import AXOLOTL_FSDP_VERSION, axolotl_fsdp, parallel_notes
from oomless.cli import main
from oomless.config import RunConfig
from oomless.errors import ConfigError
from oomless.memory.precision import dtypes_for
from oomless.memory.states import fsdp1_units
from oomless.memory.zero_buffers import fsdp1_unsharded
from oomless.models.catalog import resolve_model

AXOLOTL = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs" / "axolotl"
WHERE = "f.yaml:{}".format


def _yaml(name: str) -> dict:
    return yaml.safe_load((AXOLOTL / name).read_text())


@pytest.mark.parametrize("name,version,zero,offload", [
    ("qlora-fsdp-70b.yaml", 1, 3, "all"),  # fsdp: [full_shard, auto_wrap], fsdp_offload_params
    ("phi3-ft-fsdp.yml", 1, 3, "all"),  # the same block on a full fine-tune
    ("adamw-pretrain-fsdp2.yaml", 2, 3, "none"),  # fsdp_config alone: fsdp_version 2
])
def test_axolotl_example_fsdp_is_read(name, version, zero, offload):
    run, notes = axolotl_fsdp(_yaml(name), WHERE)
    assert run["fsdp"]["version"] == version
    assert (run["zero"], run["offload"]) == (zero, offload)
    assert notes[0].startswith(("f.yaml:fsdp", "f.yaml:fsdp_config"))
    if version == 1:  # axolotl passes fsdp_use_orig_params: false on to the plugin
        assert run["fsdp"]["use_orig_params"] is False


def test_version_where_axolotl_takes_it():
    conf = {"fsdp_offload_params": False}
    assert axolotl_fsdp({"fsdp_config": conf}, WHERE)[0]["fsdp"]["version"] == \
        AXOLOTL_FSDP_VERSION == 1  # check_fsdp_version_in_fsdp_config pins 1
    assert axolotl_fsdp({"fsdp_config": conf, "fsdp_version": 2}, WHERE)[0]["fsdp"]["version"] == 2
    assert axolotl_fsdp({"fsdp_config": {"version": 2}}, WHERE)[0]["fsdp"]["version"] == 2
    # `fsdp` words without fsdp_config: no version pinned, the transformers release's default
    run, notes = axolotl_fsdp({"fsdp": ["full_shard", "auto_wrap"]}, WHERE)
    assert any("fsdp_config has no version" in n for n in notes)
    assert axolotl_fsdp({"fsdp_version": 2}, WHERE) is None  # the version alone is no FSDP
    _run, notes = axolotl_fsdp({"fsdp": ["full_shard"], "fsdp_config": "fsdp.json"}, WHERE)
    assert any("not a mapping: can't tell" in n for n in notes)


def test_fsdp_config_keys_as_axolotls_schema_keeps_them():
    # glm47-flash/lora_fsdp.yaml's block (axolotl 067b021): unprefixed keys, FSDP's own
    # activation checkpointing, a sharding_strategy that agrees with reshard_after_forward
    conf = {"fsdp_version": 2, "offload_params": False, "cpu_ram_efficient_loading": False,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "state_dict_type": "FULL_STATE_DICT",
            "sharding_strategy": "FULL_SHARD", "reshard_after_forward": True,
            "activation_checkpointing": True}
    run, notes = axolotl_fsdp({"fsdp_config": conf}, WHERE)
    assert run["grad_ckpt"] is True and run["zero"] == 3 and run["offload"] == "none"
    assert not any("can't tell" in n for n in notes)
    run, _ = axolotl_fsdp({"fsdp_config": {**conf, "reshard_after_forward": False}}, WHERE)
    assert run["zero"] == 2  # FSDP2 keeping the gathered parameters: ZeRO-2's sharding


def test_keys_axolotl_drops_are_said_where_they_would_change_what_runs():
    fsdp = ["full_shard", "auto_wrap"]
    same = {"fsdp_limit_all_gathers": True, "fsdp_sharding_strategy": "FULL_SHARD"}
    _run, notes = axolotl_fsdp({"fsdp": fsdp, "fsdp_config": same}, WHERE)
    assert not any("axolotl 0.13" in n for n in notes)
    differ = {"fsdp_limit_all_gathers": False, "fsdp_backward_prefetch": "BACKWARD_PRE",
              "fsdp_sharding_strategy": "SHARD_GRAD_OP"}
    run, notes = axolotl_fsdp({"fsdp": fsdp, "fsdp_config": differ}, WHERE)
    said = [n for n in notes if "can't tell which release" in n]
    assert len(said) == 3 and all("fsdp_config" in n for n in said)
    # axolotl ≥ 0.13 runs them with the defaults: the estimate reads those
    assert run["zero"] == 3 and run["fsdp"]["backward_prefetch"] == "NO_PREFETCH"
    assert "limit_all_gathers" not in run["fsdp"]


def test_one_reading_for_axolotl_and_training_arguments():
    # what axolotl hands TrainingArguments, read by the same function as a TRL recipe's
    d = _yaml("qlora-fsdp-70b.yaml")
    handed = {"fsdp": d["fsdp"], "fsdp_config": {
        "version": 1, "cpu_offload": True, "use_orig_params": False}}
    assert axolotl_fsdp(d, WHERE)[0] == training_args_fsdp(handed, WHERE, transformers_release())[0]


def _check(path, gpu, **extra):
    return check(CheckOptions(files=(str(path),), gpu=gpu, **extra))


def test_fsdp1_buffers_replace_the_deepspeed_ones_in_the_estimate():
    r = _check(AXOLOTL / "qlora-fsdp-70b.yaml", "rtx-4090 x2", model="llama-3.1-70b-instruct")
    cfg = RunConfig(**r.config)
    assert cfg.fsdp.version == 1 and cfg.offload == "all"
    spec = resolve_model("llama-3.1-70b-instruct").spec
    expected, _ = fsdp1_unsharded(fsdp1_units(spec, cfg, dtypes_for(cfg)), cfg.world_size,
                                  cfg.fsdp.model_dump(), offload=True)
    with_fsdp = estimate(cfg)
    assert with_fsdp.components["zero3_gathered"] == expected
    assert any("FSDP1 FULL_SHARD" in a for a in with_fsdp.assumptions)
    as_zero3 = estimate(RunConfig(**{**r.config, "fsdp": {"version": None}}))
    assert as_zero3.components["zero3_gathered"] != expected  # what was read before
    assert not any("FSDP1" in a for a in as_zero3.assumptions)


def test_an_fsdp_config_alone_shards_the_run(tmp_path):
    # adamw-pretrain-fsdp2.yaml turns FSDP on by fsdp_config only; without it the same
    # file trains unsharded replicas on every GPU
    r = _check(AXOLOTL / "adamw-pretrain-fsdp2.yaml", "a100-80gb x8")
    d = _yaml("adamw-pretrain-fsdp2.yaml")
    del d["fsdp_config"]
    plain = tmp_path / "adamw-pretrain.yaml"
    plain.write_text(yaml.safe_dump(d))
    unsharded = _check(plain, "a100-80gb x8")
    assert (r.config["zero"], r.config["fsdp"]["version"]) == (3, 2)
    assert unsharded.config["zero"] == 0
    parts = estimate(RunConfig(**r.config)).components
    assert parts["zero3_gathered"] > 0 and r.device_peak_bytes < unsharded.device_peak_bytes


def test_deepspeed_and_fsdp_together_are_refused(tmp_path):
    # axolotl's check_fsdp_deepspeed and transformers' Trainer ("Using --fsdp xxx together
    # with --deepspeed is not possible") refuse the pair: check says so, exit 2
    d = _yaml("phi3-ft-fsdp.yml")
    d["deepspeed"] = "deepspeed_configs/zero3_bf16.json"
    path = tmp_path / "both.yml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match="deepspeed and FSDP"):
        _check(path, "a100-80gb x8")
    assert main(["check", str(path), "--gpu", "a100-80gb x8"]) == 2


def test_parallel_sizes_beside_fsdp_are_said_not_guessed():
    # distributed-parallel/qwen3-8b-fsdp-tp-cp.yaml: FSDP2 from a top-level fsdp_version,
    # with tensor and context parallelism that oomless does not model
    d = _yaml("qwen3-8b-fsdp-tp-cp.yaml")
    run, _notes = axolotl_fsdp(d, WHERE)
    assert run["fsdp"]["version"] == 2 and run["zero"] == 3
    said = parallel_notes(d, WHERE)
    assert [n.split(":")[1] for n in said] == [
        "dp_shard_size", "context_parallel_size", "tensor_parallel_size"]
    assert all("can't tell" in n and "settles it" in n for n in said)
    r = _check(AXOLOTL / "qwen3-8b-fsdp-tp-cp.yaml", "h100-80gb x8")
    assert all(any(n.split(": ", 1)[1] in a for a in r.assumptions) for n in said)
    assert parallel_notes({"tensor_parallel_size": 1}, WHERE) == []
