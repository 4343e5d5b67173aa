"""Formats built directly on transformers' TrainingArguments: a TrainingArguments JSON
with a DeepSpeed JSON, and LLaVA / MoE-LLaVA launch scripts (``deepspeed
train_mem.py --key value ...``; their ModelArguments, DataArguments and
TrainingArguments dataclasses extend transformers').

LLaVA's train_mem.py trains with FlashAttention-2
(``train(attn_implementation="flash_attention_2")``); MoE-LLaVA's MoE layers
are DeepSpeed-MoE (``deepspeed.moe.layer.MoE``), which DeepSpeed refuses under
ZeRO-3 ("MoE not supported with Stage 3", deepspeed/runtime/engine.py).
"""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from ..knobs import OPTIMIZERS
from .common import (
    HF_KEYS,
    batch_edits,
    grad_ckpt_key,
    hf_eval,
    knob_edits,
    optimizer,
    precision,
    training_args_fsdp,
    transformers_release,
)
from .dsfiles import (
    LLAVA_DEEPSPEED,
    MOE_LLAVA_DEEPSPEED,
    deepspeed_ref,
    deepspeed_source,
    read_deepspeed,
)
from .shellargs import launcher_world_size
from .sources import Reading, Source, check_keys, knob_set

# MoE-LLaVA checkpoints in the catalog, by the language model the run path names
MOE_LLAVA_CATALOG = {"phi": "moe-llava-phi2-2.7b-4e"}


def _agree(ta: dict, ds: dict, ta_key: str, ds_key: str, default: int) -> int:
    a, b = ta.get(ta_key), ds.get(ds_key)
    if isinstance(b, int) and isinstance(a, int) and a != b:
        raise ConfigError(f"{ta_key} {a} (TrainingArguments) and {ds_key} {b} (DeepSpeed) "
                          "differ; transformers refuses the mismatch: make them equal")
    return a if isinstance(a, int) else (b if isinstance(b, int) else default)


# DeepSpeed keys the HF Trainer fills from TrainingArguments when they are "auto"
# (transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process)
AUTO_FROM_ARGS = {("train_micro_batch_size_per_gpu",): "per_device_train_batch_size",
                  ("gradient_accumulation_steps",): "gradient_accumulation_steps",
                  ("bf16", "enabled"): "bf16", ("fp16", "enabled"): "fp16"}


def _refuse_auto(ds: dict[str, Any], ds_src: Source | None) -> None:
    """A DeepSpeed file alone whose batch or precision is "auto" does not say them: the
    Trainer takes them from TrainingArguments that are not given (never a guess)."""
    auto = []
    for path, arg in AUTO_FROM_ARGS.items():
        node: Any = ds
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node == "auto":
            auto.append(f"{'.'.join(path)} (← {arg})")
    if auto and ds_src is not None:
        raise ConfigError(
            f"can't tell from '{ds_src.path}' alone: {', '.join(auto)} are \"auto\", which the "
            "HF Trainer fills from its TrainingArguments; check the DeepSpeed file with the "
            "TrainingArguments JSON beside it (oomless check args.json ds.json) or check the "
            "YAML or launch script that points to it")


def read_hf_deepspeed(ta_src: Source | None, ds_src: Source | None, model: str | None,
                      method: str | None, seq_len: int | None) -> Reading:
    r = Reading("hf-deepspeed", "DeepSpeed + TrainingArguments JSON", {}, {})
    ta = ta_src.data if ta_src else {}
    if ta_src:
        check_keys(ta_src, "training_args", reading=r)
    if ds_src is None and isinstance(ta.get("deepspeed"), str):
        ds_src, _z = deepspeed_source(ta["deepspeed"], ta_src.path, {}, r)
    ds = ds_src.data if ds_src else {}
    zero, offload = read_deepspeed(ds_src, r) if ds_src else (0, "none")
    if not model:
        raise ConfigError("DeepSpeed and TrainingArguments JSON do not name the model: pass "
                          "--model (a catalog name, HF id in the local cache or a folder)")
    if not ta_src:
        _refuse_auto(ds, ds_src)
    micro = _agree(ta, ds, "per_device_train_batch_size", "train_micro_batch_size_per_gpu", 8)
    accum = _agree(ta, ds, "gradient_accumulation_steps", "gradient_accumulation_steps", 1)
    prec = precision(ta) if ta else (
        "bf16" if (ds.get("bf16") or {}).get("enabled") is True else
        "fp16" if (ds.get("fp16") or {}).get("enabled") is True else "fp32")
    ds_opt = (ds.get("optimizer") or {}).get("type")
    r.run = {
        "model": model, "method": method or "full", "precision": prec, "stack": "hf-trainer",
        "stage": "sft",
        "optimizer": "adamw" if ds_opt else optimizer(str(ta.get("optim", "adamw_torch")),
                                                       "optim", r),
        "micro_batch_size": micro, "grad_accum": accum,
        "seq_len": seq_len or ta.get("model_max_length") or 2048,
        "grad_ckpt": bool(ta.get(grad_ckpt_key(ta))), "zero": zero, "offload": offload,
        "eval": hf_eval(ta, micro, None),
    }
    sharded = training_args_fsdp(ta, ta_src.where, transformers_release()) \
        if ta_src and not ds_src else None
    if sharded:
        r.run.update(sharded[0])
        r.assumptions.extend(sharded[1])
    if not method:
        r.notes.append("the files do not say the method: estimated as full fine-tuning (--method)")
    if not seq_len and not ta.get("model_max_length"):
        r.notes.append("the files do not say the sequence length: 2048 tokens assumed (--seq-len)")
    r.sources = {k: v for k, v in (("training_args", ta_src), ("deepspeed", ds_src)) if v}
    r.fixed = knob_set("optimizer", "grad_ckpt", "zero", "eval_batch") if ta_src else knob_set()
    if ds_src is None:
        r.fixed.add("zero")
    if ds_opt:
        r.fixed.add("optimizer")
    return r


def hf_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
             model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    ta = reading.sources.get("training_args")
    ds = reading.sources.get("deepspeed")

    def put(key: str, value: Any) -> None:
        ds_key = {"per_device_train_batch_size": "train_micro_batch_size_per_gpu",
                  "gradient_accumulation_steps": "gradient_accumulation_steps"}.get(key)
        if ta:
            out.append(("training_args", (key,), value))
        if ds and ds_key and isinstance(ds.data.get(ds_key), int):  # never an "auto"
            out.append(("deepspeed", (ds_key,), value))

    batch_edits(cfg, old, put, "per_device_train_batch_size", "gradient_accumulation_steps",
                "per_device_eval_batch_size")
    if cfg.grad_ckpt != old.grad_ckpt and ta:
        out.append(("training_args", (grad_ckpt_key(ta.data),), cfg.grad_ckpt))
    if cfg.optimizer != old.optimizer and ta:
        out.append(("training_args", ("optim",), OPTIMIZERS[cfg.optimizer].hf_optim))
    if ds and (cfg.zero, cfg.offload) != (old.zero, old.offload):
        out += zero_edits(cfg, ds)
    return out


def zero_edits(cfg: RunConfig, ds: Source) -> list[tuple[str, tuple, Any]]:
    z = ("zero_optimization",)
    out: list[tuple[str, tuple, Any]] = [("deepspeed", z + ("stage",), cfg.zero)]
    has = ds.data.get("zero_optimization") or {}
    opt_on = cfg.offload in ("optimizer", "all")
    if opt_on or "offload_optimizer" in has:
        out.append(("deepspeed", z + ("offload_optimizer", "device"), "cpu" if opt_on else "none"))
    if cfg.offload == "all" or "offload_param" in has:
        out.append(("deepspeed", z + ("offload_param", "device"),
                    "cpu" if cfg.offload == "all" else "none"))
    if opt_on and "optimizer" not in ds.data:
        # ZeRO-Offload steps with DeepSpeed's CPU-Adam, built from an optimizer block
        out.append(("deepspeed", ("optimizer",), {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}))
    return out


# ---- LLaVA / MoE-LLaVA launch scripts ----------------------------------------------------
def _launch_model(a: dict[str, Any], model: str | None, r: Reading) -> str | None:
    if model:
        return model
    path = str(a.get("model_name_or_path") or "")
    if a.get("moe_enable") and a.get("num_experts", 4) in (4, [4]) and a.get("top_k_experts", 2) == 2:
        for part, name in MOE_LLAVA_CATALOG.items():
            if part in path.lower():
                r.notes.append(f"--model_name_or_path {path} with 4 experts top-2: read as "
                               f"{name} (pass --model to choose another)")
                return name
    return path or None


def _launch_method(a: dict[str, Any], src: Source, r: Reading) -> tuple[str, dict[str, Any]]:
    extra: dict[str, Any] = {}
    if a.get("lora_enable"):
        bits = a.get("bits", 16)
        extra["lora"] = {"r": a.get("lora_r", 64), "alpha": a.get("lora_alpha", 16),
                         "dropout": a.get("lora_dropout", 0.05), "targets": "all-linear"}
        if bits in (4, 8):
            extra["quantization"] = {"bits": bits, "type": a.get("quant_type", "nf4"),
                                     "double_quant": a.get("double_quant", True)}
            return "qlora", extra
        return "lora", extra
    if a.get("tune_mm_mlp_adapter") or a.get("freeze_backbone"):
        key = "tune_mm_mlp_adapter" if a.get("tune_mm_mlp_adapter") else "freeze_backbone"
        r.assumptions.append(f"{src.where(key)}: the language model is frozen and only the "
                             "projector trains: estimated as LoRA rank 8 (a frozen 16-bit base, "
                             "a backward through every activation)")
        extra["lora"] = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": "all-linear"}
        r.fixed.add("lora")
        return "lora", extra
    if a.get("train_modules"):
        r.assumptions.append(f"{src.where('train_modules')}: only {' '.join(map(str, a['train_modules']))}"
                             " train: estimated as full fine-tuning (an upper bound on gradients "
                             "and optimizer states)")
    return "full", extra


def _launch_stack(src: Source, r: Reading) -> str:
    """LLaVA and MoE-LLaVA train with a transformers Trainer subclass; another script
    is a custom loop as far as we know (its TrainingArguments still read)."""
    script = src.command.script
    if "llava" in script or "moe_enable" in src.data:
        return "hf-trainer"
    r.notes.append(f"{script}: not a script oomless knows; its --key value arguments are read "
                   "as transformers TrainingArguments (stack custom-loop)")
    return "custom-loop"


def read_launch(src: Source, model: str | None) -> Reading:
    moe_repo = "moellava" in src.command.script or "moe_enable" in src.data
    llava = "llava" in src.command.script
    label = "MoE-LLaVA launch script" if moe_repo else (
        "LLaVA launch script" if llava else "launch script")
    r = Reading("launch", label, {"main": src}, {})
    check_keys(src, "launch", reading=r)
    a = src.data
    shipped = MOE_LLAVA_DEEPSPEED if moe_repo else LLAVA_DEEPSPEED
    method, extra = _launch_method(a, src, r)
    micro = a.get("per_device_train_batch_size", 8)
    flash = src.command.script.endswith("train_mem.py") and not moe_repo
    run: dict[str, Any] = {
        "model": _launch_model(a, model, r), "method": method, "stack": _launch_stack(src, r),
        "stage": "sft",
        "precision": precision(a), "optimizer": optimizer(str(a.get("optim", "adamw_torch")),
                                                          src.where("optim"), r),
        "micro_batch_size": micro, "grad_accum": a.get("gradient_accumulation_steps", 1),
        "seq_len": a.get("model_max_length", 512), "grad_ckpt": bool(a.get("gradient_checkpointing")),
        "attn": "flash" if flash else "sdpa", "zero": 0, "offload": "none",
        "eval": hf_eval(a, micro, None), **extra,
    }
    if not run["model"]:
        raise ConfigError(f"{src.path}: no --model_name_or_path; pass --model")
    if flash:
        r.notes.append(f"{src.command.script} trains with FlashAttention-2")
    if a.get("deepspeed"):
        _s, (run["zero"], run["offload"]) = deepspeed_source(str(a["deepspeed"]), src.path,
                                                             shipped, r)
    elif (sharded := training_args_fsdp(a, src.where, transformers_release())):
        run.update(sharded[0])
        r.assumptions.extend(sharded[1])
    if a.get("moe_enable"):
        r.facts["deepspeed_moe"] = True
    gpus = launcher_world_size(src.command)
    if gpus:
        run["hardware"] = {"gpus_per_node": gpus}
    r.facts["shipped_deepspeed"] = shipped
    r.run = run
    r.shardings = tuple(shipped)  # the launcher is deepspeed: a fix names a shipped file
    r.fixed |= knob_set("grad_ckpt", "optimizer", "zero", "eval_batch", "lora", "quantization")
    if (run["stack"] == "custom-loop" and not a.get("deepspeed")) or a.get("fsdp"):
        r.fixed.add("zero")  # no DeepSpeed file of its own to point a fix at, or FSDP's
    return r


def launch_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
                 model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    put = lambda key, value: out.append(("main", (key,), value))  # noqa: E731
    knob_edits(cfg, old, put, {**HF_KEYS, "grad_ckpt": "gradient_checkpointing",
                               "lora_r": "lora_r"})
    if cfg.quantization.bits != old.quantization.bits and cfg.method == "qlora":
        put("bits", cfg.quantization.bits)
    if (cfg.zero, cfg.offload) != (old.zero, old.offload):
        put("deepspeed", deepspeed_ref(reading.facts["shipped_deepspeed"], cfg.zero,
                                       cfg.offload, reading))
    return out
