"""Read a Hugging Face ``config.json`` into a :class:`~oomless.models.spec.ModelSpec`.

The dispatcher: text decoders are read by :mod:`oomless.models.hf_decoder`,
vision-language models (llava, qwen2_vl, qwen2_5_vl, GLM-4V, MoE-LLaVA) by
:mod:`oomless.models.hf_vision`; files are found by :mod:`oomless.models.hf_cache`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import UnknownFamilyError
from . import hf_vision, hf_vision_remote
from .families import tower_checkpointed
from .hf_decoder import ConfigFields, chatglm_spec, chatglm_to_glm, decoder_spec
from .quantization import quant_spec_from_config
from .spec import ModelSpec
from .structure import checked_against_code, read_structure

# model types the formulas read whose only implementation is the checkpoint's own code
# (transformers has no class: Qwen-1 QWenLMHeadModel, Baichuan2 BaichuanForCausalLM,
# MiniCPM-V MiniCPMV, MiniCPM-o MiniCPMO; their parts are checked in
# tests/test_catalog_params.py and tests/test_catalog_remote_vlm.py)
REMOTE_CODE_ONLY = frozenset({"qwen", "baichuan", "minicpmv", "minicpmo"})

__all__ = ["buildable_hf_config", "chatglm_to_glm", "spec_from_hf_config"]


def spec_from_hf_config(config: dict[str, Any], name: str, where: str | None = None,
                        folder: Path | None = None) -> ModelSpec:
    """A ModelSpec from a config.json dict. ``where`` (file or catalog entry) goes into errors.
    ``folder``: the user's model folder the config was read from (None for the catalog):
    a family the formulas do not know is then read from the model's code, and a known one
    is checked against it (oomless.models.structure)."""
    try:
        spec = _unquantized_spec(config, name, where)
    except UnknownFamilyError as reason:
        if folder is None:
            raise
        spec = read_structure(config, name, folder, where or name, reason)
    else:
        if folder is not None:
            spec = checked_against_code(spec, config, folder, where or name)
    return with_quantization(spec, config, where or name)


def with_quantization(spec: ModelSpec, config: dict[str, Any], where: str) -> ModelSpec:
    """``spec`` with the checkpoint's quantization_config read (models/quantization.py)."""
    qcfg = config.get("quantization_config") if isinstance(config, dict) else None
    if qcfg is None:
        return spec
    quant, notes = quant_spec_from_config(qcfg, where)
    return replace(spec, quantization=quant, assumptions=(*spec.assumptions, *notes))


def _unquantized_spec(config: dict[str, Any], name: str, where: str | None) -> ModelSpec:
    spec = _read_spec(config, name, where)
    if spec.vision is None:
        return spec
    return replace(spec, vision=replace(
        spec.vision, checkpointed=tower_checkpointed(spec.vision.kind)))


def _read_spec(config: dict[str, Any], name: str, where: str | None) -> ModelSpec:
    f = ConfigFields(config, where or name)
    model_type = str(f.need("model_type"))
    if model_type == "chatglm":
        spec = chatglm_spec(f, name)
        if f.get("vision_config") is not None:
            vision = hf_vision.glm4v_vision(f, spec)
            note = (f"GLM-4V resizes every image to {vision.image_size}x{vision.image_size}: "
                    f"{vision.tokens_per_image} tokens per image")
            # THUDM/glm-4v-9b modeling_chatglm.py (mid-2024): SelfAttention builds
            # CoreAttention (baddbmm scores, fp32 softmax) whatever attn_implementation
            # says; CORE_ATTENTION_CLASSES is defined but not used (THUDM/GLM-4#420)
            eager = ("GLM-4V's language model runs its own eager CoreAttention (fp32 softmax "
                     "over heads × tokens²) whatever attn_implementation says: "
                     "modeling_chatglm.py SelfAttention builds CoreAttention, not "
                     "CORE_ATTENTION_CLASSES (THUDM/GLM-4#420)")
            spec = replace(spec, vision=vision, sdpa_supported=False,
                           assumptions=(*spec.assumptions, note, eager))
        return spec
    if model_type == "llava" and f.config.get("text_config") is not None:
        return hf_vision.llava_spec(f, name)
    if model_type in {"qwen2_vl", "qwen2_5_vl"}:
        return hf_vision.qwen2_vl_spec(f, name, model_type)
    if model_type == "internvl_chat":
        return hf_vision_remote.internvl_chat_spec(f, name)
    if model_type == "minicpmv":
        return hf_vision_remote.minicpmv_spec(f, name)
    if model_type == "minicpmo":
        return hf_vision_remote.minicpmo_spec(f, name)
    if model_type.startswith(("moe_llava", "llava")):  # LLaVA repo formats (mm_vision_tower)
        return hf_vision.moe_llava_spec(f, name, model_type)
    return decoder_spec(f, name, model_type)


def buildable_hf_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The config dict to build the real model from with transformers, or None.

    GLM-4 ``chatglm`` (text only) comes back as the equivalent ``glm`` config, InternVL's
    ``internvl_chat`` as transformers' ``internvl`` (the mapping of its own converter,
    :func:`oomless.models.hf_vision_remote.internvl_chat_to_internvl`); formats with no
    transformers class at all (GLM-4V, the LLaVA/MoE-LLaVA repo
    formats) give None; everything else comes back unchanged (a copy), for
    ``AutoConfig.for_model`` to accept or to reject with its own message.
    """
    model_type = str(config.get("model_type", ""))
    if model_type == "chatglm":
        return None if config.get("vision_config") else chatglm_to_glm(config)
    if model_type in REMOTE_CODE_ONLY:
        return None
    if model_type == "internvl_chat":  # as transformers' own converter maps it
        return hf_vision_remote.internvl_chat_to_internvl(config)
    if model_type.startswith("moe_llava") or model_type.startswith("llava_"):
        return None
    if model_type == "llava" and config.get("text_config") is None:
        return None
    return json.loads(json.dumps(config))
