"""vLLM past one GPU: what each rank of a tensor/pipeline-parallel engine holds (torch-free).

vLLM's names: ``tensor_parallel_size`` (TP), ``pipeline_parallel_size`` (PP) and
``data_parallel_size`` (DP, whole engine replicas). One engine spans TP × PP GPUs; every
number here is per GPU, for the rank that holds the most.

How vLLM shards a decoder (vllm/model_executor/layers/linear.py,
vocab_parallel_embedding.py, vllm/distributed/utils.py get_pp_indices):

- ``QKVParallelLinear``: query heads split over TP; key/value heads split too, or
  replicated (one per rank, ``num_kv_head_replicas = tp / num_kv_heads``) when a model has
  fewer KV heads than ranks. ``MergedColumnParallelLinear`` / ``ColumnParallelLinear``
  (gate, up): output features split, bias split. ``RowParallelLinear`` (o_proj,
  down_proj): input features split, bias whole on every rank. The MoE router
  (``ReplicatedLinear``) and norms are whole on every rank; ``FusedMoE`` splits each
  expert's intermediate width over TP.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of
  ``DEFAULT_VOCAB_PADDING_SIZE`` = 64, then split over TP.
- Pipeline stages: ``get_pp_indices`` gives each stage ``L // PP`` layers and the
  remainder one each to the stages before the last; the first stage holds the
  embedding, the last the final norm and the LM head.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..models.spec import LinearSpec, ModelSpec
from . import constants as C

VOCAB_PADDING_SIZE = C.VLLM_VOCAB_PADDING_SIZE
# Linears whose output features vLLM splits (ColumnParallelLinear and its merged forms)
COLUMN_PARALLEL = frozenset({"gate_proj", "up_proj", "gate_up_proj"})
# Linears whose input features vLLM splits (RowParallelLinear); their bias stays whole
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
# Whole on every rank (ReplicatedLinear)
REPLICATED = frozenset({"router", "shared_expert_gate"})
CUSTOM_AR_WORLD_SIZES = C.VLLM_CUSTOM_AR_WORLD_SIZES
CUSTOM_AR_MAX_SIZE_BYTES = C.VLLM_CUSTOM_AR_MAX_SIZE_BYTES
CUSTOM_AR_RANK_DATA_BYTES = C.VLLM_CUSTOM_AR_RANK_DATA_BYTES
CUSTOM_AR_BYTES = 2 * CUSTOM_AR_MAX_SIZE_BYTES + CUSTOM_AR_RANK_DATA_BYTES


@dataclass(frozen=True)
class VllmParallel:
    """vLLM's parallel sizes, by its own names."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def engine_gpus(self) -> int:
        """GPUs one engine spans (vLLM's ParallelConfig.world_size)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def total_gpus(self) -> int:
        return self.engine_gpus * self.data_parallel_size

    def to_dict(self) -> dict:
        return asdict(self)


def check_parallel(spec: ModelSpec, par: VllmParallel, gpus: int | None) -> None:
    """vLLM's own start-up checks (vllm/config/parallel.py, model.py verify_with_parallel_config),
    and the cluster's GPU count."""
    from ..errors import ConfigError

    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    if spec.num_heads % tp:
        raise ConfigError(
            f"--tensor-parallel-size {tp}: {spec.name} has {spec.num_heads} attention heads, "
            f"which vLLM requires to be divisible by the tensor-parallel size; use a divisor "
            f"of {spec.num_heads} (e.g. {largest_divisor(spec.num_heads, tp)})")
    if pp > spec.num_layers:
        raise ConfigError(f"--pipeline-parallel-size {pp} is more than the {spec.num_layers} "
                          "layers of the model; use at most the layer count")
    if gpus is not None and par.total_gpus > gpus:
        raise ConfigError(
            f"tensor × pipeline × data parallel sizes = {par.total_gpus} GPUs, but --gpu names "
            f"{gpus}; name more GPUs (a count after the card, e.g. --gpu l40sx{par.total_gpus}, "
            "or --nodes) or lower the parallel sizes")


def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, max(1, at_most) + 1) if n % d == 0)


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """Key/value heads each rank stores: split, or one replicated head when fewer than TP."""
    return max(1, spec.num_kv_heads // tp)


def _linear_params_per_rank(spec: ModelSpec, lin: LinearSpec, tp: int) -> int:
    """One layer's share of a linear on one TP rank (vLLM's parallel linear layers)."""
    if lin.name in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
        kv = kv_heads_per_rank(spec, tp) * spec.head_dim
        q = spec.q_dim // tp
        out = {"q_proj": q, "k_proj": kv, "v_proj": kv, "qkv_proj": q + 2 * kv}[lin.name]
        return lin.count * (lin.in_features + lin.bias) * out
    if lin.name in REPLICATED or tp == 1:
        return lin.params
    if lin.name in ROW_PARALLEL:
        return lin.count * (math.ceil(lin.in_features / tp) * lin.out_features
                            + (lin.out_features if lin.bias else 0))
    # column-parallel (gate/up) and anything split on its output
    return lin.count * (lin.in_features + lin.bias) * math.ceil(lin.out_features / tp)


def padded_vocab(vocab_size: int) -> int:
    """vLLM's pad_vocab_size: the vocabulary rounded up to a multiple of 64."""
    return math.ceil(vocab_size / VOCAB_PADDING_SIZE) * VOCAB_PADDING_SIZE


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage (vllm/distributed/utils.py get_pp_indices)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def layer_params_per_rank(spec: ModelSpec, tp: int, moe_layer: bool) -> int:
    linears = sum(_linear_params_per_rank(spec, lin, tp) for lin in spec.layer_linears(moe_layer))
    qk = 2 * spec.head_dim if spec.qk_norm else 0
    return linears + spec.norms_per_layer * spec.norm_params + qk


def stage_params(spec: ModelSpec, par: VllmParallel) -> list[int]:
    """Parameters one TP rank of each pipeline stage holds."""
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    vocab_shard = math.ceil(padded_vocab(spec.vocab_size) / tp) * spec.hidden_size
    dense = layer_params_per_rank(spec, tp, False)
    moe = layer_params_per_rank(spec, tp, True) if spec.is_moe else dense
    out, start = [], 0
    for stage, n in enumerate(stage_layers(spec.num_layers, pp)):
        layers = sum(moe if spec.is_moe_layer(i) else dense for i in range(start, start + n))
        start += n
        params = layers
        if stage == 0:
            params += vocab_shard + spec.other_params
            if spec.vision:  # vLLM's vision towers use the same parallel linears
                params += math.ceil(spec.vision.param_count / tp)
        if stage == pp - 1:
            params += spec.norm_params
            tied_here = spec.tie_embeddings and pp == 1
            if not tied_here:
                params += vocab_shard + (math.ceil(spec.vocab_size / tp) if spec.lm_head_bias else 0)
        out.append(params)
    return out


def weight_bytes_per_gpu(spec: ModelSpec, par: VllmParallel, elem_bytes: int = 2) -> int:
    """16-bit weights on the fullest GPU of one engine."""
    return max(stage_params(spec, par)) * elem_bytes


def kv_layers_per_gpu(spec: ModelSpec, par: VllmParallel) -> int:
    """Decoder layers whose KV cache the fullest pipeline stage holds."""
    return max(stage_layers(spec.num_layers, par.pipeline_parallel_size))


def comm_buffer_bytes(par: VllmParallel, custom_ar: bool = True) -> int:
    """Non-torch memory of vLLM's communicators per GPU: NCCL when an engine spans more than
    one GPU, plus the custom all-reduce buffers for supported TP sizes (``custom_ar``: the
    release has them)."""
    if par.engine_gpus == 1:
        return 0
    custom = CUSTOM_AR_BYTES if custom_ar and par.tensor_parallel_size in CUSTOM_AR_WORLD_SIZES else 0
    return C.NCCL_BYTES + custom


def parallel_assumptions(spec: ModelSpec, par: VllmParallel) -> list[str]:
    if par.engine_gpus == 1 and par.data_parallel_size == 1:
        return []
    tp = par.tensor_parallel_size
    notes = [f"vLLM TP {tp} × PP {par.pipeline_parallel_size} × DP {par.data_parallel_size}: "
             "figures are per GPU for the fullest rank (linears, embedding and LM head split "
             "as vLLM's parallel layers split them; norms whole on every rank)",
             "NCCL buffers: 300 MiB per GPU (NCCL_BUFFSIZE per channel and peer)" + (
                 "; NCCL's NVLink SHARP (NVLS) buffers, which NCCL adds for 3+ GPUs on NVSwitch "
                 "systems, are not counted — NCCL_NVLS_ENABLE=0 settles it"
                 if par.engine_gpus >= C.NCCL_NVLS_MIN_GPUS else
                 "; NCCL leaves NVLink SHARP off for two GPUs")]
    if spec.num_kv_heads < tp:
        notes.append(f"{spec.num_kv_heads} KV heads < TP {tp}: each rank keeps one replicated "
                     "KV head (vLLM's num_kv_head_replicas)")
    if tp > 2 and tp in CUSTOM_AR_WORLD_SIZES:
        notes.append("custom all-reduce buffers counted; vLLM disables them above 2 GPUs "
                     "without full NVLink (then only NCCL's)")
    if spec.vision:
        notes.append("vision tower split over TP like the language model")
    return notes
