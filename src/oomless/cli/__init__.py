"""The ``oomless`` command line. Thin: parse arguments, call the library, render.

Each sub-command lives in its own module of this package and exposes
``register(subparsers)`` (and an ``ORDER`` integer for the help listing).
Modules are discovered, so adding a command touches no central list. Heavy
libraries (torch, transformers) are imported inside the command functions only.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from ..errors import OomlessError


def _command_modules() -> list:
    mods = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "register"):
            mods.append(mod)
    return sorted(mods, key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (what is wrong, where the help is) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> object:
        # argparse drops a "--" value (--cutoff-len=--) and returns [] unconverted
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected a value, "
                       "got '--'")
        return super()._get_values(action, arg_strings)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(
        prog="oomless",
        description="Fine-tune LLMs without running out of GPU memory: "
        "estimate, plan, train, diagnose.",
    )
    parser.add_argument("--version", action="version", version=f"oomless {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        mod.register(sub)
    for command in sub.choices.values():
        if not any("--trust-remote-code" in a.option_strings for a in command._actions):
            command.add_argument(
                "--trust-remote-code", action="store_true",
                help="a model whose code ships with it (Qwen-1, ChatGLM3, Baichuan2, InternVL, "
                     "MiniCPM-V, ...) is read by building it on the meta device from its local "
                     "folder, which runs that code: allow it (nothing is downloaded)")
    return parser


def _offline() -> None:
    """oomless never goes online: every Hugging Face library call reads the local cache."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _error(message: str, code: int) -> int:
    print(f"oomless: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. User errors print one message and return 2 (never a traceback);
    an unexpected exception is reported in one line as a bug (exit 1), with its
    traceback only when OOMLESS_TRACEBACK=1."""
    _offline()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # usage errors (2, message printed), --help and --version (0)
        return int(done.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from ..models.structure import allow_remote_code
    from ..runtime import meta  # noqa: F401 - registers the structure reader (no torch import)

    allow_remote_code(getattr(args, "trust_remote_code", False))
    try:
        return int(args.func(args) or 0)
    except OomlessError as err:
        return _error(str(err), err.exit_code)
    except KeyboardInterrupt:
        print("oomless: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as err:  # a path the command was given, used where it cannot be
        where = f"'{err.filename}': " if err.filename else ""
        return _error(f"{where}{err.strerror or err}", 2)
    except MemoryError:
        return _error("ran out of host memory; the input is too large for this machine", 2)
    except RecursionError:
        return _error("an input is nested too deeply to be read", 2)
    except Exception as err:  # noqa: BLE001 - the last line of defence: no traceback
        if os.environ.get("OOMLESS_TRACEBACK") == "1":
            raise
        first = (str(err).splitlines() or [""])[0][:300]
        return _error(f"internal error ({type(err).__name__}: {first}); this is a bug in "
                      "oomless: please report it with the command (OOMLESS_TRACEBACK=1 shows "
                      "where it happened)", 1)


def run() -> None:  # console-script entry point
    code = main()
    dist = sys.modules.get("oomless.runtime.train.dist")
    if dist is not None and dist.groups_left_behind():
        # A rank of a distributed run whose process groups a library still references
        # (FSDP's DTensor caches, DeepSpeed ZeRO-3's parameter hooks): their gloo/NCCL
        # worker threads would meet interpreter shutdown, and one that then needs the GIL
        # aborts the process after a completed run (runtime.train.dist.
        # release_process_groups). Everything is written: end without that shutdown.
        import logging

        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)
