"""Training stages: the analytic estimate against a trace of TRL's own trainers.

rm, dpo, kto, orpo and simpo run TRL 1.16's trainers' ``compute_loss`` on the fake
model; ppo runs the step of TRL's last PPOTrainer, re-created from its source
(runtime/trace/ppo_step.py). The models are small real-architecture configs.
"""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.models.catalog import ResolvedModel
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
from oomless.runtime.trace.fake import trace_training

LLAMA = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
             max_position_embeddings=2048, tie_word_embeddings=False)


def _traced(**options):
    resolved = ResolvedModel(spec=spec_from_hf_config(LLAMA, "small"),
                             hf_config=buildable_hf_config(LLAMA), source="test")
    cfg = RunConfig(model="small", seq_len=256, micro_batch_size=2, **options)
    traced = trace_training(cfg, resolved=resolved)
    assert not traced.extra.get("trace_fallback"), traced.extra.get("trace_fallback")
    return traced, estimate_training(resolved.spec, cfg)


@pytest.mark.parametrize("options", [
    {"stage": "rm", "method": "lora"},
    {"stage": "dpo", "method": "lora"},  # reference: the policy with its adapters off
    {"stage": "dpo", "method": "full"},  # reference: a separate frozen copy
    {"stage": "kto", "method": "lora"},
    {"stage": "orpo", "method": "lora"},
    {"stage": "simpo", "method": "full"},
    {"stage": "ppo", "method": "lora", "grad_accum": 2, "rlhf": {"response_length": 16}},
])
def test_stage_analytic_equals_the_trace(options):
    traced, ours = _traced(**options)
    assert abs(ours.peak_allocated_bytes / traced.peak_allocated_bytes - 1) < 0.03
    for phase in ("forward", "backward", "optimizer"):
        ratio = sum(ours.breakdown[phase].values()) / sum(traced.breakdown[phase].values())
        assert abs(ratio - 1) < 0.05, phase


def test_ppo_trace_has_a_rollout_phase_and_four_models():
    traced, ours = _traced(stage="ppo", method="lora", rlhf={"response_length": 16})
    assert "generation" in traced.breakdown and "generation" in ours.breakdown
    assert {"reward_model", "value_model"} <= set(ours.breakdown["optimizer"])
