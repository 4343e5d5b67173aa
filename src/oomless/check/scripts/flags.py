"""Flags of training scripts by meaning (data/script_flags.json).

Each row of the table names a flag, what it means (LoRA on, rank, 4-bit base,
ZeRO stage, offload, lengths, which parts train, ...), the tools whose argument
classes define it and where. A script's tool is recognised by its program (the
script's file name, the module, the CLI) and the flags only that tool has; the
tool's own defaults (from the same argument classes) fill what the script does
not say. A flag no table knows whose name holds a word about the method, the
length or the GPU count is undecided: check says it cannot tell (see
:func:`undecided`), never guesses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import PurePosixPath
from typing import Any

_DATA: dict[str, Any] = json.loads(
    resources.files("oomless.data").joinpath("script_flags.json").read_text(encoding="utf-8"))
MEANINGS: dict[str, str] = _DATA["meanings"]
ROWS: list[dict[str, Any]] = _DATA["flags"]
TOOLS: dict[str, dict[str, Any]] = _DATA["tools"]
MEMORY_WORDS: list[dict[str, str]] = _DATA["memory_words"]


@dataclass(frozen=True)
class Setting:
    meaning: str
    key: str  # the flag as the script (or the tool's default) writes it
    value: Any
    default: bool  # from the tool's argument classes, not from the script


def flags_of(tool: str | None) -> frozenset[str]:
    """Flags the table knows for ``tool`` (every tool's when None)."""
    return frozenset(r["flag"] for r in ROWS if tool is None or tool in r["tools"])


def meaning_of(key: str, tool: str | None) -> str | None:
    rows = [r for r in ROWS if r["flag"] == key]
    mine = [r for r in rows if tool in r["tools"]]
    return (mine or rows or [{"meaning": None}])[0]["meaning"]


def detect_tool(program: str, keys: set[str]) -> str | None:
    """The tool whose program this is and whose own flags the script uses most."""
    name = PurePosixPath(program).name
    best, score = None, 0
    for tool, row in TOOLS.items():
        if any(program.startswith(m) for m in row.get("module", ())) or program in row.get(
                "cli", ()):
            return tool
        if name not in row.get("script", ()):
            continue
        marks = len(keys & set(row["marks"]))
        if marks > score:
            best, score = tool, marks
    return best


def detect_tool_by_marks(keys: set[str]) -> str | None:
    """The tool of a file that names no program (a TrainingArguments JSON): the one with
    at least two of its own flags in the file."""
    score = {tool: len(keys & set(row["marks"])) for tool, row in TOOLS.items()}
    best = max(score, key=score.__getitem__)
    return best if score[best] >= 2 else None


def settings(args: dict[str, Any], tool: str | None) -> dict[str, Setting]:
    """meaning -> Setting, from the script's flags over the tool's defaults."""
    out: dict[str, Setting] = {}
    defaults = TOOLS[tool]["defaults"] if tool else {}
    for source, is_default in ((defaults, True), (args, False)):
        for key, value in source.items():
            meaning = meaning_of(key, tool)
            if meaning is not None:
                out[meaning] = Setting(meaning, key, value, is_default)
    return out


def memory_word(key: str) -> dict[str, str] | None:
    """The memory word a flag's name holds (its topic and the option that settles it)."""
    low = key.lower()
    return next((w for w in MEMORY_WORDS if w["word"] in low), None)


def undecided(unknown_keys: dict[str, str]) -> list[dict[str, str]]:
    """``unknown_keys``: key -> 'FILE:LINE' of keys no tool that reads the file knows.
    Those whose names speak of the method, the length or the GPU count."""
    out = []
    for key, where in unknown_keys.items():
        word = memory_word(key)
        if word is not None:
            out.append({"key": key, "where": where, "topic": word["topic"],
                        "settles": word["settles"]})
    return out
