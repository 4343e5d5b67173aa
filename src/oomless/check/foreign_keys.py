"""Argument names of the tools ``oomless check`` reads, from data/foreign_keys.json.

The JSON is generated from the tools' own argument classes by
tests/check/gen_foreign_keys.py (its ``sources`` field says which versions).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

_DATA: dict[str, Any] = json.loads(
    resources.files("oomless.data").joinpath("foreign_keys.json").read_text(encoding="utf-8"))

SOURCES: tuple[str, ...] = tuple(_DATA["sources"])
LLAMAFACTORY_KEYS = frozenset(_DATA["llamafactory_keys"])
LLAMAFACTORY_CHOICES: dict[str, list[Any]] = _DATA["llamafactory_choices"]
TRAINING_ARGUMENTS_KEYS = frozenset(_DATA["training_arguments_keys"])
SEQ2SEQ_EXTRA_KEYS = frozenset(_DATA["seq2seq_extra_keys"])
PEFT_LORA_KEYS = frozenset(_DATA["peft_lora_keys"])
DEEPSPEED_ZERO_KEYS = frozenset(_DATA["deepspeed_zero_keys"])
