"""Unsloth's loss by release, read from unslothai/unsloth's history
(unsloth/models/llama.py CausalLM_fast_forward): the Triton cross-entropy on the model's
bf16 logits to 2024.11.7, cut_cross_entropy (no logits, batches over 1024 tokens) from
commit fa8e59eb, unsloth_zoo's chunked unsloth_fused_ce_loss from 2025.8.5 (commit 806bee24)."""

from __future__ import annotations

import pytest

from oomless.api import estimate
from oomless.config import RunConfig
from oomless.memory.loss_paths import logits_bytes
from oomless.memory.precision import dtypes_for
from oomless.memory.stacks import stack_effects
from oomless.models.catalog import resolve_model

SPEC = resolve_model("llama-3.1-8b-instruct").spec


def _cfg(version: str, seq_len: int = 4096) -> RunConfig:
    return RunConfig(model="llama-3.1-8b-instruct", method="qlora", stack="unsloth",
                     seq_len=seq_len, grad_ckpt=True, optimizer="adamw-8bit",
                     stack_options={"stack_version": version}, hardware={"gpu": "l4"})


@pytest.mark.parametrize("version, loss", [
    ("2024.8", "unsloth-triton"), ("2024.11.7", "unsloth-triton"),
    ("2024.11.8", "unsloth-cce"), ("2025.2.4", "unsloth-cce"), ("2025.8.4", "unsloth-cce"),
    ("2025.8.5", "unsloth"), ("2026.10.9", "unsloth"),
])
def test_the_release_selects_the_loss(version, loss):
    assert stack_effects(_cfg(version)).fused_loss == loss


def test_each_path_by_its_arithmetic():
    t, v, h = 4096, SPEC.vocab_size, SPEC.hidden_size
    old = _cfg("2024.8")
    dt = dtypes_for(old)
    assert logits_bytes(SPEC, old, dt, t)["forward"] == 2 * t * v + 8 * t  # bf16 logits
    cce = _cfg("2025.2.4")
    assert logits_bytes(SPEC, cce, dt, t) == {"forward": 8 * t, "backward": 8 * t + 2 * t * h,
                                              "held": 0}
    short = logits_bytes(SPEC, cce, dt, 1024)  # RETURN_LOGITS for ≤ 1024 tokens
    assert short["forward"] == 2 * 1024 * v + 8 * 1024


def test_2024_runs_are_not_estimated_with_the_2026_loss():
    ests = {ver: estimate(_cfg(ver, 8192)) for ver in ("2024.8", "2025.2.4", "2026.10.9")}
    peaks = {ver: e.peak_allocated_bytes for ver, e in ests.items()}
    forward = {ver: sum(e.breakdown["forward"].values()) for ver, e in ests.items()}
    assert peaks["2025.2.4"] < peaks["2026.10.9"]  # no logits at all under CCE
    assert forward["2024.8"] > forward["2025.2.4"]  # the full bf16 logits
