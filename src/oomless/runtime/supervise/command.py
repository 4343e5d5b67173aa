"""Recognising a training command: its launcher, script, configuration and arguments.

Forms read (what each tool's own parser takes):

- ``llamafactory-cli train CONFIG.yaml [key=value ...]`` (also ``lmf``);
- ``python finetune.py DATA MODEL CONFIG.yaml [yes]`` (GLM-4's finetune_demo:
  typer arguments data_dir, model_dir, config_file, auto_resume_from_checkpoint);
- ``python script.py ARGS.json`` or ``ARGS.yaml`` (HfArgumentParser.parse_json_file /
  parse_yaml_file, the transformers examples' convention), the kind of file told
  by its keys (LLaMA-Factory YAML, GLM-4 YAML, TrainingArguments JSON);
- ``python script.py --per_device_train_batch_size 4 --deepspeed ds.json ...``
  (HfArgumentParser flags, ``--key value`` or ``--key=value``);
- any of these behind ``torchrun``, ``python -m torch.distributed.run``,
  ``deepspeed`` or ``accelerate launch``, whose own options come before the
  script (the first argument ending in ``.py``, or the module after ``-m``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHERS = {"torchrun": "torchrun", "deepspeed": "deepspeed", "accelerate": "accelerate",
             "torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
             "deepspeed.launcher.runner": "deepspeed", "accelerate.commands.launch": "accelerate"}
LLAMAFACTORY_CLIS = {"llamafactory-cli", "lmf"}
# the launchers' options that say how many processes run on this machine
NPROC_OPTIONS = {"--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus",
                 "--num_processes", "--num-processes"}
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass
class Command:
    """A training command as recognised (indices point into ``argv``)."""

    argv: list[str]
    launcher: str = "python"  # python | torchrun | deepspeed | accelerate | llamafactory-cli | other
    script: str | None = None
    script_index: int | None = None
    config_index: int | None = None  # a configuration file argument
    positionals: list[int] = field(default_factory=list)  # indices of the script's positionals
    flags: dict[str, int] = field(default_factory=dict)  # --key → index of its value
    nproc: int = 1

    @property
    def is_python(self) -> bool:
        return self.launcher != "other"

    @property
    def config_file(self) -> str | None:
        return None if self.config_index is None else self.argv[self.config_index]

    def flag(self, key: str) -> str | None:
        i = self.flags.get(key)
        return None if i is None else self.argv[i]

    def with_values(self, values: dict[int, str], appended: list[str] = ()) -> Command:
        """A copy with arguments at these indices replaced and ``appended`` at the end."""
        argv = list(self.argv)
        for index, value in values.items():
            argv[index] = value
        return parse_command(argv + list(appended))


def _nproc(argv: list[str], start: int, stop: int) -> int:
    for i in range(start, stop):
        word = argv[i]
        name, _, value = word.partition("=")
        if name in NPROC_OPTIONS:
            value = value or (argv[i + 1] if i + 1 < stop else "")
            if value.isdigit():
                return int(value)
    return 1


def _script_after(argv: list[str], start: int) -> int | None:
    """Index of the script: after ``-m``, else the first argument ending in .py."""
    for i in range(start, len(argv)):
        if argv[i] in ("-m", "--module") and i + 1 < len(argv):
            return i + 1
        if argv[i].endswith(".py"):
            return i
    return None


def _script_args(cmd: Command, start: int) -> None:
    """Flags and positionals; a configuration file is a positional before the first flag
    (after one, a file may be a value of a multi-value flag such as --data_path A B)."""
    argv = cmd.argv
    i = start
    while i < len(argv):
        word = argv[i]
        if word.startswith("--") and len(word) > 2:
            name, eq, _value = word[2:].partition("=")
            if eq:
                cmd.flags[name] = i  # the value is inside the word: --key=value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                cmd.flags[name] = i + 1
                i += 1
            else:
                cmd.flags[name] = -1  # a bare boolean flag
        else:
            cmd.positionals.append(i)
            if cmd.config_index is None and not cmd.flags and word.endswith(CONFIG_SUFFIXES) \
                    and Path(word).is_file():
                cmd.config_index = i
        i += 1


def parse_command(argv: list[str]) -> Command:
    """Recognise ``argv``; what is not recognised is kept as launcher 'other'."""
    argv = list(argv)
    if not argv:
        from ...errors import ConfigError

        raise ConfigError("no command to run: give it after --, e.g. "
                          "oomless run -- llamafactory-cli train config.yaml")
    prog = os.path.basename(argv[0])
    cmd = Command(argv)
    if prog in LLAMAFACTORY_CLIS:
        cmd.launcher = "llamafactory-cli"
        if len(argv) > 2 and argv[1] == "train":
            cmd.script, cmd.script_index = "llamafactory-cli train", 1
            _script_args(cmd, 2)
        return cmd
    if prog.startswith("python"):
        script = _script_after(argv, 1)
    elif prog in LAUNCHERS:
        script = _script_after(argv, 2 if prog == "accelerate" else 1)
    else:
        cmd.launcher = "other"
        return cmd
    module = script is not None and argv[script - 1] in ("-m", "--module")
    if module and argv[script] in LAUNCHERS:  # python -m torch.distributed.run ...
        cmd.launcher = LAUNCHERS[argv[script]]
        inner = _script_after(argv, script + 1)
        cmd.nproc = _nproc(argv, script + 1, inner or len(argv))
        script = inner
    elif prog in LAUNCHERS:
        cmd.launcher = LAUNCHERS[prog]
        cmd.nproc = _nproc(argv, 1, script or len(argv))
    if script is not None:
        cmd.script, cmd.script_index = argv[script], script
        _script_args(cmd, script + 1)
    return cmd


def is_glm_finetune(cmd: Command) -> bool:
    """GLM-4's finetune.py: DATA MODEL CONFIG positionals, the config third."""
    return (cmd.config_index is not None and len(cmd.positionals) >= 3
            and cmd.positionals[2] == cmd.config_index)
