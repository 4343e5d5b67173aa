"""Readings shared by the formats built on transformers' TrainingArguments."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
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
# How each range of transformers releases turns ``fsdp`` / ``fsdp_config`` into accelerate's
# FullyShardedDataParallelPlugin, keyed by the first release (PyPI version) of each
# behaviour; read from the released wheels' training_args.py (4.57.6, 5.0.0rc0-rc2, 5.0.0,
# 5.3.0-5.6.0, 5.9.0-5.11.0, 5.13.0, 5.23.0) and accelerate 1.10/1.15's plugin:
# - before 5.0.0rc1 fsdp_config's "version" and "reshard_after_forward" are not read: 4.57.6
#   hands accelerate FSDP_* environment variables (the words' FSDP_SHARDING_STRATEGY, no
#   version: FullyShardedDataParallelPlugin reads FSDP_VERSION, default 1); 5.0.0rc0 reads
#   fsdp_config["fsdp_version"], a key its own "fsdp_" prefix strip has already renamed.
# - 5.0.0rc1 reads ``fsdp_config.get("version", 1)`` and reshard_after_forward (merged in
#   Dec 2025: PR #42578 "fix the FSDP1 default for reshard_after_forward", a follow-up to
#   PR #42566, whose own text was not found); the words still go as sharding_strategy,
#   which accelerate's Accelerator.prepare_model prefers for FSDP1; FSDP2 ignores the
#   words (reshard_after_forward default False).
# - 5.4.0 (its PR not found; 5.3.0's and 5.4.0's wheels differ) passes the words only as
#   reshard_after_forward's default (FSDP2: shard_grad_op False, every other word True);
#   FSDP1 gets no sharding_strategy, accelerate's plugin defaults it to
#   FSDP_SHARDING_STRATEGY or FULL_SHARD, and prepare_model prefers that over
#   reshard_after_forward: FSDP1 shards fully whatever the words say.
# - 5.10.0 (PR #45640 "Default to FSDP2"; 5.10.0 itself was yanked, 5.10.1 is the first
#   kept) reads ``fsdp_config.get("version", 2)`` and refuses FSDP1-only words
#   (hybrid_shard, hybrid_shard_zero2, no_shard) with FSDP2 (_apply_legacy_fsdp_to_config).
@dataclass(frozen=True)
class TaFsdpRelease:
    """One range of transformers releases, from ``since`` to the next row's."""

    since: str  # the first release with this behaviour
    reads_config: bool  # fsdp_config "version" and "reshard_after_forward" are read
    default_version: int  # FSDP version without a read fsdp_config "version"
    fsdp1_words: bool  # FSDP1 shards as the strategy word (else FULL_SHARD)
    fsdp2_words: str  # FSDP2 reshard_after_forward from the words: ignored|not_grad_op|strict


TA_FSDP_RELEASES = (
    TaFsdpRelease("0", False, 1, True, "ignored"),
    TaFsdpRelease("5.0.0rc1", True, 1, True, "ignored"),
    TaFsdpRelease("5.4.0", True, 1, False, "not_grad_op"),
    TaFsdpRelease("5.10.0", True, 2, False, "strict"),
)


def ta_fsdp_release(transformers_version: str) -> TaFsdpRelease:
    """The row of :data:`TA_FSDP_RELEASES` a transformers release falls in."""
    from packaging.version import Version

    v = Version(transformers_version)
    return [row for row in TA_FSDP_RELEASES if v >= Version(row.since)][-1]


def transformers_release() -> str:
    """The installed transformers' version (the project's pinned release when transformers
    is not installed)."""
    from ..memory.stacks import NEWEST_TRANSFORMERS, installed_version

    return installed_version("transformers") or NEWEST_TRANSFORMERS


def _reshard_stage(reshard: Any, version: int) -> tuple[int, str | None]:
    """The ZeRO stage of fsdp_config.reshard_after_forward: FSDP2 reads a bool (True: full
    shard), FSDP1 a sharding strategy name (accelerate FullyShardedDataParallelPlugin)."""
    text = str(reshard).lower()
    if version == 2 and text in ("true", "false", "1", "0"):
        return (3 if text in ("true", "1") else 2), None
    if version == 1 and text in STAGE_OF_FSDP_STRATEGY:
        return STAGE_OF_FSDP_STRATEGY[text], None
    want = "true or false" if version == 2 else ", ".join(STAGE_OF_FSDP_STRATEGY)
    return 3, (f"reshard_after_forward {reshard!r} is not what FSDP{version} takes ({want}; "
               "accelerate refuses it): can't tell the sharding, read as full sharding; set "
               "fsdp_config.reshard_after_forward to settle it")


def _ta_fsdp_stage(words: list[str], reshard: Any, version: int, release: str
                   ) -> tuple[int, str | None]:
    """The ZeRO stage TrainingArguments' FSDP shards as in transformers ``release``, and a
    note on what it runs that the file does not say."""
    row = ta_fsdp_release(release)
    strategies = [w.lower() for w in words if w.lower() in STAGE_OF_FSDP_STRATEGY]
    word = strategies[0] if strategies else None
    read = reshard if row.reads_config else None
    if version == 1 and read is not None and str(read).lower() not in STAGE_OF_FSDP_STRATEGY:
        return _reshard_stage(read, version)  # accelerate refuses it
    if version == 1:
        strategy = word if row.fsdp1_words and word else "full_shard"
        asked = read if read is not None else word
        stage = STAGE_OF_FSDP_STRATEGY[strategy]
        if STAGE_OF_FSDP_STRATEGY.get(str(asked).lower(), stage) == stage:
            return stage, None
        return stage, (f"FSDP1 in transformers {release} shards as {strategy}, not {asked}: "
                       "accelerate's plugin sets sharding_strategy (from the fsdp words "
                       + ("" if row.fsdp1_words else "before transformers 5.4, ")
                       + "else FSDP_SHARDING_STRATEGY, else FULL_SHARD) and "
                       "Accelerator.prepare_model prefers it over reshard_after_forward; "
                       "FSDP2 (fsdp_config.version 2) takes reshard_after_forward")
    if read is not None:
        return _reshard_stage(read, version)
    if row.fsdp2_words == "ignored":
        return 2, (f"FSDP2 in transformers {release} takes its sharding from "
                   "fsdp_config.reshard_after_forward alone, default false (parameters stay "
                   "gathered after forward: ZeRO-2's sharding), not from the fsdp words; set "
                   "reshard_after_forward true to shard fully")
    if word in (None, "full_shard", "shard_grad_op"):
        return STAGE_OF_FSDP_STRATEGY[word or "full_shard"], None
    if row.fsdp2_words == "not_grad_op":
        return 3, None if STAGE_OF_FSDP_STRATEGY[word] == 3 else (
            f"FSDP2 in transformers {release} reshards after forward for every fsdp word but "
            f"shard_grad_op: {word} shards as ZeRO-3")
    return STAGE_OF_FSDP_STRATEGY[word], (
        f"transformers {release} refuses fsdp {word} with FSDP2 (FSDP1 only: ValueError "
        f"before training); read as FSDP1's {word}; set fsdp_config.version 1 or use "
        "full_shard / shard_grad_op")


def _ta_fsdp_version(conf: dict[str, Any], release: str) -> tuple[int, str]:
    """The FSDP version transformers ``release`` runs for fsdp_config ``conf``, and what the
    note says about it."""
    row = ta_fsdp_release(release)
    named = conf.get("version")
    if named and (row.reads_config or int(named) == row.default_version):
        return int(named), ""
    if not named:
        return row.default_version, (f"; fsdp_config has no version: transformers {release} "
                                     f"runs FSDP{row.default_version}")
    return row.default_version, (
        f"; transformers {release} does not read fsdp_config.version {named} (read from "
        f"{next(r.since for r in TA_FSDP_RELEASES if r.reads_config)} on): FSDP{row.default_version} unless the launcher's "
        "accelerate config sets fsdp_version; can't tell, give that config to settle it")


def training_args_fsdp(d: dict[str, Any], where: Callable[[str], str],
                       transformers_version: str) -> tuple[dict[str, Any], list[str]] | None:
    """(the run keys — zero, offload, fsdp, and grad_ckpt when FSDP checkpoints — and
    notes) of TrainingArguments' ``fsdp`` / ``fsdp_config`` keys as transformers
    ``transformers_version`` runs them (:data:`TA_FSDP_RELEASES`), or None when the file
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
    version, version_note = _ta_fsdp_version(conf, transformers_version)
    stage, unsure = _ta_fsdp_stage(words, conf.get("reshard_after_forward"), version,
                                   transformers_version)
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
                 + version_note + ")")
    if unsure:
        notes.append(f"{where('fsdp_config')}: {unsure}")
    run: dict[str, Any] = {"zero": stage, "offload": offload, "fsdp": section}
    if str(conf.get("activation_checkpointing", False)).lower() == "true":
        run["grad_ckpt"] = True  # FSDP's own activation checkpointing wraps every layer
        notes.append(f"{where('fsdp_config')}: activation_checkpointing: every layer checkpointed")
    return run, notes
