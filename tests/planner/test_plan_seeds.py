"""The seeds' decision tree must come out of the search, not be coded in.

The stories behind the project: one 24 GB card → QLoRA + gradient checkpointing; 7B full
fine-tuning on 8×A100-80GB → DeepSpeed ZeRO; long sequences → flash
attention + checkpointing; MoE-LLaVA at batch 8 × accumulation 2 on
8×A100-40GB → a smaller micro batch keeping the effective batch.
"""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.models.catalog import resolve_model
from oomless.models.hardware import parse_gpu_arg
from oomless.planner import PlanOptions, build_request, plan_from_options, search
from oomless.planner.candidates import batch_splits


def _cfg(plan):
    return plan.run_config()


@pytest.mark.parametrize("gpu", ["rtx-4090", "a10", "rtx-3090"])
def test_9b_on_one_24gb_card_is_qlora_with_checkpointing(gpu):
    result = plan_from_options(PlanOptions(model="glm-4-9b", gpu=gpu, seq_len=2048))
    best = _cfg(result.best)
    assert best.method == "qlora" and best.grad_ckpt
    # ... because 16-bit LoRA misses, not because a rule says so
    missed = {m.group for m in result.misses}
    assert "lora · no ZeRO" in missed and "full · no ZeRO" in missed
    assert all(p.device_peak_bytes <= result.budget_bytes for p in result.plans)
    assert best.effective_batch == result.effective_batch


def test_7b_full_fine_tuning_on_8_a100_80gb_uses_zero():
    result = plan_from_options(PlanOptions(model="llama-2-7b", gpu="a100-80gb x8",
                                           method="full", seq_len=2048, effective_batch=64))
    best = _cfg(result.best)
    assert best.method == "full" and best.zero >= 1
    # plain DDP replicas (weights + fp32 grads + Adam + DDP buckets) do not fit
    assert any(m.group == "full · no ZeRO" for m in result.misses) or all(
        p.tradeoffs for p in result.plans if p.config["zero"] == 0)
    assert all(p.config["micro_batch_size"] * p.config["grad_accum"] * 8 == 64
               for p in result.plans)


def test_32k_tokens_need_checkpointing_and_flash_attention():
    result = plan_from_options(PlanOptions(model="mistral-7b-instruct-v0.3", gpu="a100-80gb",
                                           method="lora", seq_len=32768))
    best = _cfg(result.best)
    assert best.grad_ckpt and best.attn == "flash"
    # without checkpointing nothing of this length fits: every plan checkpoints
    assert all(p.config["grad_ckpt"] for p in result.plans)


def test_long_sequences_on_a_gpu_without_flash_attention_use_sdpa_and_fp16():
    result = plan_from_options(PlanOptions(model="mistral-7b-instruct-v0.3", gpu="v100-32gb",
                                           method="lora", seq_len=8192))
    assert result.plans
    assert {p.config["attn"] for p in result.plans} == {"sdpa"}
    assert {p.config["precision"] for p in result.plans} == {"fp16"}  # V100 has no bf16


def test_moe_llava_batch_8_becomes_smaller_micro_batch_same_effective_batch():
    spec = resolve_model("moe-llava-phi2-2.7b-4e").spec
    seed = RunConfig(model="moe-llava-phi2-2.7b-4e", method="full", micro_batch_size=8,
                     grad_accum=2, seq_len=2048, grad_ckpt=True, zero=2,
                     data={"images_per_sample": 1},
                     hardware={"gpu": "a100-40gb", "gpus_per_node": 8})
    cluster = parse_gpu_arg("a100-40gb x8")
    # the seed's own configuration does not fit within the 10% headroom
    keep = frozenset({"method", "precision", "optimizer", "zero", "seq_len", "attn"})
    req = build_request(spec, seed, cluster, fixed=keep, objective="change", top=3)
    result = search(spec, req)
    fix = _cfg(result.best)
    assert result.effective_batch == 128
    assert fix.micro_batch_size < 8 and fix.micro_batch_size * fix.grad_accum == 16
    assert fix.grad_ckpt and fix.zero == 2
    # the fastest plan (free knobs) keeps the same effective batch too
    fast = search(spec, build_request(spec, seed, cluster, top=3))
    assert all(p.config["micro_batch_size"] * p.config["grad_accum"] == 16 for p in fast.plans)


def test_batch_splits_multiply_to_the_per_gpu_batch():
    for n in (1, 6, 16, 96):
        splits = batch_splits(n)
        assert all(b * a == n for b, a in splits)
        assert [b for b, _ in splits] == sorted(b for b in range(1, n + 1) if n % b == 0)
