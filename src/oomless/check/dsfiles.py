"""DeepSpeed JSON files that configurations point to: ZeRO stage, offload, and the
facts the fix rules need (an own ``optimizer`` block, CPU-Adam enforcement).

Shipped files, by (ZeRO stage, offload), are what a fix may switch to: the
configuration then names a file that exists in the user's checkout of the tool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .sources import Reading, Source, check_keys, load_source

LF_DEEPSPEED = {(0, "none"): "examples/deepspeed/ds_z0_config.json",
                (2, "none"): "examples/deepspeed/ds_z2_config.json",
                (2, "optimizer"): "examples/deepspeed/ds_z2_offload_config.json",
                (3, "none"): "examples/deepspeed/ds_z3_config.json",
                (3, "all"): "examples/deepspeed/ds_z3_offload_config.json"}
GLM_DEEPSPEED = {(2, "none"): "configs/ds_zero_2.json", (3, "none"): "configs/ds_zero_3.json"}
# LLaVA and MoE-LLaVA scripts/ (MoE-LLaVA also ships zero2_offload.json)
LLAVA_DEEPSPEED = {(2, "none"): "./scripts/zero2.json", (3, "none"): "./scripts/zero3.json",
                   (3, "all"): "./scripts/zero3_offload.json"}
MOE_LLAVA_DEEPSPEED = {**LLAVA_DEEPSPEED, (2, "optimizer"): "./scripts/zero2_offload.json"}
# axolotl deepspeed_configs/
AXOLOTL_DEEPSPEED = {(1, "none"): "deepspeed_configs/zero1.json",
                     (2, "none"): "deepspeed_configs/zero2.json",
                     (3, "none"): "deepspeed_configs/zero3_bf16.json",
                     (3, "all"): "deepspeed_configs/zero3_bf16_cpuoffload_all.json"}
# Shipped files that carry their own "optimizer" block (HF then ignores `optim`)
SHIPPED_WITH_OPTIMIZER = {"configs/ds_zero_3.json", "./scripts/zero3_offload.json"}


def zero_from_deepspeed(ds: dict[str, Any], where: str) -> tuple[int, str]:
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage == "auto" or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"{where}: zero_optimization.stage {stage!r}: expected 0, 1, 2 or 3")
    dev = lambda k: ((zero.get(k) or {}).get("device") or "none")  # noqa: E731
    offload = "none"
    if dev("offload_optimizer") in ("cpu", "nvme"):
        offload = "optimizer"
    if dev("offload_param") in ("cpu", "nvme"):
        offload = "all"
    if offload == "all" and stage != 3:
        offload = "optimizer"  # DeepSpeed offloads parameters only under ZeRO-3
    return stage, offload


def deepspeed_facts(ds: dict[str, Any]) -> dict[str, Any]:
    """What the fix rules need from a DeepSpeed file (check/rules.py)."""
    return {"ds_optimizer_block": isinstance(ds.get("optimizer"), dict),
            "ds_force_cpu_optimizer": ds.get("zero_force_ds_cpu_optimizer", True) is not False}


def read_deepspeed(src: Source, reading: Reading) -> tuple[int, str]:
    """Stage and offload of a DeepSpeed file; its unknown ZeRO keys become warnings."""
    from ..memory.zero_buffers import from_deepspeed_json

    check_keys(src, "deepspeed:zero_optimization", "zero_optimization", reading=reading)
    reading.facts.update(deepspeed_facts(src.data))
    # ZeRO's buffer sizes (reduce_bucket_size, prefetch, ...) for the estimate
    reading.facts["deepspeed"] = from_deepspeed_json(src.data.get("zero_optimization") or {})
    return zero_from_deepspeed(src.data, str(src.path))


def _candidates(ref: str, base: Path) -> list[Path]:
    ref_path = Path(ref)
    out = [ref_path, base.parent / ref]
    for parent in list(base.resolve().parents)[:4]:
        out += [parent / ref, parent / ref_path.name]
    return out


def deepspeed_source(ref: str, base: Path, shipped: dict[tuple[int, str], str],
                     reading: Reading) -> tuple[Source | None, tuple[int, str]]:
    """The DeepSpeed file a configuration points to (relative to the working directory,
    the configuration or its parent folders), or, when it is not here, its stage and
    offload from a shipped file of the same name."""
    for cand in _candidates(ref, base):
        if cand.is_file():
            src = load_source(cand, "deepspeed")
            return src, read_deepspeed(src, reading)
    for (stage, offload), name in shipped.items():
        if Path(ref).name == Path(name).name:
            reading.notes.append(f"deepspeed file '{ref}' is not on this machine: read as the "
                                 f"shipped {name} (ZeRO-{stage}, offload {offload})")
            reading.facts.update(ds_optimizer_block=name in SHIPPED_WITH_OPTIMIZER,
                                 ds_force_cpu_optimizer=True)
            return None, (stage, offload)
    raise ConfigError(f"deepspeed: '{ref}' not found (looked in the working directory and "
                      f"next to {base}); give the path to the DeepSpeed JSON")
