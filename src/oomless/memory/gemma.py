"""Gemma-2 specifics the memory model needs: soft-capping and the eager default.

Gemma-2 (transformers models/gemma2/modeling_gemma2.py) soft-caps twice:

- attention scores, in ``eager_attention_forward``: ``w = q·kᵀ·scaling; w = w / cap;
  w = tanh(w); w = w · cap``. Dividing and multiplying by a Python number keep
  nothing for backward; ``tanh`` keeps its output (its derivative is 1 − y²), so
  every layer keeps one more 16-bit (b, heads, s, s) tensor next to the
  softmax's fp32 and 16-bit probabilities.
- logits, in ``Gemma2ForCausalLM.forward``: the same three ops on the lm_head
  output, so the forward keeps a 16-bit tokens × vocabulary ``tanh`` output that
  lives until the backward reaches it.

``Gemma2PreTrainedModel._supports_sdpa`` is False (SDPA has no soft-capping), so
transformers builds the model with eager attention unless FlashAttention-2
(which soft-caps inside the kernel) is asked for; ``attn: sdpa`` therefore
runs eager.
"""

from __future__ import annotations

from ..models.spec import ModelSpec
from .precision import Dtypes


def effective_attn(spec: ModelSpec, attn: str) -> str:
    """The attention kernel transformers really runs for ``attn`` on this model."""
    if attn == "sdpa" and not spec.sdpa_supported:
        return "eager"
    return attn


def softcap_scores_bytes(spec: ModelSpec, b: int, s: int, dt: Dtypes, attn: str) -> int:
    """The tanh output eager attention keeps per layer when scores are soft-capped
    (flash attention caps inside the kernel and keeps nothing more)."""
    if not spec.attn_logit_softcap or attn != "eager":
        return 0
    return dt.act_bytes * b * spec.num_heads * s * s


def softcap_logits_bytes(spec: ModelSpec, logits_elem_bytes: int, t: int) -> int:
    """The tanh output of the logits' soft-capping, in the logits' dtype."""
    return logits_elem_bytes * t * spec.vocab_size if spec.final_logit_softcap else 0


def is_sliding_layer(spec: ModelSpec, index: int) -> bool:
    """Whether decoder layer ``index`` attends through a sliding window: Gemma-3 slides in
    all but every ``sliding_window_pattern``-th layer (Gemma3TextConfig.layer_types), the
    others in every ``sliding_window_every``-th layer from the first (Gemma-2: even layers)."""
    if not spec.sliding_window:
        return False
    if spec.model_type in SLIDE_ALL_BUT_EVERY_NTH:
        return (index + 1) % spec.sliding_window_every != 0
    return index % spec.sliding_window_every == 0


# families whose sliding_window_every counts the full-attention layers (1 of n), not the sliding ones
SLIDE_ALL_BUT_EVERY_NTH = frozenset({"gemma3_text", "gemma3"})


def sliding_mask_bytes(spec: ModelSpec, b: int, s: int, dt: Dtypes, attn: str) -> tuple[int, int]:
    """(bytes over all layers, bytes of one layer) of the additive masks SDPA keeps.

    A sliding window shorter than the sequence needs an explicit (b, 1, s, s) boolean
    mask (transformers masking_utils); ``scaled_dot_product_attention`` turns a boolean
    mask into an additive one in the query's dtype on every call and the
    memory-efficient kernel keeps it for backward. Flash attention takes the window
    as an argument and eager adds its float mask without keeping it.
    """
    if attn != "sdpa" or not spec.sliding_window or s <= spec.sliding_window:
        return 0, 0
    per_layer = dt.act_bytes * b * s * s
    layers = sum(1 for i in range(spec.num_layers) if is_sliding_layer(spec, i))
    return layers * per_layer, per_layer


# Gemma RMSNorm (gemma, gemma2, gemma3): ``(x.float() · rsqrt(...)) · (1 + w.float())`` in fp32,
# cast to the input dtype afterwards, so a trained weight keeps the fp32 normalised tensor
# (Llama-style RMSNorm casts back before the weight and keeps it in the input dtype)
GEMMA_NORM_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3_text", "gemma3"})


def rms_normed_bytes(spec: ModelSpec, input_elem_bytes: int) -> int:
    """Element size of the normalised tensor an RMSNorm with a trained weight keeps."""
    return 4 if spec.model_type in GEMMA_NORM_MODEL_TYPES else input_elem_bytes


def gemma_assumptions(spec: ModelSpec, attn: str) -> list[str]:
    out = []
    if attn == "sdpa" and not spec.sdpa_supported:
        out.append(f"{spec.model_type} has no SDPA path in transformers (_supports_sdpa False): "
                   "attn sdpa runs eager attention, which keeps the s² scores")
    if spec.attn_logit_softcap and effective_attn(spec, attn) == "eager":
        out.append("attention soft-capping (tanh) keeps one more 16-bit heads × s² tensor per layer")
    if spec.final_logit_softcap:
        out.append("logit soft-capping (tanh) keeps a 16-bit tokens × vocabulary tensor until backward")
    return out
