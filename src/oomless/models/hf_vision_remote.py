"""Vision-language models whose code ships with the checkpoint: InternVL, MiniCPM-V and
MiniCPM-o (MiniCPM-V's language model, tower and resampler plus a Whisper audio encoder and
a ChatTTS speech decoder).

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
    spec = _with_minicpm_vision(f, decoder_spec(f, name, _MINICPMV_LM[version]))
    return replace(spec, model_type="minicpmv", architecture="MiniCPMV")


def _with_minicpm_vision(f: ConfigFields, text: ModelSpec) -> ModelSpec:
    """``text`` with MiniCPM-V's vpm and resampler (init_vision_module and init_resampler,
    the same in modeling_minicpmv.py and MiniCPM-o's modeling_minicpmo.py)."""
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
    return replace(text, vision=vision, assumptions=tuple(notes))


# ---- MiniCPM-o (model_type minicpmo) -------------------------------------------------
# modeling_minicpmo.py of openbmb/MiniCPM-o-2_6 (as copied in tenstorrent/tt-metal
# models/experimental/minicpm_o_2_6/reference_pytorch/minicpm_official/, commit
# 11f79439b8e8d84ec5e99cd982f2e682809c17a0): MiniCPMO.__init__ builds llm =
# Qwen2ForCausalLM(config), then vpm + resampler if init_vision, apm (MiniCPMWhisperEncoder)
# + audio_projection_layer if init_audio, tts (ConditionalChatTTS) if init_tts; its
# configuration_minicpm.py MiniCPMOConfig (same copy) defaults all three to True and
# drop_vision_last_layer to True. ConditionalChatTTSConfig's defaults, which tts_config
# overrides key by key (the release's sets llm_dim only; the counts measured on it confirm
# the rest, tests/test_catalog_remote_vlm.py):
_CHATTTS_DEFAULTS = {"llm_dim": 2560, "hidden_size": 768, "intermediate_size": 3072,
                     "num_hidden_layers": 20, "num_audio_tokens": 626,
                     "num_text_tokens": 21178, "num_vq": 4, "use_mlp": True}
# transformers WhisperConfig defaults (MiniCPMOConfig builds WhisperConfig(**audio_config))
# for the keys an audio_config leaves out; the release's leaves out the last two
_WHISPER_DEFAULTS = {"d_model": 384, "encoder_layers": 4, "encoder_ffn_dim": 1536,
                     "num_mel_bins": 80, "max_source_positions": 1500}
# LlamaConfig's default vocab_size: ConditionalChatTTS builds LlamaModel(LlamaConfig(...))
# without one, so its embed_tokens has 32000 rows (unused; the checkpoint holds them)
_LLAMA_DEFAULT_VOCAB = 32000


def _whisper_encoder_params(a: dict[str, Any]) -> int:
    """transformers' WhisperEncoder (MiniCPMWhisperEncoder subclasses it; its layers add no
    parameter): conv1 (mel bins -> d, kernel 3) and conv2 (d -> d, kernel 3) with bias,
    embed_positions max_source_positions x d; per layer q/v/out_proj with bias, k_proj
    without, fc1/fc2 with bias and two LayerNorms; a final LayerNorm."""
    w = _WHISPER_DEFAULTS | a
    d, ffn, mel = int(w["d_model"]), int(w["encoder_ffn_dim"]), int(w["num_mel_bins"])
    per_layer = 3 * _linear(d, d) + d * d + _linear(d, ffn) + _linear(ffn, d) + 2 * 2 * d
    convs = mel * d * 3 + d + d * d * 3 + d
    return (convs + int(w["max_source_positions"]) * d + int(w["encoder_layers"]) * per_layer
            + 2 * d)


def _chattts_dvae_params() -> int:
    """ConditionalChatTTS's DVAE() (borrowed from 2noise/ChatTTS ChatTTS/model/dvae.py; no
    argument, fixed shapes): coef (100), downsample_conv Conv1d(100, 512, 3) and
    Conv1d(512, 512, 4); encoder and decoder DVAEDecoder(idim 512, hidden 256, bn_dim 128,
    12 ConvNeXtBlocks of dwconv kernel 7, LayerNorm, pwconv 256 <-> 1024, coef) with
    odim 1024 and 512; out_conv Conv1d(512, 100, 3) without bias; vq_layer GFSQ(dim 1024,
    levels (5, 5, 5, 5), G 2, R 2): vector_quantize_pytorch GroupedResidualFSQ, each of the
    2 groups a ResidualFSQ(dim 512) with project_in Linear(512, 4), project_out Linear(4, 512)."""
    def conv(c_in: int, c_out: int, k: int, bias: bool = True) -> int:
        return c_in * c_out * k + (c_out if bias else 0)

    # ConvNeXtBlock(256, 1024): depthwise Conv1d (groups=dim: 1 input channel per filter)
    block = conv(1, 256, 7) + 2 * 256 + _linear(256, 1024) + _linear(1024, 256) + 256
    stem = conv(512, 128, 3) + conv(128, 256, 3) + 12 * block
    coders = (stem + conv(256, 1024, 1, bias=False)) + (stem + conv(256, 512, 1, bias=False))
    vq = 2 * (_linear(512, 4) + _linear(4, 512))
    return 100 + conv(100, 512, 3) + conv(512, 512, 4) + coders + conv(512, 100, 3, False) + vq


def _chattts_params(tts: dict[str, Any]) -> int:
    """ConditionalChatTTS: projector (MultiModalProjector llm_dim -> hidden -> hidden with
    biases, or a bias-free Linear without use_mlp), emb_code num_vq x Embedding(audio
    tokens, hidden), emb_text Embedding(text tokens, hidden), head_code num_vq
    weight_norm(Linear(hidden, audio tokens, bias=False)) (weight_g and weight_v), the DVAE
    and LlamaModel(hidden, intermediate, heads, layers; vocab and KV heads LlamaConfig's
    defaults)."""
    t = _CHATTTS_DEFAULTS | tts
    h, audio, vq = int(t["hidden_size"]), int(t["num_audio_tokens"]), int(t["num_vq"])
    llm_dim, inter = int(t["llm_dim"]), int(t["intermediate_size"])
    projector = _linear(llm_dim, h) + _linear(h, h) if t["use_mlp"] else llm_dim * h
    heads = vq * (audio + audio * h)
    llama = (_LLAMA_DEFAULT_VOCAB * h + h
             + int(t["num_hidden_layers"]) * (4 * h * h + 3 * h * inter + 2 * h))
    return (projector + vq * audio * h + int(t["num_text_tokens"]) * h + heads
            + _chattts_dvae_params() + llama)


def minicpmo_audio_and_tts_params(config: dict[str, Any]) -> tuple[int, int]:
    """(apm + audio_projection_layer, tts) parameters MiniCPMO builds from ``config``
    (0 where init_audio / init_tts is false). audio_projection_layer is a
    MultiModalProjector(encoder_ffn_dim // 4 -> hidden_size -> hidden_size, biases)."""
    audio = tts = 0
    if config.get("init_audio", True):
        a = config.get("audio_config") or {}
        width = int((_WHISPER_DEFAULTS | a)["encoder_ffn_dim"]) // 4
        hidden = int(config["hidden_size"])
        audio = _whisper_encoder_params(a) + _linear(width, hidden) + _linear(hidden, hidden)
    if config.get("init_tts", True):
        tts = _chattts_params(config.get("tts_config") or {})
    return audio, tts


def minicpmo_spec(f: ConfigFields, name: str) -> ModelSpec:
    """MiniCPM-o 2.6 (modeling_minicpmo.py MiniCPMO): Qwen2ForCausalLM, MiniCPM-V's vpm and
    resampler, and the audio encoder and TTS its init_* keys build, in other_params."""
    text = decoder_spec(f, name, "qwen2")
    spec = _with_minicpm_vision(f, text) if f.get("init_vision", True) else text
    audio, tts = minicpmo_audio_and_tts_params(f.config)
    notes = list(spec.assumptions)
    parts = [part for part, n in ((f"audio encoder and projection ({audio:,} parameters, "
                                   "init_audio)", audio),
                                  (f"speech decoder ({tts:,} parameters, init_tts)", tts)) if n]
    if parts:
        notes.append(
            f"MiniCPM-o's {' and '.join(parts)} counted in the weights, as config.json builds "
            "them (MiniCPMOConfig: true unless set); their activations are not modelled (no "
            "audio in the data). OpenBMB's finetune.py builds the model with "
            "init_audio=False, init_tts=False and LLaMA-Factory with init_tts=False (oomless "
            "check applies both); set those keys in config.json to count another run")
    return replace(spec, model_type="minicpmo", architecture="MiniCPMO",
                   other_params=spec.other_params + audio + tts, assumptions=tuple(notes))
