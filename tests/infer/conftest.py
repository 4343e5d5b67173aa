"""Fixtures of the inference tests (helpers live in infer_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from infer_fixtures import RECORDS, write_jsonl


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from oomless.runtime.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", RECORDS)
