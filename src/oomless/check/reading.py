"""Which reader reads which files, and the edits that write a change back.

One file: LLaMA-Factory, WeClone, GLM-4, TRL recipe, axolotl, launch script,
accelerate config, DeepSpeed or TrainingArguments JSON, oomless.yaml. Two
files: a TrainingArguments JSON with a DeepSpeed JSON, or a configuration with
the accelerate config it is launched with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from .readers_axolotl import axolotl_edits, read_axolotl
from .readers_glm import glm_edits, read_glm4
from .readers_hf import hf_edits, read_hf_deepspeed
from .readers_lf import llamafactory_edits, read_llamafactory, read_weclone, weclone_edits
from .readers_trl import accelerate_edits, apply_accelerate, read_accelerate, read_trl, trl_edits
from .scripts.reader import (
    read_json_by_meaning,
    read_python_script,
    read_script,
    script_edits,
)
from .scripts.torchtune import read_torchtune, torchtune_edits
from .sources import Reading, Source, detect_kind

Edits = list[tuple[str, tuple, Any]]


@dataclass(frozen=True)
class ReadOptions:
    model: str | None = None
    method: str | None = None
    seq_len: int | None = None


_ONE_FILE: dict[str, Callable[[Source, str | None], Reading]] = {
    "llamafactory": read_llamafactory, "weclone": read_weclone, "glm4": read_glm4,
    "trl": read_trl, "axolotl": read_axolotl, "launch": read_script,
    "python": read_python_script, "torchtune": read_torchtune,
}


def read_sources(sources: list[Source], opts: ReadOptions) -> Reading:
    """The reading of one or two files (see the module docstring)."""
    reading = _read(sources, opts)
    if reading.facts.get("ds_optimizer_block"):
        # transformers' deepspeed_optim_sched: an optimizer block replaces `optim`
        if reading.run.get("optimizer", "adamw") != "adamw":
            reading.warnings.append(f"optim {reading.run['optimizer']} is ignored: the DeepSpeed "
                                    "file's optimizer block builds the optimizer (read as AdamW)")
        reading.run["optimizer"] = "adamw"
        reading.fixed.add("optimizer")
    return reading


def _read(sources: list[Source], opts: ReadOptions) -> Reading:
    if not 1 <= len(sources) <= 2:
        raise ConfigError("oomless check takes one configuration file, or two: a "
                          "TrainingArguments JSON with a DeepSpeed JSON, or a configuration "
                          "with its accelerate config")
    kinds = [detect_kind(s) for s in sources]
    if kinds == ["training_args"]:
        by_meaning = read_json_by_meaning(sources[0], opts.model)
        if by_meaning is not None:
            return by_meaning
    if set(kinds) <= {"deepspeed", "training_args"}:
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"two files must be a DeepSpeed JSON and a TrainingArguments "
                              f"JSON; got {', '.join(kinds)}")
        by = {k: s for k, s in zip(kinds, sources, strict=True)}
        for role, src in by.items():
            src.role = role
        return read_hf_deepspeed(by.get("training_args"), by.get("deepspeed"), opts.model,
                                 opts.method, opts.seq_len)
    if len(sources) == 2:
        return _with_accelerate(sources, kinds, opts)
    if kinds[0] == "accelerate":
        return read_accelerate(sources[0], opts.model, opts.method, opts.seq_len)
    if kinds[0] == "oomless":
        return Reading("oomless", "oomless.yaml", {"main": sources[0]}, dict(sources[0].data))
    return _ONE_FILE[kinds[0]](sources[0], opts.model)


def _with_accelerate(sources: list[Source], kinds: list[str], opts: ReadOptions) -> Reading:
    if kinds.count("accelerate") != 1:
        raise ConfigError(f"two files must be a training configuration and its accelerate "
                          f"config, or a TrainingArguments and a DeepSpeed JSON; got "
                          f"{', '.join(kinds)}")
    acc = sources[kinds.index("accelerate")]
    main_at = 1 - kinds.index("accelerate")
    if kinds[main_at] not in _ONE_FILE:
        raise ConfigError(f"'{sources[main_at].path}' ({kinds[main_at]}) is not launched with "
                          "an accelerate config")
    reading = _ONE_FILE[kinds[main_at]](sources[main_at], opts.model)
    acc.role = "accelerate"
    apply_accelerate(acc, reading)
    return reading


def oomless_edits(cfg: RunConfig, old: RunConfig, reading: Reading, model_type: str) -> Edits:
    from ..planner.plan import KNOBS as PLAN_KNOBS
    from ..planner.plan import _get

    out = []
    for key, _label, _w in PLAN_KNOBS:
        if _get(cfg, key) != _get(old, key):
            out.append(("main", tuple(key.split(".")), _get(cfg, key)))
    return out


_EDITS: dict[str, Callable[[RunConfig, RunConfig, Reading, str], Edits]] = {
    "llamafactory": llamafactory_edits, "weclone": weclone_edits, "glm4": glm_edits,
    "trl": trl_edits, "axolotl": axolotl_edits, "launch": script_edits,
    "python": lambda *a: [], "torchtune": torchtune_edits,
    "hf-deepspeed": hf_edits, "accelerate": accelerate_edits, "oomless": oomless_edits,
}


def edits_for(reading: Reading, new: RunConfig, old: RunConfig, model_type: str) -> Edits:
    if "accelerate" not in reading.sources:
        return _EDITS[reading.kind](new, old, reading, model_type)
    # sharding is the accelerate config's; the rest is the training configuration's
    main = new.model_copy(update={"zero": old.zero, "offload": old.offload})
    return (_EDITS[reading.kind](main, old, reading, model_type)
            + accelerate_edits(new, old, reading, model_type))
