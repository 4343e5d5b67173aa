"""Rules a fix must obey to work in the tool that runs it and to save memory.

Each rule names the situation, what it forbids, and where the fact comes from
(docs/check-rules.md has the quotes). ``oomless check`` asks the planner for
several candidate changes and keeps the first one no rule forbids; the
sharding rules also narrow the search up front.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import RunConfig
from ..knobs import OPTIMIZERS
from ..models.spec import ModelSpec


@dataclass(frozen=True)
class RuleContext:
    facts: dict[str, Any]  # Reading.facts: DeepSpeed optimizer block, DeepSpeed-MoE, ...
    spec: ModelSpec
    world_size: int
    fits_gpu: bool  # the configuration as written fits the GPU (only the headroom is missed)


@dataclass(frozen=True)
class FixRule:
    code: str
    forbids: str
    source: str
    broken: Callable[[RunConfig, RunConfig, RuleContext], bool]  # (old, new, ctx) -> refused


def _bnb(cfg: RunConfig) -> bool:
    return OPTIMIZERS[cfg.optimizer].needs_cuda


def deepspeed_moe(ctx: RuleContext) -> bool:
    return bool(ctx.facts.get("deepspeed_moe")) or ctx.spec.name.startswith("moe-llava")


def no_deepspeed_model(ctx: RuleContext) -> bool:
    return ctx.spec.model_type in ("glm4v", "chatglm") and ctx.spec.vision is not None


RULES: tuple[FixRule, ...] = (
    FixRule("ds_optimizer_block",
            "changing `optim` when the DeepSpeed file has its own optimizer block",
            "transformers integrations/deepspeed.py deepspeed_optim_sched (@3a80c16): with an "
            "`optimizer` block the Trainer passes DummyOptim and never builds `optim`",
            lambda old, new, ctx: bool(ctx.facts.get("ds_optimizer_block"))
            and new.optimizer != old.optimizer),
    FixRule("offload_cpu_adam",
            "a bitsandbytes (8-bit or paged) optimizer with DeepSpeed optimizer offload",
            "DeepSpeed runtime/engine.py (@b555aa5): offload steps with DeepSpeedCPUAdam and "
            "raises ZeRORuntimeException on a client optimizer; bitsandbytes has no CPU "
            "optimizer (bitsandbytes#1402)",
            lambda old, new, ctx: new.offload != "none" and _bnb(new)
            and (new.offload != old.offload or new.optimizer != old.optimizer)),
    FixRule("moe_zero3", "ZeRO-3 for a model with DeepSpeed-MoE layers (MoE-LLaVA)",
            "DeepSpeed runtime/engine.py _configure_zero_optimizer: assert not "
            "self.has_moe_layers, \"MoE not supported with Stage 3\"; MoE-LLaVA#20 "
            "(maintainer: use zero2_offload instead of zero3)",
            lambda old, new, ctx: deepspeed_moe(ctx) and new.zero == 3 and old.zero != 3),
    FixRule("glm4v_no_deepspeed", "adding DeepSpeed for GLM-4V",
            "GLM-4 finetune/README.md (@3d5f3fa): \"GLM-4V-9B fine-tuning cannot work properly "
            "with deepspeed\"; zai-org/GLM-4#325 (maintainer: cannot be split, one card needs 75G)",
            lambda old, new, ctx: no_deepspeed_model(ctx) and new.zero > old.zero),
    FixRule("no_saving_precision", "switching between fp16 and bf16 (the same bytes)",
            "both are 2 bytes per element: the switch saves nothing",
            lambda old, new, ctx: {old.precision, new.precision} == {"bf16", "fp16"}),
    FixRule("no_saving_sharding", "a lower ZeRO stage or less offload",
            "each ZeRO stage shards more than the one below; offload moves states off the GPU: "
            "going back can only hold more per GPU",
            lambda old, new, ctx: new.zero < old.zero or _offload_rank(new) < _offload_rank(old)),
    FixRule("headroom_light", "ZeRO-3 or offload for a single-GPU adapter run that only misses "
            "the headroom",
            "policy: a few percent over the headroom is fixed by the batch split, not by "
            "sharding machinery that slows every step",
            lambda old, new, ctx: ctx.fits_gpu and ctx.world_size == 1
            and old.method in ("lora", "qlora")
            and (new.zero == 3 and old.zero != 3 or new.offload != old.offload)),
)


def _offload_rank(cfg: RunConfig) -> int:
    return ("none", "optimizer", "all").index(cfg.offload)


def broken_rules(old: RunConfig, new: RunConfig, ctx: RuleContext) -> list[FixRule]:
    return [rule for rule in RULES if rule.broken(old, new, ctx)]


def allowed_shardings(old: RunConfig, ctx: RuleContext,
                      shardings: tuple[tuple[int, str], ...] | None
                      ) -> tuple[tuple[int, str], ...] | None:
    """The (ZeRO, offload) pairs a fix may use, before the search (None: any)."""
    every = [(z, o) for z in (0, 1, 2, 3) for o in ("none", "optimizer", "all")
             if (o == "none" or z > 0) and (o != "all" or z == 3)]
    base = list(shardings) if shardings is not None else every
    probe = old.model_copy()
    kept = []
    for zero, offload in base:
        new = probe.model_copy(update={"zero": zero, "offload": offload})
        if not any(rule.broken(old, new, ctx) for rule in RULES
                   if rule.code in ("moe_zero3", "glm4v_no_deepspeed", "no_saving_sharding",
                                    "headroom_light")):
            kept.append((zero, offload))
    if (old.zero, old.offload) not in kept:
        kept.append((old.zero, old.offload))
    return tuple(kept)


def config_warnings(cfg: RunConfig, ctx: RuleContext) -> list[str]:
    """What the configuration as written runs into, by the same facts as the rules."""
    out = []
    if no_deepspeed_model(ctx) and cfg.zero > 0:
        out.append(f"{ctx.spec.name} with DeepSpeed ZeRO-{cfg.zero}: GLM-4's finetune README says "
                   "\"GLM-4V-9B fine-tuning cannot work properly with deepspeed\"; its LoRA needs "
                   "about 75 GB on one GPU and cannot be split (zai-org/GLM-4#325)")
    if deepspeed_moe(ctx) and cfg.zero == 3:
        out.append("DeepSpeed-MoE layers under ZeRO-3: DeepSpeed asserts \"MoE not supported "
                   "with Stage 3\"; use ZeRO-2 (with optimizer offload for more room)")
    if cfg.offload != "none" and _bnb(cfg) and ctx.facts.get("ds_force_cpu_optimizer", True):
        out.append(f"optim {cfg.optimizer} with DeepSpeed optimizer offload: DeepSpeed raises "
                   "ZeRORuntimeException for a client optimizer (set an optimizer block, or "
                   "zero_force_ds_cpu_optimizer: false with a CPU-capable optimizer)")
    return out
