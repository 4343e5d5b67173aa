"""Reading configurations people already have, for ``oomless check``.

Formats: LLaMA-Factory training YAML, GLM-4 finetune_demo YAML, a DeepSpeed
JSON with a transformers TrainingArguments JSON, and oomless.yaml. Each reader
turns the files into a RunConfig (stating every default it takes), says which
planner knobs the format can express (the others stay fixed in the search for
a fix), and maps a changed RunConfig back to edits of the same files.
Unknown keys are errors that name the key and its line, as the tools
themselves refuse them (HfArgumentParser, dataclass constructors, DeepSpeed's
pydantic models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..planner.candidates import KNOBS
from . import foreign_keys as K

# Keys older transformers accepted (renamed since); read with a note, not refused.
LEGACY_TRAINING_KEYS = {"evaluation_strategy": "eval_strategy",
                        "no_cuda": "use_cpu", "overwrite_output_dir": None,
                        "logging_dir": None}
GLM_TOP_KEYS = {"data_config", "max_input_length", "max_output_length", "combine", "freezeV",
                "logprob_mode", "training_args", "peft_config", "swanlab"}
GLM_DATA_KEYS = {"train_file", "val_file", "test_file", "num_proc"}
# DeepSpeed configs shipped with the tools, by (ZeRO stage, offload)
LF_DEEPSPEED = {(0, "none"): "examples/deepspeed/ds_z0_config.json",
                (2, "none"): "examples/deepspeed/ds_z2_config.json",
                (2, "optimizer"): "examples/deepspeed/ds_z2_offload_config.json",
                (3, "none"): "examples/deepspeed/ds_z3_config.json",
                (3, "all"): "examples/deepspeed/ds_z3_offload_config.json"}
GLM_DEEPSPEED = {(2, "none"): "configs/ds_zero_2.json", (3, "none"): "configs/ds_zero_3.json"}


@dataclass
class Source:
    """One file: its text, parsed content and key lines."""

    role: str  # main | deepspeed | training_args
    path: Path
    text: str
    fmt: str  # yaml | json
    data: dict[str, Any]
    lines: dict[str, int]

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.path}:{line}" if line else str(self.path)


@dataclass
class Reading:
    """A foreign configuration read as a RunConfig, and how to write changes back."""

    kind: str  # oomless | llamafactory | glm4 | hf-deepspeed
    label: str
    sources: dict[str, Source]
    run: dict[str, Any]  # RunConfig input
    fixed: set[str] = field(default_factory=set)
    shardings: tuple[tuple[int, str], ...] | None = None
    notes: list[str] = field(default_factory=list)


def _json_lines(text: str) -> dict[str, int]:
    from .textedit import _JsonSpans

    spans = _JsonSpans(text)
    return {".".join(p): text.count("\n", 0, start) + 1
            for p, (start, _end) in spans.values.items() if p}


def source_from_text(path: Path, role: str, text: str) -> Source:
    """Parse a file's text (JSON by its .json suffix, else YAML) with key lines."""
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
            lines = _json_lines(text)
        except (ValueError, RecursionError, ConfigError) as err:  # ValueError: JSONDecodeError too
            reason = "nested too deeply" if isinstance(err, RecursionError) else err
            raise ConfigError(f"'{path}' is not valid JSON: {reason}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"'{path}': expected a JSON object at the top level")
        return Source(role, path, text, "json", data, lines)

    from ..config import parse_yaml_with_lines

    data, lines = parse_yaml_with_lines(text, path)
    return Source(role, path, text, "yaml", data, lines)


def load_source(path: str | Path, role: str) -> Source:
    from ..fileio import MAX_CONFIG_BYTES, read_text

    p = Path(path)
    text = read_text(p, "configuration", ConfigError, MAX_CONFIG_BYTES)  # UTF-8, bounded
    return source_from_text(p, role, text)


def unknown_keys(src: Source, known: set[str] | frozenset[str], prefix: str = "",
                 notes: list[str] | None = None) -> list[str]:
    """Problems 'FILE:LINE: unknown key K' for keys of src (under prefix) not in known."""
    node = src.data
    for part in filter(None, prefix.split(".")):
        node = node.get(part) or {}
    out = []
    for key in node:
        if key in known:
            continue
        dotted = f"{prefix}{key}" if not prefix else f"{prefix}.{key}"
        dotted = dotted.lstrip(".")
        if key in LEGACY_TRAINING_KEYS and notes is not None:
            new = LEGACY_TRAINING_KEYS[key]
            notes.append(f"{src.where(dotted)}: '{key}' is a key of older transformers"
                         + (f" (now '{new}')" if new else "") + "; read as such")
            continue
        out.append(f"{src.where(dotted)}: unknown key '{dotted}'")
    return out


def raise_unknown(problems: list[str], label: str) -> None:
    if problems:
        raise ConfigError(f"{label}: keys the tool does not accept (it would refuse them "
                          "too):\n  " + "\n  ".join(problems))


def detect_kind(src: Source) -> str:
    d = src.data
    if src.fmt == "json":
        if {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"} & set(d):
            return "deepspeed"
        if {"per_device_train_batch_size", "output_dir", "gradient_accumulation_steps"} & set(d):
            return "training_args"
    else:
        if {"training_args", "data_config", "peft_config", "max_input_length"} & set(d):
            return "glm4"
        if {"model_name_or_path", "finetuning_type", "cutoff_len", "stage"} & set(d):
            return "llamafactory"
        if "model" in d:
            return "oomless"
    raise ConfigError(
        f"'{src.path}': cannot tell which tool this configuration is for; oomless check "
        "reads LLaMA-Factory YAML (model_name_or_path, finetuning_type, ...), GLM-4 "
        "finetune YAML (data_config, training_args, peft_config), a DeepSpeed JSON "
        "(zero_optimization) with a TrainingArguments JSON, or oomless.yaml (model: ...)")


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


def deepspeed_source(ref: str, base: Path, known: dict[tuple[int, str], str],
                     notes: list[str]) -> tuple[Source | None, tuple[int, str]]:
    """The DeepSpeed file a YAML points to (relative to the working directory or the
    YAML), or, when it is not here, its stage and offload from a shipped file name."""
    for cand in (Path(ref), base.parent / ref):
        if cand.is_file():
            src = load_source(cand, "deepspeed")
            raise_unknown(unknown_keys(src, K.DEEPSPEED_ZERO_KEYS, "zero_optimization"),
                          "DeepSpeed JSON")
            return src, zero_from_deepspeed(src.data, str(cand))
    for (stage, offload), name in known.items():
        if Path(ref).name == Path(name).name:
            notes.append(f"deepspeed file '{ref}' is not on this machine: read as the shipped "
                         f"{name} (ZeRO-{stage}, offload {offload})")
            return None, (stage, offload)
    raise ConfigError(f"deepspeed: '{ref}' not found (looked in the working directory and "
                      f"next to {base}); give the path to the DeepSpeed JSON")


def knob_set(*names: str) -> set[str]:
    return set(KNOBS) - set(names)
