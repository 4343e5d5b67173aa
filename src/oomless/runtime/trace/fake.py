"""``oomless trace``: two real training steps on fake tensors, every storage tracked.

The real transformers model is built from its config on the meta device and
turned into CPU fake tensors (runtime/build.py), real PEFT LoRA and
bitsandbytes 4-bit layers included; HF Trainer's step runs twice (the second
with optimizer state) under the storage tracker (oomless.runtime.trace.storage_tracker), with
CUDA-only kernel buffers emulated (oomless.runtime.trace.cuda_emulation); the alloc/free
stream is replayed through the caching-allocator simulation
(oomless/allocator.py). No weights, no GPU.

Large models: decoder layers repeat. A model with more than
``FULL_TRACE_MAX_LAYERS`` layers is traced with three blocks of its layer
pattern (prefix + 3·period layers) and the alloc/free stream of the full
depth is written from it (oomless.runtime.trace.expansion), so the allocator simulation
replays the whole model. Where the layers do not repeat cleanly, two shallow
traces are extrapolated linearly instead (exact for allocated bytes, an
approximation for reserved ones). tests/runtime/test_trace.py checks both
against full traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from ...allocator import AllocatorConfig
from ...config import RunConfig
from ...models.hardware import Cluster
from ...result import MemoryEstimate
from ..build import BuiltModel, TraceUnsupported, build_model, num_layers_of, transformers_config
from .analysis import TraceStats, analyze, extrapolate, module_peaks
from .expansion import ExpansionError, Stream, expand, stream_of
from .tracked_run import TraceFailed, layer_index, run_tracked

FULL_TRACE_MAX_LAYERS = 4
MAX_PATTERN_PERIOD = 8


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How to trace ``total`` decoder layers: all, or ``prefix + 3·period`` expanded."""

    total: int
    prefix: int = 0
    period: int = 1
    full: bool = True

    @property
    def traced(self) -> int:
        return self.total if self.full else self.prefix + 3 * self.period

    @property
    def copies(self) -> int:
        """Template blocks in the full model."""
        return (self.total - self.prefix) // self.period - 2

    def block(self, i: int) -> set[int]:
        start = self.prefix + i * self.period
        return set(range(start, start + self.period))

    def linear_counts(self) -> list[int]:
        """Layer counts for the linear fallback: two, one period apart."""
        return [self.prefix + self.period, self.prefix + 2 * self.period]


def plan_layers(hf_config: dict[str, Any], full: bool = False) -> LayerPlan:
    total = num_layers_of(hf_config)
    if full or total <= FULL_TRACE_MAX_LAYERS:
        return LayerPlan(total)
    config = transformers_config(hf_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    prefix = int(getattr(text, "first_k_dense_replace", 0) or 0)
    period = _pattern_period(list(getattr(text, "layer_types", None) or []), prefix)
    period = _lcm(period, int(getattr(text, "decoder_sparse_step", 1) or 1))
    regular = not getattr(text, "mlp_only_layers", None) and period <= MAX_PATTERN_PERIOD
    if not regular or (total - prefix) % period or prefix + 3 * period >= total:
        return LayerPlan(total)  # no clean repetition: trace every layer
    return LayerPlan(total, prefix, period, full=False)


def layer_counts(hf_config: dict[str, Any], full: bool = False) -> list[int]:
    """Layer counts the linear fallback traces (or all layers)."""
    plan = plan_layers(hf_config, full)
    return [plan.total] if plan.full else plan.linear_counts()


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


def _pattern_period(types: list[str], prefix: int) -> int:
    body = types[prefix:]
    for p in range(1, MAX_PATTERN_PERIOD + 1):
        if all(body[i] == body[i % p] for i in range(len(body))):
            return p
    return MAX_PATTERN_PERIOD + 1


def trace_training(cfg: RunConfig, cluster: Cluster | None = None, *, resolved: Any = None,
                   full: bool = False, alloc_conf: str | None = None,
                   timeline_points: int = 800) -> MemoryEstimate:
    """Trace ``cfg``; where that is impossible, the analytic estimate with the reason."""
    from ...models.catalog import resolve_model

    resolved = resolved or resolve_model(cfg.model)
    spec = resolved.spec
    alloc_config = AllocatorConfig.from_conf(alloc_conf)
    if resolved.hf_config is None:
        return analytic_fallback(spec, cfg, cluster, (
            f"transformers does not implement model type '{spec.model_type}', "
            "so the model cannot be built for a trace"), alloc_config)
    from .stacks import trace_unsupported

    reason = trace_unsupported(cfg)
    if reason:
        return analytic_fallback(spec, cfg, cluster, reason, alloc_config)
    started = time.perf_counter()
    try:
        from ...memory.training import llm_seq_len

        # the other models' layers (reference, reward, value) are not the policy's: layer
        # expansion cannot repeat them, and where the step peaks moves with the depth, so
        # those steps are traced at full depth
        plan = plan_layers(resolved.hf_config, full or _other_models(cfg))
        seq = llm_seq_len(spec, cfg)  # image tokens join the text (vision tower not run)
        runs = [trace_once(resolved.hf_config, cfg, cluster, plan, alloc_config,
                           timeline_points, seq_len=seq, spec=spec)]
    except TraceUnsupported as err:
        return analytic_fallback(spec, cfg, cluster, str(err), alloc_config)
    except TraceFailed as err:
        return analytic_fallback(spec, cfg, cluster, f"the trace failed in module "
                                 f"'{err.module or '(outside any module)'}': {err}", alloc_config)
    except ExpansionError as err:  # layers that do not repeat cleanly: extrapolate
        runs = [trace_once(resolved.hf_config, cfg, cluster, LayerPlan(n), alloc_config,
                           timeline_points, seq_len=seq, spec=spec) for n in plan.linear_counts()]
        runs[-1].notes.append(f"layer expansion not possible ({err}): allocated bytes "
                              "extrapolated linearly (exact while each phase peaks at the "
                              "same moment at every layer count), reserved bytes approximately")
    return _estimate(spec, cfg, cluster, runs, plan, time.perf_counter() - started)


def _other_models(cfg: RunConfig) -> bool:
    """Whether the step runs models besides the policy (a separate reference, PPO)."""
    from ...memory.stages import stage_plan

    return cfg.stage == "ppo" or stage_plan(cfg).reference == "separate"


def analytic_fallback(spec: Any, cfg: RunConfig, cluster: Cluster | None, reason: str,
                      alloc_config: AllocatorConfig | None = None) -> MemoryEstimate:
    from ...memory import estimate_training

    expandable = bool(alloc_config and alloc_config.expandable_segments)
    est = estimate_training(spec, cfg, cluster, expandable_segments=expandable)
    note = f"no trace: {reason}; this is the analytic estimate"
    return dataclasses.replace(est, assumptions=(note, *est.assumptions),
                               extra={**est.extra, "trace_fallback": reason})


def _cublas_bytes(cluster: Cluster | None) -> int:
    from .cuda_emulation import cublas_workspace_bytes

    # no GPU named: Hopper's workspace, as the analytic estimate assumes
    return cublas_workspace_bytes(cluster.gpu.compute_capability if cluster else "9.0")


def trace_once(hf_config: dict[str, Any], cfg: RunConfig, cluster: Cluster | None,
               plan: LayerPlan | int, alloc_config: AllocatorConfig,
               timeline_points: int = 800, seq_len: int | None = None,
               spec: Any = None) -> TraceStats:
    """Trace ``plan.traced`` layers and analyse the stream of ``plan.total`` layers."""
    from ..build import fake_mode
    from .cuda_emulation import CudaEmulation
    from .stage_trainers import TRAINER_STAGES, traced_stage, triton_kernel_emulation
    from .vision_inputs import is_vlm, small_constants

    plan = LayerPlan(plan) if isinstance(plan, int) else plan
    built = build_model(hf_config, cfg, mode="fake", num_layers=plan.traced,
                        sequence_classification=cfg.stage == "rm")
    model = built.model
    fake = fake_mode()
    seq = seq_len or cfg.seq_len
    stage = traced_stage(cfg, hf_config, model, plan.traced, seq, fake) \
        if cfg.stage in TRAINER_STAGES else None
    images = spec is not None and spec.vision is not None and cfg.data.images_per_sample > 0 \
        and is_vlm(model) and not stage
    with fake, small_constants() if images else contextlib.nullcontext():
        batch = stage.batch if stage else _batch(model, spec, cfg, cfg.micro_batch_size, seq, images)
        eval_batch = _batch(model, spec, cfg, cfg.eval_batch_size, seq, images) \
            if _wants_eval(cfg) and not stage else None
    emulations = triton_kernel_emulation() if stage else small_constants() if images else \
        contextlib.nullcontext()
    with emulations:
        tracker = run_tracked(stage.model if stage else model, cfg, batch, eval_batch,
                              device_type="cpu", fake=fake, num_layers=plan.traced,
                              emulation=CudaEmulation(cublas_bytes=_cublas_bytes(cluster)),
                              loss_fn=stage.loss_fn if stage else None,
                              frozen_models=stage.frozen_models if stage else (),
                              full_batch_values=True,
                              step_hooks=stage.step_hooks if stage else (None, None))
    if stage:
        built.notes.extend(stage.notes)
    stream, params, trainable = _all_layers(tracker, built, plan)
    stats = analyze(stream, alloc_config, num_layers=plan.total, param_count=params,
                    trainable_params=trainable, timeline_points=timeline_points,
                    module_peaks=module_peaks(tracker))
    stats.traced_layers = plan.traced
    stats.stream = stream
    stats.notes.extend(built.notes)
    return stats


def _all_layers(tracker: Any, built: BuiltModel, plan: LayerPlan) -> tuple[Stream, int, int]:
    """The stream of ``plan.total`` layers (the traced one, or its middle block
    repeated) and its parameters (all, trainable)."""
    params, trainable = built.param_count, built.trainable_params
    if plan.full:
        return stream_of(tracker), params, trainable
    stream = expand(tracker, plan.block(1), plan.block(0), plan.block(2), plan.copies)
    extra_params, extra_trainable = _block_params(built.model, plan.traced, plan.block(1))
    return (stream, params + (plan.copies - 1) * extra_params,
            trainable + (plan.copies - 1) * extra_trainable)


def _batch(model: Any, spec: Any, cfg: RunConfig, b: int, seq: int, images: bool) -> dict:
    """A micro batch: token ids, and for a vision-language model its images."""
    from .hf_step import make_batch
    from .vision_inputs import vision_batch

    return vision_batch(model, spec, cfg, b, seq) if images else make_batch(model, b, seq, "cpu")


def _block_params(model: Any, num_layers: int, block: set[int]) -> tuple[int, int]:
    """Parameters (and trainable ones) of the decoder layers in ``block``."""
    from ..fake_params import param_numel
    from .tracked_run import decoder_layers_name

    name = decoder_layers_name(model, num_layers)
    total = trainable = 0
    for pname, p in model.named_parameters():
        if layer_index(pname, name) in block:
            total += param_numel(p)
            trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def _wants_eval(cfg: RunConfig) -> bool:
    """Evaluation is traced when the configuration evaluates (as the analytic model does)."""
    return bool(cfg.eval.batch_size or cfg.eval.steps or cfg.eval.predict_with_generate)


def _assumptions(cfg: RunConfig, runs: list[TraceStats], plan: LayerPlan | None) -> list[str]:
    out = [
        f"trace: the real transformers/PEFT/bitsandbytes modules run two {cfg.stack} steps "
        "(forward under autocast with accelerate's fp32 output conversion, backward, "
        "gradient clipping, optimizer step, zero_grad) on CPU fake tensors; every tensor "
        "storage is tracked at the dispatcher",
        "CUDA emulation: FlashAttention-2 backward buffers (softmax_d, dq_accum, GQA "
        "dk/dv_expanded), cuBLAS + cuBLASLt workspaces for the forward thread and the "
        "autograd thread, bitsandbytes' dequantized 4-bit weight per matmul; CPU autocast "
        "stands in for CUDA autocast (transformers upcasts norms, softmax and loss itself)",
        "autograd's input-buffer sums of two gradients run in place where the engine holds "
        "the only reference, as without a dispatch mode (fake tensors turn that off)",
        "SDPA with an attention mask (a sliding window shorter than the sequence) runs "
        "CUDA's memory-efficient kernel; traced with PyTorch's CPU flash kernel, which keeps "
        "the same output and log-sum-exp (that kernel's backward workspace is not emulated)",
        "precision as HF Trainer + PEFT: LoRA/QLoRA load the base in 16-bit with fp32 "
        "adapters, full fine-tuning keeps fp32 weights, both under bf16/fp16 autocast; "
        "pure-bf16 is bf16 throughout without autocast; then the stack's own casts, "
        "hooks and loss (runtime/trace/stacks.py)",
        "batches are full length without padding (no attention mask), use_cache off",
        "reserved memory from replaying the alloc/free stream through a simulation of "
        "PyTorch's CUDA caching allocator (one stream)",
    ]
    if len(runs) == 2 and plan is not None:
        out.append(
            f"traced {runs[0].traced_layers} and {runs[1].traced_layers} decoder layers and "
            f"extrapolated linearly to {plan.total}; per-module peaks and the timeline are "
            f"those of the {runs[1].traced_layers}-layer trace")
    elif plan is not None and not plan.full:
        out.append(
            f"traced {plan.traced} decoder layers and wrote the alloc/free stream of all "
            f"{plan.total} by repeating the middle {plan.period}-layer block; per-module "
            f"peaks are those of the {plan.traced}-layer trace")
    if cfg.world_size > 1:
        out.append("data parallel without ZeRO: DDP gradient buckets as large as the "
                   "gradients are added to every phase (not traced)")
    if cfg.optimizer.startswith("paged"):
        out.append("paged optimizer states live in CUDA unified memory, outside the "
                   "caching allocator: reported as paged_optimizer_bytes, not counted")
    if cfg.data.images_per_sample:
        out.append("images: the vision tower runs on the processor's pixel tensors and its "
                   "features fill the image tokens (seq_len + images × tokens per image)")
    if cfg.eval.predict_with_generate and cfg.eval.max_new_tokens:
        out.append("generation during evaluation is not traced (it stops on data): its KV "
                   "cache, activations and logits come from the analytic model, on top of "
                   "the traced weights, adapters and optimizer states")
    for run in runs:
        out.extend(n for n in run.notes if n not in out)
    return out


PERSISTENT = ("weights", "lora_adapters", "optimizer", "cublas_workspace", "inputs",
              "ddp_buckets")


def _analytic_generation(spec: Any, cfg: RunConfig, cluster: Cluster | None,
                         breakdown: dict[str, dict[str, int]]) -> dict[str, int] | None:
    """predict_with_generate: traced persistent memory + the analytic KV cache,
    activations and logits of HF generate."""
    if not (cfg.eval.predict_with_generate and cfg.eval.max_new_tokens):
        return None
    from ...memory import estimate_training

    analytic = estimate_training(spec, cfg, cluster).breakdown.get("generation")
    if not analytic:
        return None
    base = breakdown.get("evaluation") or breakdown["optimizer"]
    out = {k: v for k, v in base.items() if k in PERSISTENT}
    for key in ("kv_cache", "activations", "logits"):
        if analytic.get(key):
            out[key] = analytic[key]
    return out


def _traced_numbers(runs: list[TraceStats], plan: LayerPlan) -> dict[str, Any]:
    """The traced breakdown, tensor peaks, reserved and paged bytes and parameter counts
    of ``plan.total`` layers: the last trace's, or two shallow traces extrapolated."""
    last = runs[-1]
    if len(runs) == 2:
        return extrapolate(runs[0], runs[1], plan.total)
    return {"breakdown": last.breakdown, "tensor_peaks": last.tensor_peaks,
            "peak_reserved_bytes": last.peak_reserved_bytes, "paged_bytes": last.paged_bytes,
            "param_count": last.param_count, "trainable_params": last.trainable_params}


def _completed_breakdown(spec: Any, cfg: RunConfig, cluster: Cluster | None,
                         traced: dict[str, dict[str, int]]) -> tuple[dict[str, dict[str, int]], int]:
    """The traced breakdown with what the trace does not run (DDP's gradient buckets,
    HF generate, the model preparation before the first step) and the reserved bytes
    the buckets add."""
    from ...memory.training import setup_phase_bytes

    breakdown = {p: dict(c) for p, c in traced.items()}
    extra_reserved = 0
    if cfg.world_size > 1:
        buckets = breakdown.get("optimizer", {}).get("gradients", 0)
        for parts in breakdown.values():
            parts["ddp_buckets"] = buckets
        extra_reserved = buckets
    generation = _analytic_generation(spec, cfg, cluster, breakdown)
    if generation:
        breakdown["generation"] = generation
    # model preparation before the first step (prepare_model_for_kbit_training's fp32
    # copies): analytic, on the traced weights
    setup = setup_phase_bytes(spec, cfg, breakdown.get("optimizer", {}))
    if setup:
        breakdown["setup"] = {k: round(v) for k, v in setup.items()}
    return breakdown, extra_reserved


def _trace_extra(runs: list[TraceStats], nums: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What the trace saw beyond the breakdown (the estimate's ``extra``)."""
    last = runs[-1]
    extra = {"per_module_peak": last.module_peaks, "timeline": last.timeline,
             "allocator": last.allocator, "layers_traced": [r.traced_layers for r in runs],
             "tensor_peaks": nums["tensor_peaks"], "trace_seconds": round(seconds, 2),
             "events": sum(r.num_events for r in runs)}
    if nums["paged_bytes"]:
        extra["paged_optimizer_bytes"] = nums["paged_bytes"]
    return extra


def _estimate(spec: Any, cfg: RunConfig, cluster: Cluster | None, runs: list[TraceStats],
              plan: LayerPlan, seconds: float) -> MemoryEstimate:
    from ...memory.band import band_bytes
    from ...memory.overheads import non_pytorch_bytes

    nums = _traced_numbers(runs, plan)
    breakdown, extra_reserved = _completed_breakdown(spec, cfg, cluster, nums["breakdown"])
    totals = {p: sum(c.values()) for p, c in breakdown.items()}
    peak_phase = max(totals, key=totals.__getitem__)
    peak_alloc = totals[peak_phase]
    reserved = max(nums["peak_reserved_bytes"] + extra_reserved, peak_alloc)
    non_pt = non_pytorch_bytes(cluster, cfg.world_size)
    low, high = band_bytes(reserved + sum(non_pt.values()), "trace")
    return MemoryEstimate(
        low_bytes=low, high_bytes=high,
        method="trace", model=spec.name, param_count=nums["param_count"],
        trainable_params=nums["trainable_params"], peak_phase=peak_phase,
        peak_allocated_bytes=peak_alloc, peak_reserved_bytes=reserved,
        device_peak_bytes=reserved + sum(non_pt.values()), breakdown=breakdown,
        non_pytorch_bytes=non_pt, assumptions=tuple(_assumptions(cfg, runs, plan)),
        config=cfg.to_dict(), gpu=cluster.gpu.name if cluster else None,
        gpu_memory_bytes=cluster.gpu.memory_bytes if cluster else None,
        extra=_trace_extra(runs, nums, seconds),
    )
