"""Vision-language models whose code ships with the checkpoint: InternVL and MiniCPM-V.

Neither is built here (their code is not run); each module's parameters are summed from
the shapes the released code builds, cited per function, and tests/test_catalog_params.py
checks the sums against models built on the meta device: InternVL through transformers'
own ``InternVLForConditionalGeneration`` (:func:`internvl_chat_to_internvl` is the config
mapping of transformers' ``convert_internvl_weights_to_hf.py``), MiniCPM-V composed of the
transformers classes its ``modeling_minicpmv.py`` builds and the resampler's torch modules,
and both against the checkpoints' published totals where a copy of them is stored.

Both cut an image into tiles (InternVL: up to ``max_dynamic_patch`` 448-pixel tiles plus a
thumbnail; MiniCPM-V: up to ``slice_config.max_slice_nums`` slices plus the whole image):
how many depends on each image's size and shape, which a config does not say. A spec
models one tile per image and says so; ``data.images_per_sample`` counts tiles.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..errors import UnknownFamilyError
from .hf_decoder import ConfigFields, decoder_spec
from .spec import ModelSpec, VisionSpec

# transformers src/transformers/models/internvl/convert_internvl_weights_to_hf.py
# (huggingface/transformers commit 015d3b273cbc4a72f2feb1da386896655a23b3da):
# LM_TYPE_CORRESPONDENCE maps InternVL2.5's InternLM2 language models to llama (wqkv is
# split into q/k/v_proj, the rest renamed) and its Qwen2 ones to qwen2; image_token_id
# 92546 (llama) or 151667 (qwen2); UNNECESSARY_CONFIG_KEYS are dropped from both configs.
_INTERNVL_LM_TYPES = {"internlm2": "llama", "llama": "llama", "qwen2": "qwen2"}
_INTERNVL_IMAGE_TOKEN = {"llama": 92546, "qwen2": 151667}
_CONVERTER_DROPS = frozenset({
    "_name_or_path", "_attn_implementation_autoset", "auto_map", "use_bfloat16", "use_flash_attn",
    "bias", "laux_allreduce", "moe_coeff_ratio", "moe_intermediate_size", "moe_output_scale",
    "noisy_gate_policy", "shared_expert_intermediate_size", "use_residual", "use_moe", "use_rts",
    "use_weighted_residual", "moe_config", "num_experts", "num_routed_experts",
    "num_shared_experts", "capacity_factor", "eval_capacity_factor", "drop_path_rate",
    "architectures", "model_type", "attn_implementation"})

# MiniCPM-V's language model by release: MiniCPM-Llama3-V-2_5 modeling_minicpmv.py builds
# LlamaForCausalLM(config); MiniCPM-V-2_6's builds Qwen2ForCausalLM(config) (its config
# class extends Qwen2Config). config.json says which release by its "version" key.
_MINICPMV_LM = {"2.5": "llama", "2.6": "qwen2"}


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _tiles_note(what: str, tokens: int) -> str:
    return (f"{what}: modelled as one tile per image ({tokens} language-model tokens); the "
            "number of tiles depends on each image's size and shape — set "
            "data.images_per_sample to the tiles per sample (or data.image_tokens)")


# ---- InternVL (model_type internvl_chat) ---------------------------------------------

def _internvl_lm_type(f: ConfigFields) -> str:
    llm_type = str(f.sub("llm_config").need("model_type"))
    if llm_type not in _INTERNVL_LM_TYPES:  # read from the model's own code instead
        raise UnknownFamilyError(
            f"{f.where}: InternVL llm_config model_type '{llm_type}' is not one the formulas "
            f"of oomless read ({', '.join(sorted(_INTERNVL_LM_TYPES))}).")
    return llm_type


def internvl_chat_to_internvl(config: dict[str, Any]) -> dict[str, Any]:
    """An ``internvl_chat`` config.json as transformers' ``internvl`` config
    (get_internvl_config of convert_internvl_weights_to_hf.py). Both language-model heads
    are untied as in the original, whose language model is built from llm_config alone."""
    f = ConfigFields(config, "internvl_chat config")
    lm_type = _INTERNVL_LM_TYPES[_internvl_lm_type(f)]
    llm, vision = config["llm_config"], config["vision_config"]
    text = {k: v for k, v in llm.items() if k not in _CONVERTER_DROPS}
    if llm.get("model_type") == "internlm2":  # InternLM2Attention: wqkv and wo bias=config.bias
        text["attention_bias"] = bool(llm.get("bias", False))
    vis = {k: v for k, v in vision.items() if k not in _CONVERTER_DROPS}
    if "attention_probs_dropout_prob" in vis:
        vis["attention_dropout"] = vis["projection_dropout"] = vis.pop("attention_probs_dropout_prob")
    if "qk_normalization" in vis:
        vis["use_qk_norm"] = vis.pop("qk_normalization")
    if "qkv_bias" in vis:
        vis["attention_bias"] = vis.pop("qkv_bias")
    vis["use_absolute_position_embeddings"] = True
    return {
        "model_type": "internvl",
        "architectures": ["InternVLForConditionalGeneration"],
        "text_config": {"model_type": lm_type, **text},
        "vision_config": {"model_type": "internvl_vision", **vis},
        "image_token_id": _INTERNVL_IMAGE_TOKEN[lm_type],
        "downsample_ratio": config.get("downsample_ratio", 0.5),
        "vision_feature_layer": config.get("select_layer", -1),
        "tie_word_embeddings": bool(llm.get("tie_word_embeddings", False)),
        "torch_dtype": config.get("torch_dtype") or llm.get("torch_dtype") or "bfloat16",
    }


def _intern_vit_params(v: ConfigFields) -> int:
    """InternVisionModel (modeling_intern_vit.py): InternVisionEmbeddings class_embedding h,
    patch Conv2d with bias, position_embedding (patches+1) x h; per InternVisionEncoderLayer
    attn.qkv (bias qkv_bias) and attn.proj (bias), q_norm/k_norm (InternRMSNorm, when
    qk_normalization), mlp.fc1/fc2 (bias), norm1/norm2 (LayerNorm, or RMSNorm for
    norm_type rms_norm), layer scales ls1/ls2; no final norm."""
    h, inter = int(v.need("hidden_size")), int(v.need("intermediate_size"))
    patch, image = int(v.need("patch_size")), int(v.need("image_size"))
    channels, layers = int(v.get("num_channels", 3)), int(v.need("num_hidden_layers"))
    norm = h if v.get("norm_type", "rms_norm") == "rms_norm" else 2 * h
    embeddings = h + _linear(channels * patch * patch, h) + ((image // patch) ** 2 + 1) * h
    per_layer = (_linear(h, 3 * h, bool(v.get("qkv_bias", False))) + _linear(h, h)
                 + (2 * h if v.get("qk_normalization", False) else 0)
                 + _linear(h, inter) + _linear(inter, h) + 2 * norm + 2 * h)
    return embeddings + layers * per_layer


def internvl_chat_spec(f: ConfigFields, name: str) -> ModelSpec:
    """InternVL 2 / 2.5 (modeling_internvl_chat.py InternVLChatModel): InternViT, a
    pixel-shuffle projector mlp1 (LayerNorm and Linear over h/ratio², GELU, Linear) and
    an InternLM2 or Qwen2 language model built from llm_config."""
    llm_type = _internvl_lm_type(f)
    llm = dict(f.config["llm_config"])
    if llm_type == "internlm2":  # the llama layout with one fused wqkv (bias: config.bias)
        llm["attention_bias"] = bool(llm.get("bias", False))
    text = decoder_spec(ConfigFields(llm, f"{f.where} [llm_config]"), name,
                        _INTERNVL_LM_TYPES[llm_type])
    if llm_type == "internlm2":
        text = replace(text, fused_qkv=True)
    v = f.sub("vision_config")
    ratio = float(f.get("downsample_ratio", 0.5))
    merge = round(1 / ratio)
    vh, big = int(v.need("hidden_size")), text.hidden_size
    projector = 2 * vh * merge**2 + _linear(vh * merge**2, big) + _linear(big, big)
    image, patch = int(f.get("force_image_size") or v.need("image_size")), int(v.need("patch_size"))
    tokens = (image // patch) ** 2 // merge**2
    vision = VisionSpec(
        hidden_size=vh, num_layers=int(v.need("num_hidden_layers")),
        num_heads=int(v.need("num_attention_heads")), intermediate_size=int(v.need("intermediate_size")),
        patch_size=patch, image_size=image, tokens_per_image=tokens,
        param_count=_intern_vit_params(v) + projector, projector_params=projector,
        kind="intern_vit", hidden_act=str(v.get("hidden_act", "gelu")),
        norm_type="rms" if v.get("norm_type", "rms_norm") == "rms_norm" else "layer",
        fused_qkv=True, class_token=True, merge_size=merge)
    notes = (*text.assumptions, _tiles_note(
        f"InternVL splits each image into up to {f.get('max_dynamic_patch', 12)} tiles of "
        f"{image}x{image} plus a thumbnail (dynamic_image_size)", tokens))
    return replace(text, model_type="internvl_chat", architecture="InternVLChatModel",
                   vision=vision, assumptions=notes)


# ---- MiniCPM-V (model_type minicpmv) -------------------------------------------------

def _siglip_navit_params(v: ConfigFields, layers: int) -> int:
    """The SigLIP-400M tower MiniCPM-V builds: transformers' Idefics2VisionTransformer
    (MiniCPM-Llama3-V-2_5) or its own modeling_navit_siglip.SiglipVisionTransformer
    (MiniCPM-V-2_6), the same modules: patch Conv2d with bias, position_embedding over
    (image_size / patch)² positions, per layer q/k/v/out_proj and fc1/fc2 with bias and
    two LayerNorms, then post_layernorm."""
    h, inter = int(v.need("hidden_size")), int(v.need("intermediate_size"))
    patch, image = int(v.need("patch_size")), int(v.need("image_size"))
    channels = int(v.get("num_channels", 3))
    embeddings = _linear(channels * patch * patch, h) + (image // patch) ** 2 * h
    per_layer = 4 * _linear(h, h) + _linear(h, inter) + _linear(inter, h) + 2 * 2 * h
    return embeddings + layers * per_layer + 2 * h


def _resampler_params(queries: int, dim: int, kv_dim: int) -> int:
    """resampler.py Resampler: query (queries x dim), kv_proj kv_dim -> dim without bias
    (Identity when equal), MultiheadAttention(dim) (in_proj 3·dim x dim with bias,
    out_proj with bias), ln_q, ln_kv, ln_post, proj (dim x dim); the 2-D sin-cos position
    table is a buffer."""
    kv = _linear(kv_dim, dim, bias=False) if kv_dim != dim else 0
    return queries * dim + kv + _linear(dim, 3 * dim) + _linear(dim, dim) + 3 * 2 * dim + dim * dim


def minicpmv_spec(f: ConfigFields, name: str) -> ModelSpec:
    """MiniCPM-V (modeling_minicpmv.py MiniCPMV): llm (the language model of the
    release), vpm (SigLIP tower, its last layer dropped when drop_vision_last_layer),
    resampler of query_num queries into the language model's width, num_heads = width // 128."""
    version = str(f.get("version") or "")
    if version not in _MINICPMV_LM:  # which release, hence which LM: read from its code
        raise UnknownFamilyError(
            f"{f.where}: MiniCPM-V config.json 'version' is {version or 'missing'}; the "
            f"formulas of oomless read releases {', '.join(sorted(_MINICPMV_LM))} (each "
            "builds a different language model).")
    text = decoder_spec(f, name, _MINICPMV_LM[version])
    v = f.sub("vision_config")
    # configuration_minicpm.py MiniCPMVConfig: drop_vision_last_layer defaults to True
    dropped = bool(f.get("drop_vision_last_layer", True))
    layers = int(v.need("num_hidden_layers")) - int(dropped)
    queries, vh = int(f.need("query_num")), int(v.need("hidden_size"))
    resampler = _resampler_params(queries, text.hidden_size, vh)
    image = int(f.get("image_size") or 448)  # MiniCPMVConfig image_size: the slice side
    vision = VisionSpec(
        hidden_size=vh, num_layers=layers, num_heads=int(v.need("num_attention_heads")),
        intermediate_size=int(v.need("intermediate_size")), patch_size=int(v.need("patch_size")),
        image_size=image, tokens_per_image=queries,
        param_count=_siglip_navit_params(v, layers) + resampler, projector_params=resampler,
        kind="siglip_navit", hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        fused_qkv=False)
    slices = (f.get("slice_config") or {}).get("max_slice_nums", 9)
    notes = [*text.assumptions, _tiles_note(
        f"MiniCPM-V cuts each image into up to {slices} slices of about {image}x{image} "
        "plus the whole image (slice_mode)", queries),
        "MiniCPM-V's resampler (one cross-attention of query_num queries over the patches) "
        "is sized in the weights; its activations are counted as a projector's"]
    if "drop_vision_last_layer" not in f.config:
        notes.append("drop_vision_last_layer not set: MiniCPMVConfig's default (True) used")
    return replace(text, model_type="minicpmv", architecture="MiniCPMV", vision=vision,
                   assumptions=tuple(notes))
