"""Quantified fixes for training-side causes.

With a run configuration every fix is priced by the estimator (``Predictor``):
the smallest change whose predicted peak fits the GPU and that saves at least
what the log says was missing. Without one, fixes are computed from the log's
own numbers and settings (``RunHints``), and say so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..knobs import OPTIMIZERS
from ..units import GiB, fmt_bytes
from .events import Cause, Fix, OomEvent, RunHints
from .predict import Predictor
from .view import GpuView


@dataclass(frozen=True)
class FixContext:
    event: OomEvent
    view: GpuView
    hints: RunHints
    predictor: Predictor | None


def _priced(ctx: FixContext, code: str, text: str, changes: dict, keeps: bool = True,
            expandable: bool = False) -> Fix:
    """A fix whose predicted peak is the estimator's for ``changes``."""
    p = ctx.predictor
    if p is None:
        return Fix(code, text, changes, keeps)
    peak = p.peak(expandable, **{k: v for k, v in changes.items()
                                 if k in _CFG_KEYS or k.startswith("eval.")})
    if peak is None:
        return Fix(code, text, changes, keeps)
    return Fix(code, text, changes, keeps, peak, p.gpu_bytes, "estimator", p.fits(peak))


_CFG_KEYS = {"micro_batch_size", "grad_accum", "grad_ckpt", "zero", "method", "optimizer",
             "seq_len", "offload", "attn"}


def _effective(b: int, a: int, world: int) -> str:
    if world > 1:
        return f"effective batch {b * a} × {world} GPUs = {b * a * world} unchanged"
    return f"effective batch {b * a} unchanged"


def _needed(ctx: FixContext) -> int:
    return ctx.view.shortfall_bytes or 0


def _pick(p: Predictor, current: int | None, needed: int, options: list[tuple[dict, int]]):
    """The first option (largest first) that fits and saves what was missing."""
    for changes, value in options:
        peak = p.peak(**changes)
        if peak is None:
            continue
        saves = (current - peak) if current is not None else needed
        if p.fits(peak) and saves >= needed:
            return changes, value
    return options[-1] if options else None


def micro_batch(ctx: FixContext) -> Fix | None:
    p = ctx.predictor
    if p is not None:
        mb, acc, world = p.cfg.micro_batch_size, p.cfg.grad_accum, p.cfg.world_size
    else:
        mb, acc, world = ctx.hints.micro_batch_size, ctx.hints.grad_accum or 1, ctx.hints.world_size or 1
    if mb is None:
        return Fix("micro_batch", "halve the micro batch and double gradient accumulation "
                   "(effective batch unchanged)", {}, True)
    per_gpu = mb * acc
    sizes = [b for b in range(mb - 1, 0, -1) if per_gpu % b == 0]
    if not sizes:
        return None
    if p is None:
        b = max(s for s in sizes if s <= max(1, mb // 2))
    else:
        options = [({"micro_batch_size": s, "grad_accum": per_gpu // s}, s) for s in sizes]
        b = _pick(p, p.peak(), _needed(ctx), options)[1]
    a = per_gpu // b
    text = f"micro batch {b}, accumulation {a}, {_effective(b, a, world)}"
    return _priced(ctx, "micro_batch", text, {"micro_batch_size": b, "grad_accum": a})


def grad_ckpt(ctx: FixContext) -> Fix | None:
    p = ctx.predictor
    enabled = p.cfg.grad_ckpt if p else ctx.hints.grad_ckpt
    if enabled:
        return None
    return _priced(ctx, "grad_ckpt", "gradient checkpointing on (same training, ~30% slower steps)",
                   {"grad_ckpt": True})


def expandable_segments(ctx: FixContext) -> Fix:
    text = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reuses reserved-but-unallocated memory)"
    changes = {"env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    if ctx.predictor is not None:
        est = ctx.predictor.estimate(expandable=True)
        if est is not None:
            p = ctx.predictor
            return Fix("expandable_segments", text, changes, True, est.device_peak_bytes,
                       p.gpu_bytes, "estimator", p.fits(est.device_peak_bytes))
    v = ctx.view
    if v.used_bytes is None or v.unallocated_bytes is None or v.requested_bytes is None or not v.total_bytes:
        return Fix("expandable_segments", text, changes, True)
    after = v.used_bytes - v.unallocated_bytes + v.requested_bytes
    return Fix("expandable_segments", text, changes, True, after, v.total_bytes, "arithmetic",
               after <= v.total_bytes)


def free_gpu(ctx: FixContext) -> Fix:
    v = ctx.view
    who = ", ".join(f"process {p.pid} ({fmt_bytes(p.memory_bytes)})"
                    for p in v.big_others(v.total_bytes or 1))
    text = (f"stop {who} or run on a free GPU (CUDA_VISIBLE_DEVICES)" if who else
            "stop the other programs on this GPU (nvidia-smi lists them) or run on a free GPU")
    if v.used_bytes is None or v.requested_bytes is None or not v.total_bytes:
        return Fix("free_gpu", text, {}, True, domain="environment")
    held = v.others_bytes or (v.outside_pytorch_bytes or 0)
    mine = v.used_bytes - held + v.requested_bytes
    return Fix("free_gpu", text, {}, True, mine, v.total_bytes, "arithmetic", mine <= v.total_bytes,
               domain="environment")


def eval_batch(ctx: FixContext) -> Fix | None:
    p = ctx.predictor
    current = p.cfg.eval_batch_size if p else (ctx.hints.eval_batch_size or ctx.hints.micro_batch_size)
    if not current or current <= 1:
        return None
    if p is None:
        b = current // 2
    else:
        options = [({"eval.batch_size": s}, s) for s in range(current - 1, 0, -1)]
        b = _pick(p, p.peak(), _needed(ctx), options)[1]
    return _priced(ctx, "eval_batch", f"eval batch {b} (was {current}; training unchanged)",
                   {"eval.batch_size": b})


def max_new_tokens(ctx: FixContext) -> Fix | None:
    p = ctx.predictor
    current = p.cfg.eval.max_new_tokens if p else ctx.hints.max_new_tokens
    if not current or current < 2:
        return None
    return _priced(ctx, "max_new_tokens", f"max_new_tokens {current // 2} when predicting (was {current})",
                   {"eval.max_new_tokens": current // 2}, keeps=False)


def zero_stage(ctx: FixContext) -> int | None:
    """ZeRO stage in use: the config's, the log's, or the DeepSpeed file in the traceback."""
    if ctx.predictor is not None:
        return ctx.predictor.cfg.zero
    if any("deepspeed/runtime/zero/stage3.py" in f for f in ctx.event.frames):
        return 3
    return ctx.hints.zero_stage


def zero3(ctx: FixContext) -> Fix:
    p = ctx.predictor
    if (zero_stage(ctx) or 0) >= 3:
        return _priced(ctx, "offload", "ZeRO-3 with optimizer states offloaded to CPU (offload: "
                       "optimizer; needs host RAM, slower steps)", {"offload": "optimizer"})
    world = p.cfg.world_size if p else (ctx.hints.world_size or 0)
    over = f" over {world} GPUs" if world > 1 else ""
    return _priced(ctx, "zero3", f"DeepSpeed ZeRO-3{over}: weights, gradients and optimizer states "
                   "sharded instead of replicated (or FSDP full shard)", {"zero": 3})


def smaller_optimizer(ctx: FixContext) -> Fix | None:
    p = ctx.predictor
    if p is not None and OPTIMIZERS[p.cfg.optimizer].saves_memory_over_adamw:
        return None
    return _priced(ctx, "optimizer", "8-bit AdamW (bitsandbytes): optimizer states 2 bytes/param "
                   "instead of 8", {"optimizer": "adamw-8bit"}, keeps=False)


def quantize_base(ctx: FixContext) -> Fix | None:
    p = ctx.predictor
    if p is not None and (p.cfg.method == "qlora" or p.cfg.zero == 3):
        return None
    if ctx.event.library == "bitsandbytes":  # already loading quantized weights
        return None
    return _priced(ctx, "qlora", "QLoRA: 4-bit base weights with LoRA adapters", {"method": "qlora"},
                   keeps=False)


def logits_chunking(ctx: FixContext) -> Fix:
    text = ("a fused/chunked cross-entropy (e.g. Liger kernel's fused linear cross-entropy) that never "
            "materialises the full logits")
    p = ctx.predictor
    est = p.estimate() if p else None
    if est is None:
        return Fix("chunked_loss", text, {}, True)
    logits_bytes = est.components.get("logits", 0)
    after = est.device_peak_bytes - logits_bytes
    return Fix("chunked_loss", f"{text} ({fmt_bytes(logits_bytes)} of logits buffers)", {}, True,
               after, p.gpu_bytes, "arithmetic", p.fits(after))


def cap_length(ctx: FixContext) -> Fix:
    p = ctx.predictor
    s = p.cfg.seq_len if p else ctx.hints.seq_len
    cap = f"cut every sample at {s} tokens" if s else "cut samples at a maximum length"
    text = (f"{cap} and group batches by length; `oomless train` splits a batch that runs out of "
            "memory instead of crashing")
    return _priced(ctx, "cap_length", text, {}, keeps=True)


def memory_fraction(ctx: FixContext) -> Fix:
    v = ctx.view
    text = (f"raise torch.cuda.set_per_process_memory_fraction (allowed {fmt_bytes(v.allowed_bytes or 0)})"
            " or remove the cap")
    if v.reserved_bytes is None or v.requested_bytes is None or not v.total_bytes:
        return Fix("memory_fraction", text, {}, True)
    after = v.reserved_bytes + v.requested_bytes
    return Fix("memory_fraction", text, {}, True, after, v.total_bytes, "arithmetic", after <= v.total_bytes)


def host_ram_needed(predictor: Predictor) -> Fix | None:
    """The host RAM the run needs (offload, pinned buffers), from the estimator."""
    est = predictor.estimate()
    if est is None or not est.host_ram_bytes:
        return None
    have = predictor.cluster.host_ram_bytes
    return Fix("host_ram_needed", "size host RAM for this run: offloaded states and pinned buffers "
               f"need {fmt_bytes(est.host_ram_bytes)} per node", {}, True, est.host_ram_bytes, have,
               "estimator", None if have is None else est.host_ram_bytes <= have)


def environment_fix() -> Fix:
    return Fix("environment", "look outside PyTorch: WSL2's share of GPU memory, the container's "
               "or MIG slice's limit, another CUDA context (nvidia-smi), the driver version; a "
               "smaller batch will not help", {}, True, domain="environment")


def training_fixes(cause: Cause, ctx: FixContext) -> list[Fix | None]:
    code = cause.code
    if code == "vision_attention":
        from .vision import image_size_fix

        return [image_size_fix(cause, ctx.view)]
    if code == "free_but_failed":
        return [environment_fix()]
    if code == "fragmentation":
        return [expandable_segments(ctx)]
    if code == "other_process":
        return [free_gpu(ctx)]
    if code == "memory_fraction":
        return [memory_fraction(ctx)]
    if code in ("activations", "long_sample"):
        extra = [cap_length(ctx)] if code == "long_sample" else []
        return [*extra, micro_batch(ctx), grad_ckpt(ctx)]
    if code == "logits":
        return [micro_batch(ctx), logits_chunking(ctx)]
    if code == "evaluation":
        return [eval_batch(ctx)]
    if code == "generation":
        return [eval_batch(ctx), max_new_tokens(ctx)]
    if code == "replicas":
        return [zero3(ctx)]
    if code == "optimizer_states":
        return [zero3(ctx), smaller_optimizer(ctx)]
    if code == "model_too_large":
        return [zero3(ctx), quantize_base(ctx)]
    if code == "oversized_request":
        return [Fix("check_lengths", "find the sample or step that asks for this much: cap the "
                    "sequence length (cutoff_len / max_seq_length / truncation), check packing and "
                    "the data for a runaway-long sample, and use a flash/SDPA attention instead of "
                    "eager on long sequences; a smaller batch does not help", {}, True),
                cap_length(ctx)]
    if code == "nccl_buffers":
        return [Fix("nccl_headroom", f"leave at least {fmt_bytes(GiB)} free for NCCL's buffers: "
                    "lower the micro batch or the other memory users first", {}, True),
                micro_batch(ctx)]
    return []
