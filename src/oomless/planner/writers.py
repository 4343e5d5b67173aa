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
- README.md: what each file is for and the commands that run them

Warm-up is ``warmup_ratio`` (accepted by transformers 4.31–5.14, every version
LLaMA-Factory supports) or, when the number of steps is known (``--data``,
``training.max_steps``), an integer ``warmup_steps`` valid in every version —
never a fractional ``warmup_steps``, which transformers 4.x reads as steps
(0.03 steps: no warm-up). Models whose code lives in their Hub repository
(GLM-4 and GLM-4V of THUDM, Qwen 1, InternLM, MiniCPM, MoE-LLaVA) get
``trust_remote_code`` in every file that loads them.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import RunConfig, dump_run_config
from ..fileio import OutputFolder, refuse_inputs
from ..knobs import ATTENTIONS, OPTIMIZERS
from ..memory.inference import EngineRequest, needs_remote_code
from ..memory.inference import vllm_engine_args as vllm_engine_args_for
from ..models.families import family_facts
from ..models.hardware import Cluster
from ..models.spec import ModelSpec
from .serving import SERVING_ASSUMPTIONS, choose_engine

DEFAULT_MAX_NEW_TOKENS = 512  # inference length when the plan has no generation setting
DATA_PLACEHOLDER = "YOUR_TRAINING_DATA.jsonl"  # written when `plan` got no --data


def total_steps(cfg: RunConfig, samples: int | None) -> int | None:
    """Optimizer steps of the run: max_steps, else samples / effective batch × epochs."""
    if cfg.training.max_steps:
        return cfg.training.max_steps
    if not samples:
        return None
    return max(1, math.ceil(math.ceil(samples / cfg.effective_batch) * cfg.training.epochs))


def warmup(cfg: RunConfig, steps: int | None) -> dict[str, Any]:
    if steps:
        return {"warmup_steps": math.ceil(cfg.training.warmup_ratio * steps)}
    return {"warmup_ratio": cfg.training.warmup_ratio}


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


def training_arguments(cfg: RunConfig, deepspeed_path: str | None,
                       steps: int | None = None) -> dict[str, Any]:
    """transformers.TrainingArguments(**this): warm-up as :func:`warmup` (an integer
    ``warmup_steps`` when the steps are known); ``gradient_checkpointing`` is accepted
    by 4.x and 5.x (5.x aliases it to activation_checkpointing)."""
    t = cfg.training
    args: dict[str, Any] = {
        "output_dir": t.output_dir,
        "per_device_train_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "per_device_eval_batch_size": cfg.eval_batch_size,
        "learning_rate": t.learning_rate, "lr_scheduler_type": t.lr_scheduler,
        **warmup(cfg, steps), "weight_decay": t.weight_decay,
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


def lf_template(family: str) -> tuple[str | None, str]:
    """(LLaMA-Factory ``template``, note): the family's row of families.json; None with
    the reason where no template is right (LLaMA-Factory then reads the tokenizer's own
    chat template: LLaMA-Factory data/template.py get_template_and_fix_tokenizer)."""
    facts = family_facts(family)
    if facts is None:
        return None, ("llamafactory.yaml names no `template`: the model is not in oomless's "
                      "catalog, so its chat template is not known here; LLaMA-Factory then "
                      "parses the tokenizer's chat template — set `template` if your data "
                      "needs another")
    if facts.llamafactory_template is None:
        return None, f"llamafactory.yaml names no `template`: {facts.template_note}"
    return facts.llamafactory_template, ""


def llamafactory_config(cfg: RunConfig, spec: ModelSpec, model_id: str, family: str,
                        deepspeed_path: str | None) -> dict[str, Any]:
    """A LLaMA-Factory SFT YAML (keys from its 0.9.5 argument dataclasses)."""
    t = cfg.training
    lf: dict[str, Any] = {
        "model_name_or_path": model_id, "stage": "sft", "do_train": True,
        "finetuning_type": "full" if cfg.method == "full" else "lora",
        "dataset": Path(cfg.data.train_file).stem if cfg.data.train_file else "my_dataset",
        "template": lf_template(family)[0],
        "cutoff_len": cfg.seq_len, "packing": cfg.data.packing,
        "per_device_train_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "learning_rate": t.learning_rate, "num_train_epochs": t.epochs,
        "lr_scheduler_type": t.lr_scheduler, "warmup_ratio": t.warmup_ratio,
        "max_grad_norm": t.max_grad_norm, "logging_steps": t.logging_steps,
        "output_dir": t.output_dir, "flash_attn": ATTENTIONS[cfg.attn].llamafactory,
        "disable_gradient_checkpointing": not cfg.grad_ckpt,
        "optim": OPTIMIZERS[cfg.optimizer].hf_optim,
    }
    if lf["template"] is None:
        del lf["template"]
    if cfg.precision == "pure-bf16":
        lf["pure_bf16"] = True
    else:
        lf[_half(cfg)] = cfg.precision != "fp32"
    if cfg.method != "full":
        targets = cfg.lora.targets
        lf.update({"lora_rank": cfg.lora.r, "lora_alpha": cfg.lora.alpha,
                   "lora_dropout": cfg.lora.dropout,
                   "lora_target": "all" if targets == "all-linear" else ",".join(targets)})
        if cfg.lora.modules_to_save:  # PEFT modules_to_save as LLaMA-Factory names it
            lf["additional_target"] = ",".join(cfg.lora.modules_to_save)
    if cfg.method == "qlora":
        lf.update({"quantization_bit": cfg.quantization.bits,
                   "quantization_method": cfg.quantization.method,
                   "double_quantization": cfg.quantization.double_quant})
        if cfg.quantization.bits == 4 and cfg.quantization.method == "bnb":
            lf["quantization_type"] = cfg.quantization.type
    if cfg.eval.batch_size or cfg.eval.steps or cfg.eval.predict_with_generate:
        lf.update({"val_size": 0.05, "per_device_eval_batch_size": cfg.eval_batch_size,
                   "eval_strategy": "steps", "eval_steps": cfg.eval.steps or 500})
    if cfg.eval.predict_with_generate and cfg.zero != 3:  # LLaMA-Factory refuses it with ZeRO-3
        lf.update({"predict_with_generate": True,
                   "max_new_tokens": cfg.eval.max_new_tokens or DEFAULT_MAX_NEW_TOKENS})
    if deepspeed_path:
        lf["deepspeed"] = deepspeed_path
    if needs_remote_code(spec):
        lf["trust_remote_code"] = True
    return lf


def vllm_engine_args(cfg: RunConfig, spec: ModelSpec, cluster: Cluster,
                     model_id: str) -> dict[str, Any]:
    """vllm.json's arguments (:func:`vllm_plan` without its reason)."""
    return vllm_plan(cfg, spec, cluster, model_id)[0]


def vllm_plan(cfg: RunConfig, spec: ModelSpec, cluster: Cluster,
              model_id: str) -> tuple[dict[str, Any], str]:
    """vLLM EngineArgs for generation with the trained model (memory.inference's, as
    `oomless infer` uses them): max_model_len = cutoff + max_new_tokens; the largest
    max_num_seqs (256 down, halving) whose full-length sequences the card holds at a
    utilization the memory model computes; one GPU per engine, or, when the weights do not
    fit one, the fitting tensor (then pipeline) parallel engine with the most decode
    tokens/s on the cluster (oomless.planner.serving.choose_engine: the same bytes per GPU, plus TP's
    all-reduces; a larger TP only where its KV cache holds more sequences)."""
    new_tokens = cfg.eval.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    req = EngineRequest(model=model_id, max_model_len=cfg.seq_len + new_tokens,
                        lora_rank=0 if cfg.method == "full" else cfg.lora.r,
                        trust_remote_code=cfg.training.trust_remote_code)
    args, budget = vllm_engine_args_for(spec, cluster.gpu, req)
    why = ""
    if not budget.fits and cluster.world_size > 1:
        chosen, why = choose_engine(spec, cluster.gpu, req, cluster.gpus_per_node, cluster.nodes)
        req = chosen or req
        args, budget = vllm_engine_args_for(spec, cluster.gpu, req)
    while (not budget.fits or not budget.holds_max_num_seqs) and req.max_num_seqs > 1:
        req = replace(req, max_num_seqs=req.max_num_seqs // 2)
        args, budget = vllm_engine_args_for(spec, cluster.gpu, req)
    if cfg.method != "full":
        args["max_loras"] = 1
    return args, why


def readme(cfg: RunConfig, files: list[str], placeholder: bool, steps: int | None,
           family: str = "") -> str:
    """What the folder holds and the next commands."""
    lines = ["# The plan's files", "", "| file | for |", "|---|---|"]
    uses = {"oomless.yaml": "`oomless train oomless.yaml` (also `estimate`, `check`)",
            "deepspeed.json": "DeepSpeed (named by the other files)",
            "accelerate.yaml": "`accelerate launch --config_file accelerate.yaml YOUR_SCRIPT.py`",
            "training_args.json": "`transformers.TrainingArguments(**json.load(...))`",
            "llamafactory.yaml": "`llamafactory-cli train llamafactory.yaml`",
            "vllm.json": "`vllm.LLM(**json.load(...))` for generation with the trained model"}
    lines += [f"| {name} | {uses.get(name, '')} |" for name in files]
    lines += ["", "Next:", "", "```", "oomless train oomless.yaml", "```", ""]
    if placeholder:
        lines += [f"`plan` was not given `--data`: `oomless.yaml` names `{DATA_PLACEHOLDER}` as "
                  f"`data.train_file` and `llamafactory.yaml` the dataset "
                  f"`{Path(DATA_PLACEHOLDER).stem}`. Replace "
                  "them with your data (a .jsonl, .json or .parquet file; for LLaMA-Factory, a "
                  "dataset registered in its dataset_info.json), or run `oomless plan` again with "
                  "`--data FILE` (its lengths also shape the plan).", ""]
    if "warmup_ratio" in warmup(cfg, steps):
        lines += ["`training_args.json` sets `warmup_ratio`, which transformers accepts up to "
                  "5.14; with a newer transformers write the same fraction as `warmup_steps` "
                  "(there a value below 1 is a ratio), or give `plan` the data so that it writes "
                  "whole warm-up steps.", ""]
    template_note = lf_template(family)[1]
    if template_note:
        lines += [template_note + ".", ""]
    return "\n".join(lines)


PLAN_FILES = ("oomless.yaml", "deepspeed.json", "accelerate.yaml", "training_args.json",
              "llamafactory.yaml", "vllm.json", "README.md")


def write_plan_files(out_dir: str | Path, cfg: RunConfig, spec: ModelSpec, cluster: Cluster,
                     model_id: str, family: str = "", data: Any = None, force: bool = False,
                     inputs: tuple[str | None, ...] = ()) -> list[Path]:
    """Write every file for one plan into ``out_dir``; return their paths. ``data``: the
    DataProfile of `plan --data` (the file and its sample count), or None.

    The folder is an :class:`~oomless.fileio.OutputFolder`: files of an earlier plan
    are replaced (a stale deepspeed.json removed); a user's files there, or an input
    of the plan, are never written over unless ``force`` (then kept as NAME.orig).
    """
    folder = OutputFolder(out_dir, force, "--out")
    out = folder.path
    train_file = str(Path(data.file).resolve()) if data is not None else DATA_PLACEHOLDER
    cfg = cfg.replace(**{"data.train_file": train_file,
                         "training.trust_remote_code": cfg.training.trust_remote_code
                         or needs_remote_code(spec)})
    steps = total_steps(cfg, data.records - data.rejected if data is not None else None)
    written: dict[str, str] = {"oomless.yaml": dump_run_config(cfg)}
    ds = deepspeed_config(cfg, spec)
    ds_name = str((out / "deepspeed.json").resolve()) if ds else None
    if ds:
        written["deepspeed.json"] = json.dumps(ds, indent=2) + "\n"
    import yaml

    written["accelerate.yaml"] = yaml.safe_dump(accelerate_config(cfg, ds_name), sort_keys=False)
    written["training_args.json"] = json.dumps(training_arguments(cfg, ds_name, steps),
                                               indent=2) + "\n"
    written["llamafactory.yaml"] = yaml.safe_dump(
        llamafactory_config(cfg, spec, model_id, family, ds_name), sort_keys=False)
    engine, engine_why = vllm_plan(cfg, spec, cluster, model_id)
    written["vllm.json"] = json.dumps(engine, indent=2) + "\n"
    written["README.md"] = readme(cfg, list(written), data is None, steps, family)
    if engine_why:
        written["README.md"] += (f"\nvllm.json: the model does not fit one GPU; {engine_why}. "
                                 f"Assumed: {'; '.join(SERVING_ASSUMPTIONS)}.\n")
    for name in written:
        refuse_inputs(out / name, inputs, "--out")
    folder.prepare(list(written), known=PLAN_FILES)
    paths = [folder.write(name, text) for name, text in written.items()]
    folder.finish()
    return paths
