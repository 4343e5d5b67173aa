"""Fixtures for the protected-Trainer and `oomless run` tests: one tiny model per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from oomless.runtime.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2-tiny")


@pytest.fixture(scope="session")
def rows(tiny_model_dir):
    from hf_helpers import demo_rows

    return demo_rows(tiny_model_dir)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: tiny matrices gain nothing from more, and on a shared machine
    the threads' spin-waits dominate (measured 20 ms vs 0.1 ms per tiny linear)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
