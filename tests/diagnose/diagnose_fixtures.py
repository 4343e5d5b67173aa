"""Shared helpers of the diagnose tests (a plain module: conftest basenames collide)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "oom_logs"
GiB = 1024**3
MiB = 1024**2


def read_fixture(name: str) -> str:
    return (FIXTURES / name).read_bytes().decode("utf-8", errors="replace")


def as_bytes(number: str, unit: str) -> int:
    """Printed size → bytes, written out independently of the parser under test."""
    factor = {"bytes": 1, "KiB": 1024, "MiB": MiB, "GiB": GiB}[unit]
    return round(float(number) * factor)


def all_fixture_logs() -> list[str]:
    return sorted(p.name for p in FIXTURES.glob("*.log"))


def real_logs() -> list[str]:
    """The logs users pasted into issues (real/), as paths relative to FIXTURES."""
    return sorted(f"real/{p.name}" for p in (FIXTURES / "real").glob("*.log"))
