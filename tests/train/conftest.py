"""Shared fixtures for the training tests: one tiny model folder per session."""

from __future__ import annotations

import os

import pytest
from train_helpers import tiny_run_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from oomless.runtime.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2-tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from oomless.dataset.records import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture
def run_config(tiny_model_dir, tmp_path):
    def make(name="run", **overrides):
        return tiny_run_config(tiny_model_dir, tmp_path / name, **overrides)

    return make

