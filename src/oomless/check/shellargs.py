"""Launch scripts: the arguments of the training command in a shell script.

LLaVA and MoE-LLaVA ship their runs as scripts like
``deepspeed llava/train/train_mem.py --deepspeed ./scripts/zero3.json
--per_device_train_batch_size 16 ...`` with ``\\`` continuations and shell
variables (``--num_experts ${num_experts}``). This module finds that command,
reads every ``--key value`` (HfArgumentParser's syntax: a flag may take
several values, a bare flag means True), resolves variables assigned in the
script, and remembers where each value is written so that a change edits the
same characters (or the variable's assignment).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

_LAUNCHERS = ("deepspeed", "torchrun", "accelerate", "python", "python3", "python -m")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(\"[^\"\n]*\"|'[^'\n]*'|[^\s;#]*)",
                     re.MULTILINE)
_TOKEN = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'[^']*'|[^\s\\]+|\\\n")
_VAR = re.compile(r"^\$\{?([A-Za-z_]\w*)\}?$")


@dataclass
class ShellArg:
    key: str
    values: list[str]
    spans: list[tuple[int, int]]  # where each value is written (or its variable's value)
    line: int


@dataclass
class LaunchCommand:
    launcher: str  # deepspeed | torchrun | accelerate | python
    script: str  # the training script the launcher runs
    launcher_args: dict[str, str] = field(default_factory=dict)
    args: dict[str, ShellArg] = field(default_factory=dict)
    end: int = 0  # offset just after the command's last token


def _unquote(token: str) -> str:
    if len(token) >= 2 and token[0] == token[-1] and token[0] in "\"'":
        return token[1:-1]
    return token


def _assignments(text: str) -> dict[str, tuple[str, tuple[int, int]]]:
    out: dict[str, tuple[str, tuple[int, int]]] = {}
    for m in _ASSIGN.finditer(text):
        start, end = m.span(2)
        raw = m.group(2)
        if raw[:1] in "\"'":
            start, end = start + 1, end - 1
        out[m.group(1)] = (_unquote(raw), (start, end))
    return out


def _tokens(text: str, start: int) -> list[tuple[str, int, int]]:
    """Tokens of the logical line starting at ``start`` (``\\`` continuations joined)."""
    out: list[tuple[str, int, int]] = []
    pos = start
    while pos < len(text):
        nl = text.find("\n", pos)
        line_end = len(text) if nl < 0 else nl
        segment = text[pos:line_end]
        hash_at = re.search(r"(?:^|\s)#", segment)
        stop = pos + hash_at.start() if hash_at else line_end
        continued = False
        for m in _TOKEN.finditer(text, pos, stop + (1 if stop < len(text) else 0)):
            if m.group(0) == "\\\n":
                continued = True
                break
            if m.start() >= stop:
                break
            out.append((m.group(0), m.start(), m.end()))
        if not continued and text[pos:stop].rstrip().endswith("\\"):
            continued = True
            if out and out[-1][0] == "\\":
                out.pop()
        if not continued:
            break
        pos = line_end + 1
    return out


def _command_start(text: str) -> tuple[int, int] | None:
    """(offset of the logical line, index of the launcher token) of the training command."""
    for m in re.finditer(r"(?m)^[^#\n]*?\b(deepspeed|torchrun|accelerate\s+launch|python3?)\s+\S",
                         text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        tokens = _tokens(text, line_start)
        if any(t.endswith(".py") for t, _s, _e in tokens):
            return line_start, 0
    return None


def parse_launch(text: str, where: str) -> LaunchCommand:
    """The training command of a launch script; ConfigError when there is none."""
    found = _command_start(text)
    if found is None:
        raise ConfigError(f"{where}: no training command found (expected a line running "
                          "`deepspeed`, `torchrun`, `accelerate launch` or `python` with a .py "
                          "script and --key value arguments)")
    tokens = _tokens(text, found[0])
    variables = _assignments(text)
    names = [t for t, _s, _e in tokens]
    launch_at = next(i for i, t in enumerate(names)
                     if t in ("deepspeed", "torchrun", "accelerate", "python", "python3"))
    script_at = next(i for i, t in enumerate(names) if t.endswith(".py"))
    cmd = LaunchCommand(names[launch_at], names[script_at], end=tokens[-1][2])
    cmd.launcher_args = _launcher_args(names[launch_at + 1:script_at])
    current: ShellArg | None = None
    for token, start, end in tokens[script_at + 1:]:
        if token.startswith("--"):
            key, _eq, inline = token[2:].partition("=")
            current = ShellArg(key, [], [], text.count("\n", 0, start) + 1)
            cmd.args[key] = current
            if inline:
                current.values.append(inline)
                current.spans.append((start + len(key) + 3, end))
            continue
        if current is None:
            continue
        value, span = _resolve(token, (start, end), variables)
        current.values.append(value)
        current.spans.append(span)
    return cmd


def _resolve(token: str, span: tuple[int, int],
             variables: dict[str, tuple[str, tuple[int, int]]]) -> tuple[str, tuple[int, int]]:
    m = _VAR.match(_unquote(token))
    if m and m.group(1) in variables:
        return variables[m.group(1)]
    if token[:1] in "\"'":
        return _unquote(token), (span[0] + 1, span[1] - 1)
    return token, span


def _launcher_args(tokens: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.startswith("--"):
            key, _eq, inline = t[2:].partition("=")
            if inline:
                out[key] = inline
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                out[key] = tokens[i + 1]
                i += 1
            else:
                out[key] = "true"
        i += 1
    return out


def typed(values: list[str]) -> Any:
    """HfArgumentParser's reading of a flag's values: bools, numbers, lists."""
    def one(v: str) -> Any:
        if v.lower() in ("true", "false"):
            return v.lower() == "true"
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v
    if not values:
        return True
    return one(values[0]) if len(values) == 1 else [one(v) for v in values]


def launcher_world_size(cmd: LaunchCommand) -> int | None:
    """GPUs the launcher starts per node, when its arguments say."""
    a = cmd.launcher_args
    for key in ("num_gpus", "nproc_per_node", "nproc-per-node", "num_processes"):
        if a.get(key, "").isdigit():
            return int(a[key])
    include = a.get("include", "")
    if ":" in include:
        return len(include.split(":", 1)[1].split(","))
    return None


def shell_value(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)


def set_shell_arg(text: str, cmd: LaunchCommand, key: str, value: Any) -> str:
    """The script with ``--key`` set to ``value`` (replaced in place, else appended)."""
    arg = cmd.args.get(key)
    new = shell_value(value)
    if arg is not None and len(arg.spans) == 1:
        start, end = arg.spans[0]
        return text[:start] + new + text[end:]
    if arg is not None:
        raise ConfigError(f"--{key} has {len(arg.values)} values; edit it by hand")
    indent = "    "
    return text[:cmd.end] + f" \\\n{indent}--{key} {new}" + text[cmd.end:]
