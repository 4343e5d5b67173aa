"""What a protected Trainer and the ``oomless run`` supervisor tell each other (torch-free).

The supervisor starts the user's command with these environment variables;
``protect()`` reads them (its keyword arguments win over them):

- ``OOMLESS_RUN_DIR``: the folder for memlog.jsonl and events.jsonl
  (default: ``TrainingArguments.output_dir``/oomless);
- ``OOMLESS_RESUME_FROM_CHECKPOINT``: a checkpoint folder ``Trainer.train()``
  resumes from when the script does not ask for one itself;
- ``OOMLESS_INJECT_OOM``: fault injection, comma-separated
  ``train:STEP[:RANK][:TIMES][:backward]`` and ``eval:ROUND[:RANK][:TIMES]``
  (RANK ``*``: every rank); fires in the first launch only;
- ``OOMLESS_MEMORY_BUDGET_GB``: a simulated GPU of this size (CPU tests);
- ``OOMLESS_PREFLIGHT`` (warn | refuse | off) and ``OOMLESS_GPU`` (the GPU
  to check against when the run is not on one);
- ``OOMLESS_PROTECT=0``: only resume and logging, no OOM handling;
- ``OOMLESS_ATTEMPT``: 1 for the first launch, 2 for the first relaunch, ...

A process that cannot recover in-process (an OOM inside a DeepSpeed or FSDP
engine, or after the forward on one of several ranks) exits with
:data:`EXIT_OOM_RESTART` after writing the event that says why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError

RUN_DIR_ENV = "OOMLESS_RUN_DIR"
RESUME_ENV = "OOMLESS_RESUME_FROM_CHECKPOINT"
INJECT_ENV = "OOMLESS_INJECT_OOM"
BUDGET_ENV = "OOMLESS_MEMORY_BUDGET_GB"
PREFLIGHT_ENV = "OOMLESS_PREFLIGHT"
GPU_ENV = "OOMLESS_GPU"
PROTECT_ENV = "OOMLESS_PROTECT"
ATTEMPT_ENV = "OOMLESS_ATTEMPT"

# EX_TEMPFAIL of sysexits.h: "temporary failure; the user is invited to retry"
EXIT_OOM_RESTART = 75
RUN_SUBDIR = "oomless"
PREFLIGHT_MODES = ("warn", "refuse", "off")

_FORMAT = ("expected train:STEP[:RANK][:TIMES][:backward] or eval:ROUND[:RANK][:TIMES], "
           "comma-separated (RANK '*' for every rank), e.g. train:3:1 or eval:1")


def _int_field(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{INJECT_ENV}: '{spec}': {what} '{text}' is not a number; "
                          f"{_FORMAT}") from None
    if value < (0 if what == "rank" else 1):
        raise ConfigError(f"{INJECT_ENV}: '{spec}': {what} {value} is out of range; {_FORMAT}")
    return value


def parse_inject(text: str) -> list[Any]:
    """``train:3:1:2,eval:1`` → InjectOOM specs (the training loop's own type)."""
    from ...config import InjectOOM  # pydantic: loaded only when there is something to parse

    out = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        parts = spec.split(":")
        phase = parts[0]
        if phase not in ("train", "eval") or not 2 <= len(parts) <= 5:
            raise ConfigError(f"{INJECT_ENV}: '{spec}': {_FORMAT}")
        during = "forward"
        if parts[-1] in ("forward", "backward"):
            during = parts.pop()
            if phase == "eval" and during == "backward":
                raise ConfigError(f"{INJECT_ENV}: '{spec}': evaluation has no backward")
        if len(parts) > 4:
            raise ConfigError(f"{INJECT_ENV}: '{spec}': {_FORMAT}")
        step = _int_field(parts[1], "step" if phase == "train" else "round", spec)
        rank = None if len(parts) > 2 and parts[2] == "*" else (
            _int_field(parts[2], "rank", spec) if len(parts) > 2 else 0)
        times = _int_field(parts[3], "times", spec) if len(parts) > 3 else 1
        out.append(InjectOOM(phase=phase, step=step, rank=rank, times=times, during=during))
    return out


def inject_specs(environ: Mapping[str, str] | None = None,
                 text: str | None = None) -> list[Any]:
    """The injection for this process: ``text`` or the environment's, first launch only."""
    env = os.environ if environ is None else environ
    if text is None:
        text = env.get(INJECT_ENV, "")
        if int(env.get(ATTEMPT_ENV, "1") or 1) > 1:
            return []
    return parse_inject(text) if text else []


def budget_gb(environ: Mapping[str, str] | None = None, value: float | None = None) -> float | None:
    if value is not None:
        return float(value)
    text = (os.environ if environ is None else environ).get(BUDGET_ENV, "")
    if not text:
        return None
    try:
        gb = float(text)
    except ValueError:
        raise ConfigError(f"{BUDGET_ENV}='{text}': expected a number of GiB, e.g. 0.5") from None
    if gb <= 0:
        raise ConfigError(f"{BUDGET_ENV}={text}: must be above 0")
    return gb


def preflight_mode(value: str | None, environ: Mapping[str, str] | None = None) -> str:
    mode = value or (os.environ if environ is None else environ).get(PREFLIGHT_ENV) or "warn"
    if mode not in PREFLIGHT_MODES:
        raise ConfigError(f"preflight '{mode}': expected one of {', '.join(PREFLIGHT_MODES)}")
    return mode
