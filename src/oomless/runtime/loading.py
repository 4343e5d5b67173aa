"""Load the model to fine-tune: local folders or the local HF cache, offline.

transformers + PEFT: LoRA, QLoRA (bitsandbytes 4/8-bit, CUDA only) and full
fine-tuning. ``trust_remote_code`` is honoured only when the run
configuration sets it, with a warning. Nothing here touches the network.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError, UnknownModelError
from ..knobs import ATTENTIONS, OPTIMIZERS, load_class

log = logging.getLogger(__name__)


def offline_env() -> None:
    """Make transformers and huggingface_hub never reach the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _catalog_hf_id(name: str) -> str | None:
    from ..models.catalog import find_entry

    entry = find_entry(name)
    return entry.hf_id if entry else None


def resolve_model_dir(model: str) -> Path:
    """A local folder with config.json: the path itself, or the cached snapshot of an id."""
    offline_env()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"model folder '{path}' has no config.json; "
                                    "point 'model' at a Hugging Face model folder")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id = _catalog_hf_id(model) or model
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise UnknownModelError(
            f"model '{model}' is neither a local folder nor in the local Hugging Face cache "
            f"(looked for '{repo_id}'); oomless trains offline: download it first "
            f"(`huggingface-cli download {repo_id}`) or set 'model' to a local folder"
        ) from None


def check_remote_code(model_dir: Path, trust_remote_code: bool) -> None:
    """Models that ship Python code load only when the config says so."""
    from ..fileio import read_json

    config = read_json(model_dir / "config.json", "a model config (JSON object)", ConfigError)
    if not isinstance(config, dict) or "auto_map" not in config:
        return
    if not trust_remote_code:
        raise ConfigError(
            f"model '{model_dir}' ships its own Python code (config.json auto_map); "
            "oomless runs it only with training.trust_remote_code: true in oomless.yaml "
            "(read the code first)"
        )
    warnings.warn(f"running the model code shipped with '{model_dir}' "
                  "(training.trust_remote_code: true)", stacklevel=2)


def torch_dtypes(cfg: RunConfig, device_type: str) -> tuple[Any, Any]:
    """(dtype of the loaded weights, autocast dtype or None) for the precision."""
    import torch

    half = {"bf16": torch.bfloat16, "fp16": torch.float16, "pure-bf16": torch.bfloat16}
    if cfg.precision == "fp32":
        return torch.float32, None
    if cfg.precision == "pure-bf16":
        return torch.bfloat16, None
    # mixed precision: trained weights stay fp32 (full), frozen base in 16-bit (LoRA)
    weights = torch.float32 if cfg.method == "full" else half[cfg.precision]
    if device_type == "cpu" and cfg.precision == "fp16":
        raise ConfigError("precision fp16 needs a GPU (CPU autocast has no fp16 GradScaler); "
                          "use precision: bf16 or fp32 on CPU")
    return weights, half[cfg.precision]


def _quantization_config(cfg: RunConfig, compute_dtype: Any, device_type: str) -> Any:
    if cfg.method != "qlora":
        return None
    if device_type != "cuda":
        raise ConfigError("method qlora needs an NVIDIA GPU: bitsandbytes' 4/8-bit kernels "
                          "run on CUDA only; on this machine use method: lora or full")
    from transformers import BitsAndBytesConfig

    q = cfg.quantization
    if q.method != "bnb":
        raise ConfigError(f"quantization.method {q.method}: oomless train quantizes with "
                          "bitsandbytes only; use quantization.method: bnb (hqq and eetq are "
                          "estimated, not trained)")
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    import torch

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.type,
                              bnb_4bit_use_double_quant=q.double_quant,
                              bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_quant_storage=getattr(torch, cfg.quant_storage))


def load_model(cfg: RunConfig, device: Any) -> tuple[Any, Path]:
    """The model ready to train (PEFT-wrapped for LoRA/QLoRA) on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(cfg.model)
    check_remote_code(model_dir, cfg.training.trust_remote_code)
    weights_dtype, compute_dtype = torch_dtypes(cfg, device.type)
    quant = _quantization_config(cfg, compute_dtype or torch.bfloat16, device.type)
    kwargs: dict[str, Any] = {"dtype": weights_dtype, "attn_implementation": ATTENTIONS[cfg.attn].hf_implementation,
                              "trust_remote_code": cfg.training.trust_remote_code,
                              "local_files_only": True}
    if quant is not None and cfg.zero == 3:
        # QLoRA under ZeRO-3: no device map (DeepSpeed places the shards), the 16-bit
        # parameters in the quant storage dtype so that every shard has one dtype (PEFT
        # docs, "Use PEFT QLoRA and DeepSpeed with ZeRO3")
        kwargs.update(quantization_config=quant, dtype=getattr(torch, cfg.quant_storage))
    elif quant is not None:
        kwargs.update(quantization_config=quant, device_map={"": device.index or 0})
    from ..dataset.vision import is_vision_model

    if is_vision_model(model_dir):
        from transformers import AutoModelForImageTextToText as AutoModel
    else:
        AutoModel = AutoModelForCausalLM
    model = AutoModel.from_pretrained(str(model_dir), **kwargs)
    if quant is None:
        model.to(device)
    model.config.use_cache = False
    if cfg.method == "full":
        model.requires_grad_(True)
    else:
        model = _wrap_lora(model, cfg, quantized=quant is not None)
    if cfg.grad_ckpt:
        enable_grad_ckpt(model)
    return model, model_dir


def _wrap_lora(model: Any, cfg: RunConfig, quantized: bool) -> Any:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lc = cfg.lora
    peft_cfg = LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                          target_modules=lc.targets, task_type="CAUSAL_LM",
                          modules_to_save=list(lc.modules_to_save) or None)
    return get_peft_model(model, peft_cfg)


def enable_grad_ckpt(model: Any) -> None:
    """Non-reentrant activation checkpointing (works with frozen inputs under LoRA)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def trainable_parameters(model: Any) -> list[Any]:
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(cfg: RunConfig, params: list[Any], device_type: str,
                    fused: bool = False) -> Any:
    """The optimizer ``cfg.optimizer`` names (its class and arguments: knobs.OPTIMIZERS).

    ``fused``: torch's fused AdamW kernel, what HF Trainer's default ``adamw_torch_fused``
    builds (the trace uses it; the training loop keeps the portable default).
    """
    kind = OPTIMIZERS[cfg.optimizer]
    if kind.needs_cuda and device_type != "cuda":
        cpu_ok = ", ".join(k for k, o in OPTIMIZERS.items() if not o.needs_cuda)
        raise ConfigError(f"optimizer '{kind.name}' uses bitsandbytes' CUDA kernels; "
                          f"on CPU use optimizer: {cpu_ok}")
    t = cfg.training
    kwargs = {"lr": t.learning_rate, "weight_decay": t.weight_decay, **kind.class_kwargs}
    if fused and kind.torch_class == "torch.optim:AdamW":
        kwargs["fused"] = True
    return load_class(kind.torch_class)(params, **kwargs)


def build_scheduler(cfg: RunConfig, optimizer: Any, total_steps: int) -> Any:
    import math

    from transformers import get_scheduler

    warmup = math.ceil(cfg.training.warmup_ratio * total_steps)
    return get_scheduler(cfg.training.lr_scheduler, optimizer, num_warmup_steps=warmup,
                         num_training_steps=total_steps)
