"""GLM-4 finetune YAML (finetune_demo/ of 2024 and finetune/ of the 0414 release).

What finetune.py does with it (THUDM/GLM-4): the model is loaded in bf16;
training samples are cut at max_input_length + max_output_length + 1 tokens
and padded to the longest in the batch; evaluation with predict_with_generate
feeds only the prompt (at most max_input_length + 1 tokens; the answer is not
in the batch) and generates generation_config.max_new_tokens. A model with a
vision tower (GLM-4V) runs finetune_vision.py instead, which cuts samples at
max_input_length + max_output_length and prompts at max_input_length
(finetune_demo/finetune_vision.py process_batch ``max_length``, process_batch_eval
``input_segment[:max_input_length]``, commit 4daff94; the same in finetune/ of the
0414 release). The 2024 scripts' Seq2SeqTrainer overrides training_step to call
``torch.cuda.empty_cache()`` after every backward (the 0414 ones do not): the step's
peak is reached before the call, and no step inherits the previous one's cached
blocks. The 2024
finetune_demo/finetune.py always enables gradient checkpointing; the 0414
finetune/finetune.py (configs with ``freezeV``) only when resuming, so there
the YAML's training_args.gradient_checkpointing decides. ``freezeV`` freezes
the vision tower of GLM-4V (finetune_vision.py: ``if ft_config.freezeV`` sets
requires_grad False on model.transformer.vision after get_peft_model); a YAML
without the key (the 2024 finetune_demo configs) freezes nothing, so the LoRA
target_modules decide what of the tower trains (``query_key_value`` is also
the name of every EVA2-CLIP attention projection). P-tuning v2
(``peft_type: PREFIX_TUNING``) trains prefix key/values only.
"""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from ..knobs import OPTIMIZERS
from .common import batch_edits, eval_on, grad_ckpt_key, native_targets, optimizer, precision
from .dsfiles import GLM_DEEPSPEED, deepspeed_ref, deepspeed_source
from .sources import Reading, Source, check_keys, knob_set

KNOBS_GLM = ("lora", "optimizer", "zero", "eval_batch")


def _glm_checks(src: Source, r: Reading) -> None:
    check_keys(src, "glm4", reading=r)
    check_keys(src, "glm4:data_config", "data_config", reading=r)
    check_keys(src, "glm4:training_args", "training_args", reading=r)
    if isinstance(src.data.get("peft_config"), dict):
        check_keys(src, "glm4:peft_config", "peft_config", reading=r)
    for key in ("max_input_length", "max_output_length"):
        if not isinstance(src.data.get(key), int):
            raise ConfigError(f"{src.where(key)}: '{key}' must be set to a number of tokens "
                              "(finetune.py requires it)")


def _peft(src: Source, peft: dict[str, Any], run: dict[str, Any], r: Reading) -> None:
    kind = str(peft.get("peft_type", "LORA")).upper()
    if kind == "LORA":
        rank = peft.get("r", 8)
        saved = peft.get("modules_to_save") or []  # PEFT LoraConfig(modules_to_save=...)
        run["lora"] = {"r": rank, "alpha": peft.get("lora_alpha", 8),
                       "dropout": peft.get("lora_dropout", 0.0),
                       "targets": peft.get("target_modules") or "all-linear",
                       "modules_to_save": [saved] if isinstance(saved, str) else list(saved)}
        return
    if kind in ("PREFIX_TUNING", "P_TUNING"):
        tokens = peft.get("num_virtual_tokens", 0)
        run["lora"] = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": "all-linear"}
        r.assumptions.append(
            f"{src.where('peft_config.peft_type')}: P-tuning v2 ({tokens} prefix tokens) is "
            "estimated as LoRA: a frozen bf16 base with a full backward through the activations; "
            "the prefix adds its key/value positions to attention (not counted). GLM-4's README "
            "measured the two alike: 21381 MiB (P-tuning v2) vs 21531 MiB (LoRA)")
        r.fixed.add("lora")
        r.facts["prefix_tokens"] = tokens
        return
    raise ConfigError(f"{src.where('peft_config.peft_type')}: peft_type {kind} is not "
                      "modelled; oomless reads LORA, PREFIX_TUNING and full fine-tuning "
                      "(no peft_config)")


def _autocast(ta: dict[str, Any], run: dict[str, Any], r: Reading) -> None:
    """HF Trainer autocasts only with ``bf16``/``fp16`` set (accelerate's mixed_precision
    "no" otherwise); finetune.py loads the model in bf16, so without them the step runs
    in bf16 without autocast and PEFT's fp32 adapters (autocast_adapter_dtype, PEFT ≥
    0.11) copy each LoRA input to fp32 (peft tuners/lora/layer.py Linear.forward)."""
    if precision(ta) in ("bf16", "fp16") or ta.get("deepspeed"):
        return
    run["stack_options"] = {"autocast": False}
    r.notes.append("training_args sets neither bf16 nor fp16: the Trainer runs the bf16 model "
                   "without autocast; PEFT's fp32 LoRA adapters take an fp32 copy of their "
                   "input")


def _glm_eval(ta: dict[str, Any], prompt_len: int, run: dict[str, Any], r: Reading) -> None:
    """The evaluation finetune.py runs on the YAML's val_file."""
    run["eval"] = {"batch_size": ta.get("per_device_eval_batch_size") or run["micro_batch_size"]}
    new_tokens = (ta.get("generation_config") or {}).get("max_new_tokens")
    if ta.get("predict_with_generate") and new_tokens:
        # process_batch_eval gives input_ids and output_ids, no labels: Seq2SeqTrainer's
        # prediction_step then generates and runs no loss forward
        run["eval"].update({"predict_with_generate": True, "max_new_tokens": new_tokens,
                            "loss": False})
        r.notes.append(f"evaluation generates up to {new_tokens} tokens from prompts of at "
                       f"most {prompt_len} tokens and computes no loss (the script feeds "
                       "no labels to it)")


def _vision_script(model: str) -> bool:
    """Whether ``model`` has a vision tower, so that GLM-4's finetune_vision.py trains it:
    a catalog entry's spec, or a local config.json with a ``vision_config``."""
    import json
    from pathlib import Path

    from ..models.catalog import find_entry

    entry = find_entry(model)
    if entry is not None:
        return entry.spec.vision is not None
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else path
    try:
        return "vision_config" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # resolve() reports a model it cannot read


def read_glm4(src: Source, model: str | None) -> Reading:
    r = Reading("glm4", "GLM-4 finetune YAML", {"main": src}, {},
                shardings=((0, "none"), *GLM_DEEPSPEED))
    _glm_checks(src, r)
    d = src.data
    ta = d.get("training_args") or {}
    peft = d.get("peft_config")
    if not model:
        raise ConfigError("a GLM-4 finetune YAML does not name the model (finetune.py takes it "
                          "on the command line): pass --model, e.g. --model glm-4-9b-chat")
    layout_0414 = "freezeV" in d
    in_len, out_len = d["max_input_length"], d["max_output_length"]
    vision = _vision_script(model)
    # finetune.py keeps one token more than the two lengths (its EOS), finetune_vision.py none
    extra = 0 if vision else 1
    ckpt_key = grad_ckpt_key(ta)
    grad_ckpt = bool(ta.get(ckpt_key, not layout_0414))
    run: dict[str, Any] = {
        "model": model, "method": "lora" if peft else "full", "stack": "hf-trainer", "stage": "sft",
        "precision": "bf16" if peft or ta.get("deepspeed") else "pure-bf16",
        "optimizer": optimizer(str(ta.get("optim", "adamw_torch")),
                               src.where("training_args.optim"), r),
        "micro_batch_size": ta.get("per_device_train_batch_size", 8),
        "grad_accum": ta.get("gradient_accumulation_steps", 1),
        "seq_len": in_len + out_len + extra, "grad_ckpt": grad_ckpt, "attn": "sdpa",
        "zero": 0, "offload": "none", "eval": {},
        "vision": {"freeze_tower": bool(d.get("freezeV", False))},
        "data": {"max_input_length": in_len + extra, "max_output_length": out_len},
    }
    if peft:
        _peft(src, peft, run, r)
        _autocast(ta, run, r)
    if ta.get("deepspeed"):
        _s, (run["zero"], run["offload"]) = deepspeed_source(str(ta["deepspeed"]), src.path,
                                                             GLM_DEEPSPEED, r)
    if eval_on(ta) and (d.get("data_config") or {}).get("val_file"):
        _glm_eval(ta, in_len + extra, run, r)
    script = "finetune_vision.py" if vision else "finetune.py"
    how = "the YAML's training_args" if ckpt_key in ta else (
        f"finetune/{script} (0414) enables it only when resuming" if layout_0414 else
        f"finetune_demo/{script} always enables it")
    r.notes.append(f"{script} loads the weights in bf16; gradient checkpointing "
                   f"{'on' if grad_ckpt else 'off'} ({how}); samples are cut at "
                   f"{in_len + out_len + extra} tokens"
                   + ("" if layout_0414 else "; its training_step empties the CUDA cache "
                      "after every backward"))
    r.run = run
    r.fixed = knob_set(*KNOBS_GLM, *(("grad_ckpt",) if layout_0414 else ())) | r.fixed
    r.facts["ckpt_key"] = ckpt_key
    return r


def glm_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
              model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    put = lambda key, value: out.append(("main", ("training_args", key), value))  # noqa: E731
    batch_edits(cfg, old, put, "per_device_train_batch_size", "gradient_accumulation_steps",
                "per_device_eval_batch_size")
    if cfg.optimizer != old.optimizer:
        put("optim", OPTIMIZERS[cfg.optimizer].hf_optim)
    if cfg.grad_ckpt != old.grad_ckpt:
        put(reading.facts.get("ckpt_key", "gradient_checkpointing"), cfg.grad_ckpt)
    if (cfg.zero, cfg.offload) != (old.zero, old.offload):
        put("deepspeed", deepspeed_ref(GLM_DEEPSPEED, cfg.zero, cfg.offload, reading))
    if cfg.lora.r != old.lora.r:
        out.append(("main", ("peft_config", "r"), cfg.lora.r))
    if cfg.lora.targets != old.lora.targets:
        t = native_targets(model_type, cfg.lora.targets)
        out.append(("main", ("peft_config", "target_modules"),
                    "all-linear" if t == "all-linear" else list(t)))
    return out
