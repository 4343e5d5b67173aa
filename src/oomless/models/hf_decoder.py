"""Decoder fields of a Hugging Face ``config.json``: dense, MoE and ChatGLM families.

The config is read as data: no transformers import, no ``trust_remote_code``.
Every field name below is the one the model's own config class uses; where a
family needs a default, it is the default of that config class in
transformers (cited next to it). Parameter counts that follow from these
fields are checked against transformers' meta-device models for every catalog
entry (tests/test_catalog_params.py).

Families: dense decoders (llama, mistral, qwen2, qwen3, gemma, gemma2, phi,
phi3, glm, glm4, gemma3_text, and the remote-code qwen (Qwen-1) and baichuan read as data;
any other model type raises UnknownFamilyError and is read
from its own code, oomless.models.structure), mixture-of-experts (mixtral, qwen2_moe,
qwen3_moe) and ChatGLM/GLM-4 (``chatglm``). Vision towers are read in
:mod:`oomless.models.hf_vision`; :mod:`oomless.models.hf_config` picks the reader.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..errors import ModelConfigError, UnknownFamilyError
from .spec import ModelSpec

# ---- values a config.json may hold --------------------------------------------------
# Sizes and counts oomless reads: whole numbers (an integral float such as 4096.0 is
# accepted), at least 1 (or 0 where zero means "none"), at most 2^31 - 1. NaN,
# Infinity, 1e308, strings, lists, booleans, 0 heads or a negative hidden size are
# refused with the field and the file named, instead of sizing a nonsense model.
MAX_CONFIG_INT = 2**31 - 1
_AT_LEAST_ONE = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
    "padded_vocab_size", "num_layers", "kv_channels", "ffn_hidden_size",
    "multi_query_group_num", "seq_length", "patch_size", "image_size", "depth", "num_heads",
    "embed_dim", "num_positions", "temporal_patch_size", "spatial_merge_size",
    "in_channels", "in_chans", "num_channels", "out_hidden_size"})
_AT_LEAST_ZERO = frozenset({"num_local_experts", "num_experts", "shared_expert_intermediate_size",
                            "sliding_window"})  # transformers' Qwen2-MoE writes 0 when unused
_POSITIVE_REAL = frozenset({"mlp_ratio", "layernorm_epsilon", "rms_norm_eps"})


def _checked(key: str, value: Any, where: str) -> Any:
    """``value`` of field ``key`` if it is a sensible one (see above); else an error."""
    import math

    if key in _POSITIVE_REAL:
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value <= 0:
            raise ModelConfigError(f"{where}: '{key}' is {value!r}; expected a positive number")
        return value
    low = 1 if key in _AT_LEAST_ONE else 0 if key in _AT_LEAST_ZERO else None
    if low is None:
        return value
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if not whole or not low <= value <= MAX_CONFIG_INT:
        raise ModelConfigError(
            f"{where}: '{key}' is {value!r}; expected a whole number from {low} to "
            f"{MAX_CONFIG_INT:,}. Fix the config.json (the model's released one has it right).")
    return int(value)


class ConfigFields:
    """A config dict plus where it came from, so errors can name both. Every value read
    through :meth:`need` and :meth:`get` is checked by :func:`_checked`."""

    def __init__(self, config: dict[str, Any], where: str, defaults: dict | None = None):
        if not isinstance(config, dict):
            raise ModelConfigError(f"{where}: expected a JSON object, got {type(config).__name__}")
        self.config = config
        self.where = where
        self.defaults = defaults or {}
        self.defaulted: list[str] = []  # fields taken from ``defaults``

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None or key in self.defaults

    def need(self, *keys: str) -> Any:
        """The first of ``keys`` that is set; a missing field is a ModelConfigError."""
        for key in keys:
            if self.config.get(key) is not None:
                return _checked(key, self.config[key], self.where)
        for key in keys:
            if key in self.defaults:
                if key not in self.defaulted:
                    self.defaulted.append(key)
                return self.defaults[key]
        also = f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""
        model_type = self.config.get("model_type", "unknown")
        raise ModelConfigError(
            f"{self.where}: config.json (model_type '{model_type}') lacks the field "
            f"'{keys[0]}'{also}, which oomless needs to size the model. Add it from the "
            "model's released config.json, or pass a catalog name (`oomless models`)."
        )

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        if value is not None:
            return _checked(key, value, self.where)
        if key in self.defaults and key not in self.defaulted:
            self.defaulted.append(key)
        return self.defaults.get(key, default)

    def sub(self, key: str, defaults: dict | None = None) -> ConfigFields:
        return ConfigFields(self.need(key), f"{self.where} [{key}]", defaults)


# transformers' config-class defaults for families whose released configs rely
# on them (llava-1.5's text_config states only a few llama fields).
# Source: transformers LlamaConfig.__init__ defaults (Llama-2-7B shapes).
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}

# Per model_type: defaults of the transformers config class for fields that
# released configs often omit, and the layer facts that are not in config.json.
# "tie": tie_word_embeddings default of the config class.
_FAMILY: dict[str, dict[str, Any]] = {
    "llama": {"tie": False},
    "mistral": {"tie": False},
    "qwen2": {"tie": False, "bias": "qkv_always"},  # Qwen2Attention: q/k/v bias=True, o_proj none
    "qwen3": {"tie": False, "qk_norm": True},  # Qwen3Attention: q_norm/k_norm over head_dim
    "gemma": {"tie": True},
    # pre/post attn + pre/post ffw norms; Gemma2PreTrainedModel._supports_sdpa = False (SDPA
    # cannot soft-cap the scores), so transformers runs it eager unless flash is asked for
    "gemma2": {"tie": True, "norms": 4, "sliding_every": 2, "no_sdpa": True,
               "softcap": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}},
    # Gemma3TextConfig: q_norm/k_norm, 4 norms per layer, 5 sliding layers of 6, no soft-capping
    "gemma3_text": {"tie": True, "norms": 4, "qk_norm": True, "sliding_every": 6},
    "phi3": {"tie": False, "fused_qkv": True, "fused_gate_up": True},
    "phi": {"tie": False, "plain_mlp": True, "norm": "layer", "norms": 1, "bias": "always"},
    "glm": {"tie": False, "fused_gate_up": True, "bias": "qkv"},  # GlmAttention: o_proj bias=False
    "glm4": {"tie": False, "fused_gate_up": True, "norms": 4, "bias": "qkv"},  # + post_self_attn/post_mlp norms
    "mixtral": {"tie": False},
    "qwen2_moe": {"tie": False, "bias": "qkv_always"},
    "qwen3_moe": {"tie": False, "qk_norm": True},
    # Glm4MoeAttention: q/k/v bias = attention_bias, o_proj none; q_norm/k_norm when use_qk_norm
    "glm4_moe": {"tie": False, "bias": "qkv"},
    # remote code, read as data (their code is not run): Qwen-1 modeling_qwen.py QWenAttention
    # c_attn hidden -> 3 x hidden with bias, c_proj without (no_bias); QWenMLP w1/w2 of
    # intermediate_size // 2 each and c_proj back (config.intermediate_size is their sum)
    "qwen": {"tie": False, "fused_qkv": True, "bias": "qkv_always", "half_width": True},
    # Baichuan2 modeling_baichuan.py: W_pack hidden -> 3 x hidden, no biases; NormHead lm_head
    "baichuan": {"tie": False, "fused_qkv": True},
}

def _dtype(f: ConfigFields) -> str:
    return str(f.get("torch_dtype") or f.get("dtype") or "bfloat16").removeprefix("torch.")


def _attention(f: ConfigFields, fam: dict[str, Any]) -> dict[str, Any]:
    heads = int(f.need("num_attention_heads"))
    hidden = int(f.need("hidden_size"))
    # transformers: num_key_value_heads defaults to num_attention_heads (MHA)
    kv_heads = int(f.get("num_key_value_heads") or heads)
    head_dim = int(f.get("head_dim") or hidden // heads)
    bias = bool(f.get("attention_bias", False))
    # "bias": how attention_bias maps to q/k/v and o_proj biases in the family's attention
    mode = fam.get("bias", "all")
    qkv_bias = {"all": bias, "qkv": bias, "qkv_always": True, "always": True}[mode]
    o_bias = {"all": bias, "qkv": False, "qkv_always": False, "always": True}[mode]
    return {
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "qkv_bias": qkv_bias,
        "o_bias": o_bias,
        "fused_qkv": fam.get("fused_qkv", False),
        "qk_norm": fam.get("qk_norm", False) or bool(f.get("use_qk_norm", False)),
    }


def _softcap(f: ConfigFields, fam: dict[str, Any], key: str) -> bool:
    """Whether soft-capping is on: the config's value (null switches it off), else the
    config class's default (Gemma2Config: 50.0 on attention, 30.0 on the logits)."""
    if key in f.config:
        return f.config[key] is not None
    return fam.get("softcap", {}).get(key) is not None


def _sliding_window(f: ConfigFields, model_type: str) -> int | None:
    window = f.get("sliding_window")
    if window is None:
        return None
    # Qwen2/Qwen2-MoE/Qwen3 carry sliding_window but only use it when use_sliding_window is set
    if "use_sliding_window" in f.config and not f.config["use_sliding_window"]:
        return None
    return int(window)


def _moe(f: ConfigFields, model_type: str, num_layers: int) -> dict[str, Any]:
    """Mixture-of-experts fields (mixtral, qwen2_moe, qwen3_moe, glm4_moe); {} for dense models."""
    experts = int(f.get("num_local_experts") or f.get("num_experts") or f.get("n_routed_experts") or 0)
    if not experts:
        return {}
    out: dict[str, Any] = {
        "num_experts": experts,
        "experts_per_token": int(f.need("num_experts_per_tok")),
    }
    if model_type == "mixtral":
        out["moe_intermediate_size"] = int(f.need("intermediate_size"))
        return out
    out["moe_intermediate_size"] = int(f.need("moe_intermediate_size"))
    if f.get("n_shared_experts") is not None or f.get("first_k_dense_replace") is not None:
        return out | _deepseek_style_moe(f, out["moe_intermediate_size"])
    shared = int(f.get("shared_expert_intermediate_size") or 0)
    if shared:
        out["shared_expert_intermediate_size"] = shared
        out["num_shared_experts"] = 1
        out["shared_expert_gate"] = model_type == "qwen2_moe"  # Qwen2MoeSparseMoeBlock.shared_expert_gate
    # Qwen2MoeDecoderLayer: sparse when layer not in mlp_only_layers and (i+1) % decoder_sparse_step == 0
    step = int(f.get("decoder_sparse_step") or 1)
    dense_only = set(f.get("mlp_only_layers") or ())
    moe_layers = tuple(
        i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0
    )
    if len(moe_layers) != num_layers:
        out["moe_layer_indices"] = moe_layers
    return out


def _deepseek_style_moe(f: ConfigFields, expert_width: int) -> dict[str, Any]:
    """GLM-4.5 (glm4_moe) keys, as DeepSeek-V3 names them: the first
    first_k_dense_replace layers have a dense MLP; each MoE layer adds one shared
    MLP of n_shared_experts x moe_intermediate_size (Glm4MoeMoE.shared_experts);
    the router's e_score_correction_bias is a buffer, not a parameter."""
    out: dict[str, Any] = {"num_dense_layers": int(f.get("first_k_dense_replace") or 0)}
    shared = int(f.get("n_shared_experts") or 0)
    if shared:
        out["shared_expert_intermediate_size"] = shared * expert_width
        out["num_shared_experts"] = shared
    return out


def decoder_spec(f: ConfigFields, name: str, model_type: str | None = None) -> ModelSpec:
    """Dense or MoE decoder-only LM in the llama layout (and its relatives)."""
    model_type = model_type or str(f.need("model_type"))
    fam = _FAMILY.get(model_type)
    notes = []
    if fam is None:
        raise UnknownFamilyError(
            f"{f.where}: model_type '{model_type}' is not a family the formulas of oomless "
            f"know ({', '.join(sorted(_FAMILY))}, chatglm and the vision families).")
    if f.config.get("num_key_value_heads") is None:
        notes.append("num_key_value_heads not set: multi-head attention (as transformers defaults)")
    num_layers = int(f.need("num_hidden_layers"))
    moe = _moe(f, model_type, num_layers)
    all_bias = fam.get("bias") == "always"
    window = _sliding_window(f, model_type)
    spec = ModelSpec(
        name=name,
        model_type=model_type,
        architecture=(f.get("architectures") or [None])[0],
        vocab_size=int(f.need("vocab_size")),
        hidden_size=int(f.need("hidden_size")),
        num_layers=num_layers,
        # dense MLP width; Mixtral: each expert's width; Qwen-1: half of the config's
        intermediate_size=int(f.need("intermediate_size")) // (2 if fam.get("half_width") else 1),
        mlp_gated=not fam.get("plain_mlp", False),
        hidden_act=str(f.get("hidden_act") or f.get("hidden_activation") or "silu"),
        fused_gate_up=fam.get("fused_gate_up", False),
        mlp_bias=all_bias or bool(f.get("mlp_bias", False)),
        norm_type=fam.get("norm", "rms"),
        norms_per_layer=fam.get("norms", 2),
        tie_embeddings=bool(f.get("tie_word_embeddings", fam["tie"])),
        lm_head_bias=all_bias and model_type == "phi",  # PhiForCausalLM.lm_head has bias=True
        max_position_embeddings=int(f.get("max_position_embeddings") or 4096),
        sliding_window=window,
        sliding_window_every=fam.get("sliding_every", 1) if window else 1,
        attn_logit_softcap=_softcap(f, fam, "attn_logit_softcapping"),
        final_logit_softcap=_softcap(f, fam, "final_logit_softcapping"),
        sdpa_supported=not fam.get("no_sdpa", False),
        resid_dropout=float(f.get("resid_pdrop") or 0.0) > 0,  # PhiDecoderLayer.resid_dropout
        dtype=_dtype(f),
        **_attention(f, fam),
        **moe,
    )
    if f.defaulted:
        notes.append(f"{f.where} omits {', '.join(f.defaulted)}: transformers' config defaults used")
    return replace(spec, assumptions=tuple(notes)) if notes else spec


def chatglm_spec(f: ConfigFields, name: str) -> ModelSpec:
    """ChatGLM2/3 and GLM-4 (remote-code ``chatglm``): fused query_key_value and dense_h_to_4h.

    Field meanings from THUDM's configuration_chatglm.py / modeling_chatglm.py:
    multi_query_group_num KV heads of kv_channels each (when multi_query_attention),
    ffn_hidden_size SwiGLU width (dense_h_to_4h: hidden -> 2*ffn), padded_vocab_size
    rows of embedding and output_layer, add_qkv_bias on query_key_value only,
    RMSNorm when rmsnorm, final_layernorm when post_layer_norm.
    """
    heads = int(f.need("num_attention_heads"))
    mqa = bool(f.get("multi_query_attention", False))
    kv_heads = int(f.need("multi_query_group_num")) if mqa else heads
    hidden = int(f.need("hidden_size"))
    spec = ModelSpec(
        name=name,
        model_type="chatglm",
        architecture=(f.get("architectures") or ["ChatGLMModel"])[0],
        vocab_size=int(f.need("padded_vocab_size")),
        hidden_size=hidden,
        num_layers=int(f.need("num_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(f.need("kv_channels")),
        intermediate_size=int(f.need("ffn_hidden_size")),
        fused_qkv=True,
        fused_gate_up=True,
        qkv_bias=bool(f.get("add_qkv_bias", False)) or bool(f.get("add_bias_linear", False)),
        o_bias=bool(f.get("add_bias_linear", False)),
        mlp_bias=bool(f.get("add_bias_linear", False)),
        norm_type="rms" if f.get("rmsnorm", True) else "layer",
        tie_embeddings=False,  # ChatGLMModel keeps a separate output_layer
        max_position_embeddings=int(f.get("seq_length") or 8192),
        dtype=_dtype(f),
    )
    if not f.get("post_layer_norm", True):
        spec = replace(spec, other_params=-spec.norm_params)
    return spec


def chatglm_to_glm(config: dict[str, Any]) -> dict[str, Any]:
    """A GLM-4 ``chatglm`` config as transformers' ``glm`` config (GlmForCausalLM).

    transformers ports GLM-4-9B as model_type ``glm`` (THUDM/glm-4-9b-chat-hf):
    same shapes, q/k/v split from query_key_value, gate_up_proj = dense_h_to_4h,
    partial_rotary_factor 0.5 (ChatGLM rotates half of each head).
    """
    f = ConfigFields(config, "chatglm config")
    heads = int(f.need("num_attention_heads"))
    mqa = bool(f.get("multi_query_attention", False))
    return {
        "model_type": "glm",
        "architectures": ["GlmForCausalLM"],
        "vocab_size": int(f.need("padded_vocab_size")),
        "hidden_size": int(f.need("hidden_size")),
        "intermediate_size": int(f.need("ffn_hidden_size")),
        "num_hidden_layers": int(f.need("num_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.need("multi_query_group_num")) if mqa else heads,
        "head_dim": int(f.need("kv_channels")),
        "attention_bias": bool(f.get("add_qkv_bias", False)),
        "max_position_embeddings": int(f.get("seq_length") or 8192),
        "rms_norm_eps": float(f.get("layernorm_epsilon") or 1.5625e-07),
        "partial_rotary_factor": 0.5,
        "tie_word_embeddings": False,
        "pad_token_id": f.get("pad_token_id"),
        "eos_token_id": f.get("eos_token_id"),
        "torch_dtype": _dtype(f),
    }
