"""The way from a config the formulas do not know to the model's own code (torch-free).

The formulas of :mod:`oomless.models.hf_decoder` and :mod:`oomless.models.hf_vision`
know a fixed set of families. Any other model is read from its code: built on the meta
device by ``oomless.runtime.meta`` (the only place that imports torch), which registers
itself here when imported (the command line imports it at start-up). Remote code runs
only with consent (``--trust-remote-code``, :func:`allow_remote_code`).

A config of a known family read from a user's file is also checked against the meta
build when the installed transformers implements it: a count that differs by more than
1% means the formulas misread it, and the structure read from the code is used instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import UnknownFamilyError
from .spec import ModelSpec

TOLERANCE = 0.01  # formulas vs the model's own code: above 1% apart, the code wins

Reader = Callable[..., ModelSpec | None]
_state: dict[str, Any] = {"reader": None, "trust_remote_code": False}


def register_structure_reader(reader: Reader) -> None:
    """``reader(config, name, folder=, trust_remote_code=, where=, must_build=)`` ->
    ModelSpec, or None when ``must_build`` is False and it cannot build the model."""
    _state["reader"] = reader


def allow_remote_code(allowed: bool) -> None:
    """The user's consent (``--trust-remote-code``) to run a checkpoint's own code."""
    _state["trust_remote_code"] = bool(allowed)


def read_structure(config: dict[str, Any], name: str, folder: Path | None, where: str,
                   reason: UnknownFamilyError) -> ModelSpec:
    """The spec read from the model's code; without the runtime, the formulas' refusal."""
    reader = _state["reader"]
    if reader is None:
        raise UnknownFamilyError(f"{reason} Reading it from its own code needs oomless's "
                                 "runtime: run the oomless command, or import "
                                 "oomless.runtime.meta first.")
    return reader(config, name, folder=folder, trust_remote_code=_state["trust_remote_code"],
                  where=where, must_build=True)


def checked_against_code(spec: ModelSpec, config: dict[str, Any], folder: Path | None,
                         where: str) -> ModelSpec:
    """The formulas' spec, or the code's where the two counts differ by more than 1%."""
    reader = _state["reader"]
    if reader is None:
        return spec
    code = reader(config, spec.name, folder=folder, trust_remote_code=False, where=where,
                  must_build=False)
    if code is None or abs(code.param_count - spec.param_count) <= TOLERANCE * code.param_count:
        return spec
    note = (f"the formulas read {spec.param_count:,} parameters, the model's own code has "
            f"{code.param_count:,}: the structure read from the code is used")
    return replace(code, quantization=spec.quantization,
                   assumptions=(*code.assumptions, note, *spec.assumptions))


def register_module_lister(lister: Callable[..., tuple[str, ...] | None]) -> None:
    """``lister(config, folder=, trust_remote_code=)`` -> the full names of the model's
    linear modules (PEFT's candidates, the output layer included), or None when the model
    cannot be built here (remote code without its files or consent, no torch)."""
    _state["lister"] = lister


def linear_module_names(config: dict[str, Any] | None,
                        folder: Path | None) -> tuple[str, ...] | None:
    """The linear modules of the model built on the meta device (None: cannot be built)."""
    lister = _state.get("lister")
    if lister is None or config is None:
        return None
    return lister(config, folder=folder, trust_remote_code=_state["trust_remote_code"])
