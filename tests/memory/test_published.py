"""The published-measurement benchmark: its rows are complete and its results current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from oomless.cli import main

ROOT = Path(__file__).resolve().parents[2]
ROWS = yaml.safe_load((ROOT / "benchmarks" / "published_rows.yaml").read_text())
RESULTS = json.loads((ROOT / "benchmarks" / "results" / "published.json").read_text())
KNOWN = ("allocated", "reserved", "vllm-profiler")


def test_rows_state_source_quote_counter_and_configuration():
    assert len(ROWS) >= 25
    assert sum(r["counter"] in KNOWN for r in ROWS) >= 10
    for r in ROWS:
        assert r["source"].startswith("https://"), r["id"]
        if "github.com" in r["source"] and "/blob/" in r["source"]:
            commit = r["source"].split("/blob/")[1].split("/")[0]
            assert len(commit) == 40, f"{r['id']}: a repository file needs its commit"
        assert r["quote"] and r["setup"], r["id"]
        assert r["counter"] in (*KNOWN, "unknown", "limit"), r["id"]
        assert ("run" in r) != ("argv" in r), r["id"]


def test_every_row_is_estimated_and_reported():
    assert [r["id"] for r in RESULTS["rows"]] == [r["id"] for r in ROWS]
    for r in RESULTS["rows"]:
        assert r["predicted_bytes"] > 0 and r["measured_bytes"] > 0
        assert r["error"] == pytest.approx(r["predicted_bytes"] / r["measured_bytes"] - 1, abs=1e-4)


@pytest.mark.parametrize("row", RESULTS["rows"], ids=lambda r: r["id"])
def test_committed_results_are_those_of_the_current_estimator(row, capsys):
    argv = [str(ROOT / a) if a.startswith("benchmarks/") else a
            for a in row["command"].split()[1:]]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    key = {"reserved": "peak_reserved_bytes", "allocated": "peak_allocated_bytes",
           "device": "device_peak_bytes"}.get(row["compare"])
    if key:
        predicted = out[key]
    elif row["compare"] == "hf-allocated":
        predicted = sum(out[k] for k in ("weights_bytes", "kv_cache_bytes",
                                         "activations_bytes", "logits_bytes"))
    elif row["compare"] == "vllm-kv":
        predicted = out["kv_cache_bytes"]
    else:
        predicted = out["weights_bytes"] + out["profile_peak_bytes"] + out["non_torch_bytes"]
    assert predicted == pytest.approx(row["predicted_bytes"], rel=0.02), \
        "the estimator changed: re-run benchmarks/published.py and commit its results"
