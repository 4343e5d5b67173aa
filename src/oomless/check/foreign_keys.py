"""Argument names of the tools ``oomless check`` reads, per version (data/foreign_keys.json).

The JSON is generated from the tools' own argument classes, in every version
people run, by tests/check/gen_foreign_keys.py. A key is accepted when any of
the tools that read a file accepts it in any version; a key none of them
knows is a warning that names it and the similar keys they do know (the
tools themselves refuse unknown keys, so it is most likely a typo or a key
of another tool), and ``--strict`` turns warnings into a refusal.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..errors import ConfigError

_DATA: dict[str, Any] = json.loads(
    resources.files("oomless.data").joinpath("foreign_keys.json").read_text(encoding="utf-8"))
TOOLS: dict[str, dict[str, Any]] = _DATA["tools"]
LLAMAFACTORY_CHOICES: dict[str, list[Any]] = _DATA["llamafactory_choices"]

# Display names of the key sets
_LABELS = {
    "transformers:TrainingArguments": "transformers TrainingArguments",
    "transformers:Seq2SeqTrainingArguments": "transformers Seq2SeqTrainingArguments",
    "llamafactory": "LLaMA-Factory", "axolotl": "axolotl", "llava": "LLaVA train.py",
    "moe-llava": "MoE-LLaVA train.py", "glm4-finetune": "GLM-4 finetune.py",
    "glm4-finetune:data_config": "GLM-4 finetune.py DataConfig",
    "alignment-handbook": "alignment-handbook", "deepspeed:zero_optimization":
    "DeepSpeed zero_optimization", "accelerate:ClusterConfig": "accelerate config",
    "peft:LoraConfig": "PEFT LoraConfig", "peft:PrefixTuningConfig": "PEFT PrefixTuningConfig",
}

# What each kind of file may hold: the key sets of the tools that read it.
TRAINING_ARGUMENTS = ("transformers:TrainingArguments", "transformers:Seq2SeqTrainingArguments")
TRL = tuple(t for t in TOOLS if t.startswith("trl:"))
FILE_TOOLS: dict[str, tuple[str, ...]] = {
    "llamafactory": ("llamafactory", *TRAINING_ARGUMENTS),
    "glm4": ("glm4-finetune",),
    "glm4:data_config": ("glm4-finetune:data_config",),
    "glm4:training_args": TRAINING_ARGUMENTS,
    "glm4:peft_config": ("peft:LoraConfig", "peft:PrefixTuningConfig"),
    "training_args": (*TRAINING_ARGUMENTS, "llava", "moe-llava"),
    "launch": (*TRAINING_ARGUMENTS, "llava", "moe-llava"),
    "trl": (*TRL, *TRAINING_ARGUMENTS, "alignment-handbook"),
    "axolotl": ("axolotl",),
    "deepspeed:zero_optimization": ("deepspeed:zero_optimization",),
    "accelerate": ("accelerate:ClusterConfig",),
}


def label(tool: str) -> str:
    return _LABELS.get(tool) or tool.replace(":", " ")


def versions_accepting(tool: str, key: str) -> str | None:
    """'4.31.0..5.1.0' style ranges of ``tool`` versions that accept ``key``, or None."""
    return TOOLS[tool]["keys"].get(key)


def keys_of(*tools: str) -> frozenset[str]:
    return frozenset(k for t in tools for k in TOOLS[t]["keys"])


def latest_version(tool: str) -> str:
    return TOOLS[tool]["versions"][-1]


def _span(tool: str) -> str:
    versions = TOOLS[tool]["versions"]
    if versions == ["source"]:
        return label(tool)
    return f"{label(tool)} {versions[0]}–{versions[-1]}"


def similar_keys(key: str, limit: int = 3) -> list[str]:
    """'lora_rank (LLaMA-Factory 0.8.3..0.9.5)': known keys close to ``key``, any tool."""
    owners: dict[str, list[str]] = {}
    for tool, data in TOOLS.items():
        for k in data["keys"]:
            owners.setdefault(k, []).append(tool)
    close = difflib.get_close_matches(key, list(owners), n=limit, cutoff=0.75)
    out = []
    for k in close:
        tool = owners[k][0]
        out.append(f"'{k}' ({label(tool)} {TOOLS[tool]['keys'][k]})")
    return out


def other_tools_knowing(key: str, mine: tuple[str, ...]) -> list[str]:
    return [f"{label(t)} {TOOLS[t]['keys'][key]}" for t in TOOLS
            if t not in mine and key in TOOLS[t]["keys"]]


@dataclass
class KeyReport:
    """Unknown keys (warnings) and keys only some versions accept (notes)."""

    warnings: list[str]
    notes: list[str]


def judge_keys(keys: dict[str, str], file_kind: str) -> KeyReport:
    """``keys``: dotted key -> 'FILE:LINE'. Which of them no version of the file's tools knows."""
    tools = FILE_TOOLS[file_kind]
    warnings: list[str] = []
    notes: list[str] = []
    for dotted, where in keys.items():
        key = dotted.rsplit(".", 1)[-1]
        accepting = [t for t in tools if key in TOOLS[t]["keys"]]
        if not accepting:
            readers = ", ".join(_span(t) for t in tools)
            hint = similar_keys(key)
            elsewhere = other_tools_knowing(key, tools)
            text = f"{where}: unknown key '{dotted}': not an argument of {readers}"
            if elsewhere:
                text += f"; known to {', '.join(elsewhere[:2])}"
            if hint:
                text += f"; similar: {', '.join(hint)}"
            warnings.append(text)
            continue
        newest = [t for t in accepting if TOOLS[t]["versions"] != ["source"]
                  and not TOOLS[t]["keys"][key].endswith(latest_version(t))]
        if newest and len(newest) == len(accepting):
            t = newest[0]
            notes.append(f"{where}: '{dotted}' is an argument of {label(t)} "
                         f"{TOOLS[t]['keys'][key]} (not of {latest_version(t)}): run the file "
                         "with one of those versions")
    return KeyReport(warnings, notes)


def refuse_if_strict(warnings: list[str], strict: bool, what: str) -> None:
    if strict and warnings:
        raise ConfigError(f"{what}: keys the tools that read this file do not know (--strict):"
                          "\n  " + "\n  ".join(warnings))
