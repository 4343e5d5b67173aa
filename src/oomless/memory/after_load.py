"""What the GPU holds once a model is loaded, beyond the sum of its tensors (torch-free).

Two mechanisms, each read from the loader's code: Unsloth's per-layer fp32 RoPE tables by
release, and the caching allocator's state after a bitsandbytes QLoRA base loads.

**Unsloth's RoPE tables.** Unsloth 2024.3 replaced transformers' Gemma rotary embedding with its own
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

**bitsandbytes QLoRA loading.** The loader's own order of allocations, replayed through the caching-allocator model
(:mod:`oomless.allocator`), gives the memory reserved before the first step and how much
of it is cache the weights do not use.

**Quantized while loading** (``method: qlora`` on a 16-bit checkpoint). transformers
5.23 (core_model_loading.py ``convert_and_load_state_dict_in_model``) loads one tensor at
a time when a quantizer converts on the fly — no thread pool, "to avoid worker threads
loading full-precision tensors to GPU faster than the main thread can quantize them" —
walking the checkpoint's names in ``dot_natural_key`` order; each tensor is materialised
on its device in 16-bit (``_materialize_copy``), converted, set, and dropped (``del
realized_value``). A checkpoint shard never reaches the GPU whole (safetensors slices are
read per tensor). transformers 4.43 did the same per parameter from a shard read into CPU
memory (modeling_utils.py ``load_state_dict`` to "cpu"; quantizers/quantizer_bnb_4bit.py
``create_quantized_param``: ``Params4bit(param_value.to("cpu")).to(target_device)``, which
quantizes on the GPU), in the shard's key order rather than the natural-key order used
here. The conversions:

- 4-bit (integrations/bitsandbytes.py ``Bnb4bitQuantize``): ``Params4bit(value).to(device)``
  → bitsandbytes 0.50 ``Params4bit._quantize`` → ``functional.quantize_4bit``: the CUDA op
  allocates ``absmax`` (fp32, one per 64-element block) then the packed output (n / 2
  bytes); with double quantization ``absmax - absmax.mean()`` (a temporary of the same
  size) is quantized by ``quantize_blockwise`` (blocksize 256: fp32 absmax per 256 blocks
  and one uint8 per block; its 8-bit map is made once and shared) and the fp32 absmax is
  dropped; ``get_4bit_type`` makes each weight its own 16-value code book. Then the 16-bit
  tensor is freed.
- 8-bit (``Bnb8bitQuantize``): the GPU tensor is copied to the CPU and ``Int8Params(...)
  .to(device)`` → ``Int8Params._quantize`` makes a float16 copy on the GPU, and
  ``int8_vectorwise_quant`` allocates fp32 row statistics and the int8 weight; the fp16 copy
  is freed, then the first 16-bit tensor.

Embeddings, norms and the LM head stay 16-bit and stay allocated. The freed 16-bit blocks
stay cached: what is left reserved beyond the weights is what the replay leaves.

**Pre-quantized checkpoints** (a ``quantization_config`` in config.json, or Unsloth, whose
``FastLanguageModel.from_pretrained`` swaps a mapped model for its ``-bnb-4bit`` repository
when ``load_in_4bit``: unsloth/models/loader.py ``_get_model_name``, FLOAT_TO_INT_MAPPER):
``Bnb4bitDeserialize`` / ``Params4bit.from_prequantized`` keep the packed weight and its
quantization state as loaded; nothing 16-bit passes through.
"""

from __future__ import annotations

import math
import re

from ..allocator.replay import ALLOC, FREE, replay
from ..config import RunConfig
from ..models.spec import ModelSpec
from .precision import dtypes_for
from .quantized import base_quantization
from .stacks import version_tuple
from .states import lora_targets

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
                "oomless.memory.after_load)"]
    return ["Unsloth's Gemma RoPE tables are counted for releases 2024.3–2024.7 (read from "
            "its gemma.py); for this release they are not counted: --stack-version settles "
            "which loader ran"]


BNB_4BIT_BLOCKSIZE = 64  # bitsandbytes Params4bit default blocksize
BNB_NESTED_BLOCKSIZE = 256  # quantize_4bit: quantize_blockwise(absmax - offset, blocksize=256)
BNB_QUANT_MAP_BYTES = 16 * 4  # the 4-bit code book (16 fp32 values)
BNB_NESTED_MAP_BYTES = 256 * 4  # the dynamic 8-bit map of the nested absmax
ATTENTION_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"})


def natural_key(name: str) -> tuple:
    """transformers' ``dot_natural_key``: dotted parts, numbers compared as numbers."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"\.", name))


def checkpoint_tensors(spec: ModelSpec) -> list[tuple[str, int, str, int]]:
    """(name, elements, linear name or "", rows) of the language model's tensors, in the order
    the loader walks them. Names follow the Llama layout; the vision tower is left out."""
    out = [("model.embed_tokens.weight", spec.embedding_params, "", spec.vocab_size)]
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        for k in range(spec.norms_per_layer):
            name = ("input_layernorm", "post_attention_layernorm")[k] if k < 2 else f"norm_{k}"
            out.append((f"{prefix}{name}.weight", spec.norm_params, "", 1))
        for lin in spec.layer_linears(spec.is_moe_layer(i)):
            group = "self_attn" if lin.name in ATTENTION_NAMES else "mlp"
            for e in range(lin.count):
                expert = f"experts.{e}." if lin.count > 1 else ""
                base = f"{prefix}{group}.{expert}{lin.name}"
                out.append((f"{base}.weight", lin.in_features * lin.out_features, lin.name,
                            lin.out_features))
                if lin.bias:
                    out.append((f"{base}.bias", lin.out_features, "", 1))
    out.append(("model.norm.weight", spec.norm_params, "", 1))
    if not spec.tie_embeddings:
        out.append(("lm_head.weight", spec.lm_head_params, "", spec.vocab_size))
    return sorted(out, key=lambda t: natural_key(t[0]))


def _quantize_4bit_events(n: int, double_quant: bool, key: int) -> list[tuple[str, int, int]]:
    blocks = math.ceil(n / BNB_4BIT_BLOCKSIZE)
    ev = [(ALLOC, key, 2 * n), (ALLOC, key + 1, 4 * blocks), (ALLOC, key + 2, math.ceil(n / 2)),
          (ALLOC, key + 7, BNB_QUANT_MAP_BYTES)]  # get_4bit_type: a code book per call
    if double_quant:
        nested = math.ceil(blocks / BNB_NESTED_BLOCKSIZE)
        ev += [(ALLOC, key + 3, 4), (ALLOC, key + 4, 4 * blocks),  # offset, absmax - offset
               (ALLOC, key + 5, 4 * nested), (ALLOC, key + 6, blocks),  # nested absmax, codes
               (FREE, key + 4, 0), (FREE, key + 1, 0)]
    return ev + [(FREE, key, 0)]


def _quantize_8bit_events(n: int, rows: int, key: int) -> list[tuple[str, int, int]]:
    return [(ALLOC, key, 2 * n), (ALLOC, key + 1, 2 * n),  # 16-bit tensor, its fp16 copy
            (ALLOC, key + 2, 4 * rows), (ALLOC, key + 3, n),  # row statistics, int8 weight
            (FREE, key + 1, 0), (FREE, key, 0)]


def _prequantized_4bit_events(n: int, double_quant: bool, key: int) -> list[tuple[str, int, int]]:
    blocks = math.ceil(n / BNB_4BIT_BLOCKSIZE)
    sizes = [math.ceil(n / 2), BNB_QUANT_MAP_BYTES]
    sizes += ([blocks, 4 * math.ceil(blocks / BNB_NESTED_BLOCKSIZE), BNB_NESTED_MAP_BYTES, 4]
              if double_quant else [4 * blocks])
    return [(ALLOC, key + j, s) for j, s in enumerate(sizes)]


def prequantized_load(spec: ModelSpec, cfg: RunConfig) -> bool:
    """Whether the packed 4-bit weights arrive as they are stored (see the module doc)."""
    return spec.quantization is not None or cfg.stack == "unsloth"


def load_events(spec: ModelSpec, cfg: RunConfig,
                kept_after: tuple[int, ...] = ()) -> list[tuple[str, int, int]] | None:
    """The loader's alloc/free stream for a bitsandbytes QLoRA base (None for any other
    run, and for mixture-of-experts models, whose experts transformers 5 loads through
    weight converters into fused parameters: not read here), then ``kept_after``: tensors created after loading that stay (adapters, tables)."""
    q = base_quantization(spec, cfg)
    if q is None or q.method != "bitsandbytes" or q.bits not in (4, 8) or spec.is_moe:
        return None
    pre = prequantized_load(spec, cfg)
    events: list[tuple[str, int, int]] = []
    if q.bits == 4 and q.double_quant and not pre:  # name2qmap["dynamic"], once
        events.append((ALLOC, -1, BNB_NESTED_MAP_BYTES))
    key = 0
    for _name, n, linear, rows in checkpoint_tensors(spec):
        key += 8
        if not linear or q.skips(linear):
            events.append((ALLOC, key, 2 * n))
        elif q.bits == 8:
            events += ([(ALLOC, key, n), (ALLOC, key + 1, 4 * rows)] if pre
                       else _quantize_8bit_events(n, rows, key))
        elif pre:
            events += _prequantized_4bit_events(n, q.double_quant, key)
        else:
            events += _quantize_4bit_events(n, q.double_quant, key)
    for size in kept_after:
        key += 8
        events.append((ALLOC, key, size))
    return events


def reserved_after_load(spec: ModelSpec, cfg: RunConfig,
                        kept_after: tuple[int, ...] = ()) -> dict[str, int] | None:
    """Allocated and reserved bytes once the weights (and ``kept_after``) are on the GPU,
    from the replay; None where the base is not a bitsandbytes QLoRA base."""
    events = load_events(spec, cfg, kept_after)
    if events is None:
        return None
    rep = replay(events)
    return {"allocated_bytes": rep.final_allocated_bytes,
            "reserved_bytes": rep.final_reserved_bytes,
            "peak_reserved_bytes": rep.peak_reserved_bytes}


def load_assumption(spec: ModelSpec, cfg: RunConfig, figures: dict[str, int]) -> str:
    cached = figures["reserved_bytes"] - figures["allocated_bytes"]
    how = ("pre-quantized weights loaded as stored" if prequantized_load(spec, cfg) else
           "each 16-bit tensor loaded on the GPU, quantized there and freed (transformers' "
           "one-at-a-time loading for on-the-fly quantization)")
    return (f"after loading: {figures['reserved_bytes'] / 2**30:.2f} GiB reserved, "
            f"{cached / 2**20:,.0f} MiB of it cached but free ({how}; the loader's "
            "allocations replayed through the caching-allocator model: "
            "oomless.memory.after_load)")


def after_load_tensors(spec: ModelSpec, cfg: RunConfig) -> tuple[int, ...]:
    """Tensors created once the weights are loaded and kept through training: Unsloth's
    per-layer RoPE tables (cos and sin, memory.after_load) and PEFT's LoRA A and B of
    every wrapped linear, in their trainable dtype (PEFT moves each to the base layer's
    device as it creates it)."""
    out: list[int] = []
    tables = unsloth_rope_table_bytes(spec, cfg)
    if tables:
        out += [tables // (2 * spec.num_layers)] * (2 * spec.num_layers)
    if cfg.method in ("lora", "qlora"):
        targets = lora_targets(spec, cfg.lora.targets)
        elem = dtypes_for(cfg).trainable_bytes
        for i in range(spec.num_layers):
            for lin in spec.layer_linears(spec.is_moe_layer(i)):
                if lin.name in targets:
                    out += [elem * cfg.lora.r * lin.in_features,
                            elem * lin.out_features * cfg.lora.r] * lin.count
    return tuple(out)
