"""Launch scripts: the arguments of the training command in a shell script.

The script is read with a real shell parser and evaluated without running
(oomless.check.scripts.shell); its training command is found with its launcher
(oomless.check.scripts.launchers). This module turns that command's words into
``--key value`` arguments (HfArgumentParser's syntax: a flag may take several
values, a bare flag means True) and remembers where each value is written so
that a change edits the same characters (or the variable's assignment).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .scripts.launchers import Launch, find_launch
from .scripts.shell import ShellScript, Unknown, read_shell


@dataclass
class ShellArg:
    key: str
    values: list[str]
    spans: list[tuple[int, int] | None]  # where each value is written (None: computed)
    line: int
    unknown: Unknown | None = None  # a value only running the script can tell


@dataclass
class LaunchCommand:
    launcher: str  # python | torchrun | deepspeed | accelerate launch | a framework's CLI
    script: str  # the training script, module or CLI subcommand the launcher runs
    launcher_args: dict[str, str] = field(default_factory=dict)
    args: dict[str, ShellArg] = field(default_factory=dict)
    end: int = 0  # offset just after the command's last word
    launch: Launch | None = None
    shell: ShellScript | None = None
    positional: list[str] = field(default_factory=list)  # words before the first --key


def parse_launch(text: str, where: str | Path) -> LaunchCommand:
    """The training command of a launch script; ConfigError when there is none."""
    shell = read_shell(text, Path(where))
    launch = find_launch(shell, str(where))
    cmd = LaunchCommand(launch.launcher, launch.program, end=launch.end, launch=launch,
                        shell=shell)
    cmd.launcher_args = {k: w.value for k, w in launch.launcher_args.items()
                         if isinstance(w.value, str)}
    current: ShellArg | None = None
    for word in launch.args:
        value = word.value
        if isinstance(value, str) and value.startswith("--") and len(value) > 2:
            key, eq, inline = value[2:].partition("=")
            current = ShellArg(key, [], [], word.line)
            cmd.args[key] = current
            if eq:
                current.values.append(inline)
                span = word.span
                current.spans.append((span[0] + len(key) + 3, span[1]) if span else None)
            continue
        if current is None:
            cmd.positional.append(value if isinstance(value, str) else "")
            continue
        if isinstance(value, Unknown):
            current.unknown = current.unknown or value
            current.values.append("")
        else:
            current.values.append(value)
        current.spans.append(word.span)
    return cmd


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
    """GPUs the launcher starts per node, when the script says."""
    gpus = cmd.launch.gpus if cmd.launch else None
    return gpus if isinstance(gpus, int) else None


def shell_value(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)


class _Bare:
    """The value of a bare flag (argparse store_true): ``--key`` alone."""

    def __repr__(self) -> str:
        return "BARE"


BARE = _Bare()


def set_shell_arg(text: str, cmd: LaunchCommand, key: str, value: Any) -> str:
    """The script with ``--key`` set to ``value`` (replaced in place, else appended); a
    bare flag (``BARE``) is appended alone, or left as it is when present."""
    arg = cmd.args.get(key)
    if value is BARE:
        return text if arg is not None else text[:cmd.end] + f" \\\n    --{key}" + text[cmd.end:]
    new = shell_value(value)
    if arg is not None and len(arg.spans) == 1 and arg.spans[0] is not None:
        start, end = arg.spans[0]
        return text[:start] + new + text[end:]
    if arg is not None:
        raise ConfigError(f"--{key} (line {arg.line}) is not written as one value in the "
                          "script (computed, or several values); edit it by hand")
    indent = "    "
    return text[:cmd.end] + f" \\\n{indent}--{key} {new}" + text[cmd.end:]
