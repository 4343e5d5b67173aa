"""``oomless trace``: two real training steps on fake tensors, every storage tracked.

The real transformers model is built from its config on the meta device and
turned into CPU fake tensors (runtime/build.py), real PEFT LoRA and
bitsandbytes 4-bit layers included; HF Trainer's step runs twice (the second
with optimizer state) under the storage tracker (runtime/tracker.py), with
CUDA-only kernel buffers emulated (runtime/cuda_emulation.py); the alloc/free
stream is replayed through the caching-allocator simulation
(oomless/allocator.py). No weights, no GPU.

Large models: the decoder layers repeat, so every byte count is affine in the
number of layers. Models with more than ``FULL_TRACE_MAX_LAYERS`` layers are
traced at two small layer counts one pattern period apart and extrapolated
(tests/runtime/test_trace.py checks this against a full trace).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..allocator import AllocatorConfig
from ..config import RunConfig
from ..hardware import Cluster
from ..result import MemoryEstimate
from .analysis import TraceStats, analyze, extrapolate
from .build import TraceUnsupported, build_model, num_layers_of, transformers_config
from .tracker import ADAPTERS, INPUTS, LOGITS, OPTIMIZER, PAGED, WEIGHTS, ModuleStack

FULL_TRACE_MAX_LAYERS = 4
MAX_PATTERN_PERIOD = 8


class TraceFailed(Exception):
    """The model's own code failed under the trace; ``module`` names where."""

    def __init__(self, module: str, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.module = module


def layer_counts(hf_config: dict[str, Any], full: bool = False) -> list[int]:
    """Layer counts to trace: all of them, or two one pattern period apart."""
    total = num_layers_of(hf_config)
    if full or total <= FULL_TRACE_MAX_LAYERS:
        return [total]
    config = transformers_config(hf_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    prefix = int(getattr(text, "first_k_dense_replace", 0) or 0)
    period = _pattern_period(list(getattr(text, "layer_types", None) or []), prefix)
    sparse_step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    period = _lcm(period, sparse_step)
    if getattr(text, "mlp_only_layers", None) or period > MAX_PATTERN_PERIOD:
        return [total]  # no repeating pattern to extrapolate from
    small = [prefix + period, prefix + 2 * period]
    return [total] if small[1] >= total else small


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
    from ..catalog import resolve_model

    resolved = resolved or resolve_model(cfg.model)
    spec = resolved.spec
    alloc_config = AllocatorConfig.from_conf(alloc_conf)
    if resolved.hf_config is None:
        return analytic_fallback(spec, cfg, cluster, (
            f"transformers does not implement model type '{spec.model_type}', "
            "so the model cannot be built for a trace"), alloc_config)
    started = time.perf_counter()
    try:
        from ..memory.training import llm_seq_len

        counts = layer_counts(resolved.hf_config, full)
        seq = llm_seq_len(spec, cfg)  # image tokens join the text (vision tower not run)
        runs = [trace_once(resolved.hf_config, cfg, cluster, n, alloc_config, timeline_points,
                           seq_len=seq) for n in counts]
    except TraceUnsupported as err:
        return analytic_fallback(spec, cfg, cluster, str(err), alloc_config)
    except TraceFailed as err:
        return analytic_fallback(spec, cfg, cluster, f"the trace failed in module "
                                 f"'{err.module or '(outside any module)'}': {err}", alloc_config)
    return _estimate(spec, cfg, cluster, runs, num_layers_of(resolved.hf_config),
                     time.perf_counter() - started)


def analytic_fallback(spec: Any, cfg: RunConfig, cluster: Cluster | None, reason: str,
                      alloc_config: AllocatorConfig | None = None) -> MemoryEstimate:
    from ..memory import estimate_training

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
               num_layers: int, alloc_config: AllocatorConfig, timeline_points: int = 800,
               seq_len: int | None = None) -> TraceStats:
    """Build the model with ``num_layers`` layers, run the steps, analyse the stream."""
    from .build import fake_mode
    from .cuda_emulation import CudaEmulation
    from .step import make_batch

    built = build_model(hf_config, cfg, mode="fake", num_layers=num_layers)
    model = built.model
    fake = fake_mode()
    seq = seq_len or cfg.seq_len
    with fake:
        batch = make_batch(model, cfg.micro_batch_size, seq, "cpu")
        eval_batch = make_batch(model, cfg.eval_batch_size, seq, "cpu") if _wants_eval(cfg) else None
    tracker = run_tracked(model, cfg, batch, eval_batch, device_type="cpu", fake=fake,
                          emulation=CudaEmulation(cublas_bytes=_cublas_bytes(cluster)))
    stats = analyze(tracker, alloc_config, num_layers=built.num_layers,
                    param_count=built.param_count, trainable_params=built.trainable_params,
                    timeline_points=timeline_points)
    stats.notes.extend(built.notes)
    return stats


def _wants_eval(cfg: RunConfig) -> bool:
    """Evaluation is traced when the configuration evaluates (as the analytic model does)."""
    return bool(cfg.eval.batch_size or cfg.eval.steps or cfg.eval.predict_with_generate)


def register_model(tracker: Any, model: Any, cfg: RunConfig, batches: list[Any]) -> None:
    """Weights, adapters, quantization states and inputs exist before the step."""
    lora = cfg.method in ("lora", "qlora")
    for p in model.parameters():
        tracker.track(p, "parameter", ADAPTERS if (lora and p.requires_grad) else WEIGHTS)
        state = getattr(p, "quant_state", None)
        if state is not None:
            for t in _quant_state_tensors(state):
                tracker.track(t, "quant_state", WEIGHTS)
    for b in model.buffers():
        tracker.track(b, "buffer", WEIGHTS)
    for batch in batches:
        for t in (batch or {}).values():
            tracker.track(t, "input", INPUTS)


def _quant_state_tensors(state: Any) -> list[Any]:
    import torch

    out = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    inner = getattr(state, "state2", None)
    if inner is not None:
        out += [v for v in vars(inner).values() if isinstance(v, torch.Tensor)]
    return out


def _output_embedding_name(model: Any) -> str | None:
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is head:
            return name
    return None


def run_tracked(model: Any, cfg: RunConfig, batch: dict, eval_batch: dict | None, *,
                device_type: str, fake: Any = None, emulation: Any = None,
                iterations: int = 2) -> Any:
    """Run the training steps under a StorageTracker and return it."""
    import contextlib

    from .step import run_steps
    from .tracker import GRADIENTS, StorageTracker

    tracker = StorageTracker(emulation=emulation)
    register_model(tracker, model, cfg, [batch, eval_batch])
    head = _output_embedding_name(model)

    def on_enter(name: str, backward: bool) -> None:
        if name == head and not backward:
            tracker.region = LOGITS

    def on_exit(name: str, backward: bool) -> None:
        if name == head and backward:
            tracker.region = None

    def on_phase(name: str, iteration: int) -> None:
        tracker.start_phase(name, iteration)
        tracker.region = LOGITS if (name == "backward" and head) else None

    states = PAGED if cfg.optimizer.startswith("paged") else OPTIMIZER
    modules = ModuleStack(model, on_enter, on_exit)
    tracker.modules = modules
    try:
        with fake if fake is not None else contextlib.nullcontext(), tracker, modules:
            tracker.losses = run_steps(
                model, cfg, batch, device_type=device_type, iterations=iterations,
                on_phase=on_phase, on_grads=lambda g: tracker.categorize(g, GRADIENTS),
                on_states=lambda s: tracker.categorize(s, states), eval_batch=eval_batch)
    except NotImplementedError as err:
        raise TraceUnsupported(str(err)) from None
    except Exception as err:  # the model's own code failed: say where, fall back
        where = modules.failed_in or ""
        raise TraceFailed(where.removeprefix("base_model.model."), err) from err
    finally:
        tracker.start_phase("teardown", 0)
        tracker.modules = None
    return tracker


def _assumptions(cfg: RunConfig, runs: list[TraceStats], layers: int) -> list[str]:
    out = [
        "trace: the real transformers/PEFT/bitsandbytes modules run two HF-Trainer steps "
        "(forward under autocast with accelerate's fp32 output conversion, backward, "
        "gradient clipping, optimizer step, zero_grad) on CPU fake tensors; every tensor "
        "storage is tracked at the dispatcher",
        "CUDA emulation: FlashAttention-2 backward buffers (softmax_d, dq_accum, GQA "
        "dk/dv_expanded), cuBLAS + cuBLASLt workspaces for the forward thread and the "
        "autograd thread, bitsandbytes' dequantized 4-bit weight per matmul; CPU autocast "
        "stands in for CUDA autocast (transformers upcasts norms, softmax and loss itself)",
        "batches are full length without padding (no attention mask), use_cache off",
        "reserved memory from replaying the alloc/free stream through a simulation of "
        "PyTorch's CUDA caching allocator (one stream)",
    ]
    if len(runs) == 2:
        out.append(
            f"traced {runs[0].num_layers} and {runs[1].num_layers} decoder layers and "
            f"extrapolated linearly to {layers}; per-module peaks and the timeline are those "
            f"of the {runs[1].num_layers}-layer trace")
    if cfg.world_size > 1:
        out.append("data parallel without ZeRO: DDP gradient buckets as large as the "
                   "gradients are added to every phase (not traced)")
    if cfg.optimizer.startswith("paged"):
        out.append("paged optimizer states live in CUDA unified memory, outside the "
                   "caching allocator: reported as paged_optimizer_bytes, not counted")
    if cfg.data.images_per_sample:
        out.append("images: the vision tower is not run; the language model sees the image "
                   "tokens as extra sequence positions (seq_len + images × tokens per image)")
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
    from ..memory import estimate_training

    analytic = estimate_training(spec, cfg, cluster).breakdown.get("generation")
    if not analytic:
        return None
    base = breakdown.get("evaluation") or breakdown["optimizer"]
    out = {k: v for k, v in base.items() if k in PERSISTENT}
    for key in ("kv_cache", "activations", "logits"):
        if analytic.get(key):
            out[key] = analytic[key]
    return out


def _estimate(spec: Any, cfg: RunConfig, cluster: Cluster | None, runs: list[TraceStats],
              layers: int, seconds: float) -> MemoryEstimate:
    from ..memory.overheads import non_pytorch_bytes

    last = runs[-1]
    if len(runs) == 2:
        nums = extrapolate(runs[0], runs[1], layers)
    else:
        nums = {"breakdown": last.breakdown, "tensor_peaks": last.tensor_peaks,
                "peak_reserved_bytes": last.peak_reserved_bytes, "paged_bytes": last.paged_bytes,
                "param_count": last.param_count, "trainable_params": last.trainable_params}
    breakdown = {p: dict(c) for p, c in nums["breakdown"].items()}
    extra_reserved = 0
    if cfg.world_size > 1:
        buckets = breakdown.get("optimizer", {}).get("gradients", 0)
        for parts in breakdown.values():
            parts["ddp_buckets"] = buckets
        extra_reserved = buckets
    generation = _analytic_generation(spec, cfg, cluster, breakdown)
    if generation:
        breakdown["generation"] = generation
    totals = {p: sum(c.values()) for p, c in breakdown.items()}
    peak_phase = max(totals, key=totals.__getitem__)
    peak_alloc = totals[peak_phase]
    reserved = max(nums["peak_reserved_bytes"] + extra_reserved, peak_alloc)
    non_pt = non_pytorch_bytes(cluster, cfg.world_size)
    extra = {
        "per_module_peak": last.module_peaks,
        "timeline": last.timeline,
        "allocator": last.allocator,
        "layers_traced": [r.num_layers for r in runs],
        "tensor_peaks": nums["tensor_peaks"],
        "trace_seconds": round(seconds, 2),
        "events": sum(r.num_events for r in runs),
    }
    if nums["paged_bytes"]:
        extra["paged_optimizer_bytes"] = nums["paged_bytes"]
    return MemoryEstimate(
        method="trace", model=spec.name, param_count=nums["param_count"],
        trainable_params=nums["trainable_params"], peak_phase=peak_phase,
        peak_allocated_bytes=peak_alloc, peak_reserved_bytes=reserved,
        device_peak_bytes=reserved + sum(non_pt.values()), breakdown=breakdown,
        non_pytorch_bytes=non_pt, assumptions=tuple(_assumptions(cfg, runs, layers)),
        config=cfg.to_dict(), gpu=cluster.gpu.name if cluster else None,
        gpu_memory_bytes=cluster.gpu.memory_bytes if cluster else None, extra=extra,
    )
