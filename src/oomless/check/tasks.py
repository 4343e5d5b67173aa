"""Files that do not train: LLaMA-Factory export (merge), inference (chat, api,
webchat), evaluation and prediction YAMLs, and vLLM serve configs.

Such a file gets the memory of what it runs (memory/inference.py: HF ``generate``
or vLLM's engine budget; a merge on the CPU needs no GPU) and never a fix: no
training key is ever added to it. What would make it fit is said in a note,
naming the file's own key.

LLaMA-Factory's argument classes (src/llamafactory/hparams, 0.8.3–0.9.x):
ExportArguments holds the ``export_*`` keys (``export_device`` "cpu" by
default), VllmArguments the ``vllm_*`` keys (``vllm_maxlen`` 4096,
``vllm_gpu_util`` 0.7 in 0.9.x and 0.9 before), ModelArguments ``infer_backend``
(huggingface by default) and ``infer_dtype``, EvaluationArguments ``task``,
``n_shot``, ``lang``, ``batch_size`` (4), ``save_dir``; GeneratingArguments
``max_new_tokens`` (1024); DataArguments ``cutoff_len`` (2048).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .sources import Source

LF_EXPORT_KEYS = frozenset({
    "export_dir", "export_size", "export_device", "export_quantization_bit",
    "export_quantization_dataset", "export_quantization_nsamples", "export_quantization_maxlen",
    "export_legacy_format", "export_hub_model_id"})
LF_INFER_KEYS = frozenset({"infer_backend", "infer_dtype", "vllm_maxlen", "vllm_gpu_util",
                           "vllm_enforce_eager", "vllm_max_lora_rank", "vllm_config"})
LF_EVAL_KEYS = frozenset({"task", "task_dir", "n_shot", "lang", "save_dir", "download_mode"})
# keys that only a training run (or a prediction over a dataset) has
LF_TRAIN_SIGNS = frozenset({"do_train", "stage", "dataset", "per_device_train_batch_size",
                            "gradient_accumulation_steps", "learning_rate", "num_train_epochs",
                            "max_steps", "deepspeed"})
LF_CUTOFF_LEN = 2048  # DataArguments.cutoff_len
LF_NEW_TOKENS = 1024  # GeneratingArguments.max_new_tokens
LF_EVAL_BATCH = 4  # EvaluationArguments.batch_size
LF_PREDICT_BATCH = 8  # TrainingArguments.per_device_eval_batch_size
LF_VLLM_MAXLEN = 4096  # VllmArguments.vllm_maxlen
LF_VLLM_UTIL = 0.7  # VllmArguments.vllm_gpu_util (0.9.x; 0.9 in 0.8.x)

# vLLM EngineArgs (vllm/engine/arg_utils.py) as `vllm serve --config` YAML spells them
VLLM_SERVE_KEYS = frozenset({
    "gpu-memory-utilization", "max-model-len", "max-num-seqs", "tensor-parallel-size",
    "pipeline-parallel-size", "kv-cache-dtype", "max-num-batched-tokens", "enforce-eager",
    "served-model-name", "block-size", "enable-prefix-caching"})
VLLM_UTIL = 0.9  # EngineArgs.gpu_memory_utilization
VLLM_MAX_NUM_SEQS = 256  # EngineArgs.max_num_seqs (v1 default on data-centre GPUs)

TASKS = ("export", "inference", "evaluation", "prediction", "vllm-serve")


def _dashed(d: dict[str, Any]) -> dict[str, Any]:
    return {str(k).replace("_", "-"): v for k, v in d.items()}


def file_task(src: Source) -> str:
    """What a YAML runs: one of TASKS, or "train"."""
    d = src.data
    keys = set(d)
    if src.fmt != "yaml":
        return "train"
    if "model" in keys and set(_dashed(d)) & VLLM_SERVE_KEYS:
        return "vllm-serve"
    if "model_name_or_path" not in keys or d.get("do_train"):
        return "train"
    if keys & LF_EXPORT_KEYS:
        return "export"
    if "task" in keys and keys & (LF_EVAL_KEYS - {"task"}):
        return "evaluation"
    if d.get("do_predict"):
        return "prediction"
    if keys & LF_INFER_KEYS or not keys & LF_TRAIN_SIGNS:
        return "inference"
    return "train"


def _weight_bytes_per_elem(d: dict[str, Any]) -> float:
    bits = d.get("quantization_bit")
    return {4: 0.5, 8: 1.0}.get(bits, 2.0) if bits else 2.0


def task_memory(task: str, d: dict[str, Any], spec: Any, cluster: Any) -> dict[str, Any]:
    """Per-GPU device bytes of what the file runs, its phase name, the limit it is held to
    (vLLM: its budget), notes and assumptions."""
    from ..memory.inference import estimate_generate

    n = cluster.gpus_per_node * cluster.nodes
    notes: list[str] = []
    assumptions: list[str] = []
    if task == "export":
        weights = spec.param_count * 2
        host = f"{weights / 2**30:.1f} GiB of 16-bit weights"
        if str(d.get("export_device", "cpu")) == "cpu" and not d.get("export_quantization_bit"):
            notes.append(f"export on the CPU (export_device cpu): no GPU memory; host RAM holds "
                         f"the {host} while the adapter is merged")
            return {"phase": "export", "peak": 0, "limit": None, "notes": notes,
                    "assumptions": assumptions}
        assumptions.append(f"the export loads the {host} spread over the {n} GPU(s) "
                           "(device_map auto); GPTQ calibration activations not counted")
        return {"phase": "export", "peak": -(-weights // n), "limit": None, "notes": notes,
                "assumptions": assumptions}
    if task in ("vllm-serve",) or (task == "inference" and d.get("infer_backend") == "vllm"):
        return _vllm(task, d, spec, cluster, notes, assumptions)
    cutoff = int(d.get("cutoff_len") or LF_CUTOFF_LEN)
    new_tokens = int(d.get("max_new_tokens") or LF_NEW_TOKENS)
    if task == "evaluation":
        batch = int(d.get("batch_size") or LF_EVAL_BATCH)
        est = estimate_generate(spec, batch, cutoff, 0, _weight_bytes_per_elem(d))
        logits = batch * cutoff * spec.vocab_size * 2
        assumptions.append(f"evaluation scores {batch} prompts of up to {cutoff} tokens with "
                           "one forward; its logits over every position are counted in 16 bits")
        peak, phase = est.device_peak_bytes + logits, "evaluation"
        key = "batch_size"
    else:
        batch = 1 if task == "inference" else int(d.get("per_device_eval_batch_size")
                                                   or LF_PREDICT_BATCH)
        est = estimate_generate(spec, batch, cutoff, new_tokens, _weight_bytes_per_elem(d))
        peak, phase = est.device_peak_bytes, "generation"
        key = "cutoff_len" if task == "inference" else "per_device_eval_batch_size"
        assumptions.append(f"{batch} sequence(s) of {cutoff} prompt tokens (cutoff_len) and "
                           f"{new_tokens} new tokens (max_new_tokens), HF generate")
    if n > 1:
        peak = peak - est.weights_bytes + -(-est.weights_bytes // n)
        assumptions.append(f"the weights are spread over the {n} GPUs (device_map auto)")
    notes.append(f"if it does not fit: lower {key} or use quantization_bit 4 in the file")
    return {"phase": phase, "peak": peak, "limit": None, "notes": notes,
            "assumptions": assumptions}


def _vllm(task: str, d: dict[str, Any], spec: Any, cluster: Any, notes: list[str],
          assumptions: list[str]) -> dict[str, Any]:
    from ..memory.inference import vllm_budget

    if task == "vllm-serve":
        v = _dashed(d)
        max_len = int(v.get("max-model-len") or spec.max_position_embeddings)
        util = float(v.get("gpu-memory-utilization") or VLLM_UTIL)
        seqs = int(v.get("max-num-seqs") or VLLM_MAX_NUM_SEQS)
        tp = int(v.get("tensor-parallel-size") or 1) * int(v.get("pipeline-parallel-size") or 1)
        kv_dtype = str(v.get("kv-cache-dtype") or "auto")
        keys = ("max-model-len", "gpu-memory-utilization")
    else:
        max_len = int(d.get("vllm_maxlen") or LF_VLLM_MAXLEN)
        util = float(d.get("vllm_gpu_util") or LF_VLLM_UTIL)
        seqs, tp, kv_dtype = VLLM_MAX_NUM_SEQS, cluster.gpus_per_node, "auto"
        keys = ("vllm_maxlen", "vllm_gpu_util")
    quant = d.get("quantization") if task == "vllm-serve" else None
    if quant:
        raise ConfigError(f"not supported yet: vLLM quantization '{quant}' (the weights' bytes "
                          "depend on it and are not modelled here); check a config without it")
    if tp > 1:
        raise ConfigError(f"not supported yet: vLLM over {tp} GPUs (tensor/pipeline parallel); "
                          "oomless check estimates one vLLM GPU (run it with --gpu NAME, one GPU)")
    b = vllm_budget(spec, cluster.gpu, max_len, seqs, util, kv_dtype)
    one_seq = b.weights_bytes + b.profile_peak_bytes + b.non_torch_bytes + (
        -(-max_len // 16) * b.block_bytes)
    assumptions.append(f"vLLM takes gpu_memory_utilization {util:g} × the GPU = "
                       f"{b.budget_bytes / 2**30:.2f} GiB; the start-up needs weights, a profile "
                       f"run and the KV cache of one {max_len}-token sequence inside it")
    notes.append(f"vLLM's KV cache holds {b.max_concurrency:g} sequences of {max_len} tokens "
                 f"at this budget; if it does not fit: lower {keys[0]} or raise {keys[1]} in "
                 "the file")
    return {"phase": "vllm start-up", "peak": one_seq, "limit": b.budget_bytes, "notes": notes,
            "assumptions": assumptions}


LABELS = {"export": "LLaMA-Factory export (merge) YAML", "inference": "LLaMA-Factory inference YAML",
          "evaluation": "LLaMA-Factory evaluation YAML",
          "prediction": "LLaMA-Factory prediction YAML (do_predict, no training)",
          "vllm-serve": "vLLM serve config"}
