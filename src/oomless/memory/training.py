"""Analytic training-memory model: per GPU, per phase, by category.

Phases: forward (end of the forward, loss computed), backward (its peak),
optimizer (the step), evaluation (eval forward) and generation
(predict_with_generate). Steady state: the optimizer already holds its
states (step ≥ 2), as in any real run after the first step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from ..config import RunConfig
from ..models.hardware import Cluster
from ..models.spec import ModelSpec
from ..result import MemoryEstimate
from . import constants as C
from .activations import (
    LayerPlan,
    act_assumption,
    compiled_assumption,
    compiled_layer_bytes,
    layer_activation_bytes,
    lora_input_note,
)
from .after_load import (
    after_load_tensors,
    load_assumption,
    reserved_after_load,
    unsloth_load_assumptions,
    unsloth_rope_table_bytes,
)
from .gemma import effective_attn, gemma_assumptions, is_sliding_layer, sliding_mask_bytes
from .loss_paths import head_saved_blocks, largest_logits_block_bytes
from .loss_paths import logits_bytes as stack_logits_bytes
from .moe_lora import merged_expert_saved_bytes, moe_lora_assumptions
from .overheads import StepKit, finish_estimate, late_dense_block_bytes, streamed_reserve_bytes
from .ppo import PpoKit, ppo_phases
from .precision import Dtypes, dtypes_for
from .quantized import lora_input_kept_uncast as _kept_uncast
from .quantized import quantization_assumptions, saved_dequant_bytes, transient_dequant_bytes
from .stacks import FP32_GROUPS_ALL, stack_assumptions, stack_effects
from .stages import (
    StagePlan,
    head_bytes,
    reference_head_bytes,
    reference_rows,
    separate_reference_params,
    stage_assumptions,
    stage_plan,
)
from .states import States, fp32_upcast_params, lora_targets, model_states
from .vision import (
    copies_saved_bytes,
    image_tokens,
    merged_input_bytes,
    pixel_bytes,
    tower_forward_bytes,
    tower_plan,
    tower_saved_bytes,
    vision_assumptions,
)


def llm_seq_len(spec: ModelSpec, cfg: RunConfig) -> int:
    """Tokens per sample the language model runs on: text plus image tokens."""
    images = cfg.data.images_per_sample if spec.vision else 0
    return cfg.seq_len + images * image_tokens(spec, cfg)


def layer_plan(spec: ModelSpec, cfg: RunConfig) -> LayerPlan:
    names = spec.cached("linear_names", lambda: frozenset(lin.name for lin in spec.layer_linears()))
    full = cfg.method == "full"
    targets = cfg.lora.targets
    key = ("lora_targets", targets if isinstance(targets, str) else tuple(targets))
    lora = frozenset() if full else spec.cached(key, lambda: frozenset(lora_targets(spec, targets)))
    return LayerPlan(
        trainable=names if full else frozenset(),
        lora=lora,
        lora_uncast=frozenset(n for n in lora if _kept_uncast(spec, cfg, n)),
        lora_r=cfg.lora.r,
        lora_dropout=cfg.lora.dropout > 0,
        norm_trainable=full,
        attn=effective_attn(spec, cfg.attn),
    )


def saved_activation_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, b: int, s: int) -> dict:
    """Activations alive at the end of the forward, and one layer's worth (for
    recomputation under gradient checkpointing)."""
    plan = layer_plan(spec, cfg)
    dense = _layer_bytes(spec, b, s, dt, plan, False)
    if stack_effects(cfg).compiled:  # torch.compile: the partitioner's saved tensors
        dense = compiled_layer_bytes(spec, cfg, dt.act_bytes, b * s) or dense
    moe = 0
    if spec.is_moe:  # + PEFT's merged expert copies when LoRA wraps the fused experts
        moe = _layer_bytes(spec, b, s, dt, plan, True) + merged_expert_saved_bytes(
            spec, cfg, dt, b * s)
    n_moe = spec.num_moe_layers
    tower = tower_saved_bytes(spec, cfg, dt)  # a trained vision tower's layers
    one_layer = max(dense, moe, tower["one_layer"])
    t = b * s
    # Shared by all layers: RoPE cos/sin (b, s, head_dim) in the residual stream's dtype;
    # the final norm's fp32 input; lm_head's input (and its autocast weight copy) when
    # lm_head is trained; what modules_to_save copies keep (vision.copies_saved_bytes).
    shared = (2 * dt.resid_bytes * t * spec.head_dim + 4 * t * spec.hidden_size
              + copies_saved_bytes(spec, cfg, dt, t))
    head = head_saved_blocks(spec, cfg, dt, t)  # a trained lm_head's input and weight copy
    shared += sum(head)
    if not head and not cfg.grad_ckpt and tower_plan(spec, cfg) is None:
        # Frozen embeddings: nothing before the first adapter needs a gradient,
        # so the first layer's input norm keeps nothing (with checkpointing HF
        # makes the embedding output require grad, enable_input_require_grads).
        shared -= 4 * t * spec.hidden_size + 4 * t * 2
    if effective_attn(spec, cfg.attn) == "eager":
        shared += dt.act_bytes * b * s * s  # additive causal mask (b, 1, s, s)
    masks, mask_one = sliding_mask_bytes(spec, b, s, dt, plan.attn)
    one_layer += mask_one
    if cfg.grad_ckpt:
        # Each layer keeps only its input (the residual stream); one layer is
        # recomputed at a time during backward (Chen et al. 2016; HF
        # gradient_checkpointing). Offloaded checkpointing (stacks.py) keeps the
        # inputs in host RAM and one layer's on the GPU.
        on_gpu = 1 if stack_effects(cfg).offload_checkpoints else spec.num_layers
        layers = on_gpu * dt.resid_bytes * t * spec.hidden_size
    else:
        layers = (spec.num_layers - n_moe) * dense + n_moe * moe + masks
    # 16-bit weights a dequantize-then-matmul kernel keeps for backward (GPTQ)
    dequant = saved_dequant_bytes(spec, cfg, dt)
    return {"layers": layers + shared + tower["layers"] + dequant["layers"],
            "one_layer": one_layer + dequant["one_layer"]}


def _layer_bytes(spec: ModelSpec, b: int, s: int, dt: Dtypes, plan: LayerPlan,
                 moe_layer: bool) -> float:
    """layer_activation_bytes, memoised on the spec (the planner evaluates the
    same layer for many ZeRO/optimizer variants): same arguments, same result."""
    return spec.cached(("layer_activation_bytes", b, s, dt, plan, moe_layer),
                       lambda: layer_activation_bytes(spec, b, s, dt, plan, moe_layer=moe_layer))


def forward_transient_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, t: int) -> float:
    """What the last layer's MLP holds for a moment in the forward, beyond what it saves:
    the activation product on its way into down_proj and, when LoRA wraps down_proj under
    autocast, PEFT's fp32 copy of it for the fp32 adapter (peft/tuners/lora/layer.py
    ``_cast_input_dtype``). It is the forward's peak when no logits follow (reward model)."""
    width = max(spec.intermediate_size, spec.moe_intermediate_size * spec.experts_per_token)
    lora_down = "down_proj" in layer_plan(spec, cfg).lora
    # PEFT's fp32 down_proj adapter takes an fp32 copy of its input under autocast, unless
    # its layer passes the input uncast (bitsandbytes' Linear4bit, quantized.KERNELS)
    fp32_copy = 4 if (lora_down and dt.autocast and dt.trainable_bytes == 4
                      and not _kept_uncast(spec, cfg, "down_proj")) else 0
    product = dt.act_bytes if lora_down else 0  # otherwise down_proj keeps it (saved)
    return (fp32_copy + product) * t * width + 2 * dt.resid_bytes * t * spec.hidden_size


def backward_transient_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, t: int) -> float:
    """Gradients of one layer's intermediates while it back-propagates: the
    MLP's three (t × intermediate) grads plus two residual-stream grads; under
    full fine-tuning also one weight gradient in 16-bit before accumulation;
    a quantized base dequantises one weight to 16-bit (memory/quantized.py)."""
    width = spec.moe_intermediate_size * spec.experts_per_token if spec.is_moe else 0
    width = max(width, spec.intermediate_size)
    tr = 3 * dt.mlp * t * width + 2 * dt.resid_bytes * t * spec.hidden_size
    biggest = max(lin.weight_params // lin.count for lin in spec.layer_linears())
    if cfg.method == "full":
        tr += dt.act_bytes * biggest
    return tr + transient_dequant_bytes(spec, cfg, dt)


def largest_block_bytes(spec: ModelSpec, cfg: RunConfig) -> int:
    """The largest tensor a training step allocates and frees: the fp32 logits
    block of the loss (4·tokens·vocab) or a tied embedding's dense gradient."""
    t = cfg.micro_batch_size * llm_seq_len(spec, cfg)
    logits = largest_logits_block_bytes(spec, cfg, t)
    return round(max(logits, embedding_grad_bytes(spec, cfg, dtypes_for(cfg))))


def embedding_grad_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> float:
    """The embedding's backward writes a dense (vocab × hidden) gradient (aten
    embedding_dense_backward). Untied, it is the .grad itself; tied, lm_head's gradient
    already waits in autograd's input buffer and the engine adds this one into it in
    place (torch/csrc/autograd/input_buffer.cpp ``accumulate``, ``old_var.add_(var)``):
    one vocab × hidden temporary, as a measured H200 allocator stream shows."""
    if cfg.method != "full" or not spec.tie_embeddings:
        return 0
    return dt.grad_bytes * spec.vocab_size * spec.hidden_size


def eval_forward_bytes(spec: ModelSpec, dt: Dtypes, b: int, s: int, attn: str) -> float:
    """No-grad forward: one layer's intermediates at a time plus the loss's logits."""
    t = b * s
    width = max(spec.intermediate_size, spec.moe_intermediate_size * spec.experts_per_token)
    layer = t * (3 * dt.mlp * width + dt.attn * (2 * spec.q_dim + 2 * spec.kv_dim))
    attn = effective_attn(spec, attn)
    if attn == "eager":
        scores = 2 if spec.attn_logit_softcap else 1  # the soft-capped copy of the scores
        layer += (4 + scores * dt.act_bytes) * b * spec.num_heads * s * s
    return layer + dt.resid_bytes * t * spec.hidden_size


def kv_cache_bytes(spec: ModelSpec, batch: int, tokens: int, elem_bytes: int) -> int:
    """K and V for every layer: 2 · layers · kv_heads · head_dim per token
    (sliding-window layers keep at most the window)."""
    per_layer_tokens = (min(tokens, spec.sliding_window) if is_sliding_layer(spec, i) else tokens
                        for i in range(spec.num_layers))
    return 2 * batch * spec.kv_dim * elem_bytes * sum(per_layer_tokens)


class _MicroStep(NamedTuple):
    """One micro batch of the policy's step: its shape and the bytes every phase reads."""

    plan: StagePlan  # rm/dpo/kto/orpo/simpo: rows per sample, head, reference
    tokens: int  # in the forward: micro batch × rows per sample × seq_len
    seq_len: int  # tokens per sequence in the language model
    acts: dict  # saved_activation_bytes
    head: dict | None  # the stage's own loss head (None: the causal-LM loss)
    logits: dict  # the logits region's bytes: "forward", "backward", "held"


def _phases(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, persistent: dict, grads: dict,
            step_only: dict) -> dict[str, dict[str, int]]:
    plan = stage_plan(cfg)
    b, s = cfg.micro_batch_size * plan.rows, llm_seq_len(spec, cfg)
    head = head_bytes(spec, cfg, dt, plan, cfg.micro_batch_size, s)
    logits = stack_logits_bytes(spec, cfg, dt, b * s, rows=b) if head is None else {
        "forward": head["forward_peak"], "backward": head["backward"], "held": 0}
    step = _MicroStep(plan, b * s, s, saved_activation_bytes(spec, cfg, dt, b, s), head, logits)
    before = {**persistent, **(grads if cfg.grad_accum > 1 else {})}  # + accumulated gradients
    # outputs a stack keeps alive until the next forward has returned (custom loop)
    held = {"logits": logits["held"]} if logits["held"] else {}
    phases: dict[str, dict[str, int]] = {
        "forward": _forward_peak(spec, cfg, dt, step, before),
        "backward": _backward_peak(spec, cfg, dt, step, before, {**persistent, **grads}, held),
        "optimizer": {**persistent, **grads, **step_only, **held},
    }
    if setup := setup_phase_bytes(spec, cfg, persistent):
        phases["setup"] = setup
    if cfg.eval.loss and (cfg.eval.batch_size or cfg.eval.steps or cfg.eval.predict_with_generate):
        eb = cfg.eval_batch_size * plan.rows
        ev = eval_forward_bytes(spec, dt, eb, s, cfg.attn)
        ev_logits = stack_logits_bytes(spec, cfg, dt, eb * s, rows=eb)
        phases["evaluation"] = {**persistent, "activations": ev, "logits": ev_logits["forward"]
                                - ev_logits["held"] + logits["held"]}
    if cfg.eval.predict_with_generate and cfg.eval.max_new_tokens:
        eb = cfg.eval_batch_size
        # the prompt and, for a vision-language model, its image positions
        prompt = cfg.data.max_input_length + s - cfg.seq_len if cfg.data.max_input_length else s
        phases["generation"] = {**persistent, "kv_cache": kv_cache_bytes(
            spec, eb, prompt + cfg.eval.max_new_tokens, dt.act_bytes),
            "activations": eval_forward_bytes(spec, dt, eb, prompt, cfg.attn),
            "logits": 4 * eb * spec.vocab_size * 2 + logits["held"]}  # last token: fp32, probs
    return {p: {k: round(v) for k, v in d.items() if v} for p, d in phases.items()}


def _forward_peak(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, step: _MicroStep,
                  before: dict) -> dict:
    """The largest of: the loss computed, inside a layer, the vision tower's forward and
    the reference's no-grad forward. ``before``: what the step starts with."""
    t, s, acts = step.tokens, step.seq_len, step.acts["layers"]
    candidates = [{**before, "activations": acts, "logits": step.logits["forward"],
                   "image_embeddings": merged_input_bytes(spec, cfg, dt, t)},
                  {**before, "activations": acts,
                   "temporaries": forward_transient_bytes(spec, cfg, dt, t)},
                  # a frozen vision tower's forward runs before the language model's
                  {**before, "vision_forward": tower_forward_bytes(spec, cfg, dt)}]
    rows = reference_rows(cfg, step.plan)
    if rows:  # the reference's no-grad forward, after the policy's, on the same rows
        candidates.append({**before, "activations": acts, "logits": step.head["saved"],
                           "reference_forward": eval_forward_bytes(spec, dt, rows, s, cfg.attn)
                           + reference_head_bytes(spec, cfg, dt, step.plan, rows, s)})
    return max(candidates, key=lambda d: sum(d.values()))


def _backward_peak(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, step: _MicroStep,
                   before: dict, after: dict, held: dict) -> dict:
    """The largest of: the backward's start, inside the layers, the first layer and the
    embedding's backward. ``after``: the persistent bytes with this step's gradients."""
    acts, transient = step.acts, backward_transient_bytes(spec, cfg, dt, step.tokens)
    saved_and_recomputed = acts["layers"] + (acts["one_layer"] if cfg.grad_ckpt else 0)
    start = {**before, "activations": acts["layers"], "logits": step.logits["backward"]}
    in_layers = {**before, **held, "activations": saved_and_recomputed, "temporaries": transient}
    # the first layer back-propagates last: its activations (saved or
    # recomputed) are alive next to the complete gradients.
    end = {**after, **held, "activations": acts["one_layer"], "temporaries": transient}
    # after the first layer: the embedding's backward, with its output's gradient alive
    out_grad = step.tokens * spec.hidden_size * dt.resid_bytes if cfg.method == "full" else 0
    embed = {**after, **held, "temporaries": out_grad + embedding_grad_bytes(spec, cfg, dt)}
    return max((start, in_layers, end, embed), key=lambda d: sum(d.values()))


def setup_phase_bytes(spec: ModelSpec, cfg: RunConfig, persistent: dict) -> dict[str, float]:
    """Model preparation before the first step, when the stack runs
    prepare_model_for_kbit_training and then casts some groups back to 16-bit: the
    weights with every 16-bit non-quantized parameter in fp32 (and, where the stack's
    PEFT does not empty the cache, the freed 16-bit originals the allocator holds)."""
    fx = stack_effects(cfg)
    if not (fx.setup_upcast and cfg.method == "qlora"):
        return {}
    every = fp32_upcast_params(spec, replace(fx, fp32_groups=FP32_GROUPS_ALL))
    kept = fp32_upcast_params(spec, fx)
    out = {"weights": persistent.get("weights", 0), "upcast_fp32": 2 * (every - kept)}
    if fx.setup_cache:
        out["cached_16bit_copies"] = 2 * every
    return out


def estimate_training(spec: ModelSpec, cfg: RunConfig, cluster: Cluster | None = None,
                      expandable_segments: bool = False,
                      synthesize_stream: bool = True) -> MemoryEstimate:
    """Predict per-GPU memory of one fine-tuning run at its peak.

    Returns a MemoryEstimate whose ``breakdown`` holds every phase's
    categories (they add up to the phase's allocated bytes), the peak phase,
    and the reserved/device peaks after allocator and CUDA overheads.
    ``synthesize_stream`` False: the allocator reserve from the calibrated proxy
    even where the step's stream is modelled (what the planner's search scores).
    """
    phases, gpu_state, st = training_phases(spec, cfg, cluster)
    assumptions = list(st.assumptions) + _training_assumptions(spec, cfg)
    extra = {}
    # ZeRO-3 / FSDP place the weights through their own sharded loading: not replayed
    loaded = reserved_after_load(spec, cfg, after_load_tensors(spec, cfg)) \
        if cfg.zero != 3 else None
    if loaded:  # bitsandbytes QLoRA: the loader's stream through the allocator model
        extra["reserved_after_load_bytes"] = loaded["reserved_bytes"]
        extra["allocated_after_load_bytes"] = loaded["allocated_bytes"]
        assumptions.append(load_assumption(spec, cfg, loaded))
    streamed, fallback = streamed_reserve_bytes(
        spec, cfg, gpu_state, lambda: step_kit(spec, cfg), expandable_segments,
        st.paged_bytes) if synthesize_stream else (None, "the planner's search")
    return finish_estimate(
        spec=spec, cfg=cfg, cluster=cluster, phases=phases, persistent=gpu_state,
        trainable=st.trainable_params, host_bytes=st.host_bytes, paged_bytes=st.paged_bytes,
        assumptions=assumptions, expandable_segments=expandable_segments,
        largest_block=largest_block_bytes(spec, cfg), late_block=late_dense_block_bytes(spec, cfg),
        extra=extra, streamed_reserve=streamed, fallback=fallback)


def step_kit(spec: ModelSpec, cfg: RunConfig) -> StepKit:
    """The quantities the synthesized stream needs (memory/overheads.py training_blocks)."""
    dt = dtypes_for(cfg)
    b, s = cfg.micro_batch_size, llm_seq_len(spec, cfg)
    acts = saved_activation_bytes(spec, cfg, dt, b, s)
    per_layer = dt.resid_bytes * b * s * spec.hidden_size if cfg.grad_ckpt else \
        _layer_bytes(spec, b, s, dt, layer_plan(spec, cfg), False)
    tower = tower_saved_bytes(spec, cfg, dt)["layers"]  # the stream lays the tower out itself
    return StepKit(layer_plan(spec, cfg), b * s, b, s,
                   round(acts["layers"] - spec.num_layers * per_layer - tower),
                   round(forward_transient_bytes(spec, cfg, dt, b * s)),
                   round(merged_input_bytes(spec, cfg, dt, b * s)),
                   round(tower_forward_bytes(spec, cfg, dt)),
                   head_saved_blocks(spec, cfg, dt, b * s))


def training_phases(spec: ModelSpec, cfg: RunConfig, cluster: Cluster | None = None,
                    states: States | None = None) -> tuple[dict[str, dict[str, int]],
                                                           dict[str, int], States]:
    """(phase breakdown, persistent bytes, model states): estimate_training
    without the MemoryEstimate packaging. ``states``: model_states(spec, cfg)
    computed earlier for a config with the same method, precision, optimizer,
    LoRA, ZeRO/offload and GPUs (the planner reuses them across micro batches)."""
    dt = dtypes_for(cfg)
    st = states if states is not None else model_states(spec, cfg, dt)
    gpu_state = dict(st.gpu)
    # 16-bit gradients exist from a step's first backward until zero_grad after
    # the optimizer step (so through the forwards of accumulation steps);
    # DeepSpeed's fp32 gradient partition only inside the step (stage_1_and_2.py
    # and stage3.py assign it before optimizer.step() and drop it after).
    grads = {k: gpu_state.pop(k) for k in ("gradients", "ddp_buckets") if k in gpu_state}
    step_only = {k: gpu_state.pop(k) for k in ("grad_partition_fp32",) if k in gpu_state}
    cap = cluster.gpu.compute_capability if cluster else "9.0"
    gpu_state["cublas_workspace"] = C.cublas_workspace_bytes(cap)
    if pixel_bytes(spec, cfg):  # the images' fp32 pixel tensors, on the GPU for the step
        gpu_state["inputs"] = round(pixel_bytes(spec, cfg))
    if unsloth_rope_table_bytes(spec, cfg):  # Unsloth's per-layer fp32 RoPE tables
        gpu_state["rope_tables"] = unsloth_rope_table_bytes(spec, cfg)
    ref_params = separate_reference_params(spec, cfg)  # dpo/kto full FT: a frozen copy
    if ref_params:
        gpu_state["reference_model"] = round(ref_params * dt.base_weight_bytes)
    if cfg.stage == "ppo":  # four models, rollout and update (memory/ppo.py)
        kit = PpoKit(saved_activation_bytes, eval_forward_bytes)
        return ppo_phases(spec, cfg, dt, gpu_state, grads, step_only, kit,
                          llm_seq_len(spec, cfg)), gpu_state, st
    return _phases(spec, cfg, dt, gpu_state, grads, step_only), gpu_state, st


def _training_assumptions(spec: ModelSpec, cfg: RunConfig) -> list[str]:
    out = (list(getattr(spec, "assumptions", ())) + stack_assumptions(cfg)
           + gemma_assumptions(spec, cfg.attn)) + [
        "steady state: optimizer states exist (step ≥ 2); gradients are freed by "
        "zero_grad(set_to_none=True) after each optimizer step",
        "AdamW is torch's fused implementation (transformers' default adamw_torch_fused): "
        "no per-parameter temporaries in the step",
        "batches are full length without padding, so SDPA runs its flash kernel "
        "(no attention mask, GQA native); padded batches use the memory-efficient kernel",
        "activations: per-op saved tensors of an HF Llama-style layer (see "
        "oomless/memory/activations.py); dropout only on LoRA inputs",
    ]
    dt = dtypes_for(cfg)
    if cfg.method != "full" and dt.trainable_bytes == 4 and dt.act_bytes == 2:
        out.append("LoRA adapters in fp32 (PEFT autocast_adapter_dtype) " +
                   ("under bf16/fp16 autocast" if dt.autocast else "on the 16-bit model")
                   + (lora_input_note(layer_plan(spec, cfg)) if dt.autocast else ""))
    out += [a for a in [act_assumption(spec.hidden_act, dt.autocast)] if a]
    out += quantization_assumptions(spec, cfg)
    out += vision_assumptions(spec, cfg)
    if spec.is_moe:
        out.append(
            f"MoE: every token visits {spec.experts_per_token} experts; expert "
            "activations as a dense MLP over tokens × experts_per_token rows, "
            "routing assumed balanced"
        )
    out += moe_lora_assumptions(spec, cfg) + stage_assumptions(spec, cfg)
    out += unsloth_load_assumptions(spec, cfg)
    fx = stack_effects(cfg)
    if fx.compiled:
        out.append(compiled_assumption(spec, cfg, fx.fused_loss == "torchtune-chunked"))
    if cfg.eval.predict_with_generate:
        out.append("generation: HF generate with a dynamic KV cache in the activation dtype")
    return out
