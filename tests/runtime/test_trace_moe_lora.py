"""MoE + LoRA under PEFT 0.21 / transformers 5: the merged expert copies, analytic vs trace."""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.memory.moe_lora import expert_adapter_params, wraps_experts
from oomless.models.catalog import ResolvedModel
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
from oomless.runtime.trace.fake import trace_training

MIXTRAL = dict(model_type="mixtral", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, vocab_size=8000, max_position_embeddings=2048)


def _resolved(config: dict) -> ResolvedModel:
    return ResolvedModel(spec=spec_from_hf_config(config, "tiny"),
                         hf_config=buildable_hf_config(config), source="test")


@pytest.mark.parametrize("options", [
    {"method": "lora"},  # all-linear: experts, router and attention
    {"method": "lora", "grad_ckpt": True},
    {"method": "lora", "lora": {"targets": ["q_proj", "v_proj", "w2"]}},  # down_proj only
])
def test_merged_expert_copies_analytic_equals_the_trace(options):
    cfg = RunConfig(model="tiny", seq_len=512, micro_batch_size=2, **options)
    resolved = _resolved(MIXTRAL)
    traced = trace_training(cfg, resolved=resolved)
    assert not traced.extra.get("trace_fallback"), traced.extra.get("trace_fallback")
    ours = estimate_training(resolved.spec, cfg)
    assert ours.trainable_params == traced.trainable_params
    assert abs(ours.peak_allocated_bytes / traced.peak_allocated_bytes - 1) < 0.02


def test_which_models_and_targets_wrap_the_experts():
    mixtral = spec_from_hf_config(MIXTRAL, "m")
    qwen2_moe = spec_from_hf_config(dict(MIXTRAL, model_type="qwen2_moe", moe_intermediate_size=256,
                                         num_experts=4, shared_expert_intermediate_size=512), "q")
    attention_only = RunConfig(model="m", lora={"targets": ["q_proj", "v_proj"]})
    assert wraps_experts(mixtral, RunConfig(model="m"))
    assert not wraps_experts(mixtral, attention_only)
    assert not wraps_experts(mixtral, RunConfig(model="m", method="full"))
    # transformers' conversion table has no qwen2_moe entry: its experts stay frozen
    assert not wraps_experts(qwen2_moe, RunConfig(model="q"))
    # all-linear: gate_up (rank doubled), down and router adapters on every MoE layer
    r, h, i, e = 16, 512, 1024, 4
    per_layer = 2 * r * e * (h + 2 * i) + r * e * (i + h) + r * (h + e)
    assert expert_adapter_params(mixtral, RunConfig(model="m")) == 2 * per_layer
