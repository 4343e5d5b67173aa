"""The fix rules of check/rules.py: each refuses what it says, on real files where the
situation occurs, and every rule is documented with its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomless.check.checker import CheckOptions, check
from oomless.check.rules import RULES, RuleContext, allowed_shardings, broken_rules
from oomless.config import RunConfig
from oomless.models.catalog import resolve_model

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "check-rules.md"


def ctx(model="qwen2.5-7b-instruct", world=8, fits_gpu=False, **facts):
    return RuleContext(facts, resolve_model(model).spec, world, fits_gpu)


def cfg(**kw):
    return RunConfig.model_validate({"model": "qwen2.5-7b-instruct", "method": "full", **kw})


def codes(old, new, c):
    return {r.code for r in broken_rules(old, new, c)}


def test_every_rule_has_a_source_and_is_documented():
    text = DOCS.read_text()
    for rule in RULES:
        assert rule.source and rule.forbids
        assert f"`{rule.code}`" in text


@pytest.mark.parametrize("old,new,c,code", [
    (cfg(zero=2), cfg(zero=2, optimizer="adamw-8bit"), ctx(ds_optimizer_block=True),
     "ds_optimizer_block"),
    (cfg(zero=2), cfg(zero=2, offload="optimizer", optimizer="adamw-8bit"), ctx(),
     "offload_cpu_adam"),
    (cfg(zero=2, offload="optimizer"), cfg(zero=2, offload="optimizer", optimizer="paged-adamw"),
     ctx(), "offload_cpu_adam"),
    (cfg(zero=2), cfg(zero=3), ctx("moe-llava-phi2-2.7b-4e"), "moe_zero3"),
    (cfg(zero=2), cfg(zero=3), ctx(deepspeed_moe=True), "moe_zero3"),
    (cfg(method="lora"), cfg(method="lora", zero=2), ctx("glm-4v-9b", world=4),
     "glm4v_no_deepspeed"),
    (cfg(precision="fp16"), cfg(precision="bf16"), ctx(), "no_saving_precision"),
    (cfg(precision="bf16"), cfg(precision="fp16"), ctx(), "no_saving_precision"),
    (cfg(zero=2), cfg(zero=0), ctx(), "no_saving_sharding"),
    (cfg(zero=3, offload="all"), cfg(zero=3, offload="optimizer"), ctx(), "no_saving_sharding"),
    (cfg(method="lora"), cfg(method="lora", zero=3, offload="all"), ctx(world=1, fits_gpu=True),
     "headroom_light"),
])
def test_rule_refuses_its_case(old, new, c, code):
    assert code in codes(old, new, c)


@pytest.mark.parametrize("old,new,c", [
    (cfg(zero=2), cfg(zero=2, optimizer="adamw-8bit"), ctx()),  # no optimizer block
    (cfg(zero=2), cfg(zero=3), ctx()),  # a dense model may use ZeRO-3
    (cfg(method="lora"), cfg(method="lora", zero=2), ctx("glm-4-9b-chat", world=4)),
    (cfg(method="lora"), cfg(method="lora", zero=3), ctx(world=1, fits_gpu=False)),  # really OOM
    (cfg(zero=2), cfg(zero=2, micro_batch_size=1, grad_accum=8), ctx(ds_optimizer_block=True)),
])
def test_rules_allow_what_works(old, new, c):
    assert codes(old, new, c) == set()


def test_allowed_shardings_drop_zero3_for_moe_and_deepspeed_for_glm4v():
    moe = allowed_shardings(cfg(zero=2), ctx("moe-llava-phi2-2.7b-4e"), None)
    assert (2, "optimizer") in moe and not [s for s in moe if s[0] == 3]
    glm = allowed_shardings(cfg(method="lora"), ctx("glm-4v-9b", world=4), None)
    assert glm == ((0, "none"),)


def test_moe_llava_fix_never_uses_zero3():
    """Two A100-40GB: the batch split alone does not fit; ZeRO-3 would (DeepSpeed refuses it
    for MoE layers), so the fix offloads the optimizer under ZeRO-2 or says nothing fits."""
    result = check(CheckOptions(files=(str(CORPUS / "moe-llava/phi2_finetune_moe.sh"),),
                                gpu="a100-40gb x2"))
    assert result.exit_code == 1
    if result.fix:
        assert result.fix["config"]["zero"] != 3
        assert "zero2_offload.json" in "".join(result.diffs.values()) or \
            result.fix["config"]["zero"] == 2


def test_glm4v_is_warned_about_deepspeed_and_never_given_more():
    result = check(CheckOptions(files=(str(CORPUS / "glm-4/finetune_lora.yaml"),),
                                gpu="rtx-4090 x4", model="glm-4v-9b"))
    assert any("cannot work properly with deepspeed" in n for n in result.warnings)
    if result.fix:
        assert result.fix["config"]["zero"] <= 2


def test_seed_moe_llava_exits_1_with_batch_4_accumulation_4():
    result = check(CheckOptions(files=(str(CORPUS / "moe-llava/phi2_finetune_moe.sh"),),
                                gpu="a100-40gb x8"))
    assert result.gpu_memory_bytes / 2**30 == pytest.approx(39.39, abs=0.005)
    assert result.verdict == "tight" and result.exit_code == 1
    assert (result.fix["config"]["micro_batch_size"], result.fix["config"]["grad_accum"]) == (4, 4)


def test_single_gpu_lora_inside_the_headroom_gets_the_batch_split():
    result = check(CheckOptions(files=(str(CORPUS / "axolotl/qlora.yml"),), gpu="rtx-4090",
                                model="llama-3.1-8b-instruct"))
    assert result.verdict == "tight"
    changed = {c["key"] for c in result.fix["changes"]}
    assert changed <= {"micro_batch_size", "grad_accum", "grad_ckpt", "eval.batch_size"}
