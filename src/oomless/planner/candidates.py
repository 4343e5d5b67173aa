"""Candidate generation: every configuration the planner considers, as families.

A *family* fixes every knob except how the per-GPU batch is split into micro
batch × gradient accumulation; the planner walks each family's splits from
the smallest micro batch up (memory grows with the micro batch, so the first
split that does not fit ends the walk). Nothing here knows which choice is
"right" for a GPU: the seeds' decision tree (QLoRA + checkpointing on one 24 GB
card, ZeRO for full fine-tuning on 8 GPUs, flash attention and checkpointing
for 32k tokens, smaller micro batch with more accumulation) must fall out of
the memory estimate and the speed model.

Knobs come in two kinds. *Faithful* knobs leave the optimisation unchanged
(micro batch × accumulation at the same effective batch, checkpointing,
attention kernel, ZeRO stage and offload, paged optimizer states). *Trade-offs*
change what is trained or how exactly (pure bf16, 8-bit optimizer states, a
narrower LoRA, truncating the longest samples, packing); each is listed with
the plan, and plans with fewer trade-offs rank first.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product
from typing import TYPE_CHECKING

from ..config import RunConfig
from ..knobs import OPTIMIZERS, offloaded_optimizer
from ..models.hardware import Cluster
from ..models.spec import ModelSpec

if TYPE_CHECKING:
    from .datastats import DataProfile

# Knobs the planner may change; a request lists those it must keep in ``fixed``.
KNOBS = ("method", "quantization", "precision", "optimizer", "lora", "grad_ckpt", "attn",
         "zero", "seq_len", "packing", "eval_batch")

SEARCH_ASSUMPTIONS = (
    "searched: method (unless fixed), QLoRA nf4 and int8, LoRA rank 8 and attention-only "
    "targets as trade-offs, bf16 (fp16 without bf16) and pure bf16 (full fine-tuning without "
    "ZeRO only: LLaMA-Factory refuses it with ZeRO-3, DeepSpeed keeps fp32 masters anyway), "
    "AdamW / paged / 8-bit for full fine-tuning (LoRA/QLoRA keep the requested optimizer: "
    "their states are < 1% of memory), checkpointing, sdpa and flash, every micro batch × "
    "accumulation split, ZeRO 0-3 with optimizer/parameter offload (QLoRA under ZeRO-3 "
    "only on several GPUs, in 4-bit with bnb_4bit_quant_storage bfloat16)",
    "attention 'flash' means transformers' flash_attention_2 (needs the flash-attn package, "
    "Ampere or newer, head_dim ≤ 256); sliding-window attention is counted as full attention",
)

# Model types whose transformers implementation has no FlashAttention-2 path
# (checked against transformers' `_supports_flash_attn` in tests/planner): Mllama
# (MllamaForConditionalGeneration / MllamaForCausalLM: _supports_flash_attn False) and
# Llama 4 (Llama4ForConditionalGeneration / Llama4ForCausalLM: _supports_flash_attn False).
NO_FLASH_MODEL_TYPES = frozenset({"mllama", "llama4"})
FLASH_MAX_HEAD_DIM = 256  # FlashAttention-2 supports head dimensions up to 256


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for: the run to keep, the hardware, the limits.

    ``base`` is the requested run (its method, LoRA, lengths, evaluation);
    ``fixed`` names knobs (see KNOBS) the planner must not change;
    ``method_auto``: any method may be chosen.
    """

    base: RunConfig
    cluster: Cluster
    effective_batch: int
    headroom: float = 0.10
    objective: str = "speed"  # speed | memory | change
    top: int = 5
    method_auto: bool = False
    fixed: frozenset[str] = frozenset()
    data: DataProfile | None = None
    host_ram_bytes: int = 0  # usable host RAM per node for offload
    host_ram_assumed: bool = True
    notes: tuple[str, ...] = ()
    shardings: tuple[tuple[int, str], ...] | None = None  # (ZeRO, offload) a format can express
    time_budget_s: float = 0.0  # the search stops after this long (planner/plan.py); 0: none
    # a plan's band upper bound (memory/band.py) must fit the card too; check's second
    # pass, when no plan does, drops it and says the fix is tight
    within_band: bool = True

    @property
    def budget_bytes(self) -> int:
        return int((1 - self.headroom) * self.cluster.gpu.memory_bytes)

    def free(self, knob: str) -> bool:
        return knob not in self.fixed

    @property
    def per_gpu_batch(self) -> int:
        return self.effective_batch // self.cluster.world_size


@dataclass(frozen=True)
class Family:
    cfg: RunConfig  # micro_batch_size = per-GPU batch, grad_accum = 1 (set per split)
    group: str  # method variant × sharding, for nearest misses
    tradeoffs: tuple[str, ...] = field(default=())
    order: int = 0  # enumeration order: preference among equals


def batch_splits(per_gpu_batch: int) -> list[tuple[int, int]]:
    """(micro batch, accumulation) pairs whose product is the per-GPU batch, smallest micro
    first: the divisors up to the square root and their partners (√n steps, not n)."""
    small = [b for b in range(1, math.isqrt(per_gpu_batch) + 1) if per_gpu_batch % b == 0]
    micros = small + [per_gpu_batch // b for b in reversed(small) if b * b != per_gpu_batch]
    return [(b, per_gpu_batch // b) for b in micros]


def flash_supported(spec: ModelSpec, cluster: Cluster, precision: str) -> bool:
    """FlashAttention-2: Ampere or newer, 16-bit, head_dim ≤ 256, and a model
    class that implements it."""
    return (cluster.gpu.flash_attention and precision != "fp32"
            and spec.head_dim <= FLASH_MAX_HEAD_DIM
            and spec.model_type not in NO_FLASH_MODEL_TYPES)


def method_label(method: str, bits: int | None) -> str:
    if method == "qlora":
        return "qlora-nf4" if bits == 4 else "qlora-int8"
    return method


def sharding_label(zero: int, offload: str) -> str:
    if zero == 0:
        return "no ZeRO"
    return f"ZeRO-{zero}" + ("" if offload == "none" else f" + {offload} offload")


def _methods(req: PlanRequest, spec: ModelSpec) -> list[tuple[str, int | None]]:
    base = req.base
    if spec.quantization is not None:
        return [("lora", None)]  # a pre-quantized checkpoint trains through adapters only
    if base.quantization.method != "bnb" and base.method == "qlora":
        return [("qlora", base.quantization.bits)]  # HQQ/EETQ: the bits the user chose
    if req.method_auto:
        return [("lora", None), ("qlora", 4), ("qlora", 8), ("full", None)]
    if base.method == "qlora":
        if req.free("quantization"):
            return [("qlora", 4), ("qlora", 8)]
        return [("qlora", base.quantization.bits)]
    return [(base.method, None)]


def _shardings(req: PlanRequest, method: str, bits: int | None) -> list[tuple[int, str]]:
    base = req.base
    if not req.free("zero"):
        return [(base.zero, base.offload)]
    multi = req.cluster.world_size > 1
    # QLoRA shards under ZeRO-3 / FSDP in 4-bit with a float quant storage, over several
    # GPUs (the PEFT docs' recipes); one GPU keeps QLoRA unsharded
    zero3 = method != "qlora" or (bits == 4 and base.quantization.storage != "uint8" and multi)
    out = [(0, "none")]
    if multi:
        out += [(1, "none"), (2, "none")] + ([(3, "none")] if zero3 else [])
    out.append((2, "optimizer"))
    if zero3:
        out += [(3, "optimizer"), (3, "all")]
    if req.shardings is not None:
        allowed = set(req.shardings) | {(base.zero, base.offload)}
        out = [z for z in out if z in allowed]
    return out


def _precisions(req: PlanRequest, method: str, zero: int) -> list[str]:
    base = req.base
    if not req.free("precision"):
        return [base.precision]
    half = "bf16" if req.cluster.gpu.bf16 else "fp16"
    out = [half]
    # pure bf16 (LLaMA-Factory pure_bf16) halves full fine-tuning's states; it is
    # incompatible with DeepSpeed ZeRO-3 there, and under ZeRO DeepSpeed keeps
    # fp32 master weights anyway: offered without ZeRO only. For adapters it saves <1%.
    if req.cluster.gpu.bf16 and method == "full" and zero == 0:
        out.append("pure-bf16")
    return out


def _optimizers(req: PlanRequest, method: str) -> list[str]:
    base = req.base
    if not req.free("optimizer") or method != "full":
        # LoRA/QLoRA optimizer states are well under 1% of the memory: keep the request's.
        return [base.optimizer]
    # the AdamW family: the same update rule, states in fp32 / 8-bit / unified memory
    return [k.name for k in OPTIMIZERS.values() if k.full_states == 2]


def attention_targets(spec: ModelSpec) -> list[str]:
    return [lin.name for lin in spec.attention_linears()]


def _lora_variants(req: PlanRequest, spec: ModelSpec, method: str) -> list[tuple[int, object, tuple]]:
    """(rank, targets, trade-offs) for adapter methods."""
    lora = req.base.lora
    out: list[tuple[int, object, tuple]] = [(lora.r, lora.targets, ())]
    if method == "full" or not req.free("lora"):
        return out[:1]
    attn = attention_targets(spec)
    wide = lora.targets == "all-linear" or not set(lora.targets) <= set(attn)
    if wide:
        out.append((lora.r, attn, (f"LoRA on attention only ({', '.join(attn)})",)))
    if lora.r > 8:
        out.append((8, lora.targets, (f"LoRA rank {lora.r} → 8",)))
    return out


def _lengths(req: PlanRequest, spec: ModelSpec) -> list[tuple[int, tuple]]:
    """(seq_len, trade-offs): the request's, or cut-offs the data allows. Data
    lengths include image tokens; seq_len counts text (the estimate adds images)."""
    if req.data is None or not req.free("seq_len"):
        return [(req.base.seq_len, ())]
    images = req.base.data.images_per_sample if spec.vision else 0
    per_image = req.base.data.image_tokens or (spec.vision.tokens_per_image if spec.vision else 0)
    return [(max(1, c.length - images * per_image), ((c.describe(),) if c.cut else ()))
            for c in req.data.cutoffs]


def _attns(req: PlanRequest, spec: ModelSpec, precision: str) -> list[str]:
    if not req.free("attn"):
        return [req.base.attn]
    return (["flash"] if flash_supported(spec, req.cluster, precision) else []) + ["sdpa"]


def _eval_batches(req: PlanRequest) -> list[int | None]:
    eb = req.base.eval.batch_size
    if eb is None or not req.free("eval_batch"):
        return [eb]
    out = [eb]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def _packings(req: PlanRequest) -> list[bool]:
    if req.data is not None and req.free("packing"):
        return [False, True]
    return [req.base.data.packing]


def _ckpts(req: PlanRequest) -> list[bool]:
    return [False, True] if req.free("grad_ckpt") else [req.base.grad_ckpt]


def _tradeoffs(base: RunConfig, precision: str, opt: str, packing: bool) -> tuple[str, ...]:
    out: tuple[str, ...] = ()
    if precision == "pure-bf16" and base.precision != "pure-bf16":
        out += ("pure bf16 (no fp32 master weights or optimizer states)",)
    if OPTIMIZERS[opt].eight_bit and not OPTIMIZERS[base.optimizer].eight_bit:
        out += (f"8-bit optimizer states ({opt})",)
    if packing and not base.data.packing:
        out += ("packing several samples per sequence (fewer samples per step)",)
    return out


def families(req: PlanRequest, spec: ModelSpec) -> Iterator[Family]:
    """Every family of candidate configurations, in preference order."""
    base = req.base
    order = 0
    for method, bits in _methods(req, spec):
        quant = base.quantization.model_copy(update={"bits": bits}) if bits else base.quantization
        for (r, targets, lora_to), (zero, offload) in product(
                _lora_variants(req, spec, method), _shardings(req, method, bits)):
            if zero == 3 and spec.quantization is not None:
                continue  # quantized checkpoints are not sharded by ZeRO-3 (LLaMA-Factory refuses)
            lora = base.lora.model_copy(update={"r": r, "targets": targets})
            group = f"{method_label(method, bits)} · {sharding_label(zero, offload)}"
            for precision in _precisions(req, method, zero):
                rest = product(_optimizers(req, method), _lengths(req, spec), _packings(req),
                               _ckpts(req), _attns(req, spec, precision), _eval_batches(req))
                seen: set[tuple] = set()
                for opt, (length, len_to), packing, ckpt, attn, eb in rest:
                    if offload != "none" and not OPTIMIZERS[opt].zero_offload:
                        if not req.free("optimizer"):
                            continue  # DeepSpeed would step CPU-Adam (knobs.OptimizerKind)
                        opt = offloaded_optimizer(opt).name
                    if (opt, length, packing, ckpt, attn, eb) in seen:
                        continue
                    seen.add((opt, length, packing, ckpt, attn, eb))
                    cfg = base.model_copy(update=dict(
                        method=method, quantization=quant, lora=lora, zero=zero,
                        offload=offload, precision=precision, optimizer=opt, seq_len=length,
                        data=base.data.model_copy(update={"packing": packing}),
                        grad_ckpt=ckpt, attn=attn,
                        eval=base.eval.model_copy(update={"batch_size": eb}),
                        micro_batch_size=req.per_gpu_batch, grad_accum=1))
                    order += 1
                    trade = lora_to + len_to + _tradeoffs(base, precision, opt, packing)
                    yield Family(cfg, group, trade, order)
