"""Fixtures of the report tests (helpers live in report_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_fixtures import make_estimate, write_run_dir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run_dir(tmp_path / "run")


@pytest.fixture
def estimate_file(tmp_path: Path) -> Path:
    path = tmp_path / "estimate.json"
    path.write_text(make_estimate().to_json())
    return path
