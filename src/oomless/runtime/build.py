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
fp32 throughout. QLoRA replaces every linear layer except those transformers
keeps in 16-bit (``get_keys_to_not_convert``: lm_head, tied weights) with
``bitsandbytes.nn.Linear4bit`` via transformers' own ``replace_with_bnb_linear``;
the weights are quantized by bitsandbytes' ``quantize_4bit`` (packed 4-bit
data + absmax, double-quantized), so they occupy their packed size.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import RunConfig
from ..errors import ModelConfigError

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


class TraceUnsupported(Exception):
    """This run cannot be traced; the message says why (the analytic estimate is used)."""


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


def compute_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.float16 if cfg.precision == "fp16" else torch.bfloat16


# ---- configs -------------------------------------------------------------------------
def _layer_holder(d: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The (sub)config dict holding the decoder's layer count, and its key."""
    for holder in (d, d.get("text_config"), d.get("llm_config")):
        if isinstance(holder, dict):
            for key in LAYER_KEYS:
                if isinstance(holder.get(key), int):
                    return holder, key
    sub = d.get("text_config")
    if isinstance(sub, dict):  # left to the text model's defaults (LLaVA-1.5)
        return sub, "num_hidden_layers"
    raise ModelConfigError("config.json has no num_hidden_layers; cannot build the model")


def num_layers_of(hf_config: dict[str, Any]) -> int:
    holder, key = _layer_holder(hf_config)
    if key in holder:
        return holder[key]
    config = transformers_config(hf_config)
    return int(config.get_text_config().num_hidden_layers)


def with_num_layers(hf_config: dict[str, Any], n: int) -> dict[str, Any]:
    """A copy of ``hf_config`` with ``n`` decoder layers; per-layer lists cut to ``n``."""
    old = num_layers_of(hf_config)
    d = copy.deepcopy(hf_config)
    holder, key = _layer_holder(d)
    holder[key] = n
    for k, v in list(holder.items()):
        if isinstance(v, list) and len(v) == old:
            holder[k] = v[:n]  # layer_types and other per-layer lists
    if isinstance(holder.get("mlp_only_layers"), list):
        holder["mlp_only_layers"] = [i for i in holder["mlp_only_layers"] if i < n]
    return d


def transformers_config(hf_config: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    d = copy.deepcopy(hf_config)
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ModelConfigError("config.json has no model_type; cannot build the model")
    try:
        return AutoConfig.for_model(model_type, **d)
    except ValueError as err:
        raise TraceUnsupported(f"transformers has no model type '{model_type}': {err}") from None


def _model_class(config: Any) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    raise TraceUnsupported(
        f"transformers implements no causal-LM class for model type '{config.model_type}'"
    )


def _supports_sdpa(config: Any) -> bool:
    auto = _model_class(config)
    return bool(getattr(auto._model_mapping[type(config)], "_supports_sdpa", True))


# ---- building ---------------------------------------------------------------------------
def attn_implementation(cfg: RunConfig) -> tuple[str, str | None]:
    """transformers attn_implementation, and a note when it stands in for another."""
    if cfg.attn == "flash":
        return "sdpa", (
            "attn 'flash' traced as SDPA's flash kernel: FlashAttention-2 keeps the same "
            "tensors (output + fp32 log-sum-exp), the flash-attn package is not needed"
        )
    return cfg.attn, None


TRACE_SDPA = "oomless_sdpa"
# FlashAttention-2 stand-in for classes without an SDPA path (Gemma-2): the same kernel under a
# name transformers does not check against ``_supports_sdpa`` (FA2 soft-caps inside the kernel
# and keeps the same output + log-sum-exp, so the extra tanh of eager attention is not there)
TRACE_FLASH_STANDIN = "oomless_fa2_standin"


def _unpadded_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA mask for batches without padding, one sequence per row.

    On real tensors transformers reads the batch (``_ignore_causal_mask_sdpa``,
    ``find_packed_sequence_indices``) and, finding no padding, passes no mask so
    that SDPA runs its causal flash kernel. Fake tensors have no values, so
    transformers treats them as a graph being traced and builds the full
    [b, 1, s, s] mask. This mask function answers as the real batch would: no
    mask unless a sliding window or a custom pattern needs one. An attention mask
    of all ones (a trainer's batch, traced with full-batch values) is no padding.
    """
    from transformers.masking_utils import sdpa_mask

    from .trace.data_emulation import full_batch_active

    local = kwargs.get("local_size")
    no_padding = kwargs.get("attention_mask") is None or full_batch_active()
    if (no_padding and not kwargs.get("use_vmap")
            and (local is None or kwargs["kv_length"] < local)):
        return None
    return sdpa_mask(*args, **kwargs)


def _register_trace_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(TRACE_SDPA, sdpa_attention_forward)
    AttentionInterface.register(TRACE_FLASH_STANDIN, _flash_standin)
    for name in (TRACE_SDPA, TRACE_FLASH_STANDIN):
        AttentionMaskInterface.register(name, _unpadded_sdpa_mask)


def _flash_standin(*args: Any, softcap: Any = None, **kwargs: Any) -> Any:
    """SDPA in place of FlashAttention-2, which applies ``softcap`` inside the kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def build_model(hf_config: dict[str, Any], cfg: RunConfig, *, mode: str = "fake",
                device: str = "cpu", num_layers: int | None = None,
                sequence_classification: bool = False, frozen: bool = False) -> BuiltModel:
    """The model of ``cfg`` from ``hf_config``; ``mode`` "fake" or "real" (see module doc).
    ``sequence_classification``: the model with a one-value score head instead of lm_head
    (a reward or value model); ``frozen``: no adapters, nothing trainable (a reference or
    reward model)."""
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
    if num_layers is not None:
        hf_config = with_num_layers(hf_config, num_layers)
    config = transformers_config(hf_config)
    attn, note = attn_implementation(cfg)
    notes = [note] if note else []
    if cfg.attn == "sdpa" and not _supports_sdpa(config):
        # what transformers itself does when no kernel is asked for (Gemma-2: SDPA cannot
        # soft-cap the scores, so the class declares no SDPA path)
        attn = "eager"
        notes.append(f"{config.model_type} has no SDPA path in transformers: traced with eager "
                     "attention, which is what it runs")
    if mode == "fake" and attn == "sdpa":
        _register_trace_attention()
        attn = TRACE_SDPA if _supports_sdpa(config) else TRACE_FLASH_STANDIN
    where = torch.device("meta") if mode == "fake" else torch.device(device)
    try:
        with where:
            if sequence_classification:
                from transformers import AutoModelForSequenceClassification

                config.num_labels = 1
                if getattr(config.get_text_config(), "pad_token_id", None) is None:
                    # the score is read at each row's last non-pad token; TRL sets the
                    # tokenizer's pad token (any id will do for a full-length batch)
                    config.get_text_config().pad_token_id = 0
                model = AutoModelForSequenceClassification.from_config(
                    config, dtype=base_dtype(cfg), attn_implementation=attn)
            else:
                model = _model_class(config).from_config(config, dtype=base_dtype(cfg),
                                                         attn_implementation=attn)
    except ValueError as err:  # e.g. an attention implementation the class does not support
        raise TraceUnsupported(f"transformers cannot build this model: {err}") from None
    model.config.use_cache = False
    model.train()
    if cfg.method == "qlora":
        _replace_with_4bit(model, cfg)
        if mode != "fake":
            _quantize_4bit(model, cfg, None, device)
    if cfg.grad_ckpt and not frozen:
        model.activation_checkpointing_enable()
    if frozen:
        model.requires_grad_(False)
        model.eval()
        return _finish(model, cfg, mode, hf_config, notes)
    from .trace.stacks import after_lora, prepare_base_model

    notes += prepare_base_model(model, cfg)  # the training stack's casts and hooks
    if cfg.method == "full" and _is_vlm(model):
        from .trace.vision_inputs import freeze_vision

        freeze_vision(model, cfg)
    elif cfg.method in ("lora", "qlora"):
        # fake mode: adapters are created on the meta device like the base weights
        # (PEFT would otherwise initialise them for real on the CPU, which is slow)
        with torch.device("meta") if mode == "fake" else contextlib.nullcontext():
            model = _apply_lora(model, cfg, "SEQ_CLS" if sequence_classification else "CAUSAL_LM")
    notes += after_lora(model, cfg)
    return _finish(model, cfg, mode, hf_config, notes)


def _finish(model: Any, cfg: RunConfig, mode: str, hf_config: dict, notes: list[str]) -> BuiltModel:
    """Fake mode: the quantized weights and every parameter become fake tensors."""
    if mode == "fake":
        if cfg.method == "qlora":
            _quantize_4bit(model, cfg, _fake_mode(), "cpu")
        fakeify(model, _fake_mode())
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
        task_type=task_type,
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as err:  # PEFT refuses this LoRA on this model; so would training
        raise TraceUnsupported(f"PEFT cannot apply LoRA (targets {targets!r}, dropout "
                               f"{cfg.lora.dropout}) to this model: {err}") from None


def _replace_with_4bit(model: Any, cfg: RunConfig) -> None:
    """transformers' own replacement of linear layers by bitsandbytes Linear4bit (meta)."""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    q = cfg.quantization
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=q.type, bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=compute_dtype(cfg),
    )
    skip = get_keys_to_not_convert(model)
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=bnb_config)
    model.is_loaded_in_4bit = True  # what from_pretrained sets; PEFT picks its bnb LoRA layer


def _quantize_4bit(model: Any, cfg: RunConfig, fake: Any, device: str) -> None:
    """Quantize every Linear4bit's weight with bitsandbytes (fake or real tensors)."""
    import bitsandbytes as bnb

    if fake is not None:
        # bitsandbytes builds its 8-bit code table with data-dependent ops: build it
        # once for real, outside the fake mode (it is cached by bitsandbytes)
        bnb.functional.quantize_4bit(torch.zeros(64, 64, dtype=torch.bfloat16),
                                     compress_statistics=True, quant_type=cfg.quantization.type)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            _quantize_module(module, fake, device, compute_dtype(cfg))


def _quantize_module(module: Any, fake: Any, device: str, dtype: torch.dtype) -> None:
    import bitsandbytes as bnb

    old = module.weight
    shape = (module.out_features, module.in_features)
    if fake is None:
        w = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02)
        param = bnb.nn.Params4bit(w, requires_grad=False, quant_type=old.quant_type,
                                  compress_statistics=old.compress_statistics,
                                  blocksize=old.blocksize, quant_storage=old.quant_storage,
                                  module=module).to(device)
    else:
        with fake:
            w = torch.empty(shape, dtype=dtype)
            packed, state = bnb.functional.quantize_4bit(
                w, blocksize=old.blocksize, compress_statistics=old.compress_statistics,
                quant_type=old.quant_type, quant_storage=old.quant_storage)
        # A fake tensor cannot be wrapped in Params4bit (a tensor subclass); Linear4bit
        # and PEFT only read these attributes from its weight.
        param = torch.nn.Parameter(packed, requires_grad=False)
        for attr in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
            setattr(param, attr, getattr(old, attr))
        param.quant_state, param.bnb_quantized, param.module = state, True, module
        module.quant_state = state
    module.weight = param
    if module.bias is not None:  # replace_with_bnb_linear leaves it on the meta device
        with fake if fake is not None else torch.device(device):
            bias = torch.zeros(module.out_features, dtype=dtype)
        module.bias = torch.nn.Parameter(bias, requires_grad=False)


_FAKE_MODE: Any = None


def _fake_mode() -> Any:
    """One FakeTensorMode per process: fake tensors of different modes cannot mix."""
    global _FAKE_MODE
    if _FAKE_MODE is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        # non-fake inputs: bitsandbytes' cached code tables are real CPU tensors
        _FAKE_MODE = FakeTensorMode(allow_non_fake_inputs=True)
    return _FAKE_MODE


def fake_mode() -> Any:
    return _fake_mode()


def fakeify(model: torch.nn.Module, fake: Any) -> None:
    """Replace every non-fake parameter and buffer by a CPU fake tensor of its
    shape and dtype; tied parameters stay tied."""
    from torch._subclasses.fake_tensor import FakeTensor

    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, FakeTensor):
                continue
            if id(p) not in memo:
                with fake:
                    t = torch.empty(p.shape, dtype=p.dtype)
                memo[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None or isinstance(b, FakeTensor):
                continue
            if id(b) not in memo:
                with fake:
                    memo[id(b)] = torch.empty(b.shape, dtype=b.dtype)
            module._buffers[name] = memo[id(b)]


def _numel(p: torch.Tensor) -> int:
    state = getattr(p, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return int(torch.Size(state.shape).numel())
    return p.numel()


def count_params(model: torch.nn.Module) -> int:
    return sum(_numel(p) for p in model.parameters())


def count_trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
