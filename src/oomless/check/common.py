"""Readings shared by the formats built on transformers' TrainingArguments."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..config import RunConfig
from ..knobs import OPTIMIZERS, optimizer_from_hf
from .sources import Reading

# Module names the model's own code uses, for writing LoRA targets back
NATIVE_LINEAR_NAMES = {
    "chatglm": {"qkv_proj": "query_key_value", "o_proj": "dense",
                "gate_up_proj": "dense_h_to_4h", "down_proj": "dense_4h_to_h"},
    "phi": {"o_proj": "dense", "up_proj": "fc1", "down_proj": "fc2"},
}
# Pre-quantized checkpoints by the names their publishers give them
PRE_QUANTIZED = re.compile(r"(?i)(?:^|[-_/.])(gptq|awq|aqlm|exl2|hqq|eetq|bnb-4bit|fp8)(?:$|[-_/.])")
TRANSFORMERS_EVAL_BATCH = 8  # TrainingArguments.per_device_eval_batch_size default


def native_targets(model_type: str, targets: Any) -> Any:
    if targets == "all-linear":
        return targets
    names = NATIVE_LINEAR_NAMES.get(model_type, {})
    return [names.get(t, t) for t in targets]


def optimizer(name: str, where: str, reading: Reading) -> str:
    """Our optimizer for a TrainingArguments ``optim`` value (AdamW when not modelled)."""
    ours = optimizer_from_hf(name)
    if ours is not None:
        return ours
    reading.assumptions.append(f"{where}: optim '{name}' is estimated as AdamW (fp32 states)")
    return "adamw"


def precision(d: dict[str, Any]) -> str:
    if d.get("pure_bf16"):
        return "pure-bf16"
    if d.get("bf16") in (True, "true", "True", "auto"):
        return "bf16"
    return "fp16" if d.get("fp16") in (True, "true", "True") else "fp32"


def eval_on(d: dict[str, Any]) -> bool:
    strategy = d.get("eval_strategy", d.get("evaluation_strategy", "no"))
    return bool(d.get("do_eval") or d.get("predict_with_generate")
                or strategy not in ("no", None, "NO"))


def grad_ckpt_key(d: dict[str, Any]) -> str:
    """transformers 5.x also accepts activation_checkpointing for gradient_checkpointing."""
    return "activation_checkpointing" if "activation_checkpointing" in d else \
        "gradient_checkpointing"


def pre_quantized_note(model: str | None, reading: Reading) -> None:
    m = PRE_QUANTIZED.search(str(model or ""))
    if m:
        reading.assumptions.append(
            f"'{model}' is a pre-quantized ({m.group(1).upper()}) checkpoint: its weights are "
            "sized from the quantization_config of its config.json where the model loader "
            "reads it, else as 16-bit (an upper bound)")


# The knobs most formats write as one key each: knob -> its value in a RunConfig
_ONE_KEY: dict[str, Callable[[RunConfig], Any]] = {
    "micro": lambda c: c.micro_batch_size, "accum": lambda c: c.grad_accum,
    "eval": lambda c: c.eval.batch_size, "grad_ckpt": lambda c: c.grad_ckpt,
    "optim": lambda c: OPTIMIZERS[c.optimizer].hf_optim, "seq_len": lambda c: c.seq_len,
    "lora_r": lambda c: c.lora.r, "packing": lambda c: c.data.packing,
}


def knob_edits(cfg: RunConfig, old: RunConfig, put: Callable[[str, Any], None],
               keys: dict[str, str]) -> None:
    """``put(file key, new value)`` for every knob of ``keys`` (knob -> the format's key)
    whose value changed."""
    for knob, key in keys.items():
        new, was = _ONE_KEY[knob](cfg), _ONE_KEY[knob](old)
        if new != was and (new is not None):
            put(key, new)


# TrainingArguments' names of the batch and optimizer knobs
HF_KEYS = {"micro": "per_device_train_batch_size", "accum": "gradient_accumulation_steps",
           "eval": "per_device_eval_batch_size", "optim": "optim"}


def batch_edits(cfg: RunConfig, old: RunConfig, put: Callable[[str, Any], None], micro: str,
                accum: str, ev: str | None) -> None:
    keys = {"micro": micro, "accum": accum, **({"eval": ev} if ev else {})}
    knob_edits(cfg, old, put, keys)


def hf_eval(d: dict[str, Any], micro: int, new_tokens: int | None) -> dict[str, Any]:
    """RunConfig.eval from TrainingArguments keys (empty when no evaluation runs)."""
    if not eval_on(d):
        return {}
    out: dict[str, Any] = {"batch_size": d.get("per_device_eval_batch_size")
                           or TRANSFORMERS_EVAL_BATCH}
    if d.get("predict_with_generate") and new_tokens:
        out.update({"predict_with_generate": True, "max_new_tokens": new_tokens})
    return out


def defaults_note(d: dict[str, Any], defaults: dict[str, Any], tool: str,
                  reading: Reading) -> None:
    missing = [f"{k} {v}" for k, v in defaults.items() if k not in d]
    if missing:
        reading.notes.append(f"not set, {tool}'s defaults: {', '.join(missing)}")


# TrainingArguments' own FSDP (transformers trainer_utils.FSDPOption; training_args.py
# TrainingArguments._process_fsdp_args and _apply_legacy_fsdp_to_config, 5.23): the words of
# ``fsdp`` name the sharding strategy, "offload" sets fsdp_config cpu_offload, "auto_wrap" is
# the default wrapping; fsdp_config keys lose an "fsdp_" prefix. Strategy → the ZeRO stage
# whose sharding it matches: FULL/HYBRID_SHARD shard parameters, SHARD_GRAD_OP (and
# hybrid_shard_zero2) gradients and optimizer states only.
STAGE_OF_FSDP_STRATEGY = {"full_shard": 3, "hybrid_shard": 3, "shard_grad_op": 2,
                  "hybrid_shard_zero2": 2, "no_shard": 0}
# the FSDP version TrainingArguments runs when fsdp_config has no "version": 2 in
# transformers 5.16.1 and 5.23 (``int(self.fsdp_config.get("version", 2))``); earlier
# releases read ``get("version", 1)`` or handed accelerate no version (its default: FSDP1).
# The release that switched is not pinned here: every 5.x is read as 2, every 4.x as 1.
TA_FSDP_DEFAULT_VERSION = {4: 1, 5: 2}


def transformers_major() -> int:
    """The installed transformers' major release (5, the release the project pins, when
    transformers is not installed)."""
    from ..memory.stacks import installed_version

    return int((installed_version("transformers") or "5").split(".")[0])


def _ta_fsdp_stage(words: list[str], reshard: Any, version: int) -> tuple[int, str | None]:
    """The ZeRO stage TrainingArguments' FSDP shards as, and a note when it can't tell.
    ``fsdp_config.reshard_after_forward`` wins over the ``fsdp`` words (transformers
    _apply_legacy_fsdp_to_config only ``setdefault``s it): FSDP2 reads a bool (True: full
    shard), FSDP1 a sharding strategy name (accelerate FullyShardedDataParallelPlugin)."""
    strategies = [w.lower() for w in words if w.lower() in STAGE_OF_FSDP_STRATEGY]
    if reshard is None:
        return (STAGE_OF_FSDP_STRATEGY[strategies[0]] if strategies else 3), None
    text = str(reshard).lower()
    if version == 2 and text in ("true", "false", "1", "0"):
        return (3 if text in ("true", "1") else 2), None
    if version == 1 and text in STAGE_OF_FSDP_STRATEGY:
        return STAGE_OF_FSDP_STRATEGY[text], None
    want = "true or false" if version == 2 else ", ".join(STAGE_OF_FSDP_STRATEGY)
    return 3, (f"reshard_after_forward {reshard!r} is not what FSDP{version} takes ({want}; "
               "accelerate refuses it): can't tell the sharding, read as full sharding; set "
               "fsdp_config.reshard_after_forward to settle it")


def training_args_fsdp(d: dict[str, Any], where: Callable[[str], str],
                       transformers_major: int) -> tuple[dict[str, Any], list[str]] | None:
    """(the run keys — zero, offload, fsdp, and grad_ckpt when FSDP checkpoints — and
    notes) of TrainingArguments' ``fsdp`` / ``fsdp_config`` keys, or None when the file
    does not use FSDP. ``fsdp: true`` (as axolotl passes it) names no strategy: the
    sharding is ``fsdp_config``'s."""
    fsdp = d.get("fsdp")
    if not fsdp:
        return None
    words = fsdp.split() if isinstance(fsdp, str) else (
        [str(w) for w in fsdp] if isinstance(fsdp, list) else [])
    conf = d.get("fsdp_config") or {}
    notes: list[str] = []
    if not isinstance(conf, dict):
        notes.append(f"{where('fsdp_config')}: the file '{conf}' is not read: FSDP's prefetch "
                     "and version take their defaults")
        conf = {}
    conf = {k[5:] if k.startswith("fsdp_") else k: v for k, v in conf.items()}
    version = int(conf.get("version") or TA_FSDP_DEFAULT_VERSION.get(transformers_major, 2))
    stage, unsure = _ta_fsdp_stage(words, conf.get("reshard_after_forward"), version)
    offload = "all" if stage == 3 and ("offload" in words or conf.get("cpu_offload")) else "none"
    section: dict[str, Any] = {"version": version}
    if version == 1:
        section.update(backward_prefetch=str(conf.get("backward_prefetch") or "NO_PREFETCH").upper(),
                       forward_prefetch=str(conf.get("forward_prefetch", False)).lower() == "true",
                       use_orig_params=str(conf.get("use_orig_params", True)).lower() == "true")
        if "limit_all_gathers" in conf:
            section["limit_all_gathers"] = str(conf["limit_all_gathers"]).lower() == "true"
    how = "no sharding" if stage == 0 else f"sharded as ZeRO-{stage}"
    named = " ".join(words) or "from fsdp_config"
    notes.append(f"{where('fsdp')}: FSDP{version} {named} ({how}"
                 + (", parameters offloaded to CPU" if offload != "none" else "")
                 + ("" if conf.get("version") else
                    f"; fsdp_config has no version: transformers {transformers_major} runs "
                    f"FSDP{version}") + ")")
    if unsure:
        notes.append(f"{where('fsdp_config')}: {unsure}")
    run: dict[str, Any] = {"zero": stage, "offload": offload, "fsdp": section}
    if str(conf.get("activation_checkpointing", False)).lower() == "true":
        run["grad_ckpt"] = True  # FSDP's own activation checkpointing wraps every layer
        notes.append(f"{where('fsdp_config')}: activation_checkpointing: every layer checkpointed")
    return run, notes
