"""The files ``oomless plan --out DIR`` writes, each valid for its own tool.

- oomless.yaml: the RunConfig (``oomless train`` / ``estimate`` / ``check`` read it)
- deepspeed.json: DeepSpeed config (only when the plan uses ZeRO); every value
  the plan decides is concrete ("auto" nowhere). ``train_batch_size`` is left
  out on purpose: DeepSpeed derives it as micro batch × accumulation × world
  size, and a written value would have to match the launcher's world size.
- accelerate.yaml: ``accelerate launch --config_file`` (ClusterConfig)
- training_args.json: keyword arguments of transformers.TrainingArguments
- llamafactory.yaml: a LLaMA-Factory (0.9.x) SFT training YAML
- vllm.json: vLLM EngineArgs for the inference step (memory.inference.vllm_budget)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import RunConfig, dump_run_config
from ..fileio import OutputFolder, refuse_inputs
from ..knobs import ATTENTIONS, OPTIMIZERS
from ..models.hardware import Cluster
from ..models.spec import ModelSpec

# LLaMA-Factory chat templates (data/template.py) by catalog family; by name first
LF_TEMPLATE_BY_NAME = {"glm-4v-9b": "glm4v", "deepseek-r1-distill-qwen-7b": "deepseekr1",
                       "phi-4": "phi4"}
LF_TEMPLATE_BY_FAMILY = {"glm4": "glm4", "qwen2.5": "qwen", "qwen2-moe": "qwen",
                         "qwen2.5-vl": "qwen2_vl", "qwen3": "qwen3", "llama2": "llama2",
                         "llama3": "llama3", "mistral": "mistral", "mixtral": "mistral",
                         "gemma2": "gemma2", "phi3": "phi", "llava": "llava"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
DEFAULT_MAX_NEW_TOKENS = 512  # inference length when the plan has no generation setting


def _half(cfg: RunConfig) -> str:
    return "fp16" if cfg.precision == "fp16" else "bf16"


def deepspeed_config(cfg: RunConfig, spec: ModelSpec) -> dict[str, Any] | None:
    """DeepSpeed JSON for a ZeRO plan (None without ZeRO). Buckets are the
    values HF's "auto" would pick (transformers integrations/deepspeed.py),
    which the memory estimate assumes."""
    if cfg.zero == 0:
        return None
    h = spec.hidden_size
    zero: dict[str, Any] = {"stage": cfg.zero, "overlap_comm": True,
                            "contiguous_gradients": True, "reduce_bucket_size": h * h}
    if cfg.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if cfg.zero == 3:
        zero.update({"stage3_prefetch_bucket_size": int(0.9 * h * h),
                     "stage3_param_persistence_threshold": 10 * h,
                     "sub_group_size": 10**9, "stage3_max_live_parameters": 10**9,
                     "stage3_max_reuse_distance": 10**9,
                     "stage3_gather_16bit_weights_on_model_save": True})
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.training.max_grad_norm,
        "bf16": {"enabled": _half(cfg) == "bf16"},
        "fp16": {"enabled": _half(cfg) == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": zero,
    }
    if cfg.offload != "none":
        # ZeRO-Offload steps on the CPU with DeepSpeed's CPU-Adam, which DeepSpeed
        # builds from its own optimizer block (a client optimizer is refused).
        ds["optimizer"] = {"type": "AdamW", "params": {
            "lr": cfg.training.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8,
            "weight_decay": cfg.training.weight_decay}}
    return ds


def training_arguments(cfg: RunConfig, deepspeed_path: str | None) -> dict[str, Any]:
    """transformers.TrainingArguments(**this), for the pinned transformers 5.x:
    ``warmup_steps`` below 1 is the warmup ratio there (5.x removed
    ``warmup_ratio``); ``gradient_checkpointing`` is accepted by 4.x and 5.x
    (5.x aliases it to activation_checkpointing)."""
    t = cfg.training
    args: dict[str, Any] = {
        "output_dir": t.output_dir,
        "per_device_train_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "per_device_eval_batch_size": cfg.eval_batch_size,
        "learning_rate": t.learning_rate, "lr_scheduler_type": t.lr_scheduler,
        "warmup_steps": t.warmup_ratio, "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm, "seed": t.seed,
        "logging_steps": t.logging_steps, "num_train_epochs": t.epochs,
        "bf16": cfg.precision == "bf16", "fp16": cfg.precision == "fp16",
        "gradient_checkpointing": cfg.grad_ckpt,
        "optim": OPTIMIZERS[cfg.optimizer].hf_optim,
    }
    if cfg.grad_ckpt:
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if t.max_steps:
        args["max_steps"] = t.max_steps
    if t.save_steps:
        args.update({"save_strategy": "steps", "save_steps": t.save_steps})
    if cfg.eval.steps:
        args.update({"eval_strategy": "steps", "eval_steps": cfg.eval.steps})
    if deepspeed_path:
        args["deepspeed"] = deepspeed_path
    return args


def accelerate_config(cfg: RunConfig, deepspeed_path: str | None) -> dict[str, Any]:
    """accelerate's ClusterConfig (accelerate launch --config_file accelerate.yaml)."""
    hw = cfg.hardware
    out: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False,
                           "machine_rank": 0, "num_machines": hw.nodes,
                           "num_processes": cfg.world_size, "main_training_function": "main",
                           "mixed_precision": _half(cfg) if cfg.precision != "fp32" else "no",
                           "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    if deepspeed_path:
        out["distributed_type"] = "DEEPSPEED"
        out["deepspeed_config"] = {"deepspeed_config_file": deepspeed_path,
                                   "zero3_init_flag": cfg.zero == 3}
        if hw.nodes > 1:
            out["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    else:
        out["distributed_type"] = "MULTI_GPU" if cfg.world_size > 1 else "NO"
        out["gpu_ids"] = "all"
    if hw.nodes > 1:
        out.update({"main_process_ip": "127.0.0.1", "main_process_port": 29500})
    return out


def lf_template(spec: ModelSpec, family: str) -> str:
    return LF_TEMPLATE_BY_NAME.get(spec.name) or LF_TEMPLATE_BY_FAMILY.get(family, "default")


def llamafactory_config(cfg: RunConfig, spec: ModelSpec, model_id: str, family: str,
                        deepspeed_path: str | None) -> dict[str, Any]:
    """A LLaMA-Factory SFT YAML (keys from its 0.9.5 argument dataclasses)."""
    t = cfg.training
    lf: dict[str, Any] = {
        "model_name_or_path": model_id, "stage": "sft", "do_train": True,
        "finetuning_type": "full" if cfg.method == "full" else "lora",
        "dataset": Path(cfg.data.train_file).stem if cfg.data.train_file else "my_dataset",
        "template": lf_template(spec, family),
        "cutoff_len": cfg.seq_len, "packing": cfg.data.packing,
        "per_device_train_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "learning_rate": t.learning_rate, "num_train_epochs": t.epochs,
        "lr_scheduler_type": t.lr_scheduler, "warmup_steps": t.warmup_ratio,
        "max_grad_norm": t.max_grad_norm, "logging_steps": t.logging_steps,
        "output_dir": t.output_dir, "flash_attn": ATTENTIONS[cfg.attn].llamafactory,
        "disable_gradient_checkpointing": not cfg.grad_ckpt,
        "optim": OPTIMIZERS[cfg.optimizer].hf_optim,
    }
    if cfg.precision == "pure-bf16":
        lf["pure_bf16"] = True
    else:
        lf[_half(cfg)] = cfg.precision != "fp32"
    if cfg.method != "full":
        targets = cfg.lora.targets
        lf.update({"lora_rank": cfg.lora.r, "lora_alpha": cfg.lora.alpha,
                   "lora_dropout": cfg.lora.dropout,
                   "lora_target": "all" if targets == "all-linear" else ",".join(targets)})
    if cfg.method == "qlora":
        lf.update({"quantization_bit": cfg.quantization.bits, "quantization_method": "bnb",
                   "double_quantization": cfg.quantization.double_quant})
        if cfg.quantization.bits == 4:
            lf["quantization_type"] = cfg.quantization.type
    if cfg.eval.batch_size or cfg.eval.steps or cfg.eval.predict_with_generate:
        lf.update({"val_size": 0.05, "per_device_eval_batch_size": cfg.eval_batch_size,
                   "eval_strategy": "steps", "eval_steps": cfg.eval.steps or 500})
    if cfg.eval.predict_with_generate and cfg.zero != 3:  # LLaMA-Factory refuses it with ZeRO-3
        lf.update({"predict_with_generate": True,
                   "max_new_tokens": cfg.eval.max_new_tokens or DEFAULT_MAX_NEW_TOKENS})
    if deepspeed_path:
        lf["deepspeed"] = deepspeed_path
    return lf


def vllm_engine_args(cfg: RunConfig, spec: ModelSpec, cluster: Cluster,
                     model_id: str) -> dict[str, Any]:
    """vLLM EngineArgs for generation with the trained model: max_model_len =
    cutoff + max_new_tokens; gpu_memory_utilization = the smallest that holds
    max_num_seqs full-length sequences (oomless.memory.vllm_budget), one GPU
    per engine, tensor parallel over the node's GPUs when one GPU cannot hold it."""
    from ..memory import vllm_budget

    new_tokens = cfg.eval.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    max_len = cfg.seq_len + new_tokens
    rank = 0 if cfg.method == "full" else cfg.lora.r
    seqs = 256
    budget = vllm_budget(spec, cluster.gpu, max_len, seqs, lora_rank=rank)
    while not budget.fits or budget.gpu_memory_utilization > 0.95:
        if seqs == 1:
            break
        seqs //= 2
        budget = vllm_budget(spec, cluster.gpu, max_len, seqs, lora_rank=rank)
    args: dict[str, Any] = {
        "model": model_id, "dtype": "bfloat16" if cluster.gpu.bf16 else "float16",
        "max_model_len": max_len, "gpu_memory_utilization": budget.gpu_memory_utilization,
        "max_num_seqs": seqs, "enable_prefix_caching": True,
        "enable_lora": cfg.method != "full", "tensor_parallel_size": 1,
        "trust_remote_code": spec.model_type == "chatglm",
    }
    if cfg.method != "full":
        args.update({"max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= cfg.lora.r),
                     "max_loras": 1})
    return args


PLAN_FILES = ("oomless.yaml", "deepspeed.json", "accelerate.yaml", "training_args.json",
              "llamafactory.yaml", "vllm.json")


def write_plan_files(out_dir: str | Path, cfg: RunConfig, spec: ModelSpec, cluster: Cluster,
                     model_id: str, family: str = "", force: bool = False,
                     inputs: tuple[str | None, ...] = ()) -> list[Path]:
    """Write every file for one plan into ``out_dir``; return their paths.

    The folder is an :class:`~oomless.fileio.OutputFolder`: files of an earlier plan
    are replaced (a stale deepspeed.json removed); a user's files there, or an input
    of the plan, are never written over unless ``force`` (then kept as NAME.orig).
    """
    folder = OutputFolder(out_dir, force, "--out")
    out = folder.path
    written: dict[str, str] = {"oomless.yaml": dump_run_config(cfg)}
    ds = deepspeed_config(cfg, spec)
    ds_name = str((out / "deepspeed.json").resolve()) if ds else None
    if ds:
        written["deepspeed.json"] = json.dumps(ds, indent=2) + "\n"
    import yaml

    written["accelerate.yaml"] = yaml.safe_dump(accelerate_config(cfg, ds_name), sort_keys=False)
    written["training_args.json"] = json.dumps(training_arguments(cfg, ds_name), indent=2) + "\n"
    written["llamafactory.yaml"] = yaml.safe_dump(
        llamafactory_config(cfg, spec, model_id, family, ds_name), sort_keys=False)
    written["vllm.json"] = json.dumps(vllm_engine_args(cfg, spec, cluster, model_id),
                                      indent=2) + "\n"
    for name in written:
        refuse_inputs(out / name, inputs, "--out")
    folder.prepare(list(written), known=PLAN_FILES)
    paths = [folder.write(name, text) for name, text in written.items()]
    folder.finish()
    return paths
