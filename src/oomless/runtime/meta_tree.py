"""The module tree of a model built on the meta device, read into a ModelSpec.

The decoder layers are the largest ``ModuleList`` of repeated blocks outside vision
modules; each layer's linears are read by name, widths from their shapes; experts are a
``ModuleList`` or fused 3-D parameters, with their router; norms, q/k norms, tied
embeddings and the lm_head bias come from the modules. Parameters the layer shapes do
not express stay in ``ModelSpec.other_params`` (the count is exact) and are said.
Entry: :func:`spec_from_model` (called by oomless.runtime.meta.meta_spec).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..errors import ModelConfigError
from ..models.spec import ModelSpec

ATTN_SPLIT = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "query": "q", "key": "k", "value": "v",
              "wq": "q", "wk": "k", "wv": "v"}
ATTN_FUSED = ("qkv_proj", "query_key_value", "W_pack", "c_attn", "Wqkv", "wqkv", "qkv")
ATTN_OUT = ("o_proj", "out_proj", "dense", "c_proj", "wo", "proj")
MLP_GATE = ("gate_proj", "w1")
MLP_UP = ("up_proj", "w3", "fc1", "c_fc", "dense_h_to_4h", "fc_in")
MLP_FUSED = ("gate_up_proj",)
MLP_DOWN = ("down_proj", "w2", "fc2", "dense_4h_to_h", "fc_out")
EXPERT_KEYS = ("experts",)
SHARED_KEYS = ("shared_expert", "shared_experts", "shared_mlp")
TOLERANCE = 0.01  # parameters outside the modelled shapes above 1% of the total are said


def count_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


def _layers(model: Any) -> tuple[str, Any]:
    """(name, ModuleList) of the language layers: the ModuleList of repeated blocks holding
    the most parameters outside any vision module."""
    import torch

    best, best_n = None, -1
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < 1:
            continue
        if any(w in name.lower() for w in ("vision", "visual", "vit", "image", "audio")):
            continue
        n = sum(p.numel() for p in mod.parameters())
        # layers may mix classes (Mllama: self- and cross-attention layers)
        if n > best_n and any(isinstance(m, torch.nn.Linear) for m in mod[0].modules()):
            best, best_n = (name, mod), n
    if best is None:
        raise ModelConfigError("the model has no list of decoder layers oomless can read")
    return best


def _linears(layer: Any) -> dict[str, Any]:
    """Last-name -> nn.Linear of a layer, outside its experts."""
    import torch

    out = {}
    for name, mod in layer.named_modules():
        parts = name.split(".")
        if any(p in EXPERT_KEYS for p in parts) or any(p in SHARED_KEYS for p in parts):
            continue
        if isinstance(mod, torch.nn.Linear):
            out.setdefault(parts[-1], mod)
    return out


def _experts(layer: Any, hidden: int = 0) -> dict[str, Any]:
    """Experts of a layer: count, width, router; {} for a dense layer."""
    import torch

    for name, mod in layer.named_modules():
        if name.split(".")[-1] not in EXPERT_KEYS:
            continue
        if isinstance(mod, torch.nn.ModuleList):
            lin = _linears_all(mod[0])
            down = _first(lin, MLP_DOWN)
            return {"num_experts": len(mod), "width": down.in_features if down else 0,
                    "gated": _first(lin, MLP_GATE) is not None or "gate_up_proj" in lin}
        params = dict(mod.named_parameters(recurse=False))
        down = params.get("down_proj", params.get("w2"))
        if down is None or down.dim() != 3:
            continue
        gate_up = params.get("gate_up_proj")
        width = next((d for d in down.shape[1:] if d != hidden), hidden)
        return {"num_experts": int(down.shape[0]), "width": int(width),
                "gated": gate_up is not None and 2 * width in gate_up.shape[1:]
                or "gate_proj" in params}
    return {}


def _shared(layer: Any) -> int:
    for name, mod in layer.named_modules():
        if name.split(".")[-1] in SHARED_KEYS:
            down = _first(_linears_all(mod), MLP_DOWN)
            return down.in_features if down is not None else 0
    return 0


def _linears_all(module: Any) -> dict[str, Any]:
    import torch

    return {n.split(".")[-1]: m for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


def _first(linears: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((linears[n] for n in names if n in linears), None)


def _norms(layer: Any, hidden: int) -> tuple[int, str, bool]:
    """(norms over hidden_size, 'rms' or 'layer', q/k norms present)."""
    count, kind, qk = 0, "rms", False
    for name, mod in layer.named_modules():
        if "norm" not in type(mod).__name__.lower() or not hasattr(mod, "weight"):
            continue
        w = getattr(mod, "weight", None)
        if w is None:
            continue
        if w.shape[-1] == hidden and "q_norm" not in name and "k_norm" not in name:
            count += 1
            kind = "layer" if getattr(mod, "bias", None) is not None else kind
        elif name.split(".")[-1] in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
            qk = True
    return count, kind, qk


ROUTER = ("gate", "router", "wg", "shared_expert_gate")
KNOWN_LINEARS = frozenset((*ATTN_SPLIT, *ATTN_FUSED, *ATTN_OUT, *MLP_GATE, *MLP_UP, *MLP_FUSED,
                           *MLP_DOWN, *ROUTER))


def _attention_fields(lin: dict[str, Any], text: Any, hidden: int) -> dict[str, Any]:
    heads = int(text.num_attention_heads)
    stated = getattr(text, "head_dim", None)
    head_dim = int(stated or hidden // heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    q, k = _first(lin, ("q_proj", "query", "wq")), _first(lin, ("k_proj", "key", "wk"))
    fused, out = _first(lin, ATTN_FUSED), _first(lin, ATTN_OUT)
    if q is not None:
        head_dim = head_dim if stated else q.out_features // heads
        kv = k.out_features // head_dim if k is not None else kv
    elif fused is not None:
        kv = max(1, (fused.out_features // head_dim - heads) // 2)
    bias_src = q if q is not None else fused
    return {"num_heads": heads, "num_kv_heads": kv, "head_dim": head_dim,
            "fused_qkv": q is None and fused is not None,
            "qkv_bias": bias_src is not None and bias_src.bias is not None,
            "o_bias": out is not None and out.bias is not None}


def _mlp_fields(lin: dict[str, Any], width: int) -> dict[str, Any]:
    gate, up = _first(lin, MLP_GATE), _first(lin, MLP_UP)
    fused, down = _first(lin, MLP_FUSED), _first(lin, MLP_DOWN)
    fused_gate_up = fused is not None or (gate is None and up is not None
                                          and up.out_features == 2 * width)
    return {"mlp_gated": gate is not None or fused_gate_up, "fused_gate_up": fused_gate_up,
            "mlp_bias": down is not None and down.bias is not None}


def _moe_fields(layers: Any, text: Any, hidden: int) -> dict[str, Any]:
    moe = [i for i, layer in enumerate(layers) if _experts(layer, hidden)]
    if not moe:
        return {}
    first = layers[moe[0]]
    facts = _experts(first, hidden)
    top_k = next((getattr(text, k) for k in ("num_experts_per_tok", "moe_k", "top_k",
                                            "num_experts_per_token", "moe_topk")
                  if isinstance(getattr(text, k, None), int)), 0)
    if not top_k:
        raise ModelConfigError("a mixture-of-experts model whose config states no experts per "
                               "token (num_experts_per_tok / moe_k / top_k)")
    shared = _shared(first)
    out: dict[str, Any] = {"num_experts": int(facts["num_experts"]), "experts_per_token": top_k,
                           "moe_intermediate_size": int(facts["width"]), "_gated": facts["gated"]}
    if shared:
        out.update(shared_expert_intermediate_size=shared, num_shared_experts=1,
                   shared_expert_gate="shared_expert_gate" in _linears_all(first))
    if moe != list(range(moe[0], len(layers))):
        out["moe_layer_indices"] = tuple(moe)
    else:
        out["num_dense_layers"] = moe[0]
    return out


def _unknown_linears(layers: Any) -> list[str]:
    seen: set[str] = set()
    for layer in layers:
        seen |= {n for n in _linears_all(layer) if n not in KNOWN_LINEARS}
    return sorted(seen)


def spec_from_model(model: Any, config_obj: Any, name: str) -> ModelSpec:
    """The ModelSpec of a meta-device model, its parameter count exact (other_params)."""
    text = config_obj.get_text_config() if hasattr(config_obj, "get_text_config") else config_obj
    emb = model.get_input_embeddings()
    vocab, hidden = (int(x) for x in emb.weight.shape)
    head = model.get_output_embeddings()
    lname, layers = _layers(model)
    with_attn = [ly for ly in layers
                 if _first(_linears(ly), ("q_proj", "query", "wq", *ATTN_FUSED)) is not None]
    ref = next((ly for ly in with_attn if not _experts(ly)), with_attn[0] if with_attn else layers[0])
    lin = _linears(ref)
    moe = _moe_fields(layers, text, hidden)
    experts_gated = moe.pop("_gated", None)
    down = _first(lin, MLP_DOWN)
    width = down.in_features if down is not None else moe.get("moe_intermediate_size", 0)
    mlp = _mlp_fields(lin, width)
    if down is None and experts_gated is not None:  # every layer MoE: the experts' layout
        mlp.update(mlp_gated=experts_gated, fused_gate_up=False)
    norms, norm_type, qk = _norms(ref, hidden)
    spec = ModelSpec(
        name=name, model_type=str(config_obj.model_type),
        architecture=type(model).__name__, vocab_size=vocab, hidden_size=hidden,
        num_layers=len(layers), intermediate_size=int(width or 1),
        hidden_act=str(getattr(text, "hidden_act", None) or getattr(text, "hidden_activation",
                                                                     None) or "silu"),
        norm_type=norm_type, norms_per_layer=max(1, norms), qk_norm=qk,
        tie_embeddings=head is None or head.weight is emb.weight,
        lm_head_bias=head is not None and getattr(head, "bias", None) is not None,
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 4096),
        dtype=str(getattr(config_obj, "dtype", None) or "bfloat16").removeprefix("torch."),
        **_attention_fields(lin, text, hidden), **mlp, **moe)
    return _exact(spec, model, layers, len(with_attn), lname)


def _exact(spec: ModelSpec, model: Any, layers: Any, attn_layers: int, lname: str) -> ModelSpec:
    total = count_params(model)
    rest = total - spec.param_count
    notes = [f"structure read from the model's own code on the meta device "
             f"({type(model).__name__}: {total:,} parameters, {len(layers)} layers in {lname})"]
    if abs(rest) > TOLERANCE * total:
        notes.append(f"{rest:,} parameters ({100 * rest / total:+.1f}%) are outside the layer "
                     "shapes the formulas model (a vision tower, projector or other modules): "
                     "counted in the weights; their activations are not modelled")
    ckpt = _checkpointing_note(model, layers, lname)
    if ckpt:
        notes.append(ckpt)
    unknown = _unknown_linears(layers)
    if attn_layers < len(layers) or unknown:
        what = (f"{len(layers) - attn_layers} of {len(layers)} layers have no q/k/v attention"
                if attn_layers < len(layers) else "")
        what = "; ".join(x for x in (what, f"linears {', '.join(unknown)}" if unknown else "") if x)
        notes.append(f"the formulas lack an operation of this family ({what}): activations are "
                     "estimated as the layers the formulas know; `oomless trace` runs the real code")
    return replace(spec, other_params=spec.other_params + rest, assumptions=tuple(notes))


def _checkpointing_note(model: Any, layers: Any, lname: str) -> str:
    """Whether gradient_checkpointing_enable() reaches the layers, from the code: the
    class's supports_gradient_checkpointing, and each layer a GradientCheckpointingLayer
    (transformers ≥ 4.52) or a holder with its own gradient_checkpointing flag (remote code,
    the older convention); "" when it does."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return (f"{type(model).__name__} does not support gradient checkpointing "
                "(supports_gradient_checkpointing is False): with grad_ckpt on, transformers "
                "raises; estimate it without")
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: the holder's flag is the convention
        GradientCheckpointingLayer = ()  # noqa: N806
    holder = model.get_submodule(lname.rsplit(".", 1)[0]) if "." in lname else model
    if isinstance(layers[0], GradientCheckpointingLayer) or hasattr(holder, "gradient_checkpointing"):
        return ""
    return (f"{type(layers[0]).__name__} is not a GradientCheckpointingLayer and {lname}'s "
            "holder has no gradient_checkpointing flag: whether checkpointing reaches these "
            "layers is not known from the code (`oomless trace` runs it)")


