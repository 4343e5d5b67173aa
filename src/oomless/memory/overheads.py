"""From allocated bytes to reserved and device bytes, and the final estimate."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ..allocator.synthetic import TrainingBlocks, replayed_peaks
from ..config import RunConfig
from ..models.hardware import Cluster
from ..models.spec import ModelSpec
from ..result import MemoryEstimate
from . import constants as C
from .activations import LayerPlan
from .band import band_assumption, band_bytes


def non_pytorch_bytes(cluster: Cluster | None, world_size: int) -> dict[str, int]:
    """Memory the card holds outside PyTorch's caching allocator in training."""
    out = {"cuda_context": C.CUDA_CONTEXT_BYTES, "cuda_kernels": C.CUDA_KERNELS_LOADED_BYTES}
    if world_size > 1:
        out["nccl"] = C.NCCL_BYTES
    return out


def allocator_reserve_bytes(peak_allocated: int, persistent: int, expandable: bool,
                            largest_block: int = 0, late_block: int = 0) -> int:
    """Reserved-but-unallocated bytes at the peak: the larger of a share of the
    step's largest transient block and a fraction of the memory that churns
    (everything but the persistent states), see constants; plus a block requested
    after the step's transient memory is scattered into holes it does not fit
    (late_dense_block_bytes), which takes a segment of its own."""
    if expandable:  # one growing segment per pool: a late block maps pages in the holes
        frac, block = C.ALLOC_RESERVE_FRACTION_EXPANDABLE, C.ALLOC_RESERVE_LARGEST_BLOCK_EXPANDABLE
        late_block = 0
    else:
        frac, block = C.ALLOC_RESERVE_FRACTION, C.ALLOC_RESERVE_LARGEST_BLOCK
    churn = frac * max(0, peak_allocated - persistent)
    return max(C.ALLOC_RESERVE_MIN_BYTES, round(churn), round(block * largest_block)) \
        + late_block


def reserve_assumption(streamed: bool, fallback: str | None, late_block: int,
                       expandable: bool) -> str:
    if streamed:
        return ("allocator reserve (reserved − allocated): the estimate's blocks (weights per "
                "tensor, each layer's saved tensors, the loss's blocks, gradients, the first "
                "step's optimizer states) laid out in the order the step requests them for two "
                "steps (oomless.allocator.synthetic) and replayed through the caching-"
                "allocator model")
    return ("allocator reserve (reserved − allocated) = the larger of 70% of the largest "
            f"transient block and {C.ALLOC_RESERVE_FRACTION:.0%} of the non-persistent peak, at "
            "least 64 MiB, calibrated on the trace's allocator simulation (`oomless trace` "
            "replays the real stream)" + (
                f"; plus the embedding's dense gradient ({late_block / 2**30:.2f} GiB), "
                "requested at the end of the backward when no freed block fits it: a segment "
                "of its own" if late_block and not expandable else "")
            + (f"; the step's stream is not synthesized for {fallback}" if fallback else ""))


def late_dense_block_bytes(spec: ModelSpec, cfg: RunConfig) -> int:
    """The embedding's dense gradient (vocab × hidden, aten embedding_dense_backward),
    requested at the very end of a full fine-tuning backward: by then the freed
    activations lie in holes between the layers' gradients, each far smaller than
    it, so the caching allocator gives it a fresh segment on top of everything it
    holds (measured on a GPU, benchmarks/results/gpu_streams: the reserved peak of
    Llama-3.2-1B full fine-tuning is reached at exactly that request). Without
    a trained embedding, or when DeepSpeed/FSDP own the gradients (zero ≥ 1), none; none
    either when the optimizer steps in the backward and the LM head is untied: its
    gradient, the same vocab × hidden, was stepped and freed earlier in the same
    backward, and its hole fits."""
    from .precision import dtypes_for
    from .stacks import stack_effects

    if cfg.method != "full" or cfg.zero != 0:
        return 0
    if stack_effects(cfg).optimizer_in_bwd and not spec.tie_embeddings:
        return 0
    return dtypes_for(cfg).grad_bytes * spec.vocab_size * spec.hidden_size


def peak_bytes(phases: dict[str, dict[str, int]], persistent: dict[str, int],
               cluster: Cluster | None, world_size: int, expandable: bool,
               largest_block: int = 0, late_block: int = 0) -> tuple[str, int, int, dict[str, int]]:
    """(peak phase, peak allocated, allocator reserve, non-PyTorch bytes) of a
    phase breakdown; the device peak is allocated + reserve + non-PyTorch."""
    totals = {p: sum(d.values()) for p, d in phases.items()}
    peak_phase = max(totals, key=totals.__getitem__)
    peak_alloc = totals[peak_phase]
    reserve = allocator_reserve_bytes(peak_alloc, sum(persistent.values()), expandable,
                                      largest_block, late_block)
    return peak_phase, peak_alloc, reserve, non_pytorch_bytes(cluster, world_size)


def finish_estimate(*, spec: ModelSpec, cfg: RunConfig, cluster: Cluster | None,
                    phases: dict[str, dict[str, int]], persistent: dict[str, int],
                    trainable: int, host_bytes: int, paged_bytes: int,
                    assumptions: list[str], expandable_segments: bool,
                    method: str = "analytic", extra: dict | None = None,
                    largest_block: int = 0, late_block: int = 0,
                    streamed_reserve: int | None = None,
                    fallback: str | None = None) -> MemoryEstimate:
    peak_phase, peak_alloc, reserve, non_pt = peak_bytes(
        phases, persistent, cluster, cfg.world_size, expandable_segments, largest_block,
        late_block)
    if streamed_reserve is not None and peak_phase in STREAMED_PHASES:
        reserve = streamed_reserve
    elif streamed_reserve is not None:  # evaluation / generation: not in the stream
        streamed_reserve, fallback = None, f"the {peak_phase} phase"
    assumptions = assumptions + [reserve_assumption(
        streamed_reserve is not None, fallback, late_block, expandable_segments)] + [
        "CUDA context 500 MiB (lazy loading), and 234 MiB of kernel images and library "
        "handles loaded by the first step (measured on one platform: H200, CUDA 13.0); "
        "NCCL 300 MiB per GPU when world size > 1; "
        "cuBLAS/cuBLASLt workspaces inside PyTorch's allocator",
        band_assumption(),
    ] + (cluster.gpu.assumptions if cluster else [])
    extra = dict(extra or {})
    extra["allocator_reserve_bytes"] = reserve
    if paged_bytes:
        extra["paged_optimizer_bytes"] = paged_bytes
    device = peak_alloc + reserve + sum(non_pt.values())
    low, high = band_bytes(device, method)
    return MemoryEstimate(
        low_bytes=low, high_bytes=high,
        method=method,
        model=spec.name,
        param_count=spec.param_count,
        trainable_params=trainable,
        peak_phase=peak_phase,
        peak_allocated_bytes=peak_alloc,
        peak_reserved_bytes=peak_alloc + reserve,
        device_peak_bytes=device,
        breakdown=phases,
        non_pytorch_bytes=non_pt,
        assumptions=tuple(assumptions),
        config=cfg.to_dict(),
        gpu=cluster.gpu.name if cluster else None,
        gpu_memory_bytes=cluster.gpu.memory_bytes if cluster else None,
        host_ram_bytes=host_bytes,
        extra=extra,
    )


# ---- the reserve from a synthesized stream ------------------------------------------
# Where the step's order is modelled, the estimate's own blocks are laid out as a coarse
# alloc/free stream (oomless.allocator.synthetic) and replayed through the caching
# allocator model: the reserve is the replay's reserved peak minus its allocated peak.


STREAMED_PHASES = ("forward", "backward", "optimizer")  # the training step's


class StepKit(NamedTuple):
    """The training model's quantities the stream needs (training.py computes them)."""

    plan: LayerPlan  # what each layer trains
    tokens: int  # micro batch × tokens per sequence
    rows: int  # sequences in the forward
    seq_len: int
    shared_bytes: int  # saved tensors shared by all layers (RoPE, final norm, lm_head input)
    forward_work_bytes: int  # a layer's forward temporaries
    before_layers_bytes: int  # merged image embeddings kept through the step
    tower_forward_bytes: int  # a frozen vision tower's forward, before the language model's
    head_saved: tuple[int, ...] = ()  # a trained lm_head's saved tensors (in shared_bytes)


def stream_fallback(spec: ModelSpec, cfg: RunConfig, expandable: bool,
                    paged_bytes: int) -> str | None:
    """Why the stream is not modelled for ``cfg`` (None: it is)."""
    from .stacks import stack_effects
    from .stages import stage_plan
    from .vision import tower_plan

    fx = stack_effects(cfg)
    checks = (
        (expandable, "expandable segments"),
        (cfg.zero or cfg.fsdp.version is not None or cfg.training.engine == "fsdp",
         "DeepSpeed ZeRO / FSDP"),
        (cfg.offload != "none" or fx.offload_checkpoints or paged_bytes, "offloading"),
        (cfg.method not in ("full", "lora"), f"method {cfg.method}"),
        (cfg.stage not in ("pt", "sft") or stage_plan(cfg).head != "lm_loss",
         f"stage {cfg.stage}"),
        (cfg.optimizer != "adamw", f"optimizer {cfg.optimizer}"),
        (bool(fx.fused_loss) or fx.compiled or fx.optimizer_in_bwd or fx.setup_upcast,
         f"stack {cfg.stack}'s loss/compile/optimizer path"),
        (spec.is_moe, "MoE layers"),
        (bool(cfg.lora.modules_to_save), "PEFT's trainable module copies (modules_to_save)"),
        (tower_plan(spec, cfg) is not None and cfg.grad_ckpt and spec.vision.checkpointed,
         "a trained, checkpointed vision tower"),
    )
    return next((why for cond, why in checks if cond), None)


def _param_blocks(spec: ModelSpec, cfg: RunConfig, dt) -> dict:
    """Weights (loader order), .grad sizes (layers, then the head's, then the
    embedding's), optimizer states (parameter order) and the grads' spans, in bytes."""
    from .after_load import checkpoint_tensors
    from .states import lora_targets

    tensors = checkpoint_tensors(spec)
    full = cfg.method == "full"
    weights = [n * (dt.trainable_bytes if full else dt.base_weight_bytes)
               for _, n, _, _ in tensors]
    targets = lora_targets(spec, cfg.lora.targets) if not full else set()
    per_layer: list[list[int]] = []
    by_layer: dict[str, list[int]] = {}
    for name, n, _, _ in tensors:
        if name.startswith("model.layers."):
            by_layer.setdefault(name.split(".")[2], []).append(n)
    for layer in range(spec.num_layers):
        if full:
            per_layer.append(by_layer.get(str(layer), []))
        else:  # PEFT's lora_A (r × in) and lora_B (out × r) per wrapped linear
            per_layer.append([e for lin in spec.layer_linears() if lin.name in targets
                              for e in (cfg.lora.r * lin.in_features * lin.count,
                                        lin.out_features * cfg.lora.r * lin.count)])
    rest = [(name, n) for name, n, _, _ in tensors if not name.startswith("model.layers.")]
    embed = [n for name, n in rest if "embed_tokens" in name] if full else []
    head = [n for name, n in rest if "embed_tokens" not in name] if full else []
    if full and spec.tie_embeddings:  # lm_head's backward makes the tied weight's .grad
        head, embed = head + embed, []
    # the backward reaches lm_head's matmul before the final norm: the span is walked in
    # reverse, so the head's matrix goes last
    head.sort(key=lambda n: n > spec.hidden_size)
    gb = dt.grad_bytes if full else dt.trainable_bytes
    elems = [n for layer in per_layer for n in layer]
    spans, first = [], 0
    for layer in per_layer:
        spans.append((first, first + len(layer)))
        first += len(layer)
    order = [n for name, n in rest if "embed_tokens" in name] + elems + [
        n for name, n in rest if "embed_tokens" not in name]  # model.parameters()
    in_order = order if full else elems
    # autocast's matmul backward makes a 16-bit gradient of the cast weight first
    cast = dt.act_bytes if dt.autocast and dt.trainable_bytes != dt.act_bytes else 0
    matmul_weight = (
        [cast if (n > spec.hidden_size and full) or not full else 0 for n in elems]
        + [cast if n > spec.hidden_size else 0 for n in head] + [0] * len(embed))
    return {"weights": weights, "adapters": [] if full else [n * dt.trainable_bytes for n in elems],
            "grads": [n * gb for n in elems + head + embed],
            "grad_casts": [c * n for c, n in zip(matmul_weight, elems + head + embed,
                                                 strict=True)],
            "states": [n * dt.optim_elem_bytes for n in in_order], "spans": tuple(spans),
            "head": (len(elems), len(elems) + len(head)),
            "embed": (len(elems) + len(head), len(elems) + len(head) + len(embed))}


def _loss_ops(spec: ModelSpec, cfg: RunConfig, dt, kit: StepKit) -> tuple[tuple, tuple, tuple]:
    """The loss region's (forward, backward, after the head's gradients) ops, keys
    numbered in order of allocation (memory/loss_paths.py: transformers
    ``ForCausalLMLoss`` upcasts the logits, shifts them, and ``cross_entropy`` keeps
    log_softmax's output; its backward makes nll_loss's gradient, log_softmax's
    gradient in fp32 and the cast back to the logits' dtype)."""
    from .gemma import softcap_logits_bytes
    from .loss_paths import lm_head_cast_bytes, loss_path_of, model_logits_bytes
    from .stacks import stack_effects

    fx = stack_effects(cfg)
    path = loss_path_of(spec, fx)
    t, tv = kit.tokens, kit.tokens * spec.vocab_size
    lb = model_logits_bytes(cfg, dt, fx, spec)
    keys: list[str] = []
    fwd: list[int] = []

    def alloc(name: str, n: int, ops: list[int]) -> None:
        if n:
            keys.append(name)
            ops.append(round(n))

    def free(ops: list[int], *names: str) -> None:
        ops.extend(-(keys.index(n) + 1) for n in names if n in keys)

    alloc("cast", lm_head_cast_bytes(spec, dt, fx), fwd)
    alloc("logits", lb * tv, fwd)
    alloc("capped", softcap_logits_bytes(spec, lb, t), fwd)
    alloc("copy", (C.LOSS_FP32_BYTES if lb == 2 else 0) * tv, fwd)
    alloc("shift", (C.LOSS_FP32_BYTES if path.shift_copy and kit.rows > 1 else 0) * tv, fwd)
    alloc("logp", C.LOSS_FP32_BYTES * tv, fwd)
    recast = dt.resid_bytes if path.recast_after_loss and lb == 4 and dt.resid_bytes != 4 else 0
    alloc("recast", recast * tv, fwd)
    free(fwd, "copy", "shift", *(() if fx.keep_outputs else ("logits", "recast")))
    bwd: list[int] = []
    alloc("g_logp", C.LOSS_FP32_BYTES * tv, bwd)
    alloc("g_fp32", C.LOSS_FP32_BYTES * tv, bwd)
    free(bwd, "g_logp", "logp")
    if lb == 2:
        alloc("g_logits", lb * tv, bwd)
        free(bwd, "g_fp32")
    alloc("g_hidden", dt.act_bytes * t * spec.hidden_size, bwd)
    after: list[int] = []
    free(after, "g_logits", "g_fp32", "capped", "cast", "g_hidden", "logits", "recast")
    return tuple(fwd), tuple(bwd), tuple(after)


def training_blocks(spec: ModelSpec, cfg: RunConfig, persistent: dict[str, int],
                    kit: StepKit) -> TrainingBlocks:
    """The run's blocks for oomless.allocator.synthetic, from the estimate's quantities."""
    from ..allocator.attention_blocks import attention_work
    from .activations import layer_cast_blocks, layer_saved_blocks
    from .precision import dtypes_for

    dt = dtypes_for(cfg)
    p = _param_blocks(spec, cfg, dt)
    modelled = ("weights", "gradients", "optimizer", "lora_adapters", "activations")
    other = [v for k, v in persistent.items() if k not in modelled and v > 0]
    extra_weights = persistent.get("weights", 0) - sum(p["weights"])  # e.g. a vision tower
    extra_adapters = persistent.get("lora_adapters", 0) - sum(p["adapters"])
    other += [n for n in (extra_weights, extra_adapters) if n > 0]
    b, s, t, h = kit.rows, kit.seq_len, kit.tokens, spec.hidden_size
    width = spec.intermediate_size
    mlp_grads = [dt.mlp * t * width] * 3 + [dt.resid_bytes * t * h] * 2
    attn = attention_work(spec, dt.act_bytes, b, s, kit.plan.attn)
    loss_fwd, loss_bwd, loss_after = _loss_ops(spec, cfg, dt, kit)
    mask = dt.act_bytes * b * s * s if kit.plan.attn == "eager" else 0
    before = _tower_ops(spec, cfg, dt) or tuple(
        n for n in (kit.tower_forward_bytes, -1 if kit.tower_forward_bytes else 0) if n)
    before += tuple(n for n in (kit.before_layers_bytes, mask) if n)
    return TrainingBlocks(
        weights=tuple(p["weights"]), persistent=tuple(p["adapters"] + other),
        grads=tuple(p["grads"]), layer_grads=p["spans"], head_grads=p["head"],
        embed_grads=p["embed"], states=tuple(p["states"]), state_count=2,
        layers=spec.num_layers,
        layer_saved=layer_saved_blocks(spec, b, s, dt, kit.plan),
        layer_input=dt.resid_bytes * t * h if cfg.grad_ckpt else 0,
        # eager attention's temporaries (allocator/attention_blocks.py), then the MLP's
        forward_work=attn.forward_chain + _forward_work(
            kit.forward_work_bytes, dt.resid_bytes * t * h, dt.act_bytes * t * width),
        backward_work=tuple(mlp_grads) + attn.backward_work, grad_casts=tuple(p["grad_casts"]),
        attention_forward=attn.forward_ops, attention_backward=attn.backward_ops,
        before_layers=before, shared=(max(0, kit.shared_bytes - mask - sum(kit.head_saved)),),
        head_saved=kit.head_saved,
        loss_forward=loss_fwd, loss_backward=loss_bwd, loss_release=loss_after,
        forward_cached=layer_cast_blocks(spec, dt, kit.plan) if cfg.grad_ckpt else (),
        late_work=(late_dense_block_bytes(spec, cfg),) if spec.tie_embeddings else (),
        micro_batches=cfg.grad_accum)


def _tower_ops(spec: ModelSpec, cfg: RunConfig, dt) -> tuple[int, ...]:
    """A trained vision tower's forward, before the language model's: its patch
    embeddings, every layer's saved tensors and the projector's, all kept until the
    tower back-propagates at the end of the backward (memory/vision.py
    tower_saved_bytes); () for a frozen tower."""
    from .activations import layer_saved_blocks
    from .vision import tower_plan, tower_rows, tower_saved_bytes, tower_spec

    plan = tower_plan(spec, cfg)
    if plan is None:
        return ()
    images, patches = tower_rows(spec, cfg)
    tower = tower_spec(spec.vision)
    layer = layer_saved_blocks(tower, images, patches, dt, plan)
    saved = tower_saved_bytes(spec, cfg, dt)
    rest = round(saved["layers"] - tower.num_layers * saved["one_layer"])
    return tuple(n for n in (rest, *layer * tower.num_layers) if n > 0)


def _forward_work(total: int, resid: int, product: int) -> tuple[int, ...]:
    """training.forward_transient_bytes as its tensors: two residual-stream sums, the
    MLP's product and, where PEFT casts it for an fp32 down_proj adapter, its fp32 copy."""
    rest = total - 2 * resid
    if rest <= 0:
        return tuple(n for n in (total,) if n > 0)
    parts = [rest - product, product] if rest > product else [rest]
    return (resid, resid, *parts)


def streamed_reserve_bytes(spec: ModelSpec, cfg: RunConfig, persistent: dict[str, int],
                           kit: Callable[[], StepKit], expandable: bool = False,
                           paged_bytes: int = 0) -> tuple[int | None, str | None]:
    """(reserved − allocated of the synthesized stream replayed through the allocator
    model, None) where the stream is modelled, else (None, what is not modelled).
    ``kit``: training.step_kit for ``cfg``. Cached on the spec per configuration."""
    fallback = stream_fallback(spec, cfg, expandable, paged_bytes)
    if fallback:
        return None, fallback

    def replayed() -> int:
        alloc, reserved = replayed_peaks(training_blocks(spec, cfg, persistent, kit()))
        return reserved - alloc

    key = ("streamed_reserve", cfg.model_dump_json(), tuple(sorted(persistent.items())))
    return spec.cached(key, replayed), None
