"""The error of a log that cannot be read (diagnose/stream.py reads logs)."""

from __future__ import annotations

from ..errors import OomlessError


class LogReadError(OomlessError):
    """A log file that cannot be read."""
