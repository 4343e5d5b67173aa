"""Sizes as the frameworks print them, back to bytes.

PyTorch's ``format_size`` (c10/cuda/CUDACachingAllocator.cpp) prints
"N bytes", then KiB/MiB/GiB with two decimals; vLLM prints GiB (and, in
older releases, "GB" for what it computed as bytes / 2**30); NCCL prints
plain byte counts; the kernel prints kB for KiB.
"""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    # decimal units, as written
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}

NUM = r"\d{1,15}(?:\.\d{1,6})?"
UNIT = r"(?:bytes|byte|[KMGT]i?B|B)\b"


def size(name: str, strict: bool = True) -> str:
    """Regex for one printed size, with groups ``name`` (number) and ``name_u`` (unit).
    ``strict=False``: the unit may run into the next word (a line joined without its
    break, "23.15 GiBmemory in use")."""
    unit = UNIT if strict else UNIT.removesuffix(r"\b")
    return rf"(?P<{name}>{NUM})\s*(?P<{name}_u>{unit})"


ANY_SIZE = rf"{NUM}\s*{UNIT}"
_ONE = re.compile(rf"({NUM})\s*({UNIT})")


def to_bytes(number: str, unit: str, binary_gb: bool = False) -> int:
    """'6.56', 'GiB' → 7043746775. ``binary_gb``: read GB/MB as GiB/MiB (vLLM's old logs)."""
    key = unit.lower()
    if binary_gb and key in ("kb", "mb", "gb", "tb"):
        key = key[0] + "ib"
    return int(round(float(number) * _UNITS.get(key, 1)))


def group_bytes(match: re.Match[str], name: str, binary_gb: bool = False) -> int | None:
    """Bytes of the size group ``name`` of a match made with :func:`size`, None if absent."""
    number = match.group(name)
    if number is None:
        return None
    return to_bytes(number, match.group(f"{name}_u"), binary_gb)


def parse_size(text: str) -> int | None:
    """The first printed size in ``text`` as bytes."""
    m = _ONE.search(text)
    return to_bytes(m.group(1), m.group(2)) if m else None
