"""ModelSpec: the architecture facts the memory model needs, torch-free.

A spec comes from the built-in catalog (``oomless.models.catalog``) or from a Hugging
Face ``config.json`` (``oomless.models.hf_config``). Its parameter count is derived
from the shapes below and is checked against transformers' own meta-device
model for every catalog entry (tests/test_catalog_params.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from .quantization import QuantSpec

NormType = Literal["rms", "layer"]
MEMO_MAX_ENTRIES = 100_000  # values memoised per ModelSpec (ModelSpec.cached)


@dataclass(frozen=True)
class LinearSpec:
    """One kind of linear layer inside a decoder layer.

    ``count`` is how many such matrices the layer holds (experts: one per
    expert). ``role`` is attn, mlp, expert, shared_expert or router; only
    experts are sparsely active (``ModelSpec.experts_per_token`` of them).
    """

    name: str  # canonical name: q_proj, k_proj, v_proj, qkv_proj, o_proj, gate_proj, up_proj, gate_up_proj, down_proj, router
    in_features: int
    out_features: int
    bias: bool = False
    count: int = 1
    role: str = "attn"

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features * self.count

    @property
    def params(self) -> int:
        return self.weight_params + (self.out_features * self.count if self.bias else 0)


@dataclass(frozen=True)
class VisionSpec:
    """A vision tower (ViT) plus its projector into the language model.

    ``param_count`` is the tower's and projector's exact count (from the
    real config, see the catalog); the other fields drive activation memory.
    ``tokens_per_image`` is what the language model sees per image, after
    any patch merging; ``patches_per_image`` is what the ViT itself runs on.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int
    tokens_per_image: int
    param_count: int
    mlp_gated: bool = False
    projector_params: int = 0  # the part of param_count that maps vision features into the LM
    kind: str = "vit"  # clip, qwen2_5_vl, qwen2_vl, eva2clip (GLM-4V): which tower layout
    dynamic_resolution: bool = False  # Qwen2-VL family: tokens grow with the image; image_size is a default
    # layer facts the activation model needs (memory/vision.py)
    hidden_act: str = "gelu"  # CLIP and Qwen2-VL: quick_gelu; Qwen2.5-VL: silu (gated)
    norm_type: str = "layer"  # Qwen2.5-VL: rms
    fused_qkv: bool = True  # CLIP: separate q/k/v projections
    class_token: bool = False  # CLIP, EVA2-CLIP: a class token before the patches
    merge_size: int = 1  # Qwen2-VL: 2×2 patches merge into one language-model token
    # the tower's layers checkpoint when the model's gradient_checkpointing_enable() is
    # called (families.json vision_towers; GLM-4V's EVA2-CLIP: no)
    checkpointed: bool = True

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of a decoder-only LLM (optionally MoE and/or vision-language)."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    architecture: str | None = None
    mlp_gated: bool = True  # SwiGLU/GeGLU: gate, up, down; plain: up, down
    hidden_act: str = "silu"  # HF ACT2FN name; gelu_new is a Python formula that keeps 4 tensors
    fused_qkv: bool = False  # one qkv matrix (ChatGLM query_key_value, Phi-3 qkv_proj)
    fused_gate_up: bool = False  # one gate+up matrix (ChatGLM dense_h_to_4h, Phi-3 gate_up_proj)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_type: NormType = "rms"
    norms_per_layer: int = 2  # Gemma-2: 4 (pre and post norms); Phi-2: 1 (parallel block)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    tie_embeddings: bool = False
    lm_head_bias: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    sliding_window_every: int = 1  # 1: every layer; 2: every second layer (Gemma-2)
    # Gemma-2 soft-capping: tanh(x / cap) · cap on the attention scores and on the logits
    attn_logit_softcap: bool = False
    final_logit_softcap: bool = False
    sdpa_supported: bool = True  # transformers has an SDPA path for this class (Gemma-2: no)
    resid_dropout: bool = False  # dropout on the attention and MLP outputs in training (Phi-2)
    # Mixture of experts (0 experts: dense)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # total width of the shared expert MLP
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    num_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek first_k_dense_replace)
    # explicit MoE layer indices when not "all layers after num_dense_layers"
    # (Qwen2-MoE decoder_sparse_step/mlp_only_layers, MoE-LLaVA alternating layers); () = default
    moe_layer_indices: tuple[int, ...] = ()
    vision: VisionSpec | None = None
    other_params: int = 0  # parameters outside the shapes above (learned positions, ...)
    dtype: str = "bfloat16"  # torch_dtype of the released weights
    # ---- pre-quantized checkpoint -------------------------------------------
    # The checkpoint's quantization_config (GPTQ, AWQ, AQLM, HQQ, bitsandbytes, FP8,
    # compressed-tensors, EETQ) as read by models/quantization.py; None: 16-bit
    # weights. Shapes and parameter counts above are those of the unquantized model.
    quantization: QuantSpec | None = None
    # ---------------------------------------------------------------------------
    aliases: tuple[str, ...] = field(default=(), compare=False)
    # what reading the config had to assume (defaults, image size, unknown families);
    # estimates should pass these on in their own assumptions
    assumptions: tuple[str, ...] = field(default=(), compare=False)

    # ---- derived shapes -------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attention_linears(self) -> list[LinearSpec]:
        h = self.hidden_size
        out: list[LinearSpec] = []
        if self.fused_qkv:
            out.append(LinearSpec("qkv_proj", h, self.q_dim + 2 * self.kv_dim, self.qkv_bias))
        else:
            out += [
                LinearSpec("q_proj", h, self.q_dim, self.qkv_bias),
                LinearSpec("k_proj", h, self.kv_dim, self.qkv_bias),
                LinearSpec("v_proj", h, self.kv_dim, self.qkv_bias),
            ]
        out.append(LinearSpec("o_proj", self.q_dim, h, self.o_bias))
        return out

    def _mlp_linears(self, width: int, role: str, count: int = 1) -> list[LinearSpec]:
        h, b = self.hidden_size, self.mlp_bias
        if not self.mlp_gated:
            return [
                LinearSpec("up_proj", h, width, b, count, role),
                LinearSpec("down_proj", width, h, b, count, role),
            ]
        if self.fused_gate_up:
            up = [LinearSpec("gate_up_proj", h, 2 * width, b, count, role)]
        else:
            up = [
                LinearSpec("gate_proj", h, width, b, count, role),
                LinearSpec("up_proj", h, width, b, count, role),
            ]
        return up + [LinearSpec("down_proj", width, h, b, count, role)]

    def mlp_linears(self, moe_layer: bool | None = None) -> list[LinearSpec]:
        """Linears of one layer's MLP; MoE layers: router, experts, shared experts."""
        if moe_layer is None:
            moe_layer = self.is_moe
        if not moe_layer:
            return self._mlp_linears(self.intermediate_size, "mlp")
        h = self.hidden_size
        out = [LinearSpec("router", h, self.num_experts, False, 1, "router")]
        out += self._mlp_linears(self.moe_intermediate_size, "expert", self.num_experts)
        if self.shared_expert_intermediate_size:
            out += self._mlp_linears(self.shared_expert_intermediate_size, "shared_expert")
            if self.shared_expert_gate:
                out.append(LinearSpec("shared_expert_gate", h, 1, False, 1, "router"))
        return out

    def cached(self, key: Any, compute: Any) -> Any:
        """Memoise a value derived from this frozen instance (and ``key``): the
        planner asks for the same shapes and activations per candidate. Kept
        outside the dataclass fields, so equality, hashing and to_dict are
        unaffected; bounded (cleared past MEMO_MAX_ENTRIES)."""
        cache = self.__dict__.setdefault("_derived_cache", {})
        if key not in cache:
            if len(cache) >= MEMO_MAX_ENTRIES:
                cache.clear()
            cache[key] = compute()
        return cache[key]

    def layer_linears(self, moe_layer: bool | None = None) -> list[LinearSpec]:
        return list(self.cached(("layer_linears", moe_layer), lambda: tuple(
            self.attention_linears() + self.mlp_linears(moe_layer))))

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        if self.moe_layer_indices:
            return len(self.moe_layer_indices)
        return self.num_layers - self.num_dense_layers

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) has a mixture-of-experts MLP."""
        if not self.is_moe:
            return False
        if self.moe_layer_indices:
            return index in self.moe_layer_indices
        return index >= self.num_dense_layers

    # ---- parameter counts ----------------------------------------------
    @property
    def norm_params(self) -> int:
        """Parameters of one norm over hidden_size (LayerNorm has a bias)."""
        return self.hidden_size * (2 if self.norm_type == "layer" else 1)

    def layer_params(self, moe_layer: bool | None = None) -> int:
        qk = 2 * self.head_dim if self.qk_norm else 0
        linears = sum(lin.params for lin in self.layer_linears(moe_layer))
        return linears + self.norms_per_layer * self.norm_params + qk

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        if self.tie_embeddings:
            return 0
        return self.vocab_size * self.hidden_size + (self.vocab_size if self.lm_head_bias else 0)

    @property
    def decoder_params(self) -> int:
        dense = self.num_layers - self.num_moe_layers
        return dense * self.layer_params(False) + self.num_moe_layers * self.layer_params(True)

    @property
    def language_params(self) -> int:
        return (
            self.embedding_params
            + self.lm_head_params
            + self.decoder_params
            + self.norm_params  # final norm
            + self.other_params
        )

    @property
    def param_count(self) -> int:
        """All parameters, vision tower included (tied embeddings counted once)."""
        return self.cached("param_count", lambda: self.language_params + (
            self.vision.param_count if self.vision else 0))

    @property
    def active_param_count(self) -> int:
        """Parameters used per token (MoE: only experts_per_token experts)."""
        if not self.is_moe:
            return self.param_count
        per_expert = sum(
            lin.params // lin.count for lin in self.mlp_linears(True) if lin.role == "expert"
        )
        idle = (self.num_experts - self.experts_per_token) * per_expert * self.num_moe_layers
        return self.param_count - idle

    # ---- serialisation ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        d["moe_layer_indices"] = list(self.moe_layer_indices)
        d["assumptions"] = list(self.assumptions)
        d["quantization"] = self.quantization.to_dict() if self.quantization else None
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if kwargs.get("vision"):
            kwargs["vision"] = VisionSpec(**kwargs["vision"])
        if kwargs.get("quantization"):
            kwargs["quantization"] = QuantSpec.from_dict(kwargs["quantization"])
        kwargs["aliases"] = tuple(kwargs.get("aliases", ()))
        kwargs["moe_layer_indices"] = tuple(kwargs.get("moe_layer_indices", ()))
        kwargs["assumptions"] = tuple(kwargs.get("assumptions", ()))
        return cls(**kwargs)
