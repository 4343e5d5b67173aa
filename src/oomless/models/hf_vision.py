"""Vision-language configs: the vision tower, its projector, and image tokens.

Each tower's parameter count is summed from the module shapes of the code
that builds it (cited per function); tests/test_catalog_params.py checks the
in-library ones (CLIP in llava, Qwen2.5-VL) against transformers exactly.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..errors import ModelConfigError
from .hf_decoder import LLAMA_DEFAULTS, ConfigFields, decoder_spec
from .spec import ModelSpec, VisionSpec

# transformers CLIPVisionConfig defaults (ViT-B/32), for vision_configs that omit fields
CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
}

# Vision towers that remote-code LLaVA variants name instead of embedding a
# vision_config. Values: the tower's own config.json (openai/clip-vit-large-patch14-336,
# vision_config of https://huggingface.co/openai/clip-vit-large-patch14-336/blob/main/config.json).
KNOWN_VISION_TOWERS: dict[str, dict[str, Any]] = {
    "openai/clip-vit-large-patch14-336": {
        "model_type": "clip_vision_model",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "image_size": 336,
        "patch_size": 14,
        "num_channels": 3,
    },
    "openai/clip-vit-large-patch14": {
        "model_type": "clip_vision_model",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "image_size": 224,
        "patch_size": 14,
        "num_channels": 3,
    },
}


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def clip_vision_params(v: ConfigFields) -> tuple[int, dict[str, int]]:
    """CLIPVisionModel (transformers modeling_clip.py) parameter count and shape facts.

    embeddings: class_embedding h, patch Conv2d without bias, position_embedding
    (patches+1) x h; pre_layrnorm and post_layernorm; per layer q/k/v/out_proj with
    bias, layer_norm1/2, fc1/fc2 with bias.
    """
    h, inter = int(v.need("hidden_size")), int(v.need("intermediate_size"))
    layers, patch = int(v.need("num_hidden_layers")), int(v.need("patch_size"))
    image, channels = int(v.need("image_size")), int(v.get("num_channels", 3))
    patches = (image // patch) ** 2
    embeddings = h + channels * patch * patch * h + (patches + 1) * h
    per_layer = 4 * _linear(h, h) + _linear(h, inter) + _linear(inter, h) + 2 * 2 * h
    total = embeddings + 2 * 2 * h + layers * per_layer
    facts = {"hidden_size": h, "num_layers": layers, "intermediate_size": inter,
             "num_heads": int(v.need("num_attention_heads")), "patch_size": patch,
             "image_size": image, "patches": patches}
    return total, facts


def llava_spec(f: ConfigFields, name: str) -> ModelSpec:
    """transformers ``llava``: CLIP vision tower, 2-layer GELU projector, any text decoder."""
    text_cfg = _text_config_with_top_level_tie(f, f.need("text_config"))
    text_type = str(text_cfg.get("model_type", "llama"))
    defaults = LLAMA_DEFAULTS if text_type == "llama" else {}
    text = ConfigFields(text_cfg, f"{f.where} [text_config]", defaults)
    spec = decoder_spec(text, name, text_type)
    vision = f.sub("vision_config", CLIP_VISION_DEFAULTS)
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelConfigError(
            f"{f.where}: llava vision_config model_type '{vision.get('model_type')}' is not "
            "supported; oomless sizes CLIP vision towers (clip_vision_model) only."
        )
    tower, facts = clip_vision_params(vision)
    layer = f.get("vision_feature_layer", -2)
    feature_layers = 1 if isinstance(layer, int) else len(layer)
    # LlavaMultiModalProjector: linear_1 (vision_h*feature_layers -> text_h), linear_2 (text_h -> text_h)
    bias = bool(f.get("multimodal_projector_bias", True))
    projector = _linear(facts["hidden_size"] * feature_layers, spec.hidden_size, bias)
    projector += _linear(spec.hidden_size, spec.hidden_size, bias)
    # "default" strategy drops the CLS token; "full" keeps it
    full = f.get("vision_feature_select_strategy", "default") == "full"
    vision_spec = VisionSpec(
        hidden_size=facts["hidden_size"],
        num_layers=facts["num_layers"],
        num_heads=facts["num_heads"],
        intermediate_size=facts["intermediate_size"],
        patch_size=facts["patch_size"],
        image_size=facts["image_size"],
        tokens_per_image=facts["patches"] + (1 if full else 0),
        param_count=tower + projector,
        projector_params=projector,
        kind="clip",
        hidden_act=str(vision.get("hidden_act", "quick_gelu")),  # CLIPVisionConfig default
        fused_qkv=False,
        class_token=True,
    )
    return replace(spec, model_type="llava", architecture=_arch(f), vision=vision_spec)


def _text_config_with_top_level_tie(f: ConfigFields, text_cfg: dict) -> dict:
    """A VLM's text config; tie_word_embeddings may sit at the top level only."""
    if text_cfg.get("tie_word_embeddings") is None and f.config.get("tie_word_embeddings") is not None:
        return dict(text_cfg, tie_word_embeddings=f.config["tie_word_embeddings"])
    return text_cfg


def _arch(f: ConfigFields) -> str | None:
    return (f.get("architectures") or [None])[0]


# Qwen2.5-VL fine-tuning default image size: LLaMA-Factory's image_max_pixels
# 768*768, which the Qwen2-VL image processor resizes to multiples of
# patch*merge = 28 pixels: 756 x 756 -> 54 x 54 patches -> 729 tokens.
QWEN_VL_DEFAULT_IMAGE_SIZE = 756


def _qwen2_5_vision_params(v: ConfigFields, out_dim: int) -> tuple[int, dict[str, int]]:
    """Qwen2_5_VisionTransformerPretrainedModel (modeling_qwen2_5_vl.py)."""
    h, inter, depth = int(v.need("hidden_size")), int(v.need("intermediate_size")), int(v.need("depth"))
    patch, temporal = int(v.get("patch_size", 14)), int(v.get("temporal_patch_size", 2))
    channels, merge = int(v.get("in_channels") or v.get("in_chans") or 3), int(v.get("spatial_merge_size", 2))
    patch_embed = channels * temporal * patch * patch * h  # Conv3d, bias=False
    # block: norm1/norm2 RMSNorm(h), qkv Linear(h,3h,bias), proj Linear(h,h,bias), gated MLP with bias
    per_block = 2 * h + _linear(h, 3 * h) + _linear(h, h) + 2 * _linear(h, inter) + _linear(inter, h)
    merged = h * merge * merge
    # PatchMerger: ln_q RMSNorm(h), Linear(merged, merged), GELU, Linear(merged, out_dim)
    merger = h + _linear(merged, merged) + _linear(merged, out_dim)
    facts = {"hidden_size": h, "num_layers": depth, "intermediate_size": inter,
             "num_heads": int(v.need("num_heads")), "patch_size": patch, "merge": merge,
             "mlp_gated": True}
    return patch_embed + depth * per_block + merger, facts | {"projector": merger}


def _qwen2_vision_params(v: ConfigFields, out_dim: int) -> tuple[int, dict[str, int]]:
    """Qwen2VisionTransformerPretrainedModel (modeling_qwen2_vl.py): LayerNorm, plain MLP."""
    h, depth = int(v.need("embed_dim")), int(v.need("depth"))
    inter = int(h * float(v.get("mlp_ratio", 4)))
    patch, temporal = int(v.get("patch_size", 14)), int(v.get("temporal_patch_size", 2))
    channels, merge = int(v.get("in_channels") or v.get("in_chans") or 3), int(v.get("spatial_merge_size", 2))
    patch_embed = channels * temporal * patch * patch * h
    per_block = 2 * 2 * h + _linear(h, 3 * h) + _linear(h, h) + _linear(h, inter) + _linear(inter, h)
    merged = h * merge * merge
    merger = 2 * h + _linear(merged, merged) + _linear(merged, out_dim)
    facts = {"hidden_size": h, "num_layers": depth, "intermediate_size": inter,
             "num_heads": int(v.need("num_heads")), "patch_size": patch, "merge": merge,
             "mlp_gated": False}
    return patch_embed + depth * per_block + merger, facts | {"projector": merger}


def qwen2_vl_spec(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
    """Qwen2-VL / Qwen2.5-VL: a qwen2 text decoder plus a dynamic-resolution ViT."""
    text_cfg = f.config.get("text_config")
    if text_cfg:
        text = ConfigFields(_text_config_with_top_level_tie(f, text_cfg), f"{f.where} [text_config]")
    else:
        text = f
    spec = decoder_spec(text, name, "qwen2")
    vision = f.sub("vision_config")
    if model_type == "qwen2_5_vl":
        out_dim = int(vision.get("out_hidden_size") or spec.hidden_size)
        total, facts = _qwen2_5_vision_params(vision, out_dim)
    else:
        total, facts = _qwen2_vision_params(vision, int(vision.get("hidden_size") or spec.hidden_size))
    image = QWEN_VL_DEFAULT_IMAGE_SIZE
    patches = (image // facts["patch_size"]) ** 2
    vision_spec = VisionSpec(
        hidden_size=facts["hidden_size"],
        num_layers=facts["num_layers"],
        num_heads=facts["num_heads"],
        intermediate_size=facts["intermediate_size"],
        patch_size=facts["patch_size"],
        image_size=image,
        tokens_per_image=patches // facts["merge"] ** 2,
        param_count=total,
        projector_params=facts["projector"],
        mlp_gated=facts["mlp_gated"],
        kind=model_type,
        dynamic_resolution=True,
        # Qwen2VLVisionConfig hidden_act quick_gelu, LayerNorm; Qwen2.5-VL silu, RMSNorm
        hidden_act=str(vision.get("hidden_act") or "quick_gelu"),
        norm_type="rms" if model_type == "qwen2_5_vl" else "layer",
        merge_size=facts["merge"],
    )
    note = (f"{model_type} has dynamic image resolution: assumed {image}x{image} images "
            f"({vision_spec.tokens_per_image} tokens each)")
    return replace(spec, model_type=model_type, architecture=_arch(f), vision=vision_spec,
                   assumptions=(*spec.assumptions, note))


def glm4v_vision(f: ConfigFields, text: ModelSpec) -> VisionSpec:
    """GLM-4V-9B's EVA2-CLIP tower (THUDM/glm-4v-9b visual.py; vLLM models/glm4v.py).

    PatchEmbedding: Conv2d(c, vh, patch) with bias, cls_embedding vh, position_embedding
    num_positions x vh. Layer: input/post_attention LayerNorm, query_key_value and dense
    with bias, fc1/fc2 with bias. Then conv Conv2d(vh, H, 2, stride 2) with bias,
    GLU(linear_proj H->H, LayerNorm H, gate_proj/dense_h_to_4h H->ffn, dense_4h_to_h,
    no biases) and boi/eoi (H each); H and ffn are the language model's.
    """
    v = f.sub("vision_config")
    vh, inter = int(v.need("hidden_size")), int(v.need("intermediate_size"))
    layers, patch = int(v.need("num_hidden_layers")), int(v.need("patch_size"))
    image, channels = int(v.need("image_size")), int(v.get("in_channels", 3))
    positions = int(v.need("num_positions"))
    h, ffn = text.hidden_size, text.intermediate_size
    embed = _linear(channels * patch * patch, vh) + vh + positions * vh
    per_layer = 2 * 2 * vh + _linear(vh, 3 * vh) + _linear(vh, vh) + _linear(vh, inter) + _linear(inter, vh)
    conv = _linear(vh * 2 * 2, h)
    glu = h * h + 2 * h + 3 * h * ffn
    boi_eoi = 2 * h
    projector = conv + glu + boi_eoi
    grid = image // patch // 2  # the stride-2 conv halves each side
    return VisionSpec(
        hidden_size=vh,
        num_layers=layers,
        num_heads=int(v.need("num_heads")),
        intermediate_size=inter,
        patch_size=patch,
        image_size=image,
        tokens_per_image=grid * grid + 2,  # + boi and eoi
        param_count=embed + layers * per_layer + projector,
        projector_params=projector,
        kind="eva2clip",
        hidden_act=str(v.get("hidden_act", "gelu")),
        class_token=True,
        merge_size=2,  # the stride-2 conv folds 2×2 patches into one token
    )


# LLaVA-repo model_type (after the "moe_llava_"/"llava_" prefix) -> the decoder family it wraps
_LLAVA_REPO_BASES = {"": "llama", "llama": "llama", "phi": "phi", "mistral": "mistral",
                     "qwen1_5": "qwen2", "qwen2": "qwen2"}


def moe_llava_spec(f: ConfigFields, name: str, model_type: str) -> ModelSpec:
    """LLaVA-repo formats (remote code): MoE-LLaVA (PKU-YuanGroup) and original LLaVA.

    moellava/model/language_model/llava_phi_moe.py: the MLP of each layer in
    moe["moe_layers_idx"] becomes a DeepSpeed MoE of moe["num_experts"] copies of that
    MLP with a bias-free router (TopKGate.wg: hidden -> experts), top moe["top_k_experts"];
    MoELLaVAPhiForCausalLM.lm_head has no bias. The image tower is named by
    mm_image_tower (mm_vision_tower in LLaVA); the projector is image_projector_type
    (mm_projector_type in LLaVA), mlp2x_gelu = two Linear.
    """
    suffix = model_type.removeprefix("moe_llava").removeprefix("llava").lstrip("_")
    base_type = _LLAVA_REPO_BASES.get(suffix)
    if base_type is None:
        raise ModelConfigError(
            f"{f.where}: model_type '{model_type}' is not supported; oomless reads LLaVA-repo "
            f"configs over {', '.join(sorted(set(_LLAVA_REPO_BASES.values())))} decoders."
        )
    spec = decoder_spec(f, name, base_type)
    notes = list(spec.assumptions)
    moe = f.get("moe") or {}
    if moe.get("moe_enable", bool(moe)):
        spec = _with_moe_layers(f, spec, moe)
        notes.append(
            "MoE-LLaVA: each MoE layer holds num_experts copies of the dense MLP plus a "
            "bias-free router; top-k routing with DeepSpeed capacity factors is modelled as "
            "experts_per_token active experts (capacity-based token dropping ignored)"
        )
    spec = replace(spec, model_type=model_type, architecture=_arch(f), lm_head_bias=False)
    tower_name = f.get("mm_image_tower") or f.get("mm_vision_tower")
    if tower_name is None:
        return replace(spec, assumptions=tuple(notes))
    if tower_name not in KNOWN_VISION_TOWERS:
        raise ModelConfigError(
            f"{f.where}: image tower '{tower_name}' is unknown to oomless; known: "
            f"{', '.join(KNOWN_VISION_TOWERS)}."
        )
    tower, facts = clip_vision_params(ConfigFields(KNOWN_VISION_TOWERS[tower_name], tower_name))
    projector = _projector_params(f, facts["hidden_size"], spec.hidden_size)
    vision = VisionSpec(
        hidden_size=facts["hidden_size"], num_layers=facts["num_layers"], num_heads=facts["num_heads"],
        intermediate_size=facts["intermediate_size"], patch_size=facts["patch_size"],
        image_size=facts["image_size"], tokens_per_image=facts["patches"],  # CLS dropped ("patch")
        param_count=tower + projector, projector_params=projector, kind="clip",
        hidden_act="quick_gelu", fused_qkv=False, class_token=True,
    )
    notes.append(f"vision tower {tower_name}: shapes from its released config.json")
    return replace(spec, vision=vision, assumptions=tuple(notes))


def _with_moe_layers(f: ConfigFields, spec: ModelSpec, moe: dict) -> ModelSpec:
    layers = tuple(int(i) for i in moe.get("moe_layers_idx") or range(0, spec.num_layers, 2))
    experts = moe.get("num_experts") or [4]
    counts = set(experts) if isinstance(experts, list) else {experts}
    if len(counts) != 1:
        raise ModelConfigError(
            f"{f.where}: moe.num_experts differs between layers ({sorted(counts)}); unsupported."
        )
    if moe.get("use_residual"):
        raise ModelConfigError(f"{f.where}: moe.use_residual (residual MoE) is not supported.")
    return replace(
        spec, num_experts=int(counts.pop()), experts_per_token=int(moe.get("top_k_experts", 2)),
        moe_intermediate_size=spec.intermediate_size, moe_layer_indices=layers,
    )


def _projector_params(f: ConfigFields, vision_h: int, text_h: int) -> int:
    kind = str(f.get("image_projector_type") or f.get("mm_projector_type") or "linear")
    if kind == "linear":
        return _linear(vision_h, text_h)
    if kind.startswith("mlp") and kind.endswith("x_gelu"):
        depth = int(kind[3:-6])
        return _linear(vision_h, text_h) + (depth - 1) * _linear(text_h, text_h)
    raise ModelConfigError(f"{f.where}: projector type '{kind}' is not supported (linear, mlpNx_gelu).")
