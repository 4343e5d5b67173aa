"""A shape-faithful stand-in for GLM-4V-9B, for traces only (not part of oomless).

GLM-4V's vision tower is remote code (THUDM/glm-4v-9b visual.py) that cannot be
imported without trust_remote_code. This module re-creates its shapes and its
order of operations in plain torch, written from reading that file: a 14-pixel
patch convolution, a class token and learned positions; transformer layers that
normalise the *outputs* of attention and MLP (``x + LN(attn(x))``,
``x + LN(mlp(x))``), fused ``query_key_value`` with bias, SDPA without a mask,
a GELU MLP; then the class token dropped, a 2×2 stride-2 convolution into the
language model's width, a GLU projector (linear, LayerNorm, GELU, SiLU-gated
MLP of the language model's FFN width) and boi/eoi tokens around the image.
The language model is transformers' GLM-4 port (``glm``: q/k/v split from
ChatGLM's query_key_value) running GLM-4V's own attention and loss, written from
THUDM/glm-4v-9b modeling_chatglm.py of mid-2024: SelfAttention builds CoreAttention
whatever attn_implementation says (THUDM/GLM-4#420), which repeats the two key/value
groups to every head (contiguous copies), scores into a preallocated buffer with
``baddbmm``, upcasts them to fp32, scales by the layer number, masks with a bool
causal mask of its own and takes an fp32 softmax cast back to bf16
(``chatglm_core_attention``); ChatGLMForConditionalGeneration upcasts the logits,
takes a contiguous copy of the shifted ones into CrossEntropyLoss and casts the
logits back to bf16 (``Glm4vShell.forward``). The image features take the place
of as many placeholder positions. Weights are random; only shapes and ops matter
for memory.
Used by tests/runtime/test_trace_glm4v.py, benchmarks/accuracy.py and
benchmarks/gpu_runs.py (its GPU measurement and the trace it is compared with).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

CHATGLM_ATTENTION = "chatglm_core"


def chatglm_core_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                           dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """GLM-4V's SelfAttention (multi-query repeat) and CoreAttention.forward, op by op:
    query (b, heads, s, d), key/value (b, groups, s, d); returns (b, s, heads, d)."""
    b, heads, sq, hn = query.shape
    groups = key.shape[1]
    key = key.unsqueeze(2).expand(-1, -1, heads // groups, -1, -1).contiguous()
    value = value.unsqueeze(2).expand(-1, -1, heads // groups, -1, -1).contiguous()
    key, value = key.view(b, heads, sq, hn), value.view(b, heads, sq, hn)
    coeff = module.layer_idx + 1  # apply_query_key_layer_scaling: coeff = layer_number
    q = query.reshape(b * heads, sq, hn)
    buffer = torch.empty(b * heads, sq, sq, dtype=q.dtype, device=q.device)
    result = torch.baddbmm(buffer, q, key.view(b * heads, sq, hn).transpose(1, 2), beta=0.0,
                           alpha=1.0 / (math.sqrt(hn) * coeff))
    scores = result.view(b, heads, sq, sq).float()  # attention_softmax_in_fp32
    scores = scores * coeff
    mask = torch.ones(b, 1, sq, sq, device=scores.device, dtype=torch.bool)
    mask.tril_()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = F.softmax(scores, dim=-1).type_as(value)  # attention_dropout 0: no-op
    context = torch.bmm(probs.view(b * heads, sq, sq), value.view(b * heads, sq, hn))
    return context.view(b, heads, sq, hn).transpose(1, 2).contiguous(), None


class PatchEmbedding(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        h = vc["hidden_size"]
        self.proj = nn.Conv2d(vc.get("in_channels", 3), h, kernel_size=vc["patch_size"],
                              stride=vc["patch_size"])
        self.cls_embedding = nn.Parameter(torch.zeros(1, h))
        self.position_embedding = nn.Embedding(vc["num_positions"], h)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)
        cls = self.cls_embedding.expand(x.shape[0], -1, -1)
        return torch.cat((cls, x), dim=1) + self.position_embedding.weight.unsqueeze(0)


class Attention(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        self.heads = vc["num_heads"]
        self.query_key_value = nn.Linear(vc["hidden_size"], 3 * vc["hidden_size"])
        self.dense = nn.Linear(vc["hidden_size"], vc["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.query_key_value(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.dense(out.transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vc["hidden_size"], vc["intermediate_size"])
        self.fc2 = nn.Linear(vc["intermediate_size"], vc["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        eps = vc.get("layer_norm_eps", 1e-6)
        self.input_layernorm = nn.LayerNorm(vc["hidden_size"], eps=eps)
        self.attention = Attention(vc)
        self.mlp = Mlp(vc)
        self.post_attention_layernorm = nn.LayerNorm(vc["hidden_size"], eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.input_layernorm(self.attention(x))
        return x + self.post_attention_layernorm(self.mlp(x))


class Glu(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_proj = nn.Linear(hidden, hidden, bias=False)
        self.norm1 = nn.LayerNorm(hidden)
        self.dense_h_to_4h = nn.Linear(hidden, ffn, bias=False)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.dense_4h_to_h = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(self.linear_proj(x)))
        return self.dense_4h_to_h(F.silu(self.gate_proj(x)) * self.dense_h_to_4h(x))


class Eva2ClipTower(nn.Module):
    def __init__(self, vc: dict[str, Any], hidden: int, ffn: int) -> None:
        super().__init__()
        self.patch_embedding = PatchEmbedding(vc)
        self.layers = nn.ModuleList(Layer(vc) for _ in range(vc["num_hidden_layers"]))
        self.linear_proj = Glu(hidden, ffn)
        self.conv = nn.Conv2d(vc["hidden_size"], hidden, kernel_size=2, stride=2)
        self.boi = nn.Parameter(torch.zeros(1, 1, hidden))
        self.eoi = nn.Parameter(torch.zeros(1, 1, hidden))
        self.scaling_factor = vc.get("scaling_factor", 8)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(images)
        for layer in self.layers:
            x = layer(x)
        x = x[:, 1:]
        b, n, h = x.shape
        side = int(n ** 0.5)
        x = self.conv(x.reshape(b, side, side, h).permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)
        x = self.linear_proj(x)
        x = torch.cat((self.boi.expand(b, -1, -1), x, self.eoi.expand(b, -1, -1)), dim=1)
        return x / self.scaling_factor


class Glm4vShell(nn.Module):
    """GLM-4's language model with the EVA2-CLIP tower in front of it."""

    def __init__(self, lm: nn.Module, vision_config: dict[str, Any]) -> None:
        super().__init__()
        self.lm = lm
        cfg = lm.config
        self.vision = Eva2ClipTower(vision_config, cfg.hidden_size, cfg.intermediate_size)

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> Any:
        from types import SimpleNamespace

        embeds = self.lm.get_input_embeddings()(input_ids)
        features = self.vision(images.to(embeds.dtype))
        embeds = torch.cat((embeds[:, :1], features, embeds[:, 1 + features.shape[1]:]), dim=1)
        lm_logits = self.lm(inputs_embeds=embeds).logits
        lm_logits = lm_logits.to(torch.float32)
        shift_logits = lm_logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = nn.CrossEntropyLoss(ignore_index=-100)(
            shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        lm_logits = lm_logits.to(embeds.dtype)
        return SimpleNamespace(loss=loss.to(embeds.dtype), logits=lm_logits)


def build_fake_shell(chatglm_config: dict[str, Any], cfg: Any, lm_layers: int | None = None,
                     tower_layers: int | None = None) -> tuple[nn.Module, int]:
    """The shell on fake tensors with LoRA on the language model's q/k/v and, when
    ``vision.freeze_tower`` is off, on the tower's query_key_value; returns (model, the
    language model's layers)."""
    from oomless.runtime.build import fake_mode, fakeify

    model, layers = _meta_shell(chatglm_config, cfg, lm_layers, tower_layers)
    fakeify(model, fake_mode())
    return model, layers


def build_real_shell(chatglm_config: dict[str, Any], cfg: Any, device: str,
                     lm_layers: int | None = None,
                     tower_layers: int | None = None) -> tuple[nn.Module, int]:
    """The same shell with real random weights on ``device`` (a GPU measurement of it)."""
    model, layers = _meta_shell(chatglm_config, cfg, lm_layers, tower_layers)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model, layers


def _meta_shell(chatglm_config: dict[str, Any], cfg: Any, lm_layers: int | None,
                tower_layers: int | None) -> tuple[nn.Module, int]:
    from peft import LoraConfig, get_peft_model
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    from oomless.models.hf_decoder import chatglm_to_glm
    from oomless.runtime.build import base_dtype

    AttentionInterface.register(CHATGLM_ATTENTION, chatglm_core_attention)

    glm = chatglm_to_glm(chatglm_config)
    if lm_layers:
        glm["num_hidden_layers"] = lm_layers
    vc = dict(chatglm_config["vision_config"])
    if tower_layers:
        vc["num_hidden_layers"] = tower_layers
    config = AutoConfig.for_model(**glm)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=base_dtype(cfg),
                                              attn_implementation=CHATGLM_ATTENTION)
        model = Glm4vShell(lm, vc).to(base_dtype(cfg))
    if cfg.grad_ckpt:  # GLMTransformer checkpoints each layer (use_reentrant=False)
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.requires_grad_(False)
    targets = ["q_proj", "k_proj", "v_proj"]
    if not cfg.vision.freeze_tower:
        targets.append("query_key_value")
    with torch.device("meta"):
        model = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                 lora_dropout=cfg.lora.dropout,
                                                 target_modules=targets))
    return model, config.num_hidden_layers


def shell_batch(model: nn.Module, vision_config: dict[str, Any], seq: int,
                image_tokens: int, device: str | None = None) -> dict[str, torch.Tensor]:
    """Inputs: ``seq`` text positions and one image (fake ones when called in fake mode)."""
    vocab = model.get_input_embeddings().num_embeddings
    side = vision_config["image_size"]
    ids = torch.randint(0, vocab, (1, seq + image_tokens), device=device)
    return {"input_ids": ids, "labels": ids.clone(),
            "images": torch.randn((1, 3, side, side), dtype=torch.float32, device=device)}


def trace_full_shell(cfg: Any) -> tuple[Any, Any]:
    """The shell at full size (GLM-4V-9B's catalog config) traced as ``cfg`` runs it,
    its micro batch's rows the same sample repeated: (TraceStats, the shell's spec —
    transformers' GLM-4 port with GLM-4V's tower, eager CoreAttention and own loss)."""
    import dataclasses

    from oomless.memory.vision import image_tokens
    from oomless.models.catalog import get_entry, resolve_model
    from oomless.models.hf_config import spec_from_hf_config
    from oomless.models.hf_decoder import chatglm_to_glm
    from oomless.runtime.build import fake_mode
    from oomless.runtime.trace.module_trace import trace_module

    config = get_entry("glm-4v-9b").config
    glm4v = resolve_model("glm-4v-9b").spec
    spec = dataclasses.replace(spec_from_hf_config(chatglm_to_glm(config), "glm-4v-9b (shell)"),
                               vision=glm4v.vision, model_type=glm4v.model_type,
                               sdpa_supported=glm4v.sdpa_supported)
    model, layers = build_fake_shell(config, cfg)
    with fake_mode():
        one = shell_batch(model, config["vision_config"], cfg.seq_len, image_tokens(spec, cfg))
        batch = {k: torch.cat([v] * cfg.micro_batch_size) for k, v in one.items()}
    del one
    stats = trace_module(model, cfg, batch, num_layers=layers, loss_fn=lambda m, b: m(**b).loss)
    return stats, spec
