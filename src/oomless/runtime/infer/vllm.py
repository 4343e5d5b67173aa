"""The vLLM backend, with engine arguments from the memory model.

vLLM reserves ``gpu_memory_utilization`` × the card's total memory and fails
at start-up when less than that is free (docs/memory-model.md §8). A fixed 0.9 or
0.95 therefore either wastes the card or collides with whatever else runs on
it (seed 004: scoring at 0.95 on a 48 GB A6000 next to other work). Here the
utilization is what this job needs (weights, LoRA slots, profile-run peak,
CUDA graphs, KV blocks for ``max_num_seqs`` sequences of ``max_model_len``
tokens), capped by what the other processes on the card leave free (NVML),
with ``max_model_len = cutoff_len + max_new_tokens``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...errors import ConfigError, GPUUnavailableError
from ...memory.inference import (
    ENGINE_CONTEXT_BYTES,
    EngineRequest,
    vllm_engine_args,
)
from ...models.hardware import GPUSpec, get_gpu
from ...units import fmt_bytes
from .core import Generation, InferOptions


def adapter_rank(adapter: str | None) -> int:
    """The LoRA rank ``r`` of a PEFT adapter folder (0 without an adapter)."""
    if not adapter:
        return 0
    path = Path(adapter) / "adapter_config.json"
    from ...errors import OomlessError
    from ...fileio import read_json

    try:
        config = read_json(path, "a PEFT adapter config")
        rank = config.get("r") if isinstance(config, dict) else None
    except OomlessError as err:
        raise ConfigError(f"--adapter '{adapter}': cannot read {path.name} ({err}); give a "
                          "PEFT LoRA folder as `oomless train` or peft save_pretrained writes") \
            from None
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"--adapter '{adapter}': adapter_config.json has no LoRA rank 'r'")
    return rank


def gpu_spec_for(name: str, total_bytes: int) -> GPUSpec:
    """The catalog entry of an NVML device name, with NVML's exact total memory."""
    from ...errors import UnknownGPUError

    try:
        return replace(get_gpu(name), memory_bytes=total_bytes)
    except UnknownGPUError:
        return GPUSpec(name=name, display_name=name, memory_bytes=total_bytes, bf16=True,
                       bf16_tflops=0.0, fp16_tflops=0.0, memory_bandwidth_gbs=0.0,
                       compute_capability="8.0", interconnect="pcie", interconnect_gbs=0.0,
                       pcie_gbs=0.0, source="NVML")


def engine_request(opts: InferOptions) -> EngineRequest:
    return EngineRequest(model=opts.model, max_model_len=opts.max_model_len,
                         max_num_seqs=opts.max_num_seqs,
                         gpu_memory_utilization=opts.gpu_memory_utilization,
                         lora_rank=adapter_rank(opts.adapter), dtype=opts.dtype,
                         trust_remote_code=opts.trust_remote_code, seed=opts.seed,
                         tensor_parallel_size=opts.tensor_parallel_size,
                         pipeline_parallel_size=opts.pipeline_parallel_size,
                         data_parallel_size=opts.data_parallel_size)


def engine_args(opts: InferOptions, spec: Any, gpu: GPUSpec,
                used_by_others_bytes: int = 0) -> tuple[dict[str, Any], Any]:
    """(vLLM ``LLM(**args)``, the VllmBudget behind them); ConfigError when it cannot fit."""
    args, budget = vllm_engine_args(spec, gpu, engine_request(opts), used_by_others_bytes)
    _check_budget(budget, gpu, used_by_others_bytes + ENGINE_CONTEXT_BYTES, opts)
    return args, budget


def _check_budget(budget: Any, gpu: GPUSpec, used_bytes: int, opts: InferOptions) -> None:
    free = gpu.memory_bytes - used_bytes
    if not budget.free_at_start_ok:
        raise ConfigError(
            f"gpu_memory_utilization {budget.gpu_memory_utilization} reserves "
            f"{fmt_bytes(budget.budget_bytes)}, but other processes and the engine's CUDA context "
            f"use {fmt_bytes(used_bytes)} of {fmt_bytes(gpu.memory_bytes)} ({fmt_bytes(free)} "
            "free at vLLM's start-up check): "
            "vLLM would fail at start-up; leave --gpu-memory-utilization out to size it"
        )
    if not budget.fits:
        non_kv = budget.weights_bytes + budget.profile_peak_bytes + budget.non_torch_bytes
        raise ConfigError(
            f"'{opts.model}' needs {fmt_bytes(non_kv)} before any KV cache (weights "
            f"{fmt_bytes(budget.weights_bytes)}, profile run {fmt_bytes(budget.profile_peak_bytes)})"
            f" and one sequence of {opts.max_model_len} tokens does not fit in the "
            f"{fmt_bytes(free)} left on the GPU; lower --cutoff-len/--max-new-tokens, free the "
            "GPU, or use a smaller or quantized model"
        )


def _visible_device(nv: Any) -> Any:
    """The NVML handle of CUDA device 0 as this process sees it (CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.startswith(("GPU-", "MIG-")):
        return nv.nvmlDeviceGetHandleByUUID(visible)
    return nv.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)


def device_memory() -> tuple[str, int, int]:
    """(name, total bytes, used bytes) of the GPU vLLM will use, from NVML."""
    from ..monitor import nvml

    with nvml() as nv:
        handle = _visible_device(nv)
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        name = nv.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        return name, int(memory.total), int(memory.used)


class VllmBackend:
    name = "vllm"

    def __init__(self, opts: InferOptions):
        from ...models.catalog import resolve_model

        if opts.data_parallel_size > 1:
            raise ConfigError(
                f"--data-parallel-size {opts.data_parallel_size}: an offline vLLM engine in one "
                "process is one replica; run one `oomless infer` per replica, each with its own "
                "CUDA_VISIBLE_DEVICES and part of the data (--engine-args prints the arguments)")
        try:
            from vllm import LLM, SamplingParams
        except ImportError:
            raise ConfigError("vLLM is not installed: pip install 'oomless[vllm]', or use "
                              "--backend hf") from None
        gpu_name, total, used = device_memory()
        self.args, self.budget = engine_args(opts, resolve_model(opts.model).spec,
                                             gpu_spec_for(gpu_name, total), used)
        self.opts = opts
        from ..loading import resolve_model_dir

        # vLLM loads from the local folder (a catalog name or id would reach the hub)
        self.llm = LLM(**{**self.args, "model": str(resolve_model_dir(opts.model))})
        self.tokenizer = self.llm.get_tokenizer()
        self.params = SamplingParams(temperature=opts.temperature, top_p=opts.top_p,
                                     max_tokens=opts.max_new_tokens, seed=opts.seed)
        self.lora = None
        if opts.adapter:
            from vllm.lora.request import LoRARequest

            self.lora = LoRARequest("adapter", 1, str(opts.adapter))

    def engine_info(self) -> dict[str, Any]:
        return {"backend": self.name, **self.args, "kv_blocks": self.budget.num_blocks,
                "max_concurrency": self.budget.max_concurrency}

    def generate(self, prompts: list[list[int]]) -> list[Generation]:
        if not prompts:
            return []
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params,
                                    lora_request=self.lora, use_tqdm=False)
        return [Generation(o.outputs[0].text, len(o.prompt_token_ids),
                           len(o.outputs[0].token_ids)) for o in outputs]

    def close(self) -> None:
        del self.llm


def vllm_usable() -> bool:
    """vLLM is installed and a CUDA GPU is visible (without importing either)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        device_memory()
    except GPUUnavailableError:
        return False
    return True
