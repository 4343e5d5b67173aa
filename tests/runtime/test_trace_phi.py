"""Phi-2 (gelu_new, one LayerNorm per parallel block): the analytic estimate against a
trace of the real transformers model, with and without autocast.

Under CUDA autocast gelu_new's pow runs in fp32 (autocast_mode.h AT_FORALL_FP32) and its
fp32 result promotes tanh, 1 + tanh and the activation's output: three of the four
tensors the formula keeps are fp32 (oomless.memory.activations.ACT_SAVED); the trace runs
CUDA's policy under CPU autocast (oomless.runtime.trace.cuda_emulation.CUDA_AUTOCAST_OPS).
Dimensions are phi-2's (microsoft/phi-2 config.json, transcribed in
oomless/data/models.json) at a quarter of the width and 2 of its 32 layers.
"""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.models.catalog import ResolvedModel
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
from oomless.runtime.trace.fake import trace_training

PHI2 = dict(model_type="phi", hidden_act="gelu_new", hidden_size=640, intermediate_size=2560,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
            partial_rotary_factor=0.4, resid_pdrop=0.1, embd_pdrop=0.0, attention_dropout=0.0,
            layer_norm_eps=1e-5, max_position_embeddings=2048, vocab_size=51200,
            tie_word_embeddings=False, qk_layernorm=False)
SEQ, BATCH = 1024, 1


def _both(config: dict, **options) -> tuple:
    cfg = RunConfig(model="tiny", seq_len=SEQ, micro_batch_size=BATCH, **options)
    resolved = ResolvedModel(spec=spec_from_hf_config(config, "tiny"),
                             hf_config=buildable_hf_config(config), source="test")
    traced = trace_training(cfg, resolved=resolved)
    assert not traced.extra.get("trace_fallback"), traced.extra.get("trace_fallback")
    return estimate_training(resolved.spec, cfg), traced


# the fp32 the formula adds under autocast: 3 tensors × 2 more bytes, per layer
AUTOCAST_EXTRA_BYTES = PHI2["num_hidden_layers"] * 3 * 2 * BATCH * SEQ * PHI2["intermediate_size"]


# LoRA under autocast (phi-2's measured row); pure bf16 (no autocast: all 16-bit) as full
# fine-tuning, since a pure-bf16 LoRA trace keeps PEFT's fp32 adapters, which the analytic
# convention does not (a separate miss).
@pytest.mark.parametrize("precision, method", [("bf16", "lora"), ("pure-bf16", "full")])
def test_phi2_analytic_equals_the_trace(precision, method):
    ours, traced = _both(PHI2, method=method, attn="sdpa", precision=precision)
    gap = abs(ours.peak_allocated_bytes - traced.peak_allocated_bytes)
    # the fp32 GELU tensors are 3.2% of the LoRA peak: a miss of them would fail
    assert gap < 0.005 * traced.peak_allocated_bytes < AUTOCAST_EXTRA_BYTES
    named = [a for a in ours.assumptions if a.startswith("gelu_new is a Python formula")]
    assert len(named) == 1 and ("3 of them fp32" in named[0]) == (precision == "bf16")


def test_autocast_gelu_new_costs_its_fp32_tensors_in_the_trace():
    """The same model with a fused GELU (one 16-bit input kept): the trace's difference is
    the formula's tensors, fp32 under autocast."""
    fused = {**PHI2, "hidden_act": "gelu_pytorch_tanh"}
    _, with_formula = _both(PHI2, method="lora", attn="sdpa", precision="bf16")
    _, with_kernel = _both(fused, method="lora", attn="sdpa", precision="bf16")
    per_elem = 4 + 4 + 4 + 2 - 2  # fp32 x copy, tanh, 1 + tanh, 16-bit 0.5·x − the fused input
    expected = PHI2["num_hidden_layers"] * per_elem * BATCH * SEQ * PHI2["intermediate_size"]
    diff = with_formula.breakdown["forward"]["activations"] - \
        with_kernel.breakdown["forward"]["activations"]
    assert diff == pytest.approx(expected, rel=0.01)
