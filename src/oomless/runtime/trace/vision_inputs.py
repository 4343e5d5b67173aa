"""Vision-language models in a trace: the tower runs with the language model.

The batch holds what the model's processor would give: LLaVA ``pixel_values``
(images, 3, side, side) for its fixed-size CLIP tower; Qwen2-VL/2.5-VL
``pixel_values`` (patches, 3·temporal·patch²) with ``image_grid_thw`` from the same
``smart_resize`` the estimate uses (memory/vision.py) and the language model's
3-D (M-RoPE) ``position_ids``. ``input_ids`` hold the text and every image's
tokens. Fake tensors have no values: the image grid is a small constant fake
tensor, and fake-tensor constant propagation is widened for the trace so that the
index tensors transformers derives from it (cu_seqlens, rotary positions, split
sizes) stay real values; placeholder masks and checks are answered as for a
full batch (runtime/trace/data_emulation.py).

What is trained follows LLaMA-Factory (``freeze_vision_tower``,
``freeze_multi_modal_projector``, both on by default): LoRA targets are the
language model's linears, plus the tower's when it is not frozen; full
fine-tuning freezes the tower and the projector unless told not to.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...config import RunConfig

_TOWERS = ("vision_tower", "visual", "vision_model")
_PROJECTORS = ("multi_modal_projector", "merger", "mm_projector")


def is_vlm(model: Any) -> bool:
    return bool(_prefixes(model, _TOWERS))


def _prefixes(model: Any, leaves: tuple[str, ...]) -> list[str]:
    out = []
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in leaves and not any(name.startswith(p + ".") for p in out):
            out.append(name)
    return out


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def lora_target_modules(model: Any, cfg: RunConfig) -> list[str]:
    """Full names of the linears LoRA wraps in a VLM (PEFT's own ``all-linear`` would
    wrap the tower and the projector too)."""
    towers, projectors = _prefixes(model, _TOWERS), _prefixes(model, _PROJECTORS)
    head = model.get_output_embeddings()
    wanted = cfg.lora.targets
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if _under(name, projectors):
            continue  # LLaMA-Factory never puts adapters on the projector
        if _under(name, towers) and cfg.vision.freeze_tower:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if wanted == "all-linear" or leaf in wanted:
            out.append(name)
    return out


def freeze_vision(model: Any, cfg: RunConfig) -> None:
    """Full fine-tuning: the tower and the projector stay frozen unless told otherwise."""
    towers, projectors = _prefixes(model, _TOWERS), _prefixes(model, _PROJECTORS)
    for name, p in model.named_parameters():
        if (cfg.vision.freeze_projector and _under(name, projectors)) or \
                (cfg.vision.freeze_tower and _under(name, towers) and not _under(name, projectors)):
            p.requires_grad_(False)


@contextlib.contextmanager
def small_constants(limit: int = 1 << 16) -> Any:
    """Let fake tensors keep the values of small integer tensors derived from constants
    (torch/_subclasses/fake_tensor.py ``CONSTANT_NUMEL_LIMIT``, 1 by default)."""
    import torch._subclasses.fake_tensor as ft

    old = ft.CONSTANT_NUMEL_LIMIT
    ft.CONSTANT_NUMEL_LIMIT = limit
    try:
        yield
    finally:
        ft.CONSTANT_NUMEL_LIMIT = old


def vision_batch(model: Any, spec: Any, cfg: RunConfig, batch: int, seq: int) -> dict[str, Any]:
    """Inputs of one micro batch with ``data.images_per_sample`` images per sample
    (``seq``: the language model's length, image tokens included); call in fake mode."""
    from ...memory.vision import image_geometry

    vision = spec.vision
    images = batch * cfg.data.images_per_sample
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
    geo = image_geometry(vision, cfg)
    if vision.dynamic_resolution:
        temporal = getattr(model.config.vision_config, "temporal_patch_size", 2)
        channels = 3 * temporal * vision.patch_size ** 2
        out["pixel_values"] = torch.empty((images * geo.patches, channels), dtype=torch.float32)
        out["image_grid_thw"] = torch.tensor([[1, *geo.grid]] * images)
        pos = torch.arange(seq).view(1, 1, seq).expand(3, batch, seq)
        out["position_ids"] = pos.contiguous()
    else:
        side = vision.image_size
        out["pixel_values"] = torch.empty((images, 3, side, side), dtype=torch.float32)
    return out
