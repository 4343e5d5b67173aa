"""Protection for Python programs that build their own Trainer, without editing them.

``oomless run`` puts a folder holding one ``sitecustomize.py`` (written by
:func:`write_shim`) first on the child's ``PYTHONPATH``. Python imports
``sitecustomize`` at start-up (the ``site`` module) in every interpreter of
the command — the launcher (torchrun, deepspeed, accelerate,
llamafactory-cli) and every worker it starts, which inherit the
environment. The shim installs an import hook: when ``transformers.trainer``
is imported, ``Trainer.train`` is wrapped so that every Trainer, subclasses
included (TRL's, LLaMA-Factory's, GLM-4's Seq2SeqTrainer), is protected
(``oomless.hf.protect``) when its training starts, and resumes from the
checkpoint the supervisor names when the script asks for none. Then it runs
the ``sitecustomize`` that would have run without it, if any.

Limits: an interpreter started with ``-I`` or ``-S``, or with its own
``PYTHONPATH`` that drops ours, is not protected; a Python without oomless
importable prints a warning and runs unprotected; a subclass whose ``train``
does not call ``Trainer.train`` is not protected; multi-node launchers that
start remote processes over ssh (DeepSpeed's pdsh) do not pass the
environment unless told to (``.deepspeed_env``).
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
from pathlib import Path
from typing import Any

from ...fileio import write_atomic
from .env import RESUME_ENV

TARGET = "transformers.trainer"

SHIM = '''"""Written by `oomless run`: protects every transformers Trainer this interpreter builds."""
import os as _os
import sys as _sys


def _oomless_install():
    try:
        from oomless.runtime.protect.bootstrap import install_import_hook
    except Exception as err:  # oomless not importable by this interpreter
        print(f"oomless: protection not installed in {_sys.executable}: {err}",
              file=_sys.stderr)
        return
    install_import_hook()


def _oomless_chain():
    """Run the sitecustomize this folder hides, if there is one."""
    import importlib

    here = _os.path.dirname(_os.path.abspath(__file__))
    saved_path, me = list(_sys.path), _sys.modules.pop("sitecustomize", None)
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError:
        pass
    finally:
        _sys.path[:] = saved_path
        if me is not None:
            _sys.modules["sitecustomize"] = me


_oomless_install()
_oomless_chain()
'''


def write_shim(folder: Path) -> Path:
    """The folder to put first on PYTHONPATH (it holds sitecustomize.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "sitecustomize.py", SHIM)
    return folder


def resume_target(value: Any) -> Any:
    """The checkpoint to resume from: the script's own choice, else the supervisor's."""
    if value not in (None, False):
        return value
    return os.environ.get(RESUME_ENV) or value


def patch_trainer_class(module: Any) -> None:
    """Wrap ``Trainer.train`` of transformers.trainer (once)."""
    trainer_class = module.Trainer
    original = trainer_class.train
    if getattr(original, "_oomless", False):
        return

    @functools.wraps(original)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        from . import install

        install(self)
        return original(self, resume_target(resume_from_checkpoint), *args, **kwargs)

    train._oomless = True  # type: ignore[attr-defined]
    trainer_class.train = train


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        patch_trainer_class(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds transformers.trainer through the other finders and patches it once loaded."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install_import_hook() -> None:
    """Patch the Trainer now if transformers.trainer is loaded, else when it is."""
    if TARGET in sys.modules:
        patch_trainer_class(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
