"""PEFT ``modules_to_save``: which parts of a model a list of module names copies.

PEFT (peft/utils/other.py ``_set_trainable``) wraps every module whose full name ends
with a listed name (``key.endswith(name)``) in a ``ModulesToSaveWrapper``: the original
module is frozen and a ``copy.deepcopy`` of it is trained in its place. The analytic
spec has no module tree, so a name is read by its last component as the part it names
in the models' code (families.json ``saved_module_names``): the input embedding, the
LM head, the multi-modal projector (MiniCPM-V's resampler) or the vision tower. The
parameters of each copy come from the spec's exact counts (torch-free).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from ..errors import ConfigError
from .spec import ModelSpec

PARTS = ("embedding", "lm_head", "projector", "vision tower")


@dataclass(frozen=True)
class SavedPart:
    name: str  # the name as listed (embed_tokens, resampler, vpm, ...)
    part: str  # one of PARTS
    params: int  # parameters of the trainable copy


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    text = resources.files("oomless.data").joinpath("families.json").read_text("utf-8")
    return json.loads(text)["saved_module_names"]


def projector_inside_tower() -> tuple[str, ...]:
    """Tower kinds whose tower module holds the projector (Qwen2-VL's visual.merger)."""
    return tuple(_table()["projector_inside_tower"])


def part_names() -> dict[str, tuple[str, ...]]:
    """part -> the module names the models' code gives it."""
    return {part: tuple(names) for part, names in _table()["parts"].items()}


def _part_of(name: str) -> str | None:
    last = name.rsplit(".", 1)[-1]
    for part, names in part_names().items():
        if last in names:
            return part
    return None


def _copy_params(spec: ModelSpec, part: str) -> int | None:
    """Parameters of a deep copy of ``part`` (None: the model has no such part). The LM
    head's copy is a full vocab × hidden matrix even where it is tied to the embedding
    (the copy's weight is its own)."""
    vision = spec.vision
    if part == "embedding":
        return spec.vocab_size * spec.hidden_size
    if part == "lm_head":
        return spec.vocab_size * (spec.hidden_size + int(spec.lm_head_bias))
    if vision is None:
        return None
    if part == "projector":
        return vision.projector_params
    inside = vision.kind in projector_inside_tower()
    return vision.param_count - (0 if inside else vision.projector_params)


def saved_parts(spec: ModelSpec, names: list[str] | tuple[str, ...]) -> tuple[SavedPart, ...]:
    """The parts of ``spec`` the listed ``modules_to_save`` copy, one per name (a part
    listed twice is copied once, as PEFT wraps a module once). A name that names no part
    of this model is a user error naming the names that do."""
    out: dict[str, SavedPart] = {}
    for name in names:
        part = _part_of(name)
        params = _copy_params(spec, part) if part else None
        if params is None:
            raise ConfigError(
                f"lora.modules_to_save: '{name}' names no part of {spec.name} that oomless "
                f"can size; it knows {known_names(spec)} (the input embedding, the LM head"
                + (", the projector and the vision tower" if spec.vision else "")
                + "); remove the name or use one of these")
        if part not in out:
            out[part] = SavedPart(name, part, params)
    if "vision tower" in out and spec.vision.kind in projector_inside_tower():
        out.pop("projector", None)  # copied with the tower that holds it
    return tuple(out.values())


def known_names(spec: ModelSpec) -> str:
    parts = PARTS if spec.vision else PARTS[:2]
    return ", ".join(n for p in parts for n in part_names()[p])


def copies_note(parts: tuple[SavedPart, ...]) -> str:
    """What the estimate counts for the copies, in words."""
    words = {"embedding": "input embedding", "lm_head": "LM head"}
    return ("PEFT modules_to_save: a trainable copy of " + ", ".join(
        f"{p.name} ({words.get(p.part, p.part)}, {p.params:,} parameters)" for p in parts)
        + " next to the frozen original")
