"""What Unsloth leaves on the GPU after loading a model, beyond its weights, by release.

Unsloth 2024.3 replaced transformers' Gemma rotary embedding with its own
``GemmaFixedRotaryEmbedding`` (unslothai/unsloth unsloth/models/gemma.py, commit
70f271b1d3, "Fix Gemma (#223)"): its ``_set_cos_sin_cache`` builds the cos and sin tables
for every position up to ``max_position_embeddings`` in float32 ("We must do RoPE in
float32!") and registers them as buffers, and transformers of the time builds one rotary
embedding in every attention layer (the patched attention forward reads
``self.rotary_emb.cos_cached`` of its own layer, unsloth/models/llama.py
``LlamaAttention_fast_forward``). The tables move to the GPU with the model, so before the
first step the card holds, next to the weights, ``layers × 2 × positions × head_dim × 4``
bytes: 448 MiB for Gemma-7B (28 layers, 8,192 positions, head_dim 256). Unsloth 2024.7
(commit 86c5675a67) still builds the Gemma tables this way; releases after it are not
read here, so they are not counted and the estimate says so.

Unsloth's Llama path of the same releases casts its tables to the model's 16-bit dtype
(``post_patch``: "Downcast RoPE embedding to correct data type"); Gemma's cast is
commented out ("RoPE must be done in float32 for Gemma"), which is why only Gemma is
counted.
"""

from __future__ import annotations

from ..config import RunConfig
from ..models.spec import ModelSpec
from .stacks import version_tuple

# Unsloth releases whose Gemma loader is read (gemma.py at 2024.3 and at 2024.7)
GEMMA_FP32_ROPE_SINCE = (2024, 3)
GEMMA_FP32_ROPE_READ_UNTIL = (2024, 8)
ROPE_TABLE_BYTES = 4  # float32
GEMMA_MODEL_TYPES = ("gemma",)


def unsloth_rope_table_bytes(spec: ModelSpec, cfg: RunConfig) -> int:
    """Bytes of Unsloth's per-layer fp32 RoPE tables on the GPU (0 where not counted)."""
    if cfg.stack != "unsloth" or spec.model_type not in GEMMA_MODEL_TYPES:
        return 0
    version = cfg.stack_options.stack_version
    if not version:
        return 0
    if not GEMMA_FP32_ROPE_SINCE <= version_tuple(version) < GEMMA_FP32_ROPE_READ_UNTIL:
        return 0
    return (spec.num_layers * 2 * spec.max_position_embeddings * spec.head_dim
            * ROPE_TABLE_BYTES)


def unsloth_load_assumptions(spec: ModelSpec, cfg: RunConfig) -> list[str]:
    if cfg.stack != "unsloth" or spec.model_type not in GEMMA_MODEL_TYPES:
        return []
    table = unsloth_rope_table_bytes(spec, cfg)
    if table:
        return [f"Unsloth {cfg.stack_options.stack_version} Gemma: fp32 RoPE cos/sin tables "
                f"in every attention layer ({table / 2**20:,.0f} MiB; "
                "oomless.memory.unsloth_load)"]
    return ["Unsloth's Gemma RoPE tables are counted for releases 2024.3–2024.7 (read from "
            "its gemma.py); for this release they are not counted: --stack-version settles "
            "which loader ran"]
