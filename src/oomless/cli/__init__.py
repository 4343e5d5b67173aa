"""The ``oomless`` command line. Thin: parse arguments, call the library, render.

Each sub-command lives in its own module of this package and exposes
``register(subparsers)`` (and an ``ORDER`` integer for the help listing).
Modules are discovered, so adding a command touches no central list. Heavy
libraries (torch, transformers) are imported inside the command functions only.
"""

from __future__ import annotations

import argparse
import importlib
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


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="oomless",
        description="Fine-tune LLMs without running out of GPU memory: "
        "estimate, plan, train, diagnose.",
    )
    parser.add_argument("--version", action="version", version=f"oomless {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except OomlessError as err:
        print(f"oomless: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("oomless: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def run() -> None:  # console-script entry point
    sys.exit(main())
