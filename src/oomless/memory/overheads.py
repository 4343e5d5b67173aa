"""From allocated bytes to reserved and device bytes, and the final estimate."""

from __future__ import annotations

from ..config import RunConfig
from ..models.hardware import Cluster
from ..models.spec import ModelSpec
from ..result import MemoryEstimate
from . import constants as C
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
                    largest_block: int = 0, late_block: int = 0) -> MemoryEstimate:
    peak_phase, peak_alloc, reserve, non_pt = peak_bytes(
        phases, persistent, cluster, cfg.world_size, expandable_segments, largest_block,
        late_block)
    assumptions = assumptions + [
        "allocator reserve (reserved − allocated) = the larger of 70% of the largest "
        f"transient block and {C.ALLOC_RESERVE_FRACTION:.0%} of the non-persistent peak, at "
        "least 64 MiB, calibrated on the trace's allocator simulation (`oomless trace` "
        "replays the real stream)" + (
            f"; plus the embedding's dense gradient ({late_block / 2**30:.2f} GiB), requested "
            "at the end of the backward when no freed block fits it: a segment of its own"
            if late_block and not expandable_segments else ""),
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
