"""Per-format readers (files → RunConfig input) and writers of changes (→ edits).

Defaults are the tools' own: LLaMA-Factory 0.9.5 (cutoff_len 2048, lora_rank 8,
lora_target all, gradient checkpointing on unless disabled, max_new_tokens
1024), transformers TrainingArguments (per-device batches 8, accumulation 1),
GLM-4 finetune_demo/finetune.py (bf16 weights, checkpointing always on,
max length = max_input_length + max_output_length + 1).
"""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from ..knobs import ATTENTIONS, OPTIMIZERS, attention_from_llamafactory, optimizer_from_hf
from . import foreign_keys as K
from .sources import (
    GLM_DATA_KEYS,
    GLM_DEEPSPEED,
    GLM_TOP_KEYS,
    LF_DEEPSPEED,
    Reading,
    Source,
    deepspeed_source,
    knob_set,
    raise_unknown,
    unknown_keys,
    zero_from_deepspeed,
)

HF_TA_KEYS = K.TRAINING_ARGUMENTS_KEYS | K.SEQ2SEQ_EXTRA_KEYS
# Module names the model's own code uses, for writing LoRA targets back
NATIVE_LINEAR_NAMES = {
    "chatglm": {"qkv_proj": "query_key_value", "o_proj": "dense",
                "gate_up_proj": "dense_h_to_4h", "down_proj": "dense_4h_to_h"},
    "phi": {"o_proj": "dense", "up_proj": "fc1", "down_proj": "fc2"},
}


def native_targets(model_type: str, targets: Any) -> Any:
    if targets == "all-linear":
        return targets
    names = NATIVE_LINEAR_NAMES.get(model_type, {})
    return [names.get(t, t) for t in targets]


def _optimizer(name: str, where: str, notes: list[str]) -> str:
    ours = optimizer_from_hf(name)
    if ours is not None:
        return ours
    notes.append(f"{where}: optim '{name}' is estimated as AdamW (fp32 states)")
    return "adamw"


def _precision(d: dict[str, Any]) -> str:
    if d.get("pure_bf16"):
        return "pure-bf16"
    if d.get("bf16"):
        return "bf16"
    return "fp16" if d.get("fp16") else "fp32"


def _eval_on(d: dict[str, Any]) -> bool:
    strategy = d.get("eval_strategy", d.get("evaluation_strategy", "no"))
    return bool(d.get("do_eval") or d.get("predict_with_generate") or strategy not in ("no", None))


# ---- LLaMA-Factory ----------------------------------------------------------------
def _lf_checks(src: Source, notes: list[str]) -> None:
    raise_unknown(unknown_keys(src, K.LLAMAFACTORY_KEYS | HF_TA_KEYS, "", notes),
                  "LLaMA-Factory YAML")
    d = src.data
    for key, choices in K.LLAMAFACTORY_CHOICES.items():
        if key in d and d[key] is not None and d[key] not in choices:
            raise ConfigError(f"{src.where(key)}: {key} '{d[key]}': LLaMA-Factory accepts "
                              f"{', '.join(map(str, choices))}")
    if d.get("finetuning_type", "lora") not in ("lora", "full"):
        raise ConfigError(f"{src.where('finetuning_type')}: finetuning_type "
                          f"'{d['finetuning_type']}' is not modelled; oomless estimates lora "
                          "(with quantization_bit: QLoRA) and full")
    if d.get("quantization_bit") not in (None, 4, 8):
        raise ConfigError(f"{src.where('quantization_bit')}: quantization_bit "
                          f"{d['quantization_bit']}: oomless models bitsandbytes 4 and 8")


def read_llamafactory(src: Source, model: str | None) -> Reading:
    notes: list[str] = []
    _lf_checks(src, notes)
    d = src.data
    bits = d.get("quantization_bit")
    method = "full" if d.get("finetuning_type") == "full" else ("qlora" if bits else "lora")
    r = d.get("lora_rank", 8)
    target = d.get("lora_target", "all")
    run: dict[str, Any] = {
        "model": model or d.get("model_name_or_path"), "method": method,
        "precision": _precision(d),
        "optimizer": _optimizer(d.get("optim", "adamw_torch"), src.where("optim"), notes),
        "lora": {"r": r, "alpha": d.get("lora_alpha") or 2 * r,
                 "dropout": d.get("lora_dropout", 0.0),
                 "targets": "all-linear" if target == "all" else
                 [t.strip() for t in str(target).split(",") if t.strip()]},
        "quantization": {"bits": bits or 4, "type": d.get("quantization_type", "nf4"),
                         "double_quant": d.get("double_quantization", True)},
        "micro_batch_size": d.get("per_device_train_batch_size", 8),
        "grad_accum": d.get("gradient_accumulation_steps", 1),
        "seq_len": d.get("cutoff_len", 2048),
        "grad_ckpt": not d.get("disable_gradient_checkpointing", False),
        "attn": attention_from_llamafactory(str(d.get("flash_attn", "auto"))) or "sdpa",
        "data": {"packing": bool(d.get("packing"))},
        "eval": {}, "zero": 0, "offload": "none",
    }
    if not run["model"]:
        raise ConfigError(f"{src.path}: no model_name_or_path; add it or pass --model")
    if d.get("deepspeed"):
        ds_src, (run["zero"], run["offload"]) = deepspeed_source(
            str(d["deepspeed"]), src.path, LF_DEEPSPEED, notes)
    if _eval_on(d) or d.get("val_size"):
        run["eval"] = {"batch_size": d.get("per_device_eval_batch_size", 8)}
    if d.get("predict_with_generate"):
        run["eval"].update({"predict_with_generate": True,
                            "max_new_tokens": d.get("max_new_tokens", 1024)})
    for key, default in (("per_device_train_batch_size", 8), ("cutoff_len", 2048)):
        if key not in d:
            notes.append(f"{key} not set: LLaMA-Factory's default {default}")
    shardings = tuple(LF_DEEPSPEED)
    return Reading("llamafactory", "LLaMA-Factory YAML", {"main": src}, run,
                   fixed=set(), shardings=shardings, notes=notes)


def lf_edits(cfg: RunConfig, old: RunConfig, model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    put = lambda key, value: out.append(("main", (key,), value))  # noqa: E731
    if (cfg.method, cfg.quantization.bits) != (old.method, old.quantization.bits):
        put("finetuning_type", "full" if cfg.method == "full" else "lora")
        put("quantization_bit", cfg.quantization.bits if cfg.method == "qlora" else None)
    if cfg.lora.r != old.lora.r:
        put("lora_rank", cfg.lora.r)
    if cfg.lora.targets != old.lora.targets:
        t = native_targets(model_type, cfg.lora.targets)
        put("lora_target", "all" if t == "all-linear" else ",".join(t))
    if cfg.precision != old.precision:
        put("pure_bf16", cfg.precision == "pure-bf16")
        put("bf16", cfg.precision == "bf16")
        put("fp16", cfg.precision == "fp16")
    if cfg.optimizer != old.optimizer:
        put("optim", OPTIMIZERS[cfg.optimizer].hf_optim)
    if cfg.grad_ckpt != old.grad_ckpt:
        put("disable_gradient_checkpointing", not cfg.grad_ckpt)
    if cfg.attn != old.attn:
        put("flash_attn", ATTENTIONS[cfg.attn].llamafactory)
    if (cfg.zero, cfg.offload) != (old.zero, old.offload):
        put("deepspeed", LF_DEEPSPEED.get((cfg.zero, cfg.offload)) if cfg.zero else None)
    _batch_edits(cfg, old, put, "per_device_train_batch_size", "gradient_accumulation_steps",
                 "per_device_eval_batch_size")
    if cfg.seq_len != old.seq_len:
        put("cutoff_len", cfg.seq_len)
    if cfg.data.packing != old.data.packing:
        put("packing", cfg.data.packing)
    return out


def _batch_edits(cfg: RunConfig, old: RunConfig, put, micro: str, accum: str, ev: str) -> None:
    if cfg.micro_batch_size != old.micro_batch_size:
        put(micro, cfg.micro_batch_size)
    if cfg.grad_accum != old.grad_accum:
        put(accum, cfg.grad_accum)
    if cfg.eval.batch_size != old.eval.batch_size and cfg.eval.batch_size:
        put(ev, cfg.eval.batch_size)


# ---- GLM-4 finetune_demo -------------------------------------------------------------
# What a GLM-4 YAML can express; the rest (method, precision, checkpointing,
# attention, lengths) is fixed by finetune.py or needs two coupled keys.
KNOBS_GLM_FIXED = knob_set("lora", "optimizer", "zero", "eval_batch")


def _glm_checks(src: Source, notes: list[str]) -> None:
    problems = unknown_keys(src, GLM_TOP_KEYS, "", notes)
    problems += unknown_keys(src, GLM_DATA_KEYS, "data_config", notes)
    problems += unknown_keys(src, HF_TA_KEYS, "training_args", notes)
    if src.data.get("peft_config"):
        problems += unknown_keys(src, K.PEFT_LORA_KEYS, "peft_config", notes)
    raise_unknown(problems, "GLM-4 finetune YAML")
    for key in ("max_input_length", "max_output_length"):
        if not isinstance(src.data.get(key), int):
            raise ConfigError(f"{src.where(key)}: '{key}' must be set to a number of tokens "
                              "(finetune.py requires it)")


def read_glm4(src: Source, model: str | None) -> Reading:
    notes: list[str] = []
    _glm_checks(src, notes)
    d = src.data
    ta = d.get("training_args") or {}
    peft = d.get("peft_config")
    if not model:
        raise ConfigError("a GLM-4 finetune YAML does not name the model (finetune.py takes it "
                          "on the command line): pass --model, e.g. --model glm-4-9b-chat")
    if peft and str(peft.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"{src.where('peft_config.peft_type')}: peft_type "
                          f"{peft.get('peft_type')} is not modelled; oomless estimates LORA "
                          "and full fine-tuning (no peft_config)")
    in_len, out_len = d["max_input_length"], d["max_output_length"]
    run: dict[str, Any] = {
        "model": model, "method": "lora" if peft else "full",
        "precision": "bf16" if peft or ta.get("deepspeed") else "pure-bf16",
        "optimizer": _optimizer(ta.get("optim", "adamw_torch"),
                                src.where("training_args.optim"), notes),
        "micro_batch_size": ta.get("per_device_train_batch_size", 8),
        "grad_accum": ta.get("gradient_accumulation_steps", 1),
        "seq_len": in_len + out_len + 1, "grad_ckpt": True, "attn": "sdpa",
        "zero": 0, "offload": "none", "eval": {},
        "data": {"max_input_length": in_len + 1, "max_output_length": out_len},
    }
    if peft:
        r = peft.get("r", 8)
        run["lora"] = {"r": r, "alpha": peft.get("lora_alpha", 8),
                       "dropout": peft.get("lora_dropout", 0.0),
                       "targets": peft.get("target_modules") or "all-linear"}
    if ta.get("deepspeed"):
        _s, (run["zero"], run["offload"]) = deepspeed_source(
            str(ta["deepspeed"]), src.path, GLM_DEEPSPEED, notes)
    if _eval_on(ta) and (d.get("data_config") or {}).get("val_file"):
        run["eval"] = {"batch_size": ta.get("per_device_eval_batch_size") or run["micro_batch_size"]}
        new_tokens = (ta.get("generation_config") or {}).get("max_new_tokens")
        if ta.get("predict_with_generate") and new_tokens:
            run["eval"].update({"predict_with_generate": True, "max_new_tokens": new_tokens})
    notes.append("finetune.py loads the weights in bf16 and always enables gradient "
                 "checkpointing; attention is the model code's SDPA")
    return Reading("glm4", "GLM-4 finetune YAML", {"main": src}, run,
                   fixed=set(KNOBS_GLM_FIXED), shardings=((0, "none"), *GLM_DEEPSPEED),
                   notes=notes)


def glm_edits(cfg: RunConfig, old: RunConfig, model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    put = lambda key, value: out.append(("main", ("training_args", key), value))  # noqa: E731
    _batch_edits(cfg, old, put, "per_device_train_batch_size", "gradient_accumulation_steps",
                 "per_device_eval_batch_size")
    if cfg.optimizer != old.optimizer:
        put("optim", OPTIMIZERS[cfg.optimizer].hf_optim)
    if (cfg.zero, cfg.offload) != (old.zero, old.offload):
        put("deepspeed", GLM_DEEPSPEED.get((cfg.zero, cfg.offload)))
    if cfg.lora.r != old.lora.r:
        out.append(("main", ("peft_config", "r"), cfg.lora.r))
    if cfg.lora.targets != old.lora.targets:
        t = native_targets(model_type, cfg.lora.targets)
        out.append(("main", ("peft_config", "target_modules"),
                    "all-linear" if t == "all-linear" else list(t)))
    return out


# ---- DeepSpeed JSON + TrainingArguments JSON -------------------------------------------
def read_hf_deepspeed(ta_src: Source | None, ds_src: Source | None, model: str | None,
                      method: str | None, seq_len: int | None) -> Reading:
    notes: list[str] = []
    ta = ta_src.data if ta_src else {}
    if ta_src:
        raise_unknown(unknown_keys(ta_src, HF_TA_KEYS, "", notes), "TrainingArguments JSON")
    if ds_src is None and ta.get("deepspeed") and isinstance(ta["deepspeed"], str):
        ds_src, _z = deepspeed_source(ta["deepspeed"], ta_src.path, {}, notes)
    ds = ds_src.data if ds_src else {}
    if ds_src:
        raise_unknown(unknown_keys(ds_src, K.DEEPSPEED_ZERO_KEYS, "zero_optimization"),
                      "DeepSpeed JSON")
    if not model:
        raise ConfigError("DeepSpeed and TrainingArguments JSON do not name the model: pass "
                          "--model (a catalog name, HF id in the local cache or a folder)")
    micro = _agree(ta, ds, "per_device_train_batch_size", "train_micro_batch_size_per_gpu", 8)
    accum = _agree(ta, ds, "gradient_accumulation_steps", "gradient_accumulation_steps", 1)
    zero, offload = zero_from_deepspeed(ds, str(ds_src.path)) if ds_src else (0, "none")
    precision = _precision(ta) if ta else (
        "bf16" if (ds.get("bf16") or {}).get("enabled") is True else
        "fp16" if (ds.get("fp16") or {}).get("enabled") is True else "fp32")
    ds_opt = (ds.get("optimizer") or {}).get("type")
    run: dict[str, Any] = {
        "model": model, "method": method or "full", "precision": precision,
        "optimizer": "adamw" if ds_opt else _optimizer(ta.get("optim", "adamw_torch"), "optim", notes),
        "micro_batch_size": micro, "grad_accum": accum, "seq_len": seq_len or 2048,
        "grad_ckpt": bool(ta.get("gradient_checkpointing") or ta.get("activation_checkpointing")),
        "zero": zero, "offload": offload, "eval": {},
    }
    if _eval_on(ta):
        run["eval"] = {"batch_size": ta.get("per_device_eval_batch_size", 8)}
    if not method:
        notes.append("the files do not say the method: estimated as full fine-tuning (--method)")
    if not seq_len:
        notes.append("the files do not say the sequence length: 2048 tokens assumed (--seq-len)")
    sources = {k: v for k, v in (("training_args", ta_src), ("deepspeed", ds_src)) if v}
    fixed = knob_set("optimizer", "grad_ckpt", "zero", "eval_batch") if ta_src else knob_set()
    if ds_src is None:
        fixed.add("zero")
    return Reading("hf-deepspeed", "DeepSpeed + TrainingArguments JSON", sources, run,
                   fixed=fixed, notes=notes)


def _agree(ta: dict, ds: dict, ta_key: str, ds_key: str, default: int) -> int:
    a, b = ta.get(ta_key), ds.get(ds_key)
    if isinstance(b, int) and isinstance(a, int) and a != b:
        raise ConfigError(f"{ta_key} {a} (TrainingArguments) and {ds_key} {b} (DeepSpeed) "
                          "differ; transformers refuses the mismatch: make them equal")
    value = a if isinstance(a, int) else (b if isinstance(b, int) else default)
    return value


def hf_edits(cfg: RunConfig, old: RunConfig, reading: Reading) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    ta = reading.sources.get("training_args")
    ds = reading.sources.get("deepspeed")

    def put(key: str, value: Any) -> None:
        ds_key = {"per_device_train_batch_size": "train_micro_batch_size_per_gpu",
                  "gradient_accumulation_steps": "gradient_accumulation_steps"}.get(key)
        if ta:
            out.append(("training_args", (key,), value))
        if ds and ds_key and (isinstance(ds.data.get(ds_key), int) or not ta):
            out.append(("deepspeed", (ds_key,), value))

    _batch_edits(cfg, old, put, "per_device_train_batch_size", "gradient_accumulation_steps",
                 "per_device_eval_batch_size")
    if cfg.grad_ckpt != old.grad_ckpt and ta:
        key = "activation_checkpointing" if "activation_checkpointing" in ta.data else \
            "gradient_checkpointing"
        out.append(("training_args", (key,), cfg.grad_ckpt))
    if cfg.optimizer != old.optimizer and ta:
        out.append(("training_args", ("optim",), OPTIMIZERS[cfg.optimizer].hf_optim))
    if ds and (cfg.zero, cfg.offload) != (old.zero, old.offload):
        out += _zero_edits(cfg, ds)
    return out


def _zero_edits(cfg: RunConfig, ds: Source) -> list[tuple[str, tuple, Any]]:
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


# ---- oomless.yaml ------------------------------------------------------------------------
def read_oomless(src: Source) -> Reading:
    return Reading("oomless", "oomless.yaml", {"main": src}, dict(src.data))


def oomless_edits(cfg: RunConfig, old: RunConfig) -> list[tuple[str, tuple, Any]]:
    from ..planner.plan import KNOBS as PLAN_KNOBS
    from ..planner.plan import _get

    out = []
    for key, _label, _w in PLAN_KNOBS:
        if _get(cfg, key) != _get(old, key):
            out.append(("main", tuple(key.split(".")), _get(cfg, key)))
    return out
