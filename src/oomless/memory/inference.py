"""Inference memory: HF ``generate`` and vLLM's engine budget (torch-free).

vLLM (v1, vllm/v1/worker/gpu_worker.py determine_available_memory;
vllm/utils/mem_utils.py): the budget is ``gpu_memory_utilization`` × the
card's total memory. The engine subtracts its non-KV memory — weights, the
torch peak of a profile run over ``max_num_batched_tokens`` and non-torch
memory (CUDA context, NCCL and custom all-reduce buffers) — and fills the rest with
KV blocks of ``2 × block_size × kv_heads × head_dim × dtype bytes`` per layer. "No
available memory for the cache blocks" means that rest is ≤ 0. CUDA graphs are
captured after the KV cache is sized (gpu_worker.compile_or_warm_up_model runs after
initialize_from_config; vLLM's own log lists "CUDAGraph memory" apart and suggests
``--kv-cache-memory`` to account for it), so they come out of the memory above the
budget, not out of the KV cache. Several GPUs: memory.vllm_parallel (per rank).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..models.hardware import GPUSpec
from ..models.spec import ModelSpec
from ..units import GiB, MiB
from . import constants as C
from .stacks import version_tuple
from .training import kv_cache_bytes
from .vllm_parallel import (
    VllmParallel,
    comm_buffer_bytes,
    kv_heads_per_rank,
    kv_layers_per_gpu,
    parallel_assumptions,
    weight_bytes_per_gpu,
)

# vLLM captures CUDA graphs for decode batch sizes up to 512, after the KV cache is
# sized: their memory is neither in the profile peak nor in the KV budget, it must fit
# above gpu_memory_utilization. Reported 0.3–1.5 GiB on 7B-class models; we take 1 GiB
# (vLLM ≥ 0.10 prints its own figure at start-up: "GiB for CUDAGraph memory").
VLLM_CUDAGRAPH_BYTES = 1 * GiB
# Default chunked-prefill token budget of a v1 offline engine (EngineArgs
# max_num_batched_tokens for LLM on a data-centre GPU; 2048 on small cards).
VLLM_DEFAULT_BATCHED_TOKENS = 8192
VLLM_DEFAULT_BLOCK_SIZE = 16
# The largest utilization we ask for: the CUDA context of the engine's own process and
# whatever else shares the card need the rest (vLLM's own default is 0.9).
MAX_UTILIZATION = 0.95
# vLLM compares the requested budget with the memory free *after* its worker created its
# CUDA context (vllm/v1/worker/gpu_worker.py init_device: the MemorySnapshot is taken
# after torch.cuda init and NCCL), so that context counts as used by others there.
ENGINE_CONTEXT_BYTES = C.CUDA_CONTEXT_BYTES
# vLLM's supported LoRA ranks (vllm/config/lora.py, MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class VllmProfileRule:
    """What one vLLM release subtracts from ``utilization × total`` besides the weights and
    the torch peak of its profile run, read from its worker's profiling code."""

    since: str  # the first release with this rule
    context: bool  # the worker's CUDA context
    comm: bool  # NCCL (and, from 0.3.0, custom all-reduce) buffers
    others: bool  # memory other processes hold on the card
    source: str


# vllm/worker/worker.py of each release, read from the PyPI wheels (vllm==X):
VLLM_PROFILE_RULES = (
    VllmProfileRule("0.0", False, False, False, "0.2.4 profile_num_available_blocks: "
                    "peak_memory = torch.cuda.max_memory_allocated() (PyTorch only)"),
    VllmProfileRule("0.2.5", True, True, True, "0.2.5 (PR 2031): peak_memory = total − free "
                    "after the profile run: everything on the card"),
    VllmProfileRule("0.3.1", False, True, False, "0.3.1–0.6.3: peak_memory = init_gpu_memory "
                    "− free, init_gpu_memory read after torch.cuda.set_device, before NCCL"),
    VllmProfileRule("0.6.4", True, True, True, "0.6.4 (PR 9352): torch peak + (total − free − "
                    "torch allocated) after empty_cache"),
    VllmProfileRule("0.6.5", False, True, False, "0.6.5 (PR 10511) V0 worker, "
                    "vllm/utils.py memory_profiling: non-torch increase over the baseline read "
                    "in init_device before init_worker_distributed_environment"),
)
# Releases from here use today's V1 modelling (no rule row): vLLM 0.8 made V1 the default
VLLM_RULES_READ_UNTIL = "0.8"
# vLLM 0.3.0 added the custom all-reduce (parallel_utils/custom_all_reduce.py in its wheel)
VLLM_CUSTOM_AR_SINCE = "0.3.0"
# V0's SchedulerConfig without chunked prefill: max(max_model_len, 2048) tokens (vllm/config.py
# of 0.2.5 and 0.6.5)
VLLM_V0_MIN_BATCHED_TOKENS = 2048


def profile_rule(engine_version: str | None) -> VllmProfileRule | None:
    """The rule of a vLLM release (None: today's engine, or a release past the table)."""
    if not engine_version or version_tuple(engine_version) >= version_tuple(VLLM_RULES_READ_UNTIL):
        return None
    return [r for r in VLLM_PROFILE_RULES
            if version_tuple(r.since) <= version_tuple(engine_version)][-1]


def _non_kv_extra(par: VllmParallel, rule: VllmProfileRule | None, version: str | None,
                  other_processes_bytes: int) -> int:
    """Memory besides weights and the torch peak that the engine subtracts from its budget."""
    if rule is None:
        return C.CUDA_CONTEXT_BYTES + comm_buffer_bytes(par)
    comm = 0
    if rule.comm:
        comm = comm_buffer_bytes(par, custom_ar=version_tuple(version) >= version_tuple(
            VLLM_CUSTOM_AR_SINCE))
    return ((C.CUDA_CONTEXT_BYTES if rule.context else 0) + comm
            + (other_processes_bytes if rule.others else 0))


def weight_bytes_16bit(spec: ModelSpec, elem_bytes: int = 2) -> int:
    return spec.param_count * elem_bytes


def forward_peak_bytes(spec: ModelSpec, tokens: int, elem_bytes: int = 2, tp: int = 1) -> int:
    """Torch peak of a no-grad forward over ``tokens`` tokens: one layer's
    intermediates (q, k, v, attention output, MLP gate/up/act) plus the
    residual stream twice. Attention is flash/paged (no s² scores). Under tensor
    parallelism each rank computes its share of heads and MLP width; the residual
    stream is whole after each all-reduce."""
    width = max(spec.intermediate_size, spec.moe_intermediate_size * spec.experts_per_token)
    kv = kv_heads_per_rank(spec, tp) * spec.head_dim
    layer = tokens * (3 * math.ceil(width / tp) + 2 * spec.q_dim // tp + 2 * kv) * elem_bytes
    return layer + 2 * tokens * spec.hidden_size * elem_bytes


@dataclass(frozen=True)
class GenerateEstimate:
    weights_bytes: int
    kv_cache_bytes: int
    activations_bytes: int
    logits_bytes: int
    non_pytorch_bytes: int
    device_peak_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_generate(spec: ModelSpec, batch: int, prompt_tokens: int, max_new_tokens: int,
                      weight_elem_bytes: float = 2, kv_elem_bytes: int = 2) -> GenerateEstimate:
    """HF ``model.generate``: weights + dynamic KV cache + prefill activations
    + last-token logits (generate asks the model for 1 logit row per sequence)."""
    weights = round(spec.param_count * weight_elem_bytes)
    kv = kv_cache_bytes(spec, batch, prompt_tokens + max_new_tokens, kv_elem_bytes)
    acts = forward_peak_bytes(spec, batch * prompt_tokens)
    logits = 3 * 4 * batch * spec.vocab_size  # fp32 logits, processed scores, probs
    non_pt = C.CUDA_CONTEXT_BYTES
    total = weights + kv + acts + logits
    device = round(total * (1 + C.ALLOC_RESERVE_FRACTION_EXPANDABLE)) + non_pt
    return GenerateEstimate(weights, kv, acts, logits, non_pt, device)


@dataclass(frozen=True)
class VllmBudget:
    """What a vLLM engine will do on one GPU, and the utilization it needs."""

    total_memory_bytes: int
    gpu_memory_utilization: float
    budget_bytes: int
    weights_bytes: int
    profile_peak_bytes: int
    non_torch_bytes: int  # CUDA context + NCCL and custom all-reduce buffers
    cudagraph_bytes: int  # captured after the KV cache is sized: above the budget
    kv_cache_bytes: int  # what is left for KV blocks under this utilization
    block_bytes: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_concurrency: float  # full-length sequences the KV cache holds
    required_bytes: int  # what holding max_num_seqs × max_model_len takes (+ headroom)
    required_utilization: float | None  # the fraction that holds them; None: more than the card
    holds_max_num_seqs: bool  # the chosen utilization holds max_num_seqs full-length sequences
    fits: bool  # at least one full-length sequence fits
    free_at_start_ok: bool  # the budget is not more than what is free at start-up
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    assumptions: tuple[str, ...] = ()
    # the CUDA graphs, captured after the KV cache, fit above the budget (else vLLM can run
    # out of memory while capturing them: lower the utilization or enforce_eager)
    cudagraphs_fit: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def kv_block_bytes(spec: ModelSpec, block_size: int, kv_elem_bytes: int,
                   par: VllmParallel | None = None) -> int:
    """One KV block across the layers of one GPU: 2 (K and V) × block × kv_heads × head_dim
    × bytes × L; per rank: the rank's KV heads and its pipeline stage's layers."""
    par = par or VllmParallel()
    kv_dim = kv_heads_per_rank(spec, par.tensor_parallel_size) * spec.head_dim
    return 2 * block_size * kv_dim * kv_elem_bytes * kv_layers_per_gpu(spec, par)


def _served_weight_bytes(spec: ModelSpec, par: VllmParallel, lora_rank: int, max_loras: int) -> int:
    """One GPU's weights and the LoRA slots vLLM pre-allocates for ``max_loras`` adapters
    over all linears (the B side split like the base layer's output under TP: counted
    whole, an upper bound)."""
    weights = weight_bytes_per_gpu(spec, par)
    if lora_rank:
        per = sum(lin.in_features + lin.out_features for lin in spec.layer_linears())
        weights += max_loras * lora_rank * per * kv_layers_per_gpu(spec, par) * 2
    return weights


def _smallest_utilization(required: float, total: int, used_by_others_bytes: int) -> float:
    """The smallest utilization that holds ``required``, capped by MAX_UTILIZATION and by what
    is free. vLLM checks free memory once its CUDA context exists (gpu_worker.init_device):
    the cap leaves room for that context and for the CUDA graphs captured after the KV cache."""
    free_frac = (total - used_by_others_bytes - C.CUDA_CONTEXT_BYTES
                 - VLLM_CUDAGRAPH_BYTES) / total
    return min(round(math.ceil(required * 100) / 100, 2), MAX_UTILIZATION,
               round(math.floor(free_frac * 100) / 100, 2))


def vllm_budget(spec: ModelSpec, gpu: GPUSpec, max_model_len: int, max_num_seqs: int = 256,
                gpu_memory_utilization: float | None = None, kv_cache_dtype: str = "auto",
                block_size: int = VLLM_DEFAULT_BLOCK_SIZE,
                max_num_batched_tokens: int | None = None, lora_rank: int = 0,
                max_loras: int = 1, used_by_others_bytes: int = 0,
                headroom: float = 0.02, parallel: VllmParallel | None = None,
                engine_version: str | None = None,
                other_processes_bytes: int = 0) -> VllmBudget:
    """vLLM's memory arithmetic; with no utilization given, choose the smallest
    that holds ``max_num_seqs`` sequences of ``max_model_len`` tokens (+ headroom),
    capped by MAX_UTILIZATION and by what other processes leave free (then
    ``holds_max_num_seqs`` is False and vLLM queues what the KV cache cannot hold)."""
    par = parallel or VllmParallel()
    tp = par.tensor_parallel_size
    total = gpu.memory_bytes
    kv_b = 1 if kv_cache_dtype.startswith("fp8") else 2
    weights = _served_weight_bytes(spec, par, lora_rank, max_loras)
    rule = profile_rule(engine_version)
    batched = max_num_batched_tokens or (max(max_model_len, VLLM_V0_MIN_BATCHED_TOKENS) if rule
                                         else VLLM_DEFAULT_BATCHED_TOKENS)
    batched = min(batched, max(max_model_len, batched))
    profile = forward_peak_bytes(spec, batched, tp=tp) + 3 * 4 * max_num_seqs * spec.vocab_size
    non_torch = _non_kv_extra(par, rule, engine_version, other_processes_bytes)
    non_kv = weights + profile + non_torch
    block = kv_block_bytes(spec, block_size, kv_b, par)
    kv_needed = max_num_seqs * math.ceil(max_model_len / block_size) * block
    required = (non_kv + kv_needed) / total + headroom
    util = gpu_memory_utilization if gpu_memory_utilization is not None else \
        _smallest_utilization(required, total, used_by_others_bytes)
    budget = int(util * total)
    kv = max(0, budget - non_kv)
    num_blocks = kv // block
    concurrency = num_blocks * block_size / max_model_len
    return VllmBudget(
        total_memory_bytes=total, gpu_memory_utilization=util, budget_bytes=budget,
        weights_bytes=weights, profile_peak_bytes=profile, non_torch_bytes=non_torch,
        cudagraph_bytes=VLLM_CUDAGRAPH_BYTES, kv_cache_bytes=kv, block_bytes=block, num_blocks=num_blocks,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_concurrency=round(concurrency, 2), required_bytes=int(required * total),
        required_utilization=round(required, 4) if required <= 1 else None,
        holds_max_num_seqs=concurrency >= max_num_seqs,
        fits=num_blocks * block_size >= max_model_len,
        free_at_start_ok=budget <= total - used_by_others_bytes + 64 * MiB,
        cudagraphs_fit=budget + VLLM_CUDAGRAPH_BYTES <= total - used_by_others_bytes,
        tensor_parallel_size=tp, pipeline_parallel_size=par.pipeline_parallel_size,
        data_parallel_size=par.data_parallel_size,
        assumptions=tuple(parallel_assumptions(spec, par)) + (
            (f"vLLM {engine_version}: {rule.source}",) if rule else ()),
    )


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM supports that holds ``rank``."""
    from ..errors import ConfigError

    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ConfigError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
    return fitting[0]


def served_model_id(text: str) -> str:
    """What vLLM loads: a catalog name's Hugging Face id, else the id or folder given."""
    from ..models.catalog import find_entry

    entry = find_entry(text)
    return entry.hf_id if entry is not None else text


def needs_remote_code(spec: ModelSpec) -> bool:
    """Models whose code lives in their Hub repository (the Hub's custom_code tag)."""
    return spec.model_type in REMOTE_CODE_MODEL_TYPES


# THUDM/glm-4-9b-chat and glm-4v-9b (chatglm), Qwen/Qwen-7B (qwen), internlm2-chat-7b
# (internlm2), openbmb MiniCPM(-V, -o), MoE-LLaVA
REMOTE_CODE_MODEL_TYPES = frozenset({"chatglm", "qwen", "internlm", "internlm2", "minicpm",
                                     "minicpmv", "minicpmo", "moe_llava_phi", "moe_llava"})


@dataclass(frozen=True)
class EngineRequest:
    """What a vLLM engine is asked to serve (``oomless infer`` and ``estimate --inference``)."""

    model: str
    max_model_len: int
    max_num_seqs: int = 256
    gpu_memory_utilization: float | None = None
    lora_rank: int = 0
    dtype: str = "auto"
    trust_remote_code: bool = False
    seed: int = 42
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    nodes: int = 1  # an engine across nodes runs on vLLM's Ray backend
    engine_version: str | None = None  # the vLLM release whose profiling rule applies

    @property
    def parallel(self) -> VllmParallel:
        return VllmParallel(self.tensor_parallel_size, self.pipeline_parallel_size,
                            self.data_parallel_size)


def vllm_engine_args(spec: ModelSpec, gpu: GPUSpec, req: EngineRequest,
                     used_by_others_bytes: int = 0) -> tuple[dict, VllmBudget]:
    """vLLM ``LLM(**args)`` and the budget behind them: one function for every command
    that prints or uses them, so they agree to the byte."""
    rank = vllm_lora_rank(req.lora_rank) if req.lora_rank else 0
    budget = vllm_budget(spec, gpu, max_model_len=req.max_model_len,
                         max_num_seqs=req.max_num_seqs,
                         gpu_memory_utilization=req.gpu_memory_utilization, lora_rank=rank,
                         kv_cache_dtype=req.kv_cache_dtype,
                         used_by_others_bytes=used_by_others_bytes + ENGINE_CONTEXT_BYTES,
                         parallel=req.parallel, engine_version=req.engine_version,
                         other_processes_bytes=used_by_others_bytes)
    args: dict = {
        "model": served_model_id(req.model), "dtype": req.dtype,
        "max_model_len": req.max_model_len,
        "gpu_memory_utilization": budget.gpu_memory_utilization,
        "max_num_seqs": req.max_num_seqs,
        "enable_prefix_caching": True,  # shared prompt prefixes are computed once
        "enable_lora": bool(rank),
        "trust_remote_code": req.trust_remote_code or needs_remote_code(spec),
        "seed": req.seed, "disable_log_stats": True,
    }
    if rank:
        args["max_lora_rank"] = rank
    if req.kv_cache_dtype != "auto":
        args["kv_cache_dtype"] = req.kv_cache_dtype
    args.update(parallel_engine_args(req))
    return args, budget


def parallel_engine_args(req: EngineRequest) -> dict:
    """vLLM's parallel arguments, only where they differ from its defaults; an engine that
    spans nodes uses the Ray backend (vLLM's distributed serving docs)."""
    out: dict = {}
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(req, name) > 1:
            out[name] = getattr(req, name)
    if req.nodes > 1 and req.parallel.engine_gpus > 1:
        out["distributed_executor_backend"] = "ray"
    return out


def smallest_fitting_parallel(spec: ModelSpec, gpu: GPUSpec, req: EngineRequest,
                              gpus_per_node: int, nodes: int = 1) -> EngineRequest | None:
    """The smallest engine (TP within a node first, then PP across nodes, as vLLM's docs
    advise) that holds one full-length sequence; the GPUs left over become data-parallel
    replicas. None when even every GPU is not enough."""
    for trial in parallel_shapes(spec, req, gpus_per_node, nodes):
        _, budget = vllm_engine_args(spec, gpu, trial)
        if budget.fits:
            return trial
    return None


def parallel_shapes(spec: ModelSpec, req: EngineRequest, gpus_per_node: int,
                    nodes: int = 1) -> list[EngineRequest]:
    """Every engine shape vLLM accepts on the cluster, smallest first: TP within a node
    (a divisor of the attention heads), then PP across nodes; the GPUs left over become
    data-parallel replicas of a one-node engine."""
    tps = [t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node and spec.num_heads % t == 0]
    shapes = [(t, 1) for t in tps] + [(tps[-1], p) for p in range(2, nodes + 1)
                                      if p <= spec.num_layers]
    out = []
    for tp, pp in shapes:
        dp = (gpus_per_node * nodes) // (tp * pp) if pp == 1 else 1
        out.append(replace(req, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                           data_parallel_size=max(1, dp), nodes=1 if pp == 1 else nodes))
    return out


def parallel_hint(spec: ModelSpec, cluster, req: EngineRequest, budget: VllmBudget) -> dict | None:
    """What to pass to vLLM when a one-GPU engine does not fit but the cluster has more GPUs."""
    if budget.fits or req.parallel != VllmParallel() or cluster.world_size == 1:
        return None
    found = smallest_fitting_parallel(spec, cluster.gpu, req, cluster.gpus_per_node, cluster.nodes)
    return None if found is None else parallel_engine_args(found)
