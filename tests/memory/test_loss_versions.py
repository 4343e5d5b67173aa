"""The logits path by transformers release: analytic against the committed traces.

benchmarks/loss_versions.py traced 4.36 to 5.23 with their real code (side
environments, CPU); this test checks the analytic model against every committed row, and
runs the probe itself on the release installed here (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomless.config import RunConfig
from oomless.memory.loss_paths import logits_bytes
from oomless.memory.precision import dtypes_for
from oomless.memory.stacks import installed_version
from oomless.models.catalog import resolve_model

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "loss_versions.json"


def slope(version: str, convention: str) -> float:
    spec = resolve_model("llama-3.2-1b-instruct").spec
    cfg = RunConfig(model=spec.name, method="lora", stack=convention,
                    stack_options={"transformers_version": version})
    parts = logits_bytes(spec, cfg, dtypes_for(cfg), 1)
    return max(parts["forward"], parts["backward"]) / spec.vocab_size


def test_committed_table_covers_the_release_lines():
    rows = json.loads(RESULTS.read_text())["rows"]
    lines = {tuple(r["transformers"].split(".")[:2]) for r in rows}
    assert {("4", "36"), ("4", "46"), ("4", "52"), ("5", "23")} <= lines
    assert {r["convention"] for r in rows} == {"hf-trainer", "custom-loop"}


@pytest.mark.parametrize("row", json.loads(RESULTS.read_text())["rows"],
                         ids=lambda r: f"{r['transformers']}-{r['convention']}")
def test_analytic_logits_path_matches_each_traced_release(row):
    assert slope(row["transformers"], row["convention"]) == pytest.approx(
        row["traced_allocated"], rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("convention", ["hf-trainer", "custom-loop"])
def test_probe_of_the_installed_release_matches_the_analytic_path(convention):
    from oomless.runtime.trace.loss_probe import probe

    traced = probe(convention)["allocated_bytes_per_token_vocab"]
    assert slope(installed_version("transformers"), convention) == pytest.approx(traced, rel=0.02)
