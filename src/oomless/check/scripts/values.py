"""Values of a shell reading: an unknown (only running can tell), a variable, a word."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPU_COUNT_WORDS = ("device_count", "nvidia-smi", "CUDA_VISIBLE_DEVICES", "gpu_count")


@dataclass(frozen=True)
class Unknown:
    """A value only running the script can tell."""

    text: str
    line: int
    why: str

    @property
    def gpu_count(self) -> bool:
        return any(w in self.text for w in GPU_COUNT_WORDS)

    def describe(self) -> str:
        return f"'{self.text}' (line {self.line}) {self.why}"


Value = Any  # str | Unknown | list[str] (arrays)


@dataclass
class Var:
    value: Value
    span: tuple[int, int] | None = None  # where the literal value is written (main file)
    line: int = 0
    at: int = -1  # value[i] is the main file's character at + i (a literal heredoc body)


@dataclass
class Word:
    value: str | Unknown
    span: tuple[int, int] | None
    line: int
    raw: str = ""  # the value with unknown parts kept as marks (see ShellScript.mark)
    end: int = -1  # offset after the word in the main script (-1: elsewhere)


