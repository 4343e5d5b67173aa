"""MoE + LoRA under PEFT 0.21 and transformers 5: the merged expert copies.

transformers 5 stores a layer's experts as 3-D parameters (``MixtralExperts.gate_up_proj``
of shape experts × 2·intermediate × hidden, ``down_proj`` experts × hidden × intermediate),
which are not ``nn.Linear``. For the model types whose experts transformers fused this
way (``conversion_mapping._MODEL_TO_CONVERSION_PATTERN`` → mixtral or qwen2_moe, plus
mixtral itself), PEFT rewrites the LoRA targets of the v4 layout
(``peft/utils/transformers_weight_conversion.py``, ``_convert_peft_config_moe``):
``all-linear`` — or any expert projection named in a target list — becomes
``target_parameters`` ``gate_up_proj``, ``down_proj`` and ``gate.weight`` (the router),
with the rank of the fused ``gate_up_proj`` doubled (``rank_pattern``: r × 2).

Each targeted parameter is wrapped by ``lora.ParamWrapper`` (peft/tuners/lora/layer.py):
its adapter has ``r·experts`` rows (lora_A: in → r·E, lora_B: r·E → out), and in every
forward ``_LoraFactorsProxy`` folds it into the weight with
``torch.baddbmm(W, lhs, rhs)`` through ``nn.utils.parametrize``. That merged weight is a
full copy of the layer's expert stack in the weight's dtype, it requires grad (through
the factors), so the expert matmuls keep it, and also their inputs (the routed tokens
and the activation product), for backward. Per MoE layer the step therefore keeps a
second copy of every expert weight: ≈ 2× the memory of a frozen-expert LoRA run on
Mixtral. qwen2_moe itself is not in the conversion table, so its experts stay frozen.
"""

from __future__ import annotations

from ..config import RunConfig
from ..models.spec import ModelSpec
from .precision import Dtypes

# model types whose fused experts PEFT re-targets as parameters (transformers 5.23
# conversion_mapping._MODEL_TO_CONVERSION_PATTERN entries for mixtral / qwen2_moe, and
# PEFT's own addition of "mixtral")
PEFT_FUSED_EXPERT_MODEL_TYPES = frozenset({
    "mixtral", "minimax", "minimax_m2", "afmoe", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "dots1", "ernie4_5_moe", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "longcat_flash",
    "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "hunyuan_v1_moe", "flex_olmo", "olmoe",
    "exaone_moe", "cohere2_moe", "solar_open", "mellum", "beam",
})
# the v4 module names PEFT maps onto the fused expert parameters and the router
_EXPERT_TARGETS = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate"})


def wraps_experts(spec: ModelSpec, cfg: RunConfig) -> bool:
    """Whether PEFT wraps this model's fused expert parameters for ``cfg``'s LoRA."""
    if cfg.method == "full" or not spec.is_moe or spec.model_type not in PEFT_FUSED_EXPERT_MODEL_TYPES:
        return False
    targets = cfg.lora.targets
    return targets == "all-linear" or bool(_EXPERT_TARGETS & set(targets))


def is_fused_expert_target(spec: ModelSpec, name: str) -> bool:
    """Whether ``name`` in a LoRA target list becomes a fused expert (or router) parameter."""
    return spec.is_moe and spec.model_type in PEFT_FUSED_EXPERT_MODEL_TYPES and name in _EXPERT_TARGETS


def _wrapped_parts(cfg: RunConfig) -> set[str]:
    """Which fused parameters PEFT wraps: gate_up, down, router."""
    targets = cfg.lora.targets
    names = _EXPERT_TARGETS if targets == "all-linear" else set(targets)
    parts = set()
    if names & {"gate_proj", "up_proj", "w1", "w3"}:
        parts.add("gate_up")
    if names & {"down_proj", "w2"}:
        parts.add("down")
    if "gate" in names:
        parts.add("router")
    return parts


def _part_params(spec: ModelSpec, r: int) -> dict[str, int]:
    """LoRA parameters of each wrapped part of one MoE layer (r·E rows per factor)."""
    h, inter, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    gated = 2 if spec.mlp_gated else 1
    return {
        "gate_up": (gated * r) * e * (h + gated * inter),  # rank doubled for the fused gate+up
        "down": r * e * (inter + h),
        "router": r * (h + e),
    }


def expert_adapter_params(spec: ModelSpec, cfg: RunConfig) -> int:
    if not wraps_experts(spec, cfg):
        return 0
    parts = _part_params(spec, cfg.lora.r)
    return spec.num_moe_layers * sum(parts[p] for p in _wrapped_parts(cfg))


def merged_expert_saved_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, t: int) -> int:
    """What one MoE layer keeps for backward on top of a frozen-expert layer: the merged
    copy of each wrapped expert parameter (in the weight's dtype), the routed input of
    the matmul that uses it (the merged weight needs it for its gradient) and the
    16-bit casts of the LoRA factors (``get_delta_factors``)."""
    if not wraps_experts(spec, cfg):
        return 0
    k, h, inter, e = spec.experts_per_token, spec.hidden_size, spec.moe_intermediate_size, \
        spec.num_experts
    gated = 2 if spec.mlp_gated else 1
    parts = _wrapped_parts(cfg) - {"router"}
    sizes = _part_params(spec, cfg.lora.r)
    weight = {"gate_up": gated * inter * h * e, "down": inter * h * e}
    routed_input = {"gate_up": t * k * h, "down": t * k * inter}
    cast = dt.base_weight_bytes if dt.trainable_bytes != dt.base_weight_bytes else 0
    return sum(dt.base_weight_bytes * weight[p] + dt.act_bytes * routed_input[p]
               + cast * sizes[p] for p in parts)


def moe_lora_assumptions(spec: ModelSpec, cfg: RunConfig) -> list[str]:
    if not wraps_experts(spec, cfg):
        return []
    return [
        "MoE + LoRA under PEFT 0.21 / transformers 5: the fused expert weights and the router "
        "are LoRA targets (target_parameters, gate_up rank × 2); every forward folds each "
        "layer's adapters into a merged copy of its expert stack (ParamWrapper, baddbmm), "
        "kept for backward with the routed inputs. List attention modules as targets to "
        "avoid it"
    ]
