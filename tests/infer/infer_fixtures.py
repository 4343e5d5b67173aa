"""Shared helpers of the inference tests: the tiny model and small datasets."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECORDS: list[dict[str, Any]] = [
    {"instruction": "Reverse the string.", "input": "winter", "output": "retniw"},
    {"instruction": "What is the capital of Brazil?", "output": "Brasilia."},
    {"prompt": "Write the word cold in upper case."},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a colour."}]},
    {"conversations": [{"from": "human", "value": "Count to three."},
                       {"from": "gpt", "value": "1, 2, 3"}]},
    {"instruction": "Give the opposite of the word.", "input": "hot", "output": "cold"},
    {"instruction": "Add the numbers.", "input": "2 + 2", "output": "4"},
    {"instruction": "Convert hours to minutes.", "input": "3 h", "output": "180 min"},
    {"instruction": "Spell the word backwards.", "input": "stone", "output": "enots"},
    {"instruction": "How many letters does the word have?", "input": "tree", "output": "4"},
]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
