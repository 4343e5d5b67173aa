"""LLaMA-Factory training YAML, and WeClone's settings (LLaMA-Factory arguments in JSONC).

Defaults are LLaMA-Factory's own (0.9.x): cutoff_len 2048 (1024 before 0.9.3
in some examples, always written there), lora_rank 8, lora_target all,
gradient checkpointing on unless disabled, max_new_tokens 1024, stage sft,
freeze_vision_tower and freeze_multi_modal_projector true (hparams/finetuning_args.py
FinetuningArguments); TrainingArguments' per-device batches 8, accumulation 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from ..knobs import ATTENTIONS, OPTIMIZERS, attention_from_llamafactory
from . import foreign_keys as K
from .common import (
    batch_edits,
    defaults_note,
    hf_eval,
    native_targets,
    optimizer,
    pre_quantized_note,
    precision,
    training_args_fsdp,
    transformers_release,
)
from .dsfiles import LF_DEEPSPEED, deepspeed_ref, deepspeed_source
from .sources import Reading, Source, check_keys

STAGES = {"pt": "pt", "sft": "sft", "rm": "rm", "ppo": "ppo", "dpo": "dpo", "kto": "kto"}
PREF_LOSS_STAGE = {"orpo": "orpo", "simpo": "simpo"}  # stage dpo with these losses
SPECIAL_OPTIMIZERS = ("use_galore", "use_badam", "use_apollo", "use_adam_mini", "use_muon")
LF_DEFAULTS = {"per_device_train_batch_size": 8, "cutoff_len": 2048}
LF_DEFAULT_NEW_TOKENS = 1024  # GeneratingArguments.max_new_tokens


def _lf_values(d: dict[str, Any], where: Callable[[str], str]) -> None:
    for key, choices in K.LLAMAFACTORY_CHOICES.items():
        if key in d and d[key] is not None and d[key] not in choices:
            raise ConfigError(f"{where(key)}: {key} '{d[key]}': LLaMA-Factory accepts "
                              f"{', '.join(map(str, choices))}")
    if d.get("finetuning_type", "lora") not in ("lora", "full", "freeze", "oft"):
        raise ConfigError(f"{where('finetuning_type')}: finetuning_type "
                          f"'{d['finetuning_type']}': LLaMA-Factory accepts lora, freeze, full")


def _method(d: dict[str, Any], where: Callable[[str], str], r: Reading) -> tuple[str, int]:
    ftype = d.get("finetuning_type", "lora")
    bits = d.get("quantization_bit")
    qmethod = str(d.get("quantization_method") or "bnb")
    if ftype in ("freeze", "full"):
        if ftype == "freeze":
            layers = d.get("freeze_trainable_layers", 2)
            r.assumptions.append(f"{where('finetuning_type')}: freeze tuning ({layers} trainable "
                                 "layers) is estimated as full fine-tuning: an upper bound")
        return "full", 4
    if bits is None:
        return "lora", 4
    if qmethod == "bnb" and bits in (4, 8):
        return "qlora", bits
    r.assumptions.append(f"{where('quantization_bit')}: {qmethod} {bits}-bit quantization is "
                         "estimated as bitsandbytes 4-bit (QLoRA)")
    return "qlora", 4


def _stage(d: dict[str, Any], where: Callable[[str], str]) -> str:
    stage = str(d.get("stage", "sft"))
    if stage not in STAGES:
        raise ConfigError(f"{where('stage')}: stage '{stage}': LLaMA-Factory accepts "
                          f"{', '.join(STAGES)}")
    if stage == "dpo":
        return PREF_LOSS_STAGE.get(str(d.get("pref_loss", "sigmoid")), "dpo")
    return stage


def _special(d: dict[str, Any], where: Callable[[str], str], r: Reading) -> bool:
    """GaLore, BAdam, APOLLO, Adam-mini, Muon: LLaMA-Factory builds its own optimizer (and
    refuses layer-wise GaLore / APOLLO and BAdam under distributed training)."""
    used = [k for k in SPECIAL_OPTIMIZERS if d.get(k)]
    for key in used:
        r.assumptions.append(f"{where(key)}: {key.removeprefix('use_')} replaces the optimizer; "
                             "estimated as the AdamW states it replaces (an upper bound), so no "
                             "fix changes its optimizer, precision or sharding")
    return bool(used)


def _names(value: Any) -> list[str]:
    """LLaMA-Factory's list arguments: a comma-separated string (hparams/finetuning_args.py
    split_arg) or a YAML list."""
    items = value if isinstance(value, list) else str(value or "").split(",")
    return [str(t).strip() for t in items if str(t).strip()]


def read_lf_dict(d: dict[str, Any], where: Callable[[str], str], src: Source, model: str | None,
                 r: Reading) -> dict[str, Any]:
    """RunConfig input from LLaMA-Factory arguments ``d`` (shared by the YAML and WeClone)."""
    _lf_values(d, where)
    method, bits = _method(d, where, r)
    rank = d.get("lora_rank", 8)
    target = d.get("lora_target", "all")
    run: dict[str, Any] = {
        "model": model or d.get("model_name_or_path"), "method": method,
        "stage": _stage(d, where), "stack": "llamafactory", "precision": precision(d),
        "optimizer": optimizer(str(d.get("optim", "adamw_torch")), where("optim"), r),
        "lora": {"r": rank, "alpha": d.get("lora_alpha") or 2 * rank,
                 "dropout": d.get("lora_dropout", 0.0),
                 "targets": "all-linear" if target == "all" else
                 [t.strip() for t in str(target).split(",") if t.strip()],
                 "modules_to_save": _names(d.get("additional_target"))},
        "quantization": {"bits": bits, "type": d.get("quantization_type", "nf4"),
                         "double_quant": d.get("double_quantization", True)},
        "micro_batch_size": d.get("per_device_train_batch_size", 8),
        "grad_accum": d.get("gradient_accumulation_steps", 1),
        "seq_len": d.get("cutoff_len", 2048),
        "grad_ckpt": not d.get("disable_gradient_checkpointing", False),
        "attn": attention_from_llamafactory(str(d.get("flash_attn", "auto"))) or "sdpa",
        "data": {"packing": bool(d.get("packing"))},
        "vision": {"freeze_tower": bool(d.get("freeze_vision_tower", True)),
                   "freeze_projector": bool(d.get("freeze_multi_modal_projector", True))},
        "zero": 0, "offload": "none",
    }
    if not run["model"]:
        raise ConfigError(f"{src.path}: no model_name_or_path; add it or pass --model")
    if _special(d, where, r):
        r.fixed |= {"optimizer", "precision", "zero"}
    pre_quantized_note(run["model"], r)
    if d.get("deepspeed"):
        _s, (run["zero"], run["offload"]) = deepspeed_source(str(d["deepspeed"]), src.path,
                                                             LF_DEEPSPEED, r)
    elif (sharded := training_args_fsdp(d, where, transformers_release())):
        run.update(sharded[0])
        r.assumptions.extend(sharded[1])
        r.fixed.add("zero")  # a fix never adds a DeepSpeed file next to the file's FSDP
    new_tokens = d.get("max_new_tokens", LF_DEFAULT_NEW_TOKENS)
    eval_d = {**d, "do_eval": d.get("do_eval") or bool(d.get("val_size"))}
    run["eval"] = hf_eval(eval_d, run["micro_batch_size"], new_tokens)
    if run["stage"] == "ppo":
        run["eval"] = {**run["eval"], "max_new_tokens": new_tokens}
    if d.get("image_max_pixels"):
        r.facts["image_max_pixels"] = int(d["image_max_pixels"])
    r.facts["trust_remote_code"] = bool(d.get("trust_remote_code"))
    defaults_note(d, LF_DEFAULTS, "LLaMA-Factory", r)
    return run


def read_llamafactory(src: Source, model: str | None) -> Reading:
    r = Reading("llamafactory", "LLaMA-Factory YAML", {"main": src}, {},
                shardings=tuple(LF_DEEPSPEED))
    check_keys(src, "llamafactory", reading=r)
    r.run = read_lf_dict(src.data, src.where, src, model, r)
    return r


def lf_edits(cfg: RunConfig, old: RunConfig, model_type: str,
             put: Callable[[str, Any], None], reading: Reading) -> None:
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
        put("deepspeed", deepspeed_ref(LF_DEEPSPEED, cfg.zero, cfg.offload, reading))
    batch_edits(cfg, old, put, "per_device_train_batch_size", "gradient_accumulation_steps",
                "per_device_eval_batch_size")
    if cfg.seq_len != old.seq_len:
        put("cutoff_len", cfg.seq_len)
    if cfg.data.packing != old.data.packing:
        put("packing", cfg.data.packing)


def llamafactory_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
                       model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    lf_edits(cfg, old, model_type, lambda key, value: out.append(("main", (key,), value)),
             reading)
    return out


# ---- WeClone settings (LLaMA-Factory arguments in sections) ------------------------------
WECLONE_TRAIN = "train_sft_args"
WECLONE_COMMON = "common_args"


def _weclone_section(d: dict[str, Any], key: str) -> str:
    if key in (d.get(WECLONE_TRAIN) or {}):
        return WECLONE_TRAIN
    if key in (d.get(WECLONE_COMMON) or {}):
        return WECLONE_COMMON
    return WECLONE_TRAIN


def read_weclone(src: Source, model: str | None) -> Reading:
    """WeClone's settings.json / .jsonc: LLaMA-Factory arguments under common_args and
    train_sft_args (what `weclone-cli train-sft` passes to LLaMA-Factory)."""
    r = Reading("weclone", "WeClone settings (LLaMA-Factory arguments)", {"main": src}, {},
                shardings=((0, "none"),))
    for section in (WECLONE_COMMON, WECLONE_TRAIN):
        check_keys(src, "llamafactory", section, reading=r)
    d = {**(src.data.get(WECLONE_COMMON) or {}), **(src.data.get(WECLONE_TRAIN) or {})}
    where = lambda key: src.where(f"{_weclone_section(src.data, key)}.{key}")  # noqa: E731
    r.run = read_lf_dict(d, where, src, model, r)
    r.run["stack"] = "llamafactory"
    r.notes.append("read train_sft_args over common_args, as WeClone passes them to "
                   "LLaMA-Factory")
    return r


def weclone_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
                  model_type: str) -> list[tuple[str, tuple, Any]]:
    data = reading.sources["main"].data
    out: list[tuple[str, tuple, Any]] = []
    lf_edits(cfg, old, model_type, lambda key, value: out.append(
        ("main", (_weclone_section(data, key), key), value)), reading)
    return out
