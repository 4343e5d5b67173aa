"""Activation memory: the tensors autograd keeps for backward, per layer.

Method: walk a decoder layer as HF transformers runs it (Llama/Qwen2 style:
RMSNorm → q,k,v → RoPE → attention → o → residual; RMSNorm → gate/up → act ·
up → down → residual) and add, per op, the tensors its backward formula saves
(PyTorch tools/autograd/derivatives.yaml: mul saves the *other* operand only if
this operand needs a gradient; linear saves its input only for a weight
gradient; SiLU/GELU save their input; softmax saves its output). Tensors saved
by several ops are counted once. This generalises Korthikanti et al. 2022
(arXiv 2205.05198, sbh(34 + 5as/h)) to GQA, gated MLPs, RMSNorm in fp32,
frozen weights (LoRA) and flash/SDPA kernels.

Under torch.compile the walk does not apply: see "torch.compile" at the end of this
module (:func:`compiled_layer_bytes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources

from ..allocator import fresh_block_bytes
from ..config import RunConfig
from ..models.spec import ModelSpec
from . import constants as C
from .gemma import effective_attn, rms_normed_bytes, softcap_scores_bytes
from .precision import Dtypes


@dataclass(frozen=True)
class LayerPlan:
    """What is trainable in a layer and how attention runs."""

    trainable: frozenset[str]  # linear names whose weight is trained (full FT)
    lora: frozenset[str]  # linear names wrapped by LoRA
    lora_r: int
    lora_dropout: bool
    norm_trainable: bool
    attn: str  # eager | sdpa | flash
    # LoRA-wrapped linears whose PEFT layer passes its input uncast under autocast (over
    # a quantized module: memory/quantized.py, TrainingKernel.peft_casts_input)
    lora_uncast: frozenset[str] = frozenset()


# What an activation saves for backward, one entry per tensor: "in" a tensor of the
# MLP's dtype, "fp32@autocast" one that is fp32 under autocast. A fused kernel (SiLU,
# GELU, gelu_pytorch_tanh) keeps its input. The Python formulas of transformers/
# activations.py keep their intermediates (derivatives.yaml: pow keeps its input, tanh and
# sigmoid their output, a product both operands, a product or sum with a Python number
# nothing). NewGELUActivation (gelu_new, GPT-2/Phi; AccurateGELUActivation, GELUTanh's
# Python path alike) = 0.5·x·(1 + tanh(√(2/π)(x + 0.044715·pow(x, 3)))) keeps x (pow),
# tanh's output, 1 + tanh and 0.5·x. Under CUDA autocast pow is on the fp32 list
# (aten/src/ATen/autocast_mode.h AT_FORALL_FP32): pow keeps an fp32 copy of x, and the
# fp32 result promotes tanh's output, 1 + tanh and the activation's output to fp32;
# 0.5·x stays 16-bit. FastGELUActivation = 0.5·x·(1 + tanh(x·0.7978845608·(1 + 0.044715·x·x)))
# has no pow: it keeps x, 0.044715·x, x·0.7978845608, 1 + 0.044715·x², tanh's output,
# 1 + tanh and 0.5·x, all 16-bit. QuickGELUActivation (CLIP, Qwen2-VL towers)
# x·sigmoid(1.702·x) keeps x and the sigmoid's output. GELUActivation's Python path
# (gelu_python) 0.5·x·(1 + erf(x/√2)) keeps x/√2, 0.5·x and 1 + erf (erf is not on the list).
_GELU_TANH_POW = ("fp32@autocast", "fp32@autocast", "fp32@autocast", "in")
ACT_SAVED: dict[str, tuple[str, ...]] = {
    "gelu_new": _GELU_TANH_POW, "gelu_accurate": _GELU_TANH_POW,
    "gelu_python_tanh": _GELU_TANH_POW, "gelu_fast": ("in",) * 7, "quick_gelu": ("in",) * 2,
    "gelu_python": ("in",) * 3}
FUSED_ACT_SAVED = ("in",)


def act_saved_bytes(act: str, mlp_bytes: int, autocast: bool) -> tuple[list[int], int]:
    """Element sizes of the tensors activation ``act`` keeps for backward, and of its
    output (ACT_SAVED)."""
    entries = ACT_SAVED.get(act, FUSED_ACT_SAVED)
    up = autocast and "fp32@autocast" in entries
    sizes = [4 if up and e == "fp32@autocast" else mlp_bytes for e in entries]
    return sizes, 4 if up else mlp_bytes


def act_assumption(act: str, autocast: bool) -> str | None:
    """The activation's saved tensors, named in the estimate's assumptions (None: a
    fused kernel keeping its input)."""
    if act not in ACT_SAVED:
        return None
    sizes, out = act_saved_bytes(act, 2, autocast)
    up = " (pow runs in fp32 under CUDA autocast: the fp32 result promotes the rest)" \
        if out == 4 else ""
    return (f"{act} is a Python formula (transformers/activations.py): it keeps "
            f"{len(sizes)} tensors for backward, {sizes.count(4)} of them fp32{up}")


# Towers without rotary embeddings: q, k and v are views of one fused projection's output.
# With rotary embeddings (decoders, Qwen2-VL's tower) q and k are rotated copies and v
# stays a view of the fused output, which keeps all of it alive.
NO_ROTARY_MODEL_TYPES = frozenset({"clip_vision", "eva2clip_vision"})


class _Saved:
    """Saved tensors by identity: the same tensor saved twice counts once. Each counts
    the block the caching allocator gives it (a large tensor's segment rounding)."""

    def __init__(self) -> None:
        self.by_name: dict[str, float] = {}

    def add(self, name: str, n_bytes: float) -> None:
        self.by_name[name] = fresh_block_bytes(n_bytes)

    @property
    def total(self) -> float:
        return sum(self.by_name.values())


def norm_out_bytes(dt: Dtypes, norm_type: str) -> int:
    """dtype of a norm's output: HF RMSNorm returns the input dtype (fp32 when its
    weight is fp32: weight · x promotes); LayerNorm runs in fp32 under autocast
    (autocast's fp32 op list)."""
    return 4 if (norm_type == "layer" and dt.autocast) or dt.norm_fp32 else dt.resid_bytes


def _norm(saved: _Saved, tag: str, t: int, width: int, dt: Dtypes, plan: LayerPlan,
          norm_type: str, normed_bytes: int | None = None) -> None:
    """HF RMSNorm computes in fp32: pow and mul keep the fp32 input (4 B); a
    trained weight also keeps the normalised tensor. LayerNorm keeps its input
    plus per-row mean and rstd: fp32 under autocast (its fp32 op list casts the
    input), the tensor's own dtype without autocast."""
    in_bytes = 4 if norm_type == "rms" or dt.autocast or dt.norm_fp32 else dt.resid_bytes
    saved.add(f"{tag}.in_fp32", in_bytes * t * width)
    saved.add(f"{tag}.stats", 4 * t * 2)
    if plan.norm_trainable and norm_type == "rms":
        saved.add(f"{tag}.normed", (normed_bytes or dt.resid_bytes) * t * width)


def _linear_input(saved: _Saved, name: str, src: str, t: int, width: int, dt: Dtypes,
                  plan: LayerPlan, src_bytes: int) -> None:
    """The input a linear keeps: for its own weight grad (trained), and for a
    LoRA branch (lora_A keeps its (dropped-out) input, lora_B keeps lora_A's output)."""
    cast = dt.autocast and src_bytes != dt.act_bytes  # autocast casts an fp32 input per call
    if name in plan.trainable:
        key = f"{src}.cast.{name}" if cast else src
        saved.add(key, dt.act_bytes * t * width)
    if name in plan.lora:
        # PEFT casts the input to the adapter dtype (peft/tuners/lora/layer.py
        # Linear.forward, _cast_input_dtype): under autocast (fp32 adapters) lora_A
        # then casts it back, so each LoRA module keeps its own 16-bit copy; without
        # autocast it keeps the adapter-dtype copy itself (none when the dtypes agree).
        # Over bitsandbytes linears PEFT skips the cast under autocast
        # (peft/tuners/lora/bnb.py: requires_conversion = not torch.is_autocast_enabled()):
        # lora_A keeps the input itself, or autocast's per-call cast of an fp32 input.
        if dt.autocast:
            own_copy = name not in plan.lora_uncast and dt.trainable_bytes != dt.act_bytes
            in_bytes = dt.act_bytes
        else:
            own_copy, in_bytes = dt.trainable_bytes != src_bytes, dt.trainable_bytes
        if plan.lora_dropout:
            # CUDA native_dropout keeps a 1-byte mask; lora_A keeps the dropped copy.
            saved.add(f"{src}.dropmask.{name}", 1 * t * width)
            saved.add(f"{src}.dropped.{name}", in_bytes * t * width)
        else:
            key = f"{src}.lora_in.{name}" if own_copy else (f"{src}.cast.{name}" if cast else src)
            saved.add(key, in_bytes * t * width)
        out_bytes = dt.act_bytes if dt.autocast else dt.trainable_bytes
        saved.add(f"{name}.lora_a_out", out_bytes * t * plan.lora_r)


def lora_input_note(plan: LayerPlan) -> str:
    """What the LoRA adapters keep of their input under autocast (``_linear_input``)."""
    copied, shared = sorted(plan.lora - plan.lora_uncast), sorted(plan.lora & plan.lora_uncast)
    out = ""
    if copied:
        out += (f"; {', '.join(copied)}: each adapter keeps its own 16-bit copy of its input "
                "(PEFT casts it to fp32, autocast casts it back)")
    if shared:
        out += (f"; {', '.join(shared)}: the adapters keep the 16-bit input itself (PEFT's "
                "LoRA layer over a quantized module casts only without autocast)")
    return out


def _weight_casts(saved: _Saved, spec: ModelSpec, dt: Dtypes, plan: LayerPlan,
                  moe_layer: bool) -> None:
    """Autocast caches a 16-bit copy of every fp32 leaf weight it casts, and the
    matmul keeps it for backward (torch/csrc/autograd autocast cache): with
    fp32 trained weights (AMP full fine-tuning) one copy of each linear weight
    of the layer; with fp32 LoRA adapters, one copy of the adapters."""
    if not dt.autocast or dt.trainable_bytes == dt.act_bytes:
        return
    lins = spec.layer_linears(moe_layer)
    if plan.trainable:
        n = sum(lin.weight_params for lin in lins if lin.role != "router")
    else:
        n = sum(plan.lora_r * (lin.in_features + lin.out_features) * lin.count
                for lin in lins if lin.name in plan.lora and lin.role not in ("expert", "router"))
    saved.add("weight_casts", dt.act_bytes * n)


def _attention(saved: _Saved, spec: ModelSpec, b: int, s: int, dt: Dtypes,
               plan: LayerPlan) -> None:
    t = b * s
    a = dt.attn
    q, kv, nh = spec.q_dim, spec.kv_dim, spec.num_heads
    if spec.qk_norm:  # Qwen3, Gemma-3: RMSNorm over head_dim on q and k, fp32 inside
        saved.add("q_norm.in_fp32", 4 * t * q)
        saved.add("k_norm.in_fp32", 4 * t * kv)
        if plan.norm_trainable:  # the normalised q and k, for the weight's gradient
            saved.add("q_norm.normed", rms_normed_bytes(spec, a) * t * q)
            saved.add("k_norm.normed", rms_normed_bytes(spec, a) * t * kv)
    if plan.attn == "eager":
        # q·kᵀ keeps q and the repeated k; softmax keeps its fp32 output; its
        # 16-bit copy is kept by probs·v together with the repeated v.
        saved.add("attn.q", a * t * q)
        saved.add("attn.k_rep", a * t * q)
        saved.add("attn.v_rep", a * t * q)
        saved.add("attn.probs_fp32", 4 * b * nh * s * s)
        saved.add("attn.probs", a * b * nh * s * s)
        saved.add("attn.softcap_tanh", softcap_scores_bytes(spec, b, s, dt, plan.attn))
    else:
        # Flash / memory-efficient kernels keep q, k, v, the output and the
        # fp32 log-sum-exp (no s² matrix); GQA runs natively (enable_gqa).
        saved.add("attn.q", a * t * q)
        saved.add("attn.k", a * t * kv)
        fused_view = spec.fused_qkv and spec.model_type not in NO_ROTARY_MODEL_TYPES
        saved.add("attn.v", a * t * ((q + 2 * kv) if fused_view else kv))
        saved.add("attn.out", a * t * q)
        saved.add("attn.lse", C.LSE_BYTES * b * nh * s)
    # The output goes to o_proj as (b, s, heads·dim): flash/SDPA kernels already
    # return it in that memory layout, so .contiguous() is a no-op and o_proj
    # keeps the same storage; eager's matmul output is transposed into a copy.
    ctx = "attn.ctx" if plan.attn == "eager" else "attn.out"
    _linear_input(saved, "o_proj", ctx, t, q, dt, plan, a)


def _mlp(saved: _Saved, spec: ModelSpec, tokens: int, width: int, dt: Dtypes,
         plan: LayerPlan, src: str, src_bytes: int, role: str) -> None:
    """A gated (act(gate)·up → down) or plain (act(up) → down) MLP on ``tokens`` rows."""
    a, h = dt.mlp, spec.hidden_size
    if not spec.mlp_gated:
        first = ["up_proj"]
    elif spec.fused_gate_up:
        first = ["gate_up_proj"]
    else:
        first = ["gate_proj", "up_proj"]
    for name in first:
        _linear_input(saved, name, src, tokens, h, dt, plan, src_bytes)
    act_sizes, out_bytes = act_saved_bytes(spec.hidden_act, a, dt.autocast)
    for i, size in enumerate(act_sizes):  # what the activation keeps (its input, or more)
        saved.add(f"{role}.act{i}", size * tokens * width)
    if spec.mlp_gated:
        saved.add(f"{role}.act_out", out_bytes * tokens * width)  # kept by the product
        saved.add(f"{role}.up_out", a * tokens * width)  # kept by the product
    # down's input (the product, or the activation output) is kept only for
    # down's own weight gradient or its LoRA branch.
    _linear_input(saved, "down_proj", f"{role}.prod", tokens, width, dt, plan,
                  max(out_bytes, a))


def layer_activation_bytes(spec: ModelSpec, b: int, s: int, dt: Dtypes, plan: LayerPlan,
                           moe_layer: bool = False) -> float:
    """Bytes autograd keeps for one decoder layer's backward."""
    return _layer_saved(spec, b, s, dt, plan, moe_layer).total


def layer_saved_blocks(spec: ModelSpec, b: int, s: int, dt: Dtypes, plan: LayerPlan,
                       moe_layer: bool = False) -> tuple[int, ...]:
    """The blocks of layer_activation_bytes, one per saved tensor, in the order the
    layer's forward makes them."""
    out: list[int] = []
    for name, n in _layer_saved(spec, b, s, dt, plan, moe_layer).by_name.items():
        if name == "weight_casts":  # autocast casts each weight when its linear runs
            out += [round(fresh_block_bytes(c)) for c in _cast_sizes(spec, dt, plan, moe_layer)]
        elif n:
            out.append(round(n))
    return tuple(out)


def layer_cast_blocks(spec: ModelSpec, dt: Dtypes, plan: LayerPlan) -> tuple[int, ...]:
    """The 16-bit copies autocast makes of one layer's fp32 trained weights (none
    without autocast or when they are already 16-bit), see _weight_casts."""
    if not dt.autocast or dt.trainable_bytes == dt.act_bytes:
        return ()
    return tuple(round(fresh_block_bytes(c)) for c in _cast_sizes(spec, dt, plan, False))


def _cast_sizes(spec: ModelSpec, dt: Dtypes, plan: LayerPlan, moe_layer: bool) -> list[int]:
    """One 16-bit copy per weight _weight_casts counts, in the layer's order."""
    lins = spec.layer_linears(moe_layer)
    if plan.trainable:
        return [dt.act_bytes * lin.weight_params for lin in lins if lin.role != "router"]
    return [dt.act_bytes * plan.lora_r * f * lin.count for lin in lins
            if lin.name in plan.lora and lin.role not in ("expert", "router")
            for f in (lin.in_features, lin.out_features)]


def _layer_saved(spec: ModelSpec, b: int, s: int, dt: Dtypes, plan: LayerPlan,
                 moe_layer: bool) -> _Saved:
    saved = _Saved()
    t = b * s
    h = spec.hidden_size
    _weight_casts(saved, spec, dt, plan, moe_layer)
    normed = rms_normed_bytes(spec, dt.resid_bytes)
    _norm(saved, "norm1", t, h, dt, plan, spec.norm_type, normed)
    qkv = ["qkv_proj"] if spec.fused_qkv else ["q_proj", "k_proj", "v_proj"]
    nb = norm_out_bytes(dt, spec.norm_type)
    for name in qkv:
        _linear_input(saved, name, "x_norm1", t, h, dt, plan, nb)
    _attention(saved, spec, b, s, dt, plan)
    if spec.norms_per_layer > 1:  # Phi-2's parallel block shares one norm
        _norm(saved, "norm2", t, h, dt, plan, spec.norm_type, normed)
        if spec.norms_per_layer >= 4:  # Gemma-2 post-attention / post-MLP norms
            _norm(saved, "norm3", t, h, dt, plan, spec.norm_type, normed)
            _norm(saved, "norm4", t, h, dt, plan, spec.norm_type, normed)
    if spec.resid_dropout:  # Phi-2: dropout on the attention and MLP outputs keeps its masks
        saved.add("resid_dropout.attn_mask", 1 * t * h)  # CUDA native_dropout: bool mask
        saved.add("resid_dropout.mlp_mask", 1 * t * h)
    src = "x_norm2" if spec.norms_per_layer > 1 else "x_norm1"
    if not moe_layer:
        _mlp(saved, spec, t, spec.intermediate_size, dt, plan, src, nb, "mlp")
    else:
        k, e = spec.experts_per_token, spec.num_experts
        saved.add("router.probs_fp32", 4 * t * e)
        # each routed token's expert output is scaled by its router weight:
        # the product keeps the expert output (t·k rows of hidden_size).
        saved.add("experts.weighted", dt.act_bytes * t * k * h)
        expert_plan = replace(plan, lora=frozenset())  # experts are not nn.Linear
        _mlp(saved, spec, t * k, spec.moe_intermediate_size, dt, expert_plan, "experts.gathered_in",
             dt.act_bytes, "experts")
        if spec.shared_expert_intermediate_size:
            _mlp(saved, spec, t, spec.shared_expert_intermediate_size, dt, plan, src, nb,
                 "shared")
    return saved


# ---- torch.compile ------------------------------------------------------------------
# What a compiled region saves for backward, from the partitioner's trace.
#
# With ``torch.compile`` AOTAutograd traces each compiled region's joint forward and
# backward, and ``torch._functorch.partitioners.min_cut_rematerialization_partition``
# picks the tensors handed to the backward: cheap pointwise results (a norm's normalised
# output before the weight, SiLU × mul, fp32 upcasts) are recomputed instead of saved,
# and inductor fuses the pointwise kernels so their buffers never exist. torchtune
# compiles every decoder layer and its chunked loss (pytorch/torchtune@bd2a0fc
# training/_compile.py ``compile_model``, ``compile_loss``).
#
# The saved tensors are not a formula here: oomless/data/compiled_saved.json holds them
# as the partitioner chose them for the decoder layer of Llama, Mistral, Qwen2 and Qwen3
# (transformers' classes; full, frozen, LoRA on every linear) and
# one chunk of torchtune's cross-entropy, each as a width per token (a model dimension)
# and an element size, written by ``benchmarks/compiled_partition.py`` from
# :func:`oomless.runtime.trace.compiled.partition_saved` and checked against a fresh
# trace by the tests. This module evaluates the table at a model's dimensions.


@cache
def compiled_table() -> dict:
    text = resources.files("oomless.data").joinpath("compiled_saved.json").read_text("utf-8")
    return json.loads(text)


def width_of(spec: ModelSpec, cfg: RunConfig, width: str) -> int:
    """A saved tensor's elements per token at this model's dimensions."""
    return {"1": 1, "hidden": spec.hidden_size, "intermediate": spec.intermediate_size,
            "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "q_width": spec.q_dim, "kv_width": spec.kv_dim, "vocab": spec.vocab_size,
            "lora_r": cfg.lora.r}[width]


def _element_bytes(row: dict, act_bytes: int) -> int:
    """16-bit entries take the run's activation dtype; fp32 statistics and int64 labels
    keep theirs."""
    return act_bytes if row["bytes"] == 2 else row["bytes"]


def layer_region(spec: ModelSpec, cfg: RunConfig) -> str | None:
    """The traced layer of this model's family and method, or None (not traced: the
    eager walk stands, said in the assumptions)."""
    kind = "full" if cfg.method == "full" else "lora" if cfg.method in ("lora", "qlora",
                                                                         "dora") else None
    region = f"{spec.model_type}-layer-{kind}"
    fused = effective_attn(spec, cfg.attn) != "eager"  # traced with SDPA (lse, not scores)
    return region if kind and fused and not spec.is_moe and \
        region in compiled_table()["regions"] else None


def compiled_layer_bytes(spec: ModelSpec, cfg: RunConfig, act_bytes: int,
                         tokens: int) -> int | None:
    """Bytes one compiled decoder layer saves for backward over ``tokens`` tokens: every
    tensor the partitioner keeps, the layer's input included, the RoPE tables (shared by
    all layers, counted once elsewhere) left out; None when the family was not traced."""
    region = layer_region(spec, cfg)
    if region is None:
        return None
    rows = compiled_table()["regions"][region]
    return sum(_element_bytes(r, act_bytes) * width_of(spec, cfg, r["width"]) * tokens
               for r in rows if not (r["input"] and r["width"] == "head_dim"))


def compiled_chunk_loss_bytes(t: int, act_bytes: int) -> dict[str, int]:
    """Per-token bytes one compiled chunk of torchtune's cross-entropy saves, split into
    its 16-bit logits input ("logits", per vocabulary entry: the model's own logits,
    kept alive by the save), the labels input and the fp32 per-row statistics."""
    rows = compiled_table()["regions"]["chunked-ce"]
    out = {"logits": 0, "labels": 0, "rows": 0}
    for r in rows:
        key = "logits" if r["width"] == "vocab" else "labels" if r["input"] else "rows"
        out[key] += _element_bytes(r, act_bytes) * t
    return out


def compiled_assumption(spec: ModelSpec, cfg: RunConfig, chunked_loss: bool) -> str:
    region = layer_region(spec, cfg)
    layer = (f"each decoder layer saves what the partitioner kept for {region}"
             if region else f"decoder layers: no partitioner trace for {spec.model_type} "
             f"{cfg.method} with {effective_attn(spec, cfg.attn)} attention (the eager saved "
             "tensors are counted: an upper bound)")
    if region and cfg.method != "full":
        layer += (" (LoRA traced on every linear, an upper bound for fewer targets"
                  + ("; the 4-bit base traced as 16-bit linears" if cfg.method == "qlora"
                     else "") + ")")
    loss = ("; the chunked loss saves its 16-bit logits and per-row fp32 statistics instead "
            "of fp32 log-probabilities" if chunked_loss else "")
    return f"torch.compile: {layer}{loss} ({compiled_table()['source']})"
