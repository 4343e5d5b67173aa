"""Unsloth's per-layer fp32 RoPE tables of its Gemma loader, by release (--stack-version)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomless.config import RunConfig
from oomless.memory.after_load import unsloth_load_assumptions, unsloth_rope_table_bytes
from oomless.memory.training import estimate_training
from oomless.models.catalog import resolve_model

ROOT = Path(__file__).resolve().parents[2]
GEMMA_7B = str(ROOT / "benchmarks" / "configs" / "gemma-7b" / "config.json")


def _cfg(model: str, version: str | None, stack: str = "unsloth") -> RunConfig:
    opts = {"stack_version": version} if version else {}
    return RunConfig(model=model, method="qlora", stack=stack, precision="fp16",
                     optimizer="adamw-8bit", micro_batch_size=2, seq_len=512,
                     grad_ckpt=True, stack_options=opts, hardware={"gpu": "t4"})


@pytest.mark.parametrize("version", ["2024.3", "2024.7.1"])
def test_gemma_7b_holds_28_layers_of_fp32_cos_and_sin_tables(version):
    spec = resolve_model(GEMMA_7B).spec
    cfg = _cfg(GEMMA_7B, version)
    # 28 layers × (cos, sin) × 8,192 positions × head_dim 256 × 4 bytes = 448 MiB
    assert unsloth_rope_table_bytes(spec, cfg) == 28 * 2 * 8192 * 256 * 4 == 448 * 2**20
    est = estimate_training(spec, cfg)
    assert est.breakdown[est.peak_phase]["rope_tables"] == 448 * 2**20
    assert any("fp32 RoPE cos/sin tables" in a for a in est.assumptions)


@pytest.mark.parametrize(("version", "stack", "model"), [
    ("2024.8", "unsloth", GEMMA_7B),          # a release whose loader was not read
    ("2024.2", "unsloth", GEMMA_7B),          # before GemmaFixedRotaryEmbedding
    ("2024.3", "trl", GEMMA_7B),              # not Unsloth
    ("2024.3", "unsloth", "llama-3.1-8b-instruct"),  # Llama's tables are cast to 16-bit
])
def test_the_tables_are_counted_only_where_the_loader_was_read(version, stack, model):
    spec = resolve_model(model).spec
    cfg = _cfg(model, version, stack)
    assert unsloth_rope_table_bytes(spec, cfg) == 0
    est = estimate_training(spec, cfg)
    assert "rope_tables" not in est.breakdown[est.peak_phase]


def test_an_unread_release_says_the_tables_are_not_counted():
    spec = resolve_model(GEMMA_7B).spec
    (note,) = unsloth_load_assumptions(spec, _cfg(GEMMA_7B, "2025.1"))
    assert "not counted" in note and "--stack-version" in note
