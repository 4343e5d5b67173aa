"""axolotl YAML (``axolotl train config.yml``).

Keys and defaults from axolotl's config schema (AxolotlInputConfig):
micro_batch_size 1, gradient_accumulation_steps 1, sequence_len 512, eval
batch = micro batch; ``adapter: lora|qlora`` with ``load_in_8bit`` /
``load_in_4bit`` for the quantized base; ``rl: dpo|ipo|kto|orpo|simpo`` for
preference training; ``unfrozen_parameters`` trains only the listed
parameters; evaluation with ``eval_table_size`` generates
``eval_max_new_tokens`` (older: ``eval_table_max_new_tokens``, default 128).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig
from .common import knob_edits, optimizer, pre_quantized_note
from .dsfiles import AXOLOTL_DEEPSPEED, deepspeed_ref, deepspeed_source
from .sources import Reading, Source, check_keys, knob_set

RL_STAGE = {"dpo": "dpo", "ipo": "dpo", "kto": "kto", "orpo": "orpo", "simpo": "simpo"}
AXOLOTL_DEFAULTS = {"micro_batch_size": 1, "gradient_accumulation_steps": 1,
                    "sequence_len": 512}
PARAMS_OFFLOAD_FILE = "zero3_bf16_cpuoffload_params.json"  # offload_param only


def _method(d: dict[str, Any], src: Source, run: dict[str, Any], r: Reading) -> None:
    adapter = str(d.get("adapter") or "")
    if adapter in ("lora", "qlora"):
        targets = "all-linear" if d.get("lora_target_linear") else (
            d.get("lora_target_modules") or "all-linear")
        run["lora"] = {"r": d.get("lora_r", 8), "alpha": d.get("lora_alpha", 16),
                       "dropout": d.get("lora_dropout", 0.0), "targets": targets}
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
    fsdp = d.get("fsdp") or []
    if fsdp:
        words = " ".join(map(str, fsdp)).lower()
        stage = 2 if "shard_grad_op" in words else 3
        conf = d.get("fsdp_config") or {}
        offload = "all" if stage == 3 and ("offload" in words or conf.get("fsdp_offload_params")) \
            else "none"
        r.assumptions.append(f"{src.where('fsdp')}: FSDP ({words}) is estimated as DeepSpeed "
                             f"ZeRO-{stage}" + (" with parameter offload" if offload != "none" else ""))
        return stage, offload
    return 0, "none"


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
                       "packing", *(("zero",) if not d.get("fsdp") else ()))
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
