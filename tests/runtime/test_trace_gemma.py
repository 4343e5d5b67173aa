"""Gemma-2/3: the analytic estimate against a trace of the real transformers model.

Gemma-2 soft-caps its attention scores and logits (one more tanh output kept for
each), has no SDPA path in transformers (attn sdpa runs eager) and four norms per
layer; Gemma-3 has q/k norms and sliding-window layers whose boolean mask SDPA
turns into an additive one on every call.
"""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.models.catalog import ResolvedModel
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
from oomless.runtime.trace.fake import trace_training

GEMMA2 = dict(model_type="gemma2", hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32000,
              max_position_embeddings=4096, sliding_window=256, query_pre_attn_scalar=64)
GEMMA3 = dict(model_type="gemma3_text", hidden_size=512, intermediate_size=2048,
              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
              vocab_size=32000, max_position_embeddings=4096, sliding_window=128,
              query_pre_attn_scalar=128)


def _resolved(config: dict) -> ResolvedModel:
    return ResolvedModel(spec=spec_from_hf_config(config, "tiny"),
                         hf_config=buildable_hf_config(config), source="test")


def _error(config: dict, **options) -> float:
    cfg = RunConfig(model="tiny", seq_len=512, micro_batch_size=2, **options)
    resolved = _resolved(config)
    traced = trace_training(cfg, resolved=resolved)
    assert not traced.extra.get("trace_fallback"), traced.extra.get("trace_fallback")
    ours = estimate_training(resolved.spec, cfg)
    return ours.peak_allocated_bytes / traced.peak_allocated_bytes - 1


@pytest.mark.parametrize("options", [
    {"method": "lora", "attn": "eager"},
    {"method": "lora", "attn": "sdpa"},  # transformers runs Gemma-2 eager
    {"method": "lora", "attn": "flash", "grad_ckpt": True},
    {"method": "full", "attn": "eager"},
])
def test_gemma2_analytic_equals_the_trace(options):
    assert abs(_error(GEMMA2, **options)) < 0.02


@pytest.mark.parametrize("options", [{"method": "lora"}, {"method": "full", "attn": "eager"}])
def test_gemma3_analytic_equals_the_trace(options):
    assert abs(_error(GEMMA3, **options)) < 0.02


def test_softcapping_is_what_the_gemma2_estimate_adds():
    spec = spec_from_hf_config(GEMMA2, "tiny")
    plain = spec_from_hf_config({**GEMMA2, "attn_logit_softcapping": None,
                                 "final_logit_softcapping": None}, "tiny")
    assert spec.attn_logit_softcap and spec.final_logit_softcap and not spec.sdpa_supported
    assert not plain.attn_logit_softcap and not plain.final_logit_softcap
    cfg = RunConfig(model="tiny", seq_len=512, micro_batch_size=2, attn="eager")
    with_caps = estimate_training(spec, cfg).breakdown["forward"]
    without = estimate_training(plain, cfg).breakdown["forward"]
    t = 2 * 512
    # one 16-bit tanh output of the logits and, per layer, of the heads × s² scores
    assert with_caps["logits"] - without["logits"] == 2 * t * spec.vocab_size
    assert with_caps["activations"] - without["activations"] == (
        spec.num_layers * 2 * 2 * spec.num_heads * 512 * 512)
