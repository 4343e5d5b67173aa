"""Library entry points that tie the steps together (torch-free).

    cfg = RunConfig(model="qwen2.5-7b", method="qlora", hardware={"gpu": "rtx-4090"})
    est = oomless.api.estimate(cfg)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import RunConfig
from .errors import ConfigError
from .models.catalog import ResolvedModel
from .models.catalog import resolve_model as _resolve
from .models.hardware import Cluster, get_gpu
from .result import MemoryEstimate
from .units import GiB, fmt_bytes

if TYPE_CHECKING:
    from .memory.inference import GenerateEstimate, VllmBudget


def resolve_model(text: str, trust_remote_code: bool | None = None) -> ResolvedModel:
    """The one entry from a model argument to its spec: a catalog name or alias, a local
    config.json or model folder, or a model id in the local Hugging Face cache (offline).

    A family the formulas do not know is read from the model's own code on the meta
    device (oomless.runtime.meta, registered with oomless.models.structure when imported;
    the command line imports it); code that ships with the checkpoint runs only with
    ``trust_remote_code`` (the command line's ``--trust-remote-code``). None keeps the
    consent given before (the command line's flag)."""
    if trust_remote_code is not None:
        from .models.structure import allow_remote_code

        allow_remote_code(trust_remote_code)
    return _resolve(text)


def cluster_for(cfg: RunConfig) -> Cluster | None:
    """The cluster a run configuration names (None when it names no GPU)."""
    hw = cfg.hardware
    if not hw.gpu:
        return None
    host = round(hw.host_ram_gb * 1e9) if hw.host_ram_gb else None
    return Cluster(get_gpu(hw.gpu), hw.gpus_per_node, hw.nodes, host)


def check_host_ram(est: MemoryEstimate, cluster: Cluster | None) -> None:
    """Offload needs host RAM; stop when the stated RAM cannot hold it."""
    if not cluster or not cluster.host_ram_bytes or not est.host_ram_bytes:
        return
    if est.host_ram_bytes > cluster.host_ram_bytes:
        raise ConfigError(
            f"offload needs {fmt_bytes(est.host_ram_bytes)} of host RAM per node, but "
            f"host_ram_gb states {cluster.host_ram_bytes / 1e9:.0f} GB; use offload: optimizer "
            "instead of all, more GPUs, or a machine with "
            f"≥ {est.host_ram_bytes / GiB * 1.074:.0f} GB RAM"
        )


_FROM_CONFIG: Any = object()  # sentinel: the cluster that cfg.hardware names


def estimate(cfg: RunConfig, expandable_segments: bool = False, *, model: str | None = None,
             cluster: Cluster | None = _FROM_CONFIG) -> MemoryEstimate:
    """Analytic estimate of a run configuration.

    The model is ``cfg.model`` — a catalog name, a local config.json/folder, or a
    model id in the local Hugging Face cache — unless ``model`` names another
    place to read the same model from (the trainer passes the folder it loads).
    The GPUs are those ``cfg.hardware`` names unless ``cluster`` is given (the
    trainer passes the CUDA device it runs on; None: no fit verdict).
    """
    from .memory import estimate_training
    from .memory.vision import check_images_fit_model

    spec = resolve_model(model or cfg.model).spec
    check_images_fit_model(spec, cfg)
    if cluster is _FROM_CONFIG:
        cluster = cluster_for(cfg)
    est = estimate_training(spec, cfg, cluster, expandable_segments=expandable_segments)
    check_host_ram(est, cluster)
    return est


@dataclass(frozen=True)
class InferenceOptions:
    """`oomless estimate --inference`'s own options, with its flags' defaults."""

    engine: str = "vllm"  # "hf" (model.generate) or "vllm"
    max_model_len: int | None = None  # vLLM; None: seq_len + max_new_tokens
    max_num_seqs: int = 256
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1


@dataclass(frozen=True)
class InferenceEstimate:
    """Inference memory of a run configuration: HF generate's (``generate``) or a vLLM
    engine's arguments, per-GPU budget and the parallel sizes that would fit (or None)."""

    model_name: str
    cluster: Cluster | None
    generate: GenerateEstimate | None = None
    engine_args: dict | None = None
    budget: VllmBudget | None = None
    suggested_parallel: dict | None = None


def estimate_inference(cfg: RunConfig, options: InferenceOptions, *,
                       gpu_fix: str = "e.g. --gpu a100-80gb") -> InferenceEstimate:
    """`oomless estimate --inference` of a run configuration (the command line and the
    web page both call it). The vLLM engine needs the GPU ``cfg.hardware`` names; without
    one the ConfigError ends with ``gpu_fix``, the caller's way to name one."""
    from .memory import estimate_generate

    spec = resolve_model(cfg.model).spec
    new_tokens = cfg.eval.max_new_tokens or 512
    cluster = cluster_for(cfg)
    if options.engine == "hf":
        generate = estimate_generate(spec, cfg.micro_batch_size, cfg.seq_len, new_tokens)
        return InferenceEstimate(spec.name, cluster, generate=generate)
    if cluster is None:
        raise ConfigError("--inference --engine vllm needs --gpu (vLLM's budget is a "
                          f"fraction of the card's memory); {gpu_fix}")
    return _vllm_estimate(cfg, options, spec, cluster, new_tokens)


def _vllm_estimate(cfg: RunConfig, options: InferenceOptions, spec, cluster: Cluster,
                   new_tokens: int) -> InferenceEstimate:
    from .memory.inference import EngineRequest, parallel_hint, vllm_engine_args
    from .memory.vllm_parallel import check_parallel

    # LoRA slots only for an adapter the run says it trains (--method lora/qlora or the YAML)
    adapter = cfg.method != "full" and "method" in cfg.model_fields_set
    req = EngineRequest(model=cfg.model,
                        max_model_len=options.max_model_len or cfg.seq_len + new_tokens,
                        max_num_seqs=options.max_num_seqs,
                        gpu_memory_utilization=options.gpu_memory_utilization,
                        lora_rank=cfg.lora.r if adapter else 0,
                        kv_cache_dtype=options.kv_cache_dtype,
                        trust_remote_code=cfg.training.trust_remote_code,
                        tensor_parallel_size=options.tensor_parallel_size,
                        pipeline_parallel_size=options.pipeline_parallel_size,
                        data_parallel_size=options.data_parallel_size, nodes=cluster.nodes,
                        # --stack-version names the vLLM release (its profiling rule)
                        engine_version=cfg.stack_options.stack_version)
    check_parallel(spec, req.parallel, cluster.world_size)
    engine, budget = vllm_engine_args(spec, cluster.gpu, req)
    return InferenceEstimate(spec.name, cluster, engine_args=engine, budget=budget,
                             suggested_parallel=parallel_hint(spec, cluster, req, budget))
