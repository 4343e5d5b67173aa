"""User-facing errors.

Every mistake a user can make raises an :class:`OomlessError` subclass whose
message names what was given, what was expected and how to fix it. The CLI
prints the message and exits with code 2, without a traceback.
"""

from __future__ import annotations


class OomlessError(Exception):
    """Base class for user errors (exit code 2, no traceback)."""

    exit_code = 2


class UnknownModelError(OomlessError):
    """A model name, path or id that cannot be resolved."""


class ModelConfigError(OomlessError):
    """A config.json that lacks a field the memory model needs."""


class UnknownGPUError(OomlessError):
    """A GPU name that is not in the catalog."""


class ConfigError(OomlessError):
    """A run configuration that is invalid or contradictory."""


class DataError(OomlessError):
    """A dataset that cannot be read or has bad records."""


class OutputError(OomlessError):
    """An output path that cannot be written, or must not be (an input, a user's file)."""


class GPUUnavailableError(OomlessError):
    """A command that needs an NVIDIA GPU ran on a machine without one."""

    exit_code = 1


class CannotTellError(OomlessError):
    """A file whose memory depends on something only running it can tell, or on a
    setting oomless does not understand: the message names it and the option that
    settles it (exit code 2)."""


class UnknownFamilyError(ModelConfigError):
    """A config.json whose model_type the formulas of oomless.models do not know (the
    model's structure is then read from its own code, oomless.models.structure)."""
