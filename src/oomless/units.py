"""Byte units and formatting. GiB = 2**30 bytes, the unit nvidia-smi and PyTorch use."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def gib(n_bytes: float) -> float:
    """Bytes → GiB."""
    return n_bytes / GiB


def fmt_bytes(n_bytes: float) -> str:
    """Human-readable size: '31.20 GiB', '512.0 MiB', '4.0 KiB'."""
    size = abs(n_bytes)
    sign = "-" if n_bytes < 0 else ""
    if size >= GiB:
        return f"{sign}{size / GiB:.2f} GiB"
    if size >= MiB:
        return f"{sign}{size / MiB:.1f} MiB"
    if size >= KiB:
        return f"{sign}{size / KiB:.1f} KiB"
    return f"{sign}{size:.0f} B"


def fmt_count(n: float) -> str:
    """Parameter counts: '7.62B', '494.0M', '12.3K'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))
