"""Throughput model: predicted time of one optimizer step for a run configuration.

Torch-free arithmetic, meant to *rank* configurations that fit, not to replace
a measurement. One optimizer step on one GPU is

    step = Σ micro batches (compute + dequantisation + kernel launches
                            + exposed ZeRO-3 gathers + parameter offload)
           + exposed gradient communication + optimizer step (GPU or CPU)

Compute is FLOPs at a utilisation (MFU) that grows with the tokens of a micro
batch. Every constant below is an assumption, listed in ``ASSUMPTIONS`` and in
each plan; none is a measurement of this project yet (no GPU run has been
calibrated against it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import RunConfig
from ..knobs import OPTIMIZERS
from ..models.hardware import Cluster, GPUSpec
from ..models.spec import ModelSpec

# --- utilisation ------------------------------------------------------------------
# Model-FLOPs utilisation an HF Trainer fine-tune reaches with large micro
# batches: 35–45 % of the dense peak is the range commonly reported for
# transformers + FlashAttention-2 on A100-class GPUs; Hopper and newer run
# further below their (much higher) peak without FP8 or fused kernels.
MFU_MAX = 0.40
MFU_MAX_HOPPER = 0.33  # compute capability ≥ 9.0
# Small micro batches under-fill the GEMMs: mfu(t) = MFU_MAX · t / (t + t_half)
# with t tokens per micro batch and t_half = TOKENS_HALF_SCALE / hidden_size
# (256 tokens for hidden 4096; narrow models need more rows). Heuristic.
TOKENS_HALF_SCALE = 2**20
# Host-side overhead per decoder layer and pass (kernel launches, Python,
# autograd bookkeeping): about 50 kernels × 3 µs forward, twice that backward.
LAUNCH_S_PER_LAYER_PASS = 0.15e-3
# Attention FLOPs run at this fraction of the GEMM utilisation (flash kernels
# on causal masks); eager attention additionally streams the s² scores.
ATTN_EFFICIENCY = 0.7
# Memory-bound kernels (dequantisation, optimizer step, eager softmax) reach
# this fraction of the card's peak bandwidth.
BANDWIDTH_EFFICIENCY = 0.6
# bitsandbytes dequantises every 4-bit weight to 16-bit for each matmul:
# read 0.5 B (+ absmax), write 2 B per parameter and pass (bnb
# functional.dequantize_4bit; the matmul's own read of the 16-bit copy is compute).
NF4_DEQUANT_BYTES_PER_PARAM = 2.5
# LLM.int8: read 1 B, write 2 B per parameter in the backward dequantisation;
# the forward int8 matmul with outlier decomposition is slower than a 16-bit
# GEMM (Dettmers et al. 2022, §5: slower than fp16 below ~6.7B): factor below.
INT8_DEQUANT_BYTES_PER_PARAM = 3.0
INT8_FORWARD_SLOWDOWN = 1.25
# Fused AdamW reads param, grad, m, v and writes param, m, v: with fp32 states
# and 4-byte params ≈ 28 B per trainable parameter; 8-bit states ≈ 16 B.
ADAM_BYTES_PER_PARAM = 28.0
ADAM8BIT_BYTES_PER_PARAM = 16.0
# DeepSpeed CPU-Adam throughput per node (parameters updated per second), a
# conservative figure for a many-core server CPU with AVX-512 (Ren et al.
# 2021, ZeRO-Offload §5 reports several billion per second on 2 sockets).
CPU_ADAM_PARAMS_PER_S = 2.0e9
# Collective efficiency: achieved / nominal link bandwidth for NCCL rings.
COLLECTIVE_EFFICIENCY = 0.8
# Between nodes: one 200 Gb/s InfiniBand HDR link per GPU (DGX A100 layout).
INTER_NODE_GBS = 25.0
# Fraction of a micro batch's backward (or forward+backward for ZeRO-3
# gathers) that hides communication behind compute (bucketed overlap).
COMM_OVERLAP = 0.8

ASSUMPTIONS = (
    f"step time = FLOPs at {MFU_MAX:.0%} of the dense bf16/fp16 peak for large micro batches "
    f"({MFU_MAX_HOPPER:.0%} on Hopper and newer), lower for small ones "
    "(mfu · t/(t + 2^20/hidden)); not calibrated on a GPU yet",
    "FLOPs per token: 2·N forward; backward 4·N with trained weights, 2·N with a frozen base "
    "(LoRA/QLoRA: input gradients only) plus 6·N_adapter; +1 forward with gradient "
    "checkpointing; causal attention 2·s·q_dim per token and layer forward, twice backward; "
    "a frozen vision tower runs forward only",
    f"QLoRA dequantises each weight to 16-bit per pass ({NF4_DEQUANT_BYTES_PER_PARAM} B/param "
    f"nf4, {INT8_DEQUANT_BYTES_PER_PARAM} B/param int8) at {BANDWIDTH_EFFICIENCY:.0%} of peak "
    f"bandwidth; LLM.int8 forward matmuls {INT8_FORWARD_SLOWDOWN}x slower than 16-bit",
    f"communication over the GPU's interconnect (NVLink or PCIe figure of the catalog; "
    f"{INTER_NODE_GBS:.0f} GB/s per GPU between nodes) at {COLLECTIVE_EFFICIENCY:.0%} efficiency; "
    f"{COMM_OVERLAP:.0%} of the overlapping compute hides it: DDP all-reduces once per step "
    "(no_sync during accumulation), ZeRO-2/3 reduce-scatter every micro batch, ZeRO-3 "
    "all-gathers every parameter per forward, backward and recomputation",
    f"optimizer offload: CPU-Adam at {CPU_ADAM_PARAMS_PER_S:.0e} parameters/s per node plus "
    "16-bit gradients down and parameters up over PCIe; parameter offload moves the "
    "16-bit weights over PCIe for every pass; paged optimizer states that do not fit page "
    "over PCIe twice per step",
    "tokens/s counts real (non-padding) tokens; micro batches are padded to their longest "
    "sample; evaluation and generation time are not included",
)


@dataclass(frozen=True)
class TokenLoad:
    """What one micro batch of ``micro_batch`` samples costs and carries.

    ``padded_tokens``: tokens the model runs on (padding included);
    ``real_tokens``: tokens of data; ``attn_len_sq``: Σ over its sequences of
    (attended length)² (for attention FLOPs); ``samples``: data samples in it.
    """

    padded_tokens: float
    real_tokens: float
    attn_len_sq: float
    samples: float
    images: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step on one GPU, by part."""

    compute_s: float
    dequant_s: float
    overhead_s: float
    comm_s: float
    offload_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s: float  # real tokens per second, all GPUs together
    samples_per_s: float
    mfu: float

    def to_dict(self) -> dict:
        return {k: round(v, 6) for k, v in asdict(self).items()}


def peak_flops(gpu: GPUSpec, cfg: RunConfig) -> float:
    """Dense tensor-core peak for the run's 16-bit dtype (FLOP/s)."""
    tflops = gpu.bf16_tflops if cfg.precision in ("bf16", "pure-bf16") else gpu.fp16_tflops
    if cfg.precision == "fp32":
        tflops = gpu.fp16_tflops / 8  # TF32 is about 1/2, plain fp32 1/16: take between
    return tflops * 1e12


def mfu_for(gpu: GPUSpec, spec: ModelSpec, tokens: float) -> float:
    top = MFU_MAX_HOPPER if float(gpu.compute_capability) >= 9.0 else MFU_MAX
    half = TOKENS_HALF_SCALE / spec.hidden_size
    return top * tokens / (tokens + half)


def matmul_params(spec: ModelSpec) -> int:
    """Language-model parameters that take part in matmuls per token (MoE:
    active experts only; no embedding lookup; a tied lm_head counts once)."""
    vision = spec.vision.param_count if spec.vision else 0
    n = spec.active_param_count - vision - spec.embedding_params
    if spec.tie_embeddings:
        n += spec.vocab_size * spec.hidden_size
    return n


def _attn_width(spec: ModelSpec) -> int:
    return spec.q_dim * spec.num_layers


@dataclass(frozen=True)
class FamilyCost:
    """Per-token and per-pass costs that do not depend on the micro batch."""

    linear_flops_per_token: float  # forward + backward (+ recompute)
    attn_flops_per_len_sq: float  # × Σ L² of a micro batch
    vision_flops_per_image: float
    passes: int  # forward + backward (+ recomputation) passes over the weights
    dequant_s_per_pass: float
    int8_forward_extra: float  # extra fraction on forward linear FLOPs


def family_cost(spec: ModelSpec, cfg: RunConfig, gpu: GPUSpec, adapter_params: int,
                quantized_params: int) -> FamilyCost:
    n = matmul_params(spec)
    full = cfg.method == "full"
    backward = 2.0 if full else 1.0  # × forward FLOPs of the base linears
    recompute = 1.0 if cfg.grad_ckpt else 0.0
    linear = 2 * n * (1 + backward + recompute) + 6 * adapter_params
    # causal attention forward: QKᵀ and PV, 2·2·L²·q_dim per layer, half masked.
    attn_fwd = 2.0 * _attn_width(spec)
    attn = attn_fwd * (1 + 2 + recompute)
    vision = 0.0
    if spec.vision:
        vision = 2.0 * spec.vision.param_count * spec.vision.patches_per_image
    passes = 2 + (1 if cfg.grad_ckpt else 0)
    dequant = 0.0
    int8_extra = 0.0
    if cfg.method == "qlora":
        per = NF4_DEQUANT_BYTES_PER_PARAM if cfg.quantization.bits == 4 else INT8_DEQUANT_BYTES_PER_PARAM
        dequant = quantized_params * per / (gpu.memory_bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)
        if cfg.quantization.bits == 8:
            int8_extra = (INT8_FORWARD_SLOWDOWN - 1) * (1 + recompute) / (1 + backward + recompute)
    return FamilyCost(linear, attn, vision, passes, dequant, int8_extra)


def _link_gbs(cluster: Cluster) -> float:
    bw = cluster.gpu.interconnect_gbs
    if cluster.nodes > 1:
        bw = min(bw, INTER_NODE_GBS)
    return bw * 1e9 * COLLECTIVE_EFFICIENCY


@dataclass(frozen=True)
class ShardBytes:
    """Bytes that move per step or pass, from the family's model states."""

    trainable_params: int
    grad_elem_bytes: int
    weight_bytes_16: float  # all module weights in their on-GPU dtype (ZeRO-3 gathers)
    paged_overflow_bytes: float  # paged optimizer states that do not fit on the device


def _micro_compute(fc: FamilyCost, load: TokenLoad, spec: ModelSpec, cfg: RunConfig,
                   cluster: Cluster) -> tuple[float, float, float]:
    gpu = cluster.gpu
    mfu = mfu_for(gpu, spec, load.padded_tokens)
    peak = peak_flops(gpu, cfg)
    linear = fc.linear_flops_per_token * load.padded_tokens * (1 + fc.int8_forward_extra)
    attn = fc.attn_flops_per_len_sq * load.attn_len_sq / ATTN_EFFICIENCY
    vision = fc.vision_flops_per_image * load.images
    compute = (linear + attn + vision) / (peak * mfu)
    if cfg.attn == "eager":
        # scores (b, heads, s, s): fp32 + 16-bit copies written, read back in backward
        score_bytes = 6 * spec.num_heads * load.attn_len_sq * spec.num_layers * 3
        compute += score_bytes / (gpu.memory_bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)
    overhead = LAUNCH_S_PER_LAYER_PASS * spec.num_layers * (fc.passes + 1)
    return compute, fc.dequant_s_per_pass * fc.passes, overhead


def _comm(cfg: RunConfig, cluster: Cluster, sb: ShardBytes, backward_s: float,
          micro_s: float) -> tuple[float, float]:
    """(exposed communication per step, exposed ZeRO-3 gathers per micro batch)."""
    n = cfg.world_size
    if n == 1:
        return 0.0, 0.0
    link = _link_gbs(cluster)
    frac = (n - 1) / n
    grads = sb.trainable_params * sb.grad_elem_bytes
    params16 = sb.trainable_params * 2
    a = cfg.grad_accum
    hide_bwd = COMM_OVERLAP * backward_s
    if cfg.zero == 0:
        return max(0.0, 2 * frac * grads / link - hide_bwd), 0.0
    if cfg.zero == 1:
        return max(0.0, frac * grads / link - hide_bwd) + frac * params16 / link, 0.0
    reduce = a * max(0.0, frac * grads / link - hide_bwd)
    if cfg.zero == 2:
        return reduce + frac * params16 / link, 0.0
    passes = 3 if cfg.grad_ckpt else 2
    gather = passes * frac * sb.weight_bytes_16 / link
    return reduce, max(0.0, gather - COMM_OVERLAP * micro_s)


def _offload(cfg: RunConfig, cluster: Cluster, sb: ShardBytes) -> tuple[float, float]:
    """(seconds per step, seconds per micro batch) of host transfers and CPU work."""
    pcie = cluster.gpu.pcie_gbs * 1e9
    n = cfg.world_size
    per_step = 0.0
    per_micro = 0.0
    if cfg.offload in ("optimizer", "all"):
        part = sb.trainable_params / n
        node_params = sb.trainable_params * cluster.gpus_per_node / n
        per_step += node_params / CPU_ADAM_PARAMS_PER_S + part * 2 / pcie
        per_micro += part * 2 / pcie  # 16-bit gradients to the host each micro batch
    if cfg.offload == "all":
        passes = 3 if cfg.grad_ckpt else 2
        per_micro += passes * sb.weight_bytes_16 / n / pcie
    if sb.paged_overflow_bytes > 0:
        per_step += 2 * sb.paged_overflow_bytes / pcie
    return per_step, per_micro


def _optimizer_step(cfg: RunConfig, cluster: Cluster, sb: ShardBytes) -> float:
    if cfg.offload in ("optimizer", "all"):
        return 0.0  # on the CPU, counted in the offload time
    per = ADAM8BIT_BYTES_PER_PARAM if OPTIMIZERS[cfg.optimizer].eight_bit else ADAM_BYTES_PER_PARAM
    shard = cfg.world_size if cfg.zero >= 1 else 1
    bw = cluster.gpu.memory_bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY
    return sb.trainable_params / shard * per / bw


def step_time(spec: ModelSpec, cfg: RunConfig, cluster: Cluster, fc: FamilyCost,
              sb: ShardBytes, load: TokenLoad) -> StepTime:
    """Predicted time of one optimizer step (``cfg.grad_accum`` micro batches)."""
    compute, dequant, overhead = _micro_compute(fc, load, spec, cfg, cluster)
    micro = compute + dequant + overhead
    backward_s = compute * (fc.passes - 1) / fc.passes  # backward (+ recompute) share
    comm_step, gather_micro = _comm(cfg, cluster, sb, backward_s, micro)
    off_step, off_micro = _offload(cfg, cluster, sb)
    opt = _optimizer_step(cfg, cluster, sb)
    a = cfg.grad_accum
    step = a * (micro + gather_micro + off_micro) + comm_step + off_step + opt
    n = cfg.world_size
    tokens = load.real_tokens * a * n
    samples = load.samples * a * n
    mfu = mfu_for(cluster.gpu, spec, load.padded_tokens)
    return StepTime(
        compute_s=a * compute, dequant_s=a * dequant, overhead_s=a * overhead,
        comm_s=comm_step + a * gather_micro, offload_s=off_step + a * off_micro,
        optimizer_s=opt, step_s=step, tokens_per_s=tokens / step, samples_per_s=samples / step,
        mfu=mfu,
    )
