"""QLoRA's 4-bit layers: transformers' own replacement of linear layers by bitsandbytes
``Linear4bit`` (every linear except those transformers keeps in 16-bit,
``get_keys_to_not_convert``: lm_head, tied weights), and their weights quantized by
bitsandbytes' ``quantize_4bit`` (packed 4-bit data + absmax, double-quantized), on fake
or real tensors, so that they occupy their packed size.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import RunConfig


def compute_dtype(cfg: RunConfig) -> torch.dtype:
    """bitsandbytes' ``bnb_4bit_compute_dtype`` of the run."""
    return torch.float16 if cfg.precision == "fp16" else torch.bfloat16


def replace_with_4bit(model: Any, cfg: RunConfig) -> None:
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


def quantize_4bit(model: Any, cfg: RunConfig, fake: Any, device: str) -> None:
    """Quantize every Linear4bit's weight with bitsandbytes (fake tensors in the
    FakeTensorMode ``fake``, or real ones on ``device`` when ``fake`` is None)."""
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
