"""Build the real transformers model of a run, with PEFT LoRA and bitsandbytes QLoRA.

Two modes share every step that decides memory (classes, dtypes, adapters,
quantized layers, checkpointing):

- ``fake``: the model is built on the meta device (no weights, no GPU), then
  every parameter and buffer becomes a CPU fake tensor of the same shape and
  dtype, so a training step runs through the real module code without data.
- ``real``: the model is built on a device with random weights
  (``oomless measure``).

Dtypes follow oomless.memory.precision (HF Trainer + PEFT defaults): LoRA and
QLoRA load the base model in 16-bit and PEFT keeps adapters in fp32
(``autocast_adapter_dtype``); full fine-tuning with bf16/fp16 keeps fp32
weights and runs under autocast (AMP); pure-bf16 is bf16 throughout; fp32 is
fp32 throughout. QLoRA's 4-bit layers are oomless.runtime.bnb4bit's.

The steps live beside this module: the config.json as transformers reads it
(oomless.runtime.model_config), the attention kernel (oomless.runtime.trace_attention),
the 4-bit layers (oomless.runtime.bnb4bit) and the fake parameters and counts
(oomless.runtime.fake_params); their names are re-exported here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import RunConfig
from .bnb4bit import compute_dtype, quantize_4bit, replace_with_4bit
from .fake_params import count_params, count_trainable, fake_mode, fakeify
from .model_config import (
    LAYER_KEYS,
    TraceUnsupported,
    model_class,
    num_layers_of,
    transformers_config,
    with_num_layers,
)
from .trace_attention import attn_implementation, build_attention

__all__ = ["LAYER_KEYS", "BuiltModel", "TraceUnsupported", "attn_implementation",
           "autocast_dtype", "base_dtype", "build_model", "compute_dtype", "count_params",
           "count_trainable", "fake_mode", "fakeify", "num_layers_of", "transformers_config",
           "with_num_layers"]


@dataclass
class BuiltModel:
    model: torch.nn.Module
    param_count: int
    trainable_params: int
    num_layers: int
    notes: list[str] = field(default_factory=list)


# ---- dtypes ------------------------------------------------------------------------
def base_dtype(cfg: RunConfig) -> torch.dtype:
    """dtype the model's own weights are created in."""
    from ..memory.stacks import stack_effects

    half = torch.float16 if cfg.precision == "fp16" else torch.bfloat16
    if cfg.precision == "fp32":
        return torch.float32
    if cfg.precision == "pure-bf16":
        return torch.bfloat16
    if not stack_effects(cfg).autocast:  # a loop without autocast trains the 16-bit model
        return half
    return half if cfg.method in ("lora", "qlora") else torch.float32


def autocast_dtype(cfg: RunConfig) -> torch.dtype | None:
    """dtype of torch.autocast around the forward (HF Trainer bf16=True / fp16=True;
    None for a stack that runs without autocast)."""
    from ..memory.stacks import stack_effects

    if not stack_effects(cfg).autocast:
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)


# ---- building ---------------------------------------------------------------------------
def build_model(hf_config: dict[str, Any], cfg: RunConfig, *, mode: str = "fake",
                device: str = "cpu", num_layers: int | None = None,
                sequence_classification: bool = False, frozen: bool = False) -> BuiltModel:
    """The model of ``cfg`` from ``hf_config``; ``mode`` "fake" or "real" (see module doc).
    ``sequence_classification``: the model with a one-value score head instead of lm_head
    (a reward or value model); ``frozen``: no adapters, nothing trainable (a reference or
    reward model)."""
    _refuse_untraceable(hf_config, cfg)
    if num_layers is not None:
        hf_config = with_num_layers(hf_config, num_layers)
    config = transformers_config(hf_config)
    attn, notes = build_attention(cfg, config, mode)
    where = torch.device("meta") if mode == "fake" else torch.device(device)
    model = _instantiate(config, cfg, attn, where, sequence_classification)
    model.config.use_cache = False
    model.train()
    if cfg.method == "qlora":
        replace_with_4bit(model, cfg)
        if mode != "fake":
            quantize_4bit(model, cfg, None, device)
    if cfg.grad_ckpt and not frozen:
        model.activation_checkpointing_enable()
    if frozen:
        model.requires_grad_(False)
        model.eval()
        return _finish(model, cfg, mode, hf_config, notes)
    task_type = "SEQ_CLS" if sequence_classification else "CAUSAL_LM"
    model, trained_notes = _make_trainable(model, cfg, mode, task_type)
    return _finish(model, cfg, mode, hf_config, notes + trained_notes)


def _refuse_untraceable(hf_config: dict[str, Any], cfg: RunConfig) -> None:
    """TraceUnsupported for what one process on fake tensors cannot build."""
    if cfg.zero or cfg.offload != "none":
        raise TraceUnsupported("DeepSpeed ZeRO sharding and offload are not traced (one process)")
    if cfg.method == "qlora" and cfg.quantization.bits != 4:
        raise TraceUnsupported("8-bit QLoRA is not traced; only 4-bit (nf4/fp4)")
    if cfg.method == "qlora" and cfg.quantization.method != "bnb":
        raise TraceUnsupported(f"{cfg.quantization.method} quantization is not traced (its "
                               "layers need the hqq/eetq library and a GPU); analytic only")
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method", "?")
        raise TraceUnsupported(f"pre-quantized ({method}) checkpoints are not traced: "
                               "transformers needs the quantization library and a GPU to build "
                               "their layers; the estimate is analytic")


def _instantiate(config: Any, cfg: RunConfig, attn: str, where: torch.device,
                 sequence_classification: bool) -> Any:
    """The transformers model of ``config`` on ``where`` (meta: no weights)."""
    try:
        with where:
            if sequence_classification:
                from transformers import AutoModelForSequenceClassification

                config.num_labels = 1
                if getattr(config.get_text_config(), "pad_token_id", None) is None:
                    # the score is read at each row's last non-pad token; TRL sets the
                    # tokenizer's pad token (any id will do for a full-length batch)
                    config.get_text_config().pad_token_id = 0
                return AutoModelForSequenceClassification.from_config(
                    config, dtype=base_dtype(cfg), attn_implementation=attn)
            return model_class(config).from_config(config, dtype=base_dtype(cfg),
                                                   attn_implementation=attn)
    except ValueError as err:  # e.g. an attention implementation the class does not support
        raise TraceUnsupported(f"transformers cannot build this model: {err}") from None


def _make_trainable(model: Any, cfg: RunConfig, mode: str, task_type: str) -> tuple[Any, list[str]]:
    """The training stack's casts and hooks, then the adapters (or the frozen vision tower
    of a full fine-tune); the model PEFT returns and the stack's notes."""
    from .trace.stacks import after_lora, prepare_base_model

    notes = prepare_base_model(model, cfg)
    if cfg.method == "full" and _is_vlm(model):
        from .trace.vision_inputs import freeze_vision

        freeze_vision(model, cfg)
    elif cfg.method in ("lora", "qlora"):
        # fake mode: adapters are created on the meta device like the base weights
        # (PEFT would otherwise initialise them for real on the CPU, which is slow)
        with torch.device("meta") if mode == "fake" else contextlib.nullcontext():
            model = _apply_lora(model, cfg, task_type)
    return model, notes + after_lora(model, cfg)


def _finish(model: Any, cfg: RunConfig, mode: str, hf_config: dict, notes: list[str]) -> BuiltModel:
    """Fake mode: the quantized weights and every parameter become fake tensors."""
    if mode == "fake":
        if cfg.method == "qlora":
            quantize_4bit(model, cfg, fake_mode(), "cpu")
        fakeify(model, fake_mode())
    return BuiltModel(model, count_params(model), count_trainable(model),
                      num_layers_of(hf_config), notes)


def _is_vlm(model: Any) -> bool:
    from .trace.vision_inputs import is_vlm

    return is_vlm(model)


def _apply_lora(model: Any, cfg: RunConfig, task_type: str = "CAUSAL_LM") -> Any:
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora.targets
    modules = targets if targets == "all-linear" else list(targets)
    if _is_vlm(model):  # the language model's linears (and the tower's when unfrozen)
        from .trace.vision_inputs import lora_target_modules

        modules = lora_target_modules(model, cfg)
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=modules,
        modules_to_save=list(cfg.lora.modules_to_save) or None,  # trainable copies (PEFT)
        task_type=task_type,
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as err:  # PEFT refuses this LoRA on this model; so would training
        raise TraceUnsupported(f"PEFT cannot apply LoRA (targets {targets!r}, dropout "
                               f"{cfg.lora.dropout}) to this model: {err}") from None
