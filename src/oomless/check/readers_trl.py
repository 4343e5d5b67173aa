"""TRL / alignment-handbook recipe YAML (``trl sft --config``, ``run_dpo.py recipe.yaml``)
and accelerate config files (``accelerate launch --config_file``).

A recipe holds TRL's ModelConfig (model_name_or_path, torch_dtype,
attn_implementation, use_peft, lora_*, load_in_4bit) next to the trainer's
config (SFTConfig, DPOConfig, ...: TrainingArguments plus max_length etc.).
The stage comes from the keys only one trainer's config has (DPO: beta,
max_prompt_length; KTO: desirable_weight; reward: center_rewards_coefficient),
else from the file name. What the recipe leaves unset takes the trainer config's own
default of the TRL release that runs it (:func:`trl_defaults`): since TRL 0.19 every
trainer config defaults ``bf16`` to True when ``fp16`` is not set, since 0.22
``gradient_checkpointing`` to True (TrainingArguments: both False before). An
accelerate config gives the processes, mixed
precision and the DeepSpeed ZeRO stage / offload or FSDP sharding (FULL_SHARD
is estimated as ZeRO-3, SHARD_GRAD_OP as ZeRO-2, fsdp_offload_params as
parameter offload; the FSDP version, prefetch, limit_all_gathers and use_orig_params
go to the run's ``fsdp`` section: :func:`accelerate_fsdp`).
"""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..memory.stacks import NEWEST_TRL, installed_version, version_tuple
from .common import (
    HF_KEYS,
    grad_ckpt_key,
    hf_eval,
    knob_edits,
    optimizer,
    precision,
    training_args_fsdp,
    transformers_release,
)
from .sources import Reading, Source, check_keys, knob_set

TRL_DEFAULT_MAX_LENGTH = 1024  # SFTConfig / DPOConfig max_length default (TRL ≥ 0.16)
# Defaults TRL's trainer configs (SFTConfig, DPOConfig, KTOConfig, RewardConfig, ORPOConfig,
# CPOConfig, GRPOConfig) set where TrainingArguments' differ, by the first release with each:
# bf16 None -> `not fp16` in __post_init__: huggingface/trl PRs #3515 and #3598
#   (trl/trainer/sft_config.py & co., v0.19.0; trl/trainer/base_config.py since #5136);
# gradient_checkpointing default True: PR #3510 (v0.22.0). TrainingArguments: both False.
TRL_BF16_DEFAULT_SINCE = (0, 19)
TRL_GRAD_CKPT_DEFAULT_SINCE = (0, 22)
_ATTN = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "sdpa",
         "eager": "eager"}
_FSDP_ZERO = {"FULL_SHARD": 3, "HYBRID_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0,
              "1": 3, "2": 2, "3": 0}


def _stage(d: dict[str, Any], name: str, r: Reading) -> str:
    keys = set(d)
    lower = name.lower()
    if {"desirable_weight", "undesirable_weight"} & keys or "kto" in lower:
        return "kto"
    if "center_rewards_coefficient" in keys or "reward" in lower:
        return "rm"
    if "num_generations" in keys or "grpo" in lower:
        r.assumptions.append("GRPO (generation of num_generations completions per prompt) is "
                             "not modelled: estimated as SFT over max_length tokens")
        return "sft"
    if "orpo" in lower:
        return "orpo"
    if "simpo" in lower or d.get("loss_type") == "simpo":
        return "simpo"
    if {"beta", "max_prompt_length", "precompute_ref_log_probs", "ref_model_init_kwargs"} & keys \
            or "dpo" in lower:
        return "dpo"
    return "sft"


def trl_version() -> str:
    """The TRL release whose defaults fill a recipe's unset keys: the installed one (the
    machine that checks is taken for the one that trains), else NEWEST_TRL, the release
    the project pins (requirements-ci.txt) — the rule oomless.memory.stacks follows."""
    return installed_version("trl") or NEWEST_TRL


def trl_defaults(d: dict[str, Any], version: str) -> tuple[dict[str, Any], list[str]]:
    """The precision and gradient checkpointing TRL ``version`` gives a recipe that leaves
    ``bf16`` / ``gradient_checkpointing`` unset (run keys to set, notes saying so)."""
    v = version_tuple(version)[:2]
    out: dict[str, Any] = {}
    notes: list[str] = []
    if d.get("bf16") is None and precision(d) == "fp32":
        if v >= TRL_BF16_DEFAULT_SINCE:
            out["precision"] = "bf16"
            notes.append(f"bf16 not set: TRL {version}'s trainer configs default it to True "
                         "when fp16 is not set (since TRL 0.19): read as bf16")
        else:
            notes.append(f"bf16 not set: TRL {version} keeps TrainingArguments' False "
                         "(bf16 defaults to True from TRL 0.19): read as fp32")
    key = grad_ckpt_key(d)
    if d.get(key) is None:
        out["grad_ckpt"] = v >= TRL_GRAD_CKPT_DEFAULT_SINCE
        notes.append(f"{key} not set: TRL {version} defaults it to {out['grad_ckpt']} "
                     "(True from TRL 0.22)")
    return out, notes


def _length_key(d: dict[str, Any]) -> str:
    return "max_seq_length" if "max_seq_length" in d or "max_length" not in d and \
        "max_prompt_length" not in d and "beta" not in d else "max_length"


def _method(d: dict[str, Any], run: dict[str, Any]) -> None:
    if not d.get("use_peft"):
        run["method"] = "full"
        return
    saved = d.get("lora_modules_to_save") or []  # ModelConfig → get_peft_config
    run["lora"] = {"r": d.get("lora_r", 16), "alpha": d.get("lora_alpha", 32),
                   "dropout": d.get("lora_dropout", 0.05),
                   "targets": d.get("lora_target_modules") or "all-linear",
                   "modules_to_save": [saved] if isinstance(saved, str) else list(saved)}
    if str(d.get("lora_target_modules")).lower() == "all-linear":
        # PEFT's all-linear (tuners_utils._maybe_include_all_linear_layers) takes every
        # Linear but the output layer, a vision tower's included; TRL freezes nothing
        run["vision"] = {"freeze_tower": False}
    bits = 4 if d.get("load_in_4bit") else (8 if d.get("load_in_8bit") else None)
    run["method"] = "qlora" if bits else "lora"
    if bits:
        run["quantization"] = {"bits": bits, "type": d.get("bnb_4bit_quant_type", "nf4"),
                               "double_quant": bool(d.get("use_bnb_nested_quant", False))}


def read_trl(src: Source, model: str | None) -> Reading:
    r = Reading("trl", "TRL / alignment-handbook recipe", {"main": src}, {},
                shardings=None)
    check_keys(src, "trl", reading=r)
    d = src.data
    length_key = _length_key(d)
    micro = d.get("per_device_train_batch_size", 8)
    run: dict[str, Any] = {
        "model": model or d.get("model_name_or_path"), "stack": "trl",
        "stage": _stage(d, src.path.name, r), "precision": precision(d),
        "optimizer": optimizer(str(d.get("optim", "adamw_torch")), src.where("optim"), r),
        "micro_batch_size": micro, "grad_accum": d.get("gradient_accumulation_steps", 1),
        "seq_len": d.get(length_key) or TRL_DEFAULT_MAX_LENGTH,
        "grad_ckpt": bool(d.get(grad_ckpt_key(d))),
        "attn": _ATTN.get(str(d.get("attn_implementation")),
                          "flash" if d.get("use_flash_attention_2") else "sdpa"),
        "zero": 0, "offload": "none", "eval": hf_eval(d, micro, None),
    }
    defaults, notes = trl_defaults(d, trl_version())
    run.update(defaults)
    r.notes.extend(notes)
    sharded = training_args_fsdp(d, src.where, transformers_release())
    if sharded:
        run.update(sharded[0])
        r.assumptions.extend(sharded[1])
    _method(d, run)
    if run["method"] == "full" and d.get("torch_dtype") == "bfloat16" and run["precision"] == "bf16":
        run["precision"] = "pure-bf16"
        r.notes.append(f"{src.where('torch_dtype')}: a bf16 model trained without ZeRO keeps "
                       "bf16 weights and AdamW states (no fp32 master copy): read as pure bf16")
    if not d.get(length_key):
        r.notes.append(f"{length_key} not set: TRL's default {TRL_DEFAULT_MAX_LENGTH} tokens")
    r.facts.update(length_key=length_key, precompute_ref=bool(d.get("precompute_ref_log_probs")))
    r.run = run
    r.fixed = knob_set("grad_ckpt", "optimizer", "eval_batch", "lora", "quantization", "attn")
    r.fixed.add("zero")
    return r


def trl_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
              model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    put = lambda key, value: out.append(("main", (key,), value))  # noqa: E731
    data = reading.sources["main"].data
    knob_edits(cfg, old, put, {**HF_KEYS, "grad_ckpt": grad_ckpt_key(data), "lora_r": "lora_r"})
    if cfg.lora.targets != old.lora.targets and cfg.lora.targets != "all-linear":
        put("lora_target_modules", list(cfg.lora.targets))
    if cfg.quantization.bits != old.quantization.bits and cfg.method == "qlora":
        put("load_in_4bit", cfg.quantization.bits == 4)
        put("load_in_8bit", cfg.quantization.bits == 8)
    if cfg.attn != old.attn:
        put("attn_implementation", {"flash": "flash_attention_2"}.get(cfg.attn, cfg.attn))
    return out


# ---- accelerate config -------------------------------------------------------------------
# accelerate config fsdp_config keys → RunConfig.fsdp; what a file leaves out takes
# accelerate's FullyShardedDataParallelPlugin default (accelerate 1.15 utils/dataclasses.py:
# fsdp_version 1, backward_prefetch None = NO_PREFETCH, limit_all_gathers True,
# use_orig_params False, forward_prefetch False), which config.sections.FsdpConfig holds.
_FSDP_KEYS = {"fsdp_version": "version", "fsdp_limit_all_gathers": "limit_all_gathers",
              "fsdp_backward_prefetch": "backward_prefetch",
              "fsdp_forward_prefetch": "forward_prefetch",
              "fsdp_use_orig_params": "use_orig_params"}


def accelerate_fsdp(fsdp_config: dict[str, Any]) -> dict[str, Any]:
    """The run configuration's ``fsdp`` section of an accelerate ``fsdp_config``."""
    out: dict[str, Any] = {"version": 1}
    for key, name in _FSDP_KEYS.items():
        if key in fsdp_config:
            out[name] = fsdp_config[key]
    if "backward_prefetch" in out:
        out["backward_prefetch"] = str(out["backward_prefetch"] or "NO_PREFETCH").upper()
    out["version"] = int(out["version"])
    return out


def accelerate_sharding(d: dict[str, Any]) -> tuple[int, str, list[str]]:
    """(ZeRO stage, offload, notes) of an accelerate config."""
    kind = str(d.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        ds = d.get("deepspeed_config") or {}
        stage = int(ds.get("zero_stage", 2))
        offload = "none"
        if str(ds.get("offload_optimizer_device", "none")) in ("cpu", "nvme"):
            offload = "optimizer"
        if stage == 3 and str(ds.get("offload_param_device", "none")) in ("cpu", "nvme"):
            offload = "all"
        return stage, offload, []
    if kind == "FSDP":
        fsdp = d.get("fsdp_config") or {}
        strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
        stage = _FSDP_ZERO.get(strategy, 3)
        offload = "all" if fsdp.get("fsdp_offload_params") and stage == 3 else "none"
        version = int(fsdp.get("fsdp_version") or 1)
        how = (f"sharded as ZeRO-{stage} with FSDP{version}'s own unsharded units"
               if stage == 3 else f"estimated as DeepSpeed ZeRO-{stage}")
        return stage, offload, [f"FSDP {strategy}{' with parameter offload' if offload != 'none' else ''}"
                                f" is {how}"]
    return 0, "none", []


def apply_accelerate(src: Source, r: Reading) -> None:
    """Read an accelerate config into a reading: processes, precision, sharding."""
    check_keys(src, "accelerate", reading=r)
    d = src.data
    stage, offload, notes = accelerate_sharding(d)
    r.assumptions += notes
    r.run["zero"], r.run["offload"] = stage, offload
    if str(d.get("distributed_type", "")).upper() == "FSDP":
        r.run["fsdp"] = accelerate_fsdp(d.get("fsdp_config") or {})
    processes = int(d.get("num_processes") or 1)
    machines = int(d.get("num_machines") or 1)
    r.run["hardware"] = {"gpus_per_node": max(1, processes // machines), "nodes": machines}
    mixed = str(d.get("mixed_precision", "no"))
    if mixed in ("bf16", "fp16") and r.run.get("precision") == "fp32":
        r.run["precision"] = mixed
    if r.run.get("precision") == "pure-bf16" and stage:
        r.run["precision"] = "bf16"
    r.sources["accelerate"] = src
    editable = str(d.get("distributed_type", "")).upper() == "DEEPSPEED"
    r.fixed.discard("zero") if editable else r.fixed.add("zero")
    r.shardings = tuple((z, o) for z in (1, 2, 3) for o in ("none", "optimizer", "all")
                        if o != "all" or z == 3) if editable else None


def read_accelerate(src: Source, model: str | None, method: str | None,
                    seq_len: int | None) -> Reading:
    r = Reading("accelerate", "accelerate config", {"main": src}, {})
    if not model:
        from ..errors import ConfigError

        raise ConfigError("an accelerate config does not name the model: pass --model, or "
                          "check it together with the training recipe (two files)")
    r.run = {"model": model, "method": method or "full", "precision": "fp32",
             "micro_batch_size": 8, "grad_accum": 1, "seq_len": seq_len or 2048,
             "stack": "hf-trainer", "stage": "sft", "eval": {}}
    r.notes.append("an accelerate config alone: TrainingArguments' defaults (batch 8, "
                   "accumulation 1), --method (default full) and --seq-len (default 2048)")
    apply_accelerate(src, r)
    del r.sources["accelerate"]
    r.facts["batch_not_in_file"] = True
    r.fixed = knob_set("zero") if "zero" not in r.fixed else knob_set()
    return r


def accelerate_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
                     model_type: str) -> list[tuple[str, tuple, Any]]:
    role = "accelerate" if "accelerate" in reading.sources else "main"
    src = reading.sources[role]
    out: list[tuple[str, tuple, Any]] = []
    if (cfg.zero, cfg.offload) != (old.zero, old.offload):
        ds = ("deepspeed_config",)
        out.append((role, ds + ("zero_stage",), cfg.zero))
        out.append((role, ds + ("offload_optimizer_device",),
                    "cpu" if cfg.offload in ("optimizer", "all") else "none"))
        out.append((role, ds + ("offload_param_device",), "cpu" if cfg.offload == "all" else "none"))
    accum = (src.data.get("deepspeed_config") or {}).get("gradient_accumulation_steps")
    if isinstance(accum, int) and cfg.grad_accum != old.grad_accum:
        out.append((role, ("deepspeed_config", "gradient_accumulation_steps"), cfg.grad_accum))
    return out
