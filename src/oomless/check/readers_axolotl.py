"""axolotl YAML (``axolotl train config.yml``).

Keys and defaults from axolotl's config schema (AxolotlInputConfig):
micro_batch_size 1, gradient_accumulation_steps 1, sequence_len 512, eval
batch = micro batch; ``adapter: lora|qlora`` with ``load_in_8bit`` /
``load_in_4bit`` for the quantized base; ``rl: dpo|ipo|kto|orpo|simpo`` for
preference training; ``unfrozen_parameters`` trains only the listed
parameters; evaluation with ``eval_table_size`` generates
``eval_max_new_tokens`` (older: ``eval_table_max_new_tokens``, default 128).
``fsdp`` / ``fsdp_config`` / ``fsdp_version`` are read as the TrainingArguments axolotl
builds from them (:func:`axolotl_fsdp`); ``deepspeed`` names a DeepSpeed JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from .common import (
    STAGE_OF_FSDP_STRATEGY,
    knob_edits,
    optimizer,
    pre_quantized_note,
    training_args_fsdp,
    transformers_release,
)
from .dsfiles import AXOLOTL_DEEPSPEED, deepspeed_ref, deepspeed_source
from .sources import Reading, Source, check_keys, knob_set

RL_STAGE = {"dpo": "dpo", "ipo": "dpo", "kto": "kto", "orpo": "orpo", "simpo": "simpo"}
AXOLOTL_DEFAULTS = {"micro_batch_size": 1, "gradient_accumulation_steps": 1,
                    "sequence_len": 512}
PARAMS_OFFLOAD_FILE = "zero3_bf16_cpuoffload_params.json"  # offload_param only
# axolotl's FSDP, read at axolotl-ai-cloud/axolotl 067b021c8b87a9e5e380b9173c704cf7340e30f5
# (0.18): utils/schemas/validation.py check_fsdp_config_kwargs_prefix drops the "fsdp_"
# prefix of fsdp_config keys (fsdp_version kept) and check_fsdp_version_in_fsdp_config takes
# the version from fsdp_version, fsdp_config.fsdp_version or fsdp_config.version, else pins
# AXOLOTL_FSDP_VERSION; utils/schemas/fsdp.py FSDPConfig (since axolotl 0.13, #3170; a
# pydantic model, so keys it has no field for are dropped) keeps AXOLOTL_FSDP_FIELDS;
# core/builders/base.py hands TrainingArguments ``fsdp=cfg.fsdp or True`` and that
# fsdp_config; utils/trainer.py setup_fsdp_envs turns offload_params into FSDP_OFFLOAD_PARAMS,
# which accelerate's FullyShardedDataParallelPlugin reads as cpu_offload.
AXOLOTL_FSDP_VERSION = 1
AXOLOTL_FSDP_FIELDS = frozenset({
    "fsdp_version", "activation_checkpointing", "offload_params", "sync_module_states",
    "cpu_ram_efficient_loading", "cpu_offload_pin_memory", "use_orig_params", "state_dict_type",
    "final_state_dict_type", "auto_wrap_policy", "transformer_layer_cls_to_wrap",
    "min_num_params", "reshard_after_forward", "mixed_precision_policy"})


def _method(d: dict[str, Any], src: Source, run: dict[str, Any], r: Reading) -> None:
    adapter = str(d.get("adapter") or "")
    if adapter in ("lora", "qlora"):
        targets = "all-linear" if d.get("lora_target_linear") else (
            d.get("lora_target_modules") or "all-linear")
        saved = d.get("lora_modules_to_save") or []  # axolotl: LoraConfig(modules_to_save=)
        run["lora"] = {"r": d.get("lora_r", 8), "alpha": d.get("lora_alpha", 16),
                       "dropout": d.get("lora_dropout", 0.0), "targets": targets,
                       "modules_to_save": [saved] if isinstance(saved, str) else list(saved)}
        bits = 4 if d.get("load_in_4bit") or adapter == "qlora" else (
            8 if d.get("load_in_8bit") else None)
        run["method"] = "qlora" if bits else "lora"
        if bits:
            run["quantization"] = {"bits": bits, "type": "nf4", "double_quant": True}
        return
    run["method"] = "full"
    if d.get("unfrozen_parameters"):
        r.assumptions.append(f"{src.where('unfrozen_parameters')}: only the listed parameters "
                             "train: estimated as full fine-tuning (an upper bound)")


def _precision(d: dict[str, Any]) -> str:
    if d.get("bf16") in (True, "auto", "true"):
        return "bf16"
    return "fp16" if d.get("fp16") in (True, "auto", "true") else "fp32"


def _attention(d: dict[str, Any]) -> str:
    if d.get("flash_attention"):
        return "flash"
    return "eager" if d.get("eager_attention") else "sdpa"


def _sharding(d: dict[str, Any], src: Source, r: Reading) -> tuple[int, str]:
    ref = d.get("deepspeed")
    if ref:
        if Path(str(ref)).name == PARAMS_OFFLOAD_FILE and not (src.path.parent / ref).is_file() \
                and not Path(str(ref)).is_file():
            r.notes.append(f"deepspeed file '{ref}' is not on this machine: read as axolotl's "
                           "(ZeRO-3, parameters offloaded to CPU)")
            r.facts.update(ds_optimizer_block=False, ds_force_cpu_optimizer=True)
            return 3, "all"
        _s, zero = deepspeed_source(str(ref), src.path, AXOLOTL_DEEPSPEED, r)
        return zero
    return 0, "none"


def axolotl_fsdp(d: dict[str, Any], where: Callable[[str], str]
                 ) -> tuple[dict[str, Any], list[str]] | None:
    """(run keys, notes) of axolotl's ``fsdp`` / ``fsdp_config`` / ``fsdp_version``, read
    as the TrainingArguments axolotl builds from them (:func:`training_args_fsdp`), or None
    without FSDP (``fsdp_version`` alone does not turn it on)."""
    given = d.get("fsdp_config")
    if not (d.get("fsdp") or given):
        return None
    raw = given if isinstance(given, dict) else {}
    conf = {k if k == "fsdp_version" else k.removeprefix("fsdp_"): v for k, v in raw.items()}
    version = d.get("fsdp_version") or conf.get("fsdp_version") or conf.get("version") or (
        AXOLOTL_FSDP_VERSION if raw else None)
    kept = {k: v for k, v in conf.items()
            if k in AXOLOTL_FSDP_FIELDS - {"fsdp_version", "offload_params"}}
    if conf.get("offload_params"):
        kept["cpu_offload"] = True  # FSDP_OFFLOAD_PARAMS, read by accelerate's plugin
    if version is not None:
        kept["version"] = version
    at = where if d.get("fsdp") else (lambda key: where("fsdp_config" if key == "fsdp" else key))
    run, notes = training_args_fsdp({"fsdp": d.get("fsdp") or True, "fsdp_config": kept},
                                    at, transformers_release()) or ({}, [])
    if given and not raw:
        notes.append(f"{where('fsdp_config')}: fsdp_config is not a mapping: can't tell FSDP's "
                     "settings, read with TrainingArguments' defaults")
    notes += _unread_fsdp_notes(raw, run["zero"], where("fsdp_config"))
    return run, notes


# axolotl's parallel sizes beside data parallelism (utils/schemas/config.py; utils/trainer.py
# setup_parallelism_envs hands them to accelerate's ParallelismConfig; expert_parallel_size is
# the expert_parallel plugin's), 067b021: what each splits, none modelled
AXOLOTL_PARALLEL_SIZES = {
    "dp_shard_size": "FSDP shards over this many GPUs, replicated over the rest (unless it is "
                     "the GPU count)",
    "dp_replicate_size": "replicas of the FSDP shards",
    "context_parallel_size": "each sequence split over this many GPUs",
    "sequence_parallel_degree": "each sequence split over this many GPUs (the older name of "
                                "context_parallel_size)",
    "tensor_parallel_size": "each layer's weights and activations split over this many GPUs",
    "expert_parallel_size": "the MoE experts split over this many GPUs",
}


def parallel_notes(d: dict[str, Any], where: Callable[[str], str]) -> list[str]:
    """A can't-tell note for each of axolotl's parallel sizes set above 1."""
    return [f"{where(key)}: {key} {d[key]}: {what}: not modelled, can't tell its memory (every "
            f"GPU is counted as a data-parallel rank); removing {key} settles it"
            for key, what in AXOLOTL_PARALLEL_SIZES.items()
            if isinstance(d.get(key), int) and d[key] > 1]


# What TrainingArguments (transformers 5.23 _process_fsdp_args) and accelerate 1.15's plugin
# run with when axolotl ≥ 0.13 drops these fsdp_config keys
_DROPPED_RUN_AS = {"limit_all_gathers": True, "backward_prefetch": "NO_PREFETCH",
                   "forward_prefetch": False}


def _unread_fsdp_notes(raw: dict[str, Any], stage: int, where: str) -> list[str]:
    """What axolotl's fsdp_config sets that the estimate does not take as written, said
    (keys axolotl drops are said where they would change what runs)."""
    notes = []
    conf = {name.removeprefix("fsdp_"): name for name in raw if name != "fsdp_version"}
    for key, name in sorted(conf.items()):
        if key in AXOLOTL_FSDP_FIELDS | {"version"}:
            continue
        value = raw[name]
        if key == "sharding_strategy":
            if STAGE_OF_FSDP_STRATEGY.get(str(value).lower(), stage) == stage:
                continue
            runs = "the sharding of fsdp / reshard_after_forward"
        elif key in _DROPPED_RUN_AS:
            if str(value).upper() == str(_DROPPED_RUN_AS[key]).upper():
                continue
            runs = str(_DROPPED_RUN_AS[key])
        else:
            runs = "its default"
        notes.append(f"{where}: {name} {value!r}: axolotl 0.13 and later drop it (its FSDPConfig "
                     f"has no such field) and run {runs}, older axolotl passed it on: can't tell "
                     "which release runs the file, estimated as 0.13 and later; remove the key "
                     "to settle it")
    policy = raw.get(conf.get("mixed_precision_policy", ""))
    if policy:
        notes.append(f"{where}: mixed_precision_policy {policy!r} is not modelled: the "
                     "gathered parameters are counted in the run's precision")
    if raw.get(conf.get("cpu_ram_efficient_loading", "")):
        notes.append(f"{where}: cpu_ram_efficient_loading: only rank 0 reads the weights into "
                     "host RAM while loading; the GPU's training peak is unchanged")
    return notes


def _stack_options(d: dict[str, Any], src: Source, r: Reading) -> dict[str, Any]:
    """axolotl's switches the estimator models: ``activation_offloading`` (its
    ActivationOffloadingMixin wraps the checkpointed layers in TRL's OffloadActivations:
    their inputs wait in host RAM, as torchtune's) and the Cut Cross-Entropy plugin
    (axolotl.integrations.cut_cross_entropy: cut_cross_entropy's linear_cross_entropy
    replaces the lm_head and the loss, no logits) and ``torch_compile`` (passed to
    transformers' TrainingArguments: the model compiled, stack_options.compile)."""
    out: dict[str, Any] = {}
    if d.get("activation_offloading") and d.get("gradient_checkpointing"):
        out["offload_checkpoints"] = True
        r.assumptions.append(f"{src.where('activation_offloading')}: checkpointed layer inputs "
                             "offloaded to host RAM (axolotl ActivationOffloadingMixin)")
    if d.get("torch_compile") is True:
        out["compile"] = True
        r.assumptions.append(f"{src.where('torch_compile')}: torch.compile (transformers "
                             "TrainingArguments.torch_compile): layers' saved tensors from the "
                             "min-cut partitioner's trace, the loss counted eager")
    if any("cut_cross_entropy" in str(p) for p in d.get("plugins") or ()):
        out["cut_cross_entropy"] = True
        r.assumptions.append(f"{src.where('plugins')}: Cut Cross-Entropy: the loss without "
                             "the logits")
    return out


def read_axolotl(src: Source, model: str | None) -> Reading:
    r = Reading("axolotl", "axolotl YAML", {"main": src}, {}, shardings=tuple(AXOLOTL_DEEPSPEED))
    check_keys(src, "axolotl", reading=r)
    d = src.data
    micro = d.get("micro_batch_size") or 1
    run: dict[str, Any] = {
        "model": model or d.get("base_model"), "stack": "axolotl",
        "stage": RL_STAGE.get(str(d.get("rl") or ""), "sft"), "precision": _precision(d),
        "optimizer": optimizer(str(d.get("optimizer") or "adamw_torch"), src.where("optimizer"), r),
        "micro_batch_size": micro, "grad_accum": d.get("gradient_accumulation_steps") or 1,
        "seq_len": d.get("sequence_len") or 512, "grad_ckpt": bool(d.get("gradient_checkpointing")),
        "attn": _attention(d), "data": {"packing": bool(d.get("sample_packing"))},
        "eval": {},
    }
    _method(d, src, run, r)
    run["stack_options"] = _stack_options(d, src, r)
    if d.get("rl") and str(d["rl"]) not in RL_STAGE:
        r.assumptions.append(f"{src.where('rl')}: rl '{d['rl']}' is not modelled: estimated as SFT")
    sharded = axolotl_fsdp(d, src.where)
    if sharded and d.get("deepspeed"):
        key = "fsdp" if d.get("fsdp") else "fsdp_config"
        raise ConfigError(f"{src.where('deepspeed')}: deepspeed and FSDP ({src.where(key)}) are "
                          "both set: axolotl (check_fsdp_deepspeed) and transformers' Trainer "
                          "refuse the two together; remove one of them")
    r.assumptions.extend(parallel_notes(d, src.where))
    if sharded:
        run.update(sharded[0])
        r.assumptions.extend(sharded[1])
    else:
        run["zero"], run["offload"] = _sharding(d, src, r)
    if (d.get("val_set_size") or 0) > 0 or d.get("test_datasets"):
        run["eval"] = {"batch_size": d.get("eval_batch_size") or micro}
        new = d.get("eval_max_new_tokens") or d.get("eval_table_max_new_tokens") or 128
        if d.get("eval_table_size"):
            run["eval"].update({"predict_with_generate": True, "max_new_tokens": new})
    pre_quantized_note(run["model"], r)
    r.facts["trust_remote_code"] = bool(d.get("trust_remote_code"))
    missing = {k: v for k, v in AXOLOTL_DEFAULTS.items() if d.get(k) is None}
    if missing:
        r.notes.append("not set, axolotl's defaults: " +
                       ", ".join(f"{k} {v}" for k, v in missing.items()))
    r.run = run
    r.fixed = knob_set("grad_ckpt", "optimizer", "eval_batch", "lora", "quantization", "attn",
                       "packing", *(("zero",) if not sharded else ()))
    return r


def axolotl_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
                  model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    put = lambda key, value: out.append(("main", (key,), value))  # noqa: E731
    knob_edits(cfg, old, put, {
        "micro": "micro_batch_size", "accum": "gradient_accumulation_steps",
        "eval": "eval_batch_size", "grad_ckpt": "gradient_checkpointing",
        "optim": "optimizer", "seq_len": "sequence_len", "lora_r": "lora_r",
        "packing": "sample_packing"})
    if cfg.method == "qlora" and cfg.quantization.bits != old.quantization.bits:
        put("load_in_4bit", cfg.quantization.bits == 4)
        put("load_in_8bit", cfg.quantization.bits == 8)
        put("adapter", "qlora" if cfg.quantization.bits == 4 else "lora")
    if cfg.attn != old.attn:
        put("flash_attention", cfg.attn == "flash")
    if (cfg.zero, cfg.offload) != (old.zero, old.offload):
        put("deepspeed", deepspeed_ref(AXOLOTL_DEEPSPEED, cfg.zero, cfg.offload, reading))
    return out
