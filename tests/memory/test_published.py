"""The published-measurement benchmark: its rows are complete and its results current."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from oomless.cli import main

ROOT = Path(__file__).resolve().parents[2]
ROWS = yaml.safe_load((ROOT / "benchmarks" / "published_rows.yaml").read_text())
RESULTS = json.loads((ROOT / "benchmarks" / "results" / "published.json").read_text())
KNOWN = ("allocated", "reserved", "vllm-profiler")
_SPEC = importlib.util.spec_from_file_location("published_benchmark",
                                               ROOT / "benchmarks" / "published.py")
PUBLISHED = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(PUBLISHED)


def _argv(command: str) -> list[str]:
    return [str(ROOT / a) if a.startswith("benchmarks/") else a for a in command.split()[1:]]


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
        assert r["outcome"] in ("ran", "oom"), r["id"]
        assert r["measured_on"] is None or isinstance(r["measured_on"], str), r["id"]


def test_every_card_a_row_names_is_one_oomless_reads():
    from oomless.models.hardware import parse_gpu_arg

    for r in ROWS:
        if r["measured_on"] is not None:
            assert parse_gpu_arg(r["measured_on"]).gpu.memory_bytes > 0, r["id"]


def test_a_verdict_is_judged_against_what_happened():
    assert PUBLISHED.judged("ran", "fits") == "right"
    assert PUBLISHED.judged("ran", "oom") == "wrong"
    assert PUBLISHED.judged("oom", "oom") == "right"
    assert PUBLISHED.judged("oom", "fits") == "wrong"
    assert PUBLISHED.judged("ran", "tight") == PUBLISHED.judged("oom", "tight") == "tight"


def test_the_verdict_summary_counts_the_rows():
    v, rows = RESULTS["summary"]["verdicts"], RESULTS["rows"]
    scored = [r for r in rows if r["verdict"] is not None]
    assert v["rows"] == len(scored) == len(rows) - len(v["card_unknown"])
    assert v["strict_right"] == sum(r["verdict_right"] == "right" for r in scored)
    assert v["lenient_right"] == v["strict_right"] + len(v["tight"])
    assert v["wrong"] == [r["id"] for r in scored if r["verdict_right"] == "wrong"]
    assert v["card_unknown"] == [r["id"] for r in ROWS if r["measured_on"] is None]


def test_every_row_is_estimated_and_reported():
    assert [r["id"] for r in RESULTS["rows"]] == [r["id"] for r in ROWS]
    for r in RESULTS["rows"]:
        assert r["predicted_bytes"] > 0 and r["measured_bytes"] > 0
        assert r["error"] == pytest.approx(r["predicted_bytes"] / r["measured_bytes"] - 1, abs=1e-4)


@pytest.mark.parametrize("row", RESULTS["rows"], ids=lambda r: r["id"])
def test_committed_results_are_those_of_the_current_estimator(row, capsys):
    argv = _argv(row["command"])
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


@pytest.mark.parametrize("row", [r for r in RESULTS["rows"] if r["verdict_command"]],
                         ids=lambda r: r["id"])
def test_committed_verdicts_are_those_of_the_current_estimator(row, capsys):
    source = next(r for r in ROWS if r["id"] == row["id"])
    assert (row["measured_on"], row["outcome"]) == (source["measured_on"], source["outcome"])
    assert row["verdict_command"] == f"{row['command']} --gpu {row['measured_on']}"
    assert main([*_argv(row["verdict_command"]), "--json"]) == 0
    verdict = PUBLISHED.verdict_of(json.loads(capsys.readouterr().out), row["measured_on"])
    assert verdict == row["verdict"], \
        "the estimator's verdict changed: re-run benchmarks/published.py and commit its results"
    assert row["verdict_right"] == PUBLISHED.judged(row["outcome"], verdict)
