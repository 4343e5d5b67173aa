"""DeepSpeed JSON files that configurations point to: ZeRO stage, offload, and the
facts the fix rules need (an own ``optimizer`` block, CPU-Adam enforcement).

Shipped files, by (ZeRO stage, offload), are what a fix may switch to where the
user's checkout has them (:func:`deepspeed_ref`); elsewhere the fix writes a new
DeepSpeed file next to the configuration and points to it.
"""

from __future__ import annotations

import json
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .sources import Reading, Source, check_keys, load_source, source_from_text

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


def repo_root(start: Path) -> Path | None:
    """The nearest folder at or above ``start`` that holds ``.git`` (a checkout)."""
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return folder
    return None


def _folders_up(base: Path) -> list[Path]:
    """The configuration's folder and its parents up to the repository root (without
    one: up to the working directory when the file is below it, else 4 levels)."""
    here = base.resolve().parent
    up = [here, *here.parents]
    root = repo_root(here)
    cwd = Path.cwd().resolve()
    stop = root if root is not None else (cwd if cwd in up else None)
    return up[: up.index(stop) + 1] if stop is not None else up[:4]


def candidates(ref: str, base: Path) -> list[Path]:
    """Where a file that a configuration names is looked up, in order: the working
    directory (where the tool runs), next to the configuration (also by its base
    name), then the configuration's parent folders up to the repository root."""
    ref_path = Path(ref).expanduser()
    if ref_path.is_absolute():
        return [ref_path]
    folders = _folders_up(base)
    out = [ref_path, folders[0] / ref_path, folders[0] / ref_path.name]
    return out + [folder / ref_path for folder in folders[1:]]


# Files a fix is about to write ({resolved path: text}), seen by the read-back of the fix
PENDING: ContextVar[dict[Path, str] | None] = ContextVar("pending_deepspeed_files", default=None)


def _pending_source(cand: Path) -> Source | None:
    text = (PENDING.get() or {}).get(cand.resolve())
    return source_from_text(cand, "deepspeed", text) if text is not None else None


def deepspeed_source(ref: str, base: Path, shipped: dict[tuple[int, str], str],
                     reading: Reading) -> tuple[Source | None, tuple[int, str]]:
    """The DeepSpeed file a configuration points to (looked up as :func:`candidates`
    says), or, when it is not here, its stage and offload from a shipped file of the
    same name."""
    for cand in candidates(ref, base):
        src = _pending_source(cand)
        if src is None and cand.is_file():
            src = load_source(cand, "deepspeed")
        if src is not None:
            return src, read_deepspeed(src, reading)
    for (stage, offload), name in shipped.items():
        if Path(ref).name == Path(name).name:
            reading.notes.append(f"deepspeed file '{ref}' is not on this machine: read as the "
                                 f"shipped {name} (ZeRO-{stage}, offload {offload})")
            reading.facts.update(ds_optimizer_block=name in SHIPPED_WITH_OPTIMIZER,
                                 ds_force_cpu_optimizer=True)
            return None, (stage, offload)
    raise ConfigError(f"deepspeed: '{ref}' not found (looked in the working directory, next "
                      f"to {base} and in its parent folders up to the repository root); give "
                      "the path to the DeepSpeed JSON")


# ---- the DeepSpeed file a fix points to ---------------------------------------------------
def deepspeed_text(zero: int, offload: str) -> str:
    """A DeepSpeed JSON for the HF Trainer (transformers integrations/deepspeed.py): every
    value the Trainer fills from its TrainingArguments is "auto" (batch sizes, clipping,
    precision, buckets), so the file cannot disagree with the arguments. With offload,
    an ``optimizer`` block makes DeepSpeed build its CPU-Adam (runtime/engine.py refuses
    a client optimizer under ZeRO-Offload)."""
    z: dict[str, Any] = {"stage": zero, "overlap_comm": False, "contiguous_gradients": True,
                         "reduce_bucket_size": "auto"}
    if zero == 3:
        z.update({"stage3_prefetch_bucket_size": "auto",
                  "stage3_param_persistence_threshold": "auto",
                  "stage3_gather_16bit_weights_on_model_save": True})
    if offload in ("optimizer", "all"):
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "all":
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds: dict[str, Any] = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": z,
    }
    if offload != "none":
        ds["optimizer"] = {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    return json.dumps(ds, indent=2) + "\n"


def _says(path: Path, zero: int, offload: str) -> bool:
    try:
        src = load_source(path, "deepspeed")
        return zero_from_deepspeed(src.data, str(path)) == (zero, offload)
    except ConfigError:
        return False


def _as_written(path: Path) -> str:
    """``path`` as a configuration names it: relative to the working directory (where
    the tool is started) when below it, else absolute."""
    rel = os.path.relpath(path.resolve())
    return Path(rel).as_posix() if not rel.startswith("..") else path.resolve().as_posix()


def deepspeed_ref(shipped: dict[tuple[int, str], str], zero: int, offload: str,
                  reading: Reading) -> str | None:
    """The DeepSpeed file a fix to (``zero``, ``offload``) points to, by a path that
    exists: the tool's shipped file where it is found (looked up as :func:`candidates`
    says) and says that stage and offload, else a new file next to the configuration,
    recorded in ``reading.facts["new_files"]`` for ``--write`` to create."""
    if not zero:
        return None
    config = reading.sources["main"].path
    name = shipped.get((zero, offload))
    if name is not None:
        found = next((c for c in candidates(name, config) if c.is_file()), None)
        if found is not None and _says(found, zero, offload):
            return name if Path(name).is_file() and found == Path(name) else _as_written(found)
    stem = f"ds_z{zero}" + ("" if offload == "none" else f"_offload_{offload}")
    target = config.parent / (Path(name).name if name else f"{stem}_config.json")
    if target.exists() and not _says(target, zero, offload):
        target = config.parent / f"{stem}_oomless.json"
    if not target.exists():
        reading.facts.setdefault("new_files", {})[str(target)] = deepspeed_text(zero, offload)
    return _as_written(target)
