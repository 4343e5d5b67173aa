"""The training command of a launch script: its launcher, the program it starts, the
program's arguments and how many GPU processes it starts per node.

Launchers: ``python script.py`` / ``python -m module``, ``torchrun`` (and ``python -m
torch.distributed.run``), ``deepspeed`` (``--module``), ``accelerate launch`` (``-m``),
``llamafactory-cli train``, ``swift sft|rlhf|pt``, ``tune run <recipe> --config``,
``axolotl train``. Which launcher options take no value comes from the launchers'
own argument parsers (data/script_flags.json, ``launchers``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from ...errors import ConfigError
from .shell import Command, ShellScript, Unknown, Word

LAUNCHERS: dict[str, dict[str, Any]] = json.loads(
    resources.files("oomless.data").joinpath("script_flags.json").read_text(encoding="utf-8"))[
    "launchers"]
_WRAPPERS = {"nohup", "time", "exec", "env", "sudo", "stdbuf", "numactl"}
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_CLIS = {"llamafactory-cli": ("train",), "lmf": ("train",), "swift": ("sft", "rlhf", "pt"),
         "tune": ("run",), "axolotl": ("train",)}
_MODULE_LAUNCHERS = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
                     "deepspeed.launcher.runner": "deepspeed",
                     "accelerate.commands.launch": "accelerate launch"}


@dataclass
class Launch:
    launcher: str  # python | torchrun | deepspeed | accelerate launch | a framework's CLI
    program: str  # the script, the module, or the CLI and its subcommand ('swift sft')
    kind: str  # script | module | cli
    command: Command
    launcher_args: dict[str, Word] = field(default_factory=dict)
    args: list[Word] = field(default_factory=list)
    gpus: int | Unknown | None = None  # processes per node (None: not said by the launcher)
    end: int = -1  # offset after the command's last word in the script (for appending)

    def env(self, name: str, script: ShellScript) -> Any:
        """A variable as the command sees it (NAME=value before it, else the script's)."""
        if name in self.command.prefix:
            return script.resolve(self.command.prefix[name].value)
        return script.value(name, self.command.env)


def _text(word: Word) -> str:
    return word.value if isinstance(word.value, str) else ""


def _strip_wrappers(argv: list[Word]) -> list[Word]:
    while argv and (PurePosixPath(_text(argv[0])).name in _WRAPPERS
                    or re.fullmatch(r"[A-Za-z_]\w*=.*", _text(argv[0]))):
        argv = argv[1:]
    return argv


def _options(words: list[Word], launcher: str) -> tuple[dict[str, Word], int, str | None]:
    """The launcher's options, the index of its first other word, and a module named with
    ``-m`` / ``--module``."""
    table = LAUNCHERS[launcher]
    out: dict[str, Word] = {}
    module_flag = False
    i = 0
    while i < len(words):
        t = _text(words[i])
        if not t.startswith("-") or t == "-":
            break
        key, eq, inline = t.lstrip("-").partition("=")
        if key in ("m", "module"):
            module_flag = True
            i += 1
            continue
        if eq:
            out[key] = Word(inline, None, words[i].line)
        elif key in table["no_value"]:
            out[key] = Word("true", None, words[i].line)
        elif i + 1 < len(words):
            out[key] = words[i + 1]
            i += 1
        i += 1
    if module_flag and i < len(words):
        return out, i + 1, _text(words[i])
    return out, i, None


def _python(argv: list[Word], cmd: Command) -> Launch | None:
    i = 1
    while i < len(argv) and _text(argv[i]).startswith("-") and _text(argv[i]) != "-m":
        i += 2 if _text(argv[i]) in ("-W", "-X") else 1
    if i < len(argv) and _text(argv[i]) == "-m" and i + 1 < len(argv):
        module = _text(argv[i + 1])
        if module in _MODULE_LAUNCHERS:
            return _launcher(_MODULE_LAUNCHERS[module], argv[i + 2:], cmd)
        return Launch("python", module, "module", cmd, args=argv[i + 2:], gpus=1)
    if i < len(argv) and _text(argv[i]).endswith(".py"):
        return Launch("python", _text(argv[i]), "script", cmd, args=argv[i + 1:], gpus=1)
    return None


def _launcher(name: str, rest: list[Word], cmd: Command) -> Launch | None:
    opts, at, module = _options(rest, name)
    if module:
        return Launch(name, module, "module", cmd, opts, rest[at:])
    if at < len(rest) and (_text(rest[at]).endswith(".py") or name != "python"):
        if not _text(rest[at]):
            return None
        kind = "script" if _text(rest[at]).endswith(".py") else "module"
        return Launch(name, _text(rest[at]), kind, cmd, opts, rest[at + 1:])
    return None


def _cli(name: str, argv: list[Word], cmd: Command) -> Launch | None:
    sub = _text(argv[1]) if len(argv) > 1 else ""
    if sub not in _CLIS[name]:
        return None
    if name == "tune":
        opts, at, _m = _options(argv[2:], "torchrun")
        rest = argv[2 + at:]
        if not rest:
            return None
        return Launch("tune run", _text(rest[0]), "cli", cmd, opts, rest[1:])
    return Launch(f"{name} {sub}", f"{name} {sub}", "cli", cmd, {}, argv[2:])


def launch_of(cmd: Command) -> Launch | None:
    argv = _strip_wrappers(list(cmd.argv))
    if not argv or not _text(argv[0]):
        return None
    name = PurePosixPath(_text(argv[0])).name
    found: Launch | None = None
    if name == "srun":  # Slurm: one task per GPU, each running the program
        return _srun(argv, cmd)
    if _PYTHON.match(name):
        found = _python(argv, cmd)
    elif name in ("torchrun", "deepspeed"):
        found = _launcher(name, argv[1:], cmd)
    elif name == "accelerate" and len(argv) > 1 and _text(argv[1]) == "launch":
        found = _launcher("accelerate launch", argv[2:], cmd)
    elif name in _CLIS:
        found = _cli(name, argv, cmd)
    if found is not None:
        ends = [w.end for w in cmd.argv if w.end > 0]
        found.end = max(ends) if ends else cmd.end
    return found


def _srun(argv: list[Word], cmd: Command) -> Launch | None:
    opts, at, _m = _options(argv[1:], "srun")
    inner = launch_of(Command(argv[1 + at:], cmd.prefix, cmd.env, cmd.line, cmd.end))
    if inner is None:
        return None
    if inner.launcher == "python":
        inner.launcher, inner.launcher_args = "srun", opts
    return inner


def find_launch(script: ShellScript, where: str) -> Launch:
    """The script's training command (the first command that starts a training program)."""
    for cmd in script.commands:
        found = launch_of(cmd)
        if found is not None:
            found.gpus = processes(found, script)
            return found
    raise ConfigError(
        f"{where}: no training command found: oomless reads scripts that run `python "
        "train.py`, `python -m module`, `torchrun`, `deepspeed` (--module), `accelerate "
        "launch`, `llamafactory-cli train`, `swift sft|rlhf`, `tune run` or `axolotl train`"
        + (f" (not read: {'; '.join(script.skipped)})" if script.skipped else ""))


def _count(value: Any) -> int | Unknown | None:
    if isinstance(value, Unknown):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _visible(launch: Launch, script: ShellScript) -> int | Unknown | None:
    seen = launch.env("CUDA_VISIBLE_DEVICES", script)
    if isinstance(seen, Unknown):
        return seen
    if isinstance(seen, str) and seen.strip():
        return len([d for d in seen.split(",") if d.strip()])
    return None


def processes(launch: Launch, script: ShellScript) -> int | Unknown | None:
    """GPU processes per node the launcher starts; an Unknown when only running can tell."""
    line = launch.command.line
    every_gpu = Unknown(launch.launcher, line, "starts one process per GPU of the machine")
    if launch.launcher == "python":
        return 1
    if launch.launcher in LAUNCHERS:
        table = LAUNCHERS[launch.launcher]
        for key in table["processes"]:
            if key in launch.launcher_args:
                word = launch.launcher_args[key]
                got = _count(word.value)
                if got is None and word.value in ("gpu", "auto"):
                    return every_gpu
                return got
        gres = launch.launcher_args.get("gres")
        if launch.launcher == "srun" and gres is not None:
            got = gres.value if isinstance(gres.value, Unknown) else _count(
                str(gres.value).rsplit(":", 1)[-1])
            return got if got is not None else every_gpu
        include = launch.launcher_args.get("include")
        if include is not None and isinstance(include.value, str) and ":" in include.value:
            return len(include.value.split(":", 1)[1].split(","))
        if table["default_processes"]:
            return int(table["default_processes"])
        return _visible(launch, script) or (None if launch.launcher == "accelerate launch"
                                            else every_gpu)
    if launch.launcher in ("swift sft", "swift rlhf", "swift pt"):
        return _count(launch.env("NPROC_PER_NODE", script)) or 1
    if launch.launcher == "tune run":
        return _count(launch.launcher_args["nproc_per_node"].value) \
            if "nproc_per_node" in launch.launcher_args else 1
    if launch.launcher.startswith(("llamafactory-cli", "lmf")):
        return (_count(launch.env("NPROC_PER_NODE", script)) or _visible(launch, script)
                or every_gpu)
    return _visible(launch, script) or every_gpu


def find_file(ref: str, script: Path) -> Path | None:
    """A file a script names: in the working directory, next to the script, then in the
    script's parent folders."""
    p = Path(ref).expanduser()
    if p.is_absolute():
        return p if p.is_file() else None
    for base in [Path.cwd(), script.parent, *list(script.resolve().parent.parents)[:4]]:
        if (base / p).is_file():
            return base / p
    return None
