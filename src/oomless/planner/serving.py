"""Decode throughput of a vLLM engine shape, to rank tensor/pipeline/data-parallel choices.

Torch-free arithmetic meant to *rank* engine shapes that fit, not to predict a
measurement. One decode step of an engine serving ``batch`` sequences is memory-bound:
every rank reads its shard of the weights and the KV cache of its sequences once, then
tensor parallelism adds its communication:

    step = (weights per rank + KV read per rank) / (bandwidth × efficiency)
           + TP_ALLREDUCES_PER_LAYER × layers × all-reduce(batch × hidden × 2 bytes)

The all-reduces are vLLM's own: ``RowParallelLinear.forward`` all-reduces its output when
``reduce_results`` and ``tp_size > 1`` (vllm-project/vllm
vllm/model_executor/layers/linear.py, v0.6.5 and the v0.11 line alike), and a Llama-style
decoder layer has two of them, ``o_proj`` (attention) and ``down_proj`` (MLP)
(vllm/model_executor/models/llama.py ``LlamaAttention``, ``LlamaMLP``). A ring all-reduce
moves ``2 (t − 1) / t`` of the message per GPU over the GPU's interconnect (NCCL's ring
algorithm; the catalog's NVLink or PCIe figure: a TP group stays inside one node) and
costs a launch latency besides. Pipeline stages run one after another for one batch (no
overlap is counted; their point-to-point transfers are not). Replicas (data parallel) multiply the engine's throughput.

Two engines that both hold ``max_num_seqs`` full-length sequences read the same bytes per
GPU, so the larger TP loses exactly its all-reduce time and the smaller wins; a larger TP
wins only where it lets the KV cache hold more sequences than the smaller one can.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..memory.inference import (
    VLLM_DEFAULT_BLOCK_SIZE,
    EngineRequest,
    VllmBudget,
    parallel_shapes,
    vllm_engine_args,
)
from ..models.hardware import GPUSpec
from ..models.spec import ModelSpec
from .speed import BANDWIDTH_EFFICIENCY, COLLECTIVE_EFFICIENCY

# vLLM's RowParallelLinear all-reduces o_proj and down_proj: two per decoder layer forward
TP_ALLREDUCES_PER_LAYER = 2
# Latency of one small all-reduce (kernel launch and synchronisation across ranks):
# an assumption of the order NCCL's and vLLM's custom all-reduce reach inside a node,
# not a measurement of this project (listed in SERVING_ASSUMPTIONS).
ALLREDUCE_LATENCY_S = 10e-6
ACTIVATION_BYTES = 2  # the 16-bit hidden state vLLM all-reduces

SERVING_ASSUMPTIONS = (
    f"decode is memory-bound: each rank reads its weights and its sequences' KV cache once "
    f"per step at {BANDWIDTH_EFFICIENCY:.0%} of peak bandwidth (average context half of "
    "max_model_len)",
    f"tensor parallelism: {TP_ALLREDUCES_PER_LAYER} all-reduces of batch × hidden × 2 bytes per "
    "layer (vLLM's RowParallelLinear for o_proj and down_proj), ring traffic 2(t−1)/t over the "
    f"interconnect at {COLLECTIVE_EFFICIENCY:.0%} efficiency plus {ALLREDUCE_LATENCY_S * 1e6:.0f} "
    "µs each; pipeline stages run in turn; not calibrated on a GPU yet",
)


@dataclass(frozen=True)
class ServingSpeed:
    """Predicted decode step of one engine shape and the cluster's throughput with it."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    batch: int  # sequences one engine decodes together (max_num_seqs or what the KV holds)
    read_s: float  # weights + KV read per step
    allreduce_s: float  # TP communication per step
    step_s: float
    tokens_per_s: float  # all replicas together

    def to_dict(self) -> dict:
        return asdict(self)


def allreduce_seconds(message_bytes: float, tp: int, link_gbs: float) -> float:
    """One ring all-reduce of ``message_bytes`` over ``tp`` GPUs."""
    if tp == 1:
        return 0.0
    traffic = 2 * (tp - 1) / tp * message_bytes
    return ALLREDUCE_LATENCY_S + traffic / (link_gbs * 1e9 * COLLECTIVE_EFFICIENCY)


def decode_speed(spec: ModelSpec, gpu: GPUSpec, req: EngineRequest,
                 budget: VllmBudget) -> ServingSpeed:
    """Decode step time of the engine ``req`` describes, with the budget vLLM gives it."""
    tp, pp = req.tensor_parallel_size, req.pipeline_parallel_size
    batch = max(1, min(req.max_num_seqs, int(budget.max_concurrency)))
    # KV bytes one rank reads: its share of each sequence, at half the maximum length
    kv_read = batch * (req.max_model_len / 2) * budget.block_bytes / VLLM_DEFAULT_BLOCK_SIZE
    read_s = (budget.weights_bytes + kv_read) / (gpu.memory_bandwidth_gbs * 1e9
                                                 * BANDWIDTH_EFFICIENCY)
    # a TP group stays inside one node (parallel_shapes): the GPU's own interconnect
    layers = spec.num_layers // pp
    message = batch * spec.hidden_size * ACTIVATION_BYTES
    comm_s = TP_ALLREDUCES_PER_LAYER * layers * allreduce_seconds(message, tp,
                                                                  gpu.interconnect_gbs)
    step_s = (read_s + comm_s) * pp
    return ServingSpeed(tp, pp, req.data_parallel_size, batch, read_s * pp, comm_s * pp,
                        step_s, req.data_parallel_size * batch / step_s)


def _label(sp: ServingSpeed) -> str:
    pp = f" × PP {sp.pipeline_parallel_size}" if sp.pipeline_parallel_size > 1 else ""
    return f"TP {sp.tensor_parallel_size}{pp} × DP {sp.data_parallel_size}"


def choose_engine(spec: ModelSpec, gpu: GPUSpec, req: EngineRequest, gpus_per_node: int,
                  nodes: int = 1) -> tuple[EngineRequest | None, str]:
    """The fitting engine shape with the most decode tokens/s on the cluster, and why
    (each fitting shape's prediction and the all-reduce time that separates them); the
    smaller shape wins ties. (None, why) when no shape holds one full-length sequence."""
    rated: list[tuple[ServingSpeed, EngineRequest]] = []
    for trial in parallel_shapes(spec, req, gpus_per_node, nodes):
        _, budget = vllm_engine_args(spec, gpu, trial)
        if budget.fits:
            rated.append((decode_speed(spec, gpu, trial, budget), trial))
    if not rated:
        return None, "no tensor/pipeline-parallel engine on these GPUs holds one sequence"
    best_speed, best = max(rated, key=lambda r: r[0].tokens_per_s)  # first (smallest) on ties
    parts = [f"{_label(sp)}: {sp.tokens_per_s:,.0f} tokens/s ({sp.batch} sequences, "
             f"all-reduce {sp.allreduce_s * 1e3:.2f} ms of a {sp.step_s * 1e3:.2f} ms step)"
             for sp, _ in rated]
    why = (f"{_label(best_speed)} chosen, the most decode tokens/s of the engines that fit — "
           + "; ".join(parts) + ". A larger TP reads the same bytes per GPU and adds "
           f"{TP_ALLREDUCES_PER_LAYER} all-reduces per layer; it wins only where its KV cache "
           "holds more sequences")
    return best, why
