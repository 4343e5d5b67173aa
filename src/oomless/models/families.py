"""Family facts: one row per catalog family in ``oomless/data/families.json`` (torch-free).

A row holds everything oomless does differently per family — the LLaMA-Factory
chat template ``plan --out`` writes, whether the checkpoint's own code runs
(``trust_remote_code``), the vision tower kind, the loss, where the facts come
from — and ``vision_towers`` says per tower kind whether its layers checkpoint
when the model's ``gradient_checkpointing_enable()`` is called. Every catalog
family has a complete row (tests/test_families.py walks them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

ROW_KEYS = ("llamafactory_template", "template_note", "remote_code", "vision_tower", "loss",
            "source")
# keys only some rows hold: where the family's checkpoint code puts each part
# (module_parts) and what each trainer's from_pretrained call makes it build (trainer_builds)
OPTIONAL_KEYS = ("module_parts", "trainer_builds")


@dataclass(frozen=True)
class FamilyFacts:
    family: str
    llamafactory_template: str | None  # None: no template is written (template_note says why)
    template_note: str
    remote_code: bool
    vision_tower: str | None  # VisionSpec.kind of the family's vision-language members
    loss: str
    source: str
    # {"language": {"prefix", "model_type"}, "others": {prefix: part}, "source"} or None
    module_parts: dict[str, Any] | None = None
    # {script tool or stack: {"who", "config": {key: value}, "source"}} or None
    trainer_builds: dict[str, Any] | None = None


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    text = resources.files("oomless.data").joinpath("families.json").read_text("utf-8")
    return json.loads(text)


def family_rows() -> dict[str, FamilyFacts]:
    """Every row of the table, by family name."""
    rows = _table()["families"]
    return {name: FamilyFacts(name, **{k: row[k] for k in ROW_KEYS + OPTIONAL_KEYS if k in row})
            for name, row in rows.items()}


def family_facts(family: str) -> FamilyFacts | None:
    """The row of ``family`` (None for a model outside the catalog's families)."""
    return family_rows().get(family)


def tower_checkpointed(kind: str) -> bool:
    """Whether a tower of this kind checkpoints its layers under the model's
    ``gradient_checkpointing_enable()`` (families.json ``vision_towers``); a kind
    the table lacks is read as checkpointed only by the meta-device build."""
    row = _table()["vision_towers"].get(kind)
    if row is None:
        raise KeyError(f"families.json has no vision_towers row for tower kind '{kind}'")
    return bool(row["checkpointed"])


def tower_kinds() -> dict[str, dict[str, Any]]:
    return dict(_table()["vision_towers"])


def own_loss_path(model_type: str) -> str | None:
    """The loss path (memory/stacks.py LOSS_PATHS name) of a model type whose own forward
    computes the loss (remote code), or None: transformers' loss of the installed release."""
    row = _table().get("own_loss", {}).get(model_type)
    return row["loss_path"] if row else None


def own_eager_attention(model_type: str) -> str | None:
    """The eager-attention kernel (allocator/attention_blocks.py KERNELS name) of a model type
    whose own code runs its own eager attention (families.json own_attention), or None:
    transformers' ``eager_attention_forward``."""
    row = _table().get("own_attention", {}).get(model_type)
    return row["eager"] if row else None


def own_attention_rows() -> dict[str, dict[str, Any]]:
    return dict(_table().get("own_attention", {}))
