"""Reading configurations people already have, for ``oomless check``.

Formats: LLaMA-Factory training YAML (and WeClone's JSONC settings, which hold
LLaMA-Factory arguments), GLM-4 finetune YAML (LoRA, P-tuning v2, full),
TRL / alignment-handbook recipe YAML, axolotl YAML, a TrainingArguments JSON
with a DeepSpeed JSON, a LLaVA / MoE-LLaVA launch script (``deepspeed
train.py --key value ...``), an accelerate config, and oomless.yaml. Each
reader turns the files into a RunConfig (stating every default it takes),
says which planner knobs the format can express (the others stay fixed in
the search for a fix), and maps a changed RunConfig back to edits of the
same files. Keys no version of the tool knows are warnings that name them
(``--strict``: errors), as a tool may accept keys from versions we did not read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..planner.candidates import KNOBS
from . import foreign_keys as K
from .jsonc import blank
from .shellargs import LaunchCommand, parse_launch, typed


@dataclass
class Source:
    """One file: its text, parsed content and key lines."""

    role: str  # main | deepspeed | training_args | accelerate
    path: Path
    text: str
    fmt: str  # yaml | json | sh
    data: dict[str, Any]
    lines: dict[str, int]
    command: LaunchCommand | None = None  # launch scripts: the parsed command
    undecided: dict[str, int] = field(default_factory=dict)  # Python: non-literal settings

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.path}:{line}" if line else str(self.path)


@dataclass
class Reading:
    """A foreign configuration read as a RunConfig, and how to write changes back."""

    kind: str  # oomless | llamafactory | weclone | glm4 | hf-deepspeed | launch | trl | axolotl | accelerate
    label: str
    sources: dict[str, Source]
    run: dict[str, Any]  # RunConfig input
    fixed: set[str] = field(default_factory=set)
    shardings: tuple[tuple[int, str], ...] | None = None
    notes: list[str] = field(default_factory=list)  # defaults taken, how a setting was read
    warnings: list[str] = field(default_factory=list)  # keys no version of the tool knows
    assumptions: list[str] = field(default_factory=list)  # read, but not (fully) modelled
    facts: dict[str, Any] = field(default_factory=dict)  # for the fix rules (check/rules.py)


def _json_lines(text: str) -> dict[str, int]:
    from .textedit import JsonSpans

    spans = JsonSpans(text)
    return {".".join(p): text.count("\n", 0, start) + 1
            for p, (start, _end) in spans.values.items() if p}


def _json_source(path: Path, role: str, text: str) -> Source:
    plain = blank(text)
    try:
        data = json.loads(plain)
        lines = _json_lines(plain)
    except (ValueError, RecursionError, ConfigError) as err:  # ValueError: JSONDecodeError too
        reason = "nested too deeply" if isinstance(err, RecursionError) else err
        raise ConfigError(f"'{path}' is not valid JSON: {reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"'{path}': expected a JSON object at the top level")
    return Source(role, path, text, "json", data, lines)


def _shell_source(path: Path, role: str, text: str) -> Source:
    cmd = parse_launch(text, str(path))
    data = {key: typed(arg.values) for key, arg in cmd.args.items()}
    lines = {key: arg.line for key, arg in cmd.args.items()}
    return Source(role, path, text, "sh", data, lines, cmd)


def source_from_text(path: Path, role: str, text: str) -> Source:
    """Parse a file's text: JSON (.json/.jsonc, comments allowed), a launch script
    (.sh or a text starting with #!), else YAML."""
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonc", ".json5"):
        return _json_source(path, role, text)
    if suffix == ".py":
        from .scripts.pyscript import read_python

        data, lines, undecided = read_python(text, str(path))
        return Source(role, path, text, "py", data, lines, undecided=undecided)
    if suffix in (".sh", ".bash") or text.startswith("#!"):
        return _shell_source(path, role, text)
    from ..config import parse_yaml_with_lines

    data, lines = parse_yaml_with_lines(text, path)
    return Source(role, path, text, "yaml", data, lines)


def load_source(path: str | Path, role: str) -> Source:
    from ..fileio import MAX_CONFIG_BYTES, read_text

    p = Path(path)
    text = read_text(p, "configuration", ConfigError, MAX_CONFIG_BYTES)  # UTF-8, bounded
    return source_from_text(p, role, text)


def subtree(src: Source, prefix: str) -> dict[str, Any]:
    node: Any = src.data
    for part in filter(None, prefix.split(".")):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def check_keys(src: Source, file_kind: str, prefix: str = "", skip: frozenset[str] = frozenset(),
               reading: Reading | None = None) -> list[str]:
    """Warnings for keys (under ``prefix``) that no version of the file's tools knows;
    notes for keys only older versions accept go to ``reading.notes``."""
    keys = {}
    for key in subtree(src, prefix):
        if key in skip:
            continue
        dotted = f"{prefix}.{key}" if prefix else str(key)
        keys[dotted] = src.where(dotted)
    report = K.judge_keys(keys, file_kind)
    if reading is not None:
        reading.warnings.extend(report.warnings)
        reading.notes.extend(report.notes)
        _undecided_keys(keys, file_kind, reading)
    return report.warnings


def _undecided_keys(keys: dict[str, str], file_kind: str, reading: Reading) -> None:
    """Unknown keys whose names speak of the method, the length or the GPU count: check
    cannot tell what they do (oomless.check.scripts.decide settles or refuses)."""
    from .scripts.flags import undecided

    tools = K.FILE_TOOLS[file_kind]
    unknown = {dotted: where for dotted, where in keys.items()
               if not any(dotted.rsplit(".", 1)[-1] in K.TOOLS[t]["keys"] for t in tools)}
    for item in undecided(unknown):
        entry = {"what": f"unknown key '{item['key']}'", "where": item["where"], "topic": item["topic"],
                 "settles": item["settles"]}
        if entry not in reading.facts.setdefault("undecided", []):
            reading.facts["undecided"].append(entry)


_LF_KEYS = {"finetuning_type", "cutoff_len", "stage", "template", "lora_target", "dataset_dir",
            "quantization_bit", "flash_attn", "pure_bf16", "freeze_vision_tower"}
_TRL_KEYS = {"dataset_mixer", "dataset_name", "dataset_splits", "max_seq_length", "use_peft",
             "max_prompt_length", "beta", "lora_target_modules", "attn_implementation",
             "use_flash_attention_2", "torch_dtype", "load_in_4bit"}
_AXOLOTL_KEYS = {"base_model", "sequence_len", "micro_batch_size", "adapter", "datasets",
                 "sample_packing", "lora_target_linear", "val_set_size"}
_ACCELERATE_KEYS = {"distributed_type", "compute_environment", "num_processes", "mixed_precision"}
_WECLONE_SECTIONS = {"train_sft_args", "train_pt_args", "common_args"}


def _yaml_kind(d: dict[str, Any]) -> str | None:
    keys = set(d)
    if isinstance(d.get("model"), dict) and "_component_" in d["model"]:
        return "torchtune"
    if {"training_args", "data_config", "peft_config", "max_input_length"} & keys:
        return "glm4"
    if len(_AXOLOTL_KEYS & keys) >= 2:
        return "axolotl"
    if len(_ACCELERATE_KEYS & keys) >= 2:
        return "accelerate"
    if _LF_KEYS & keys:
        return "llamafactory"
    if "model_name_or_path" in keys:
        lf_only = K.keys_of("llamafactory") - keys_of_ta() - K.keys_of(*K.TRL, "alignment-handbook")
        return "llamafactory" if keys & lf_only else "trl"
    if "model" in keys:
        return "oomless"
    return None


def keys_of_ta() -> frozenset[str]:
    return K.keys_of(*K.TRAINING_ARGUMENTS)


def detect_kind(src: Source) -> str:
    d = src.data
    kind: str | None = None
    if src.fmt == "sh":
        kind = "launch"
    elif src.fmt == "py":
        kind = "python"
    elif src.fmt == "json":
        if _WECLONE_SECTIONS & set(d):
            kind = "weclone"
        elif {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"} & set(d):
            kind = "deepspeed"
        elif {"per_device_train_batch_size", "output_dir", "gradient_accumulation_steps"} & set(d):
            kind = "training_args"
    else:
        kind = _yaml_kind(d)
    if kind is None:
        raise ConfigError(
            f"'{src.path}': cannot tell which tool this configuration is for; oomless check "
            "reads LLaMA-Factory YAML (model_name_or_path, finetuning_type, ...), WeClone "
            "settings, GLM-4 finetune YAML (data_config, training_args, peft_config), TRL / "
            "alignment-handbook recipes, axolotl YAML (base_model, sequence_len), an accelerate "
            "config, a DeepSpeed JSON (zero_optimization) with a TrainingArguments JSON, a "
            "LLaVA-style launch script (deepspeed train.py --key value), or oomless.yaml")
    return kind


def knob_set(*names: str) -> set[str]:
    """Every planner knob except ``names``: the knobs a format cannot change."""
    return set(KNOBS) - set(names)
