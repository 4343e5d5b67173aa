"""The uncertainty band and the three-valued verdict, and where their numbers come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomless.config import RunConfig
from oomless.memory import band, estimate_training
from oomless.models.catalog import resolve_model
from oomless.models.hardware import parse_gpu_arg
from oomless.result import FITS, OUT_OF_MEMORY, TIGHT, MemoryEstimate, fit_verdict

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "published.json"


def test_band_constants_are_those_of_the_committed_benchmark():
    summary = json.loads(RESULTS.read_text())["summary"]["band"]
    assert band.WORST_UNDER_ESTIMATE == pytest.approx(summary["worst_under_estimate"], abs=1e-4)
    assert band.WORST_OVER_ESTIMATE == pytest.approx(summary["worst_over_estimate"], abs=1e-4)


def test_band_rows_are_inside_their_own_band():
    """Every row the band is derived from lies within it (that is how it is derived)."""
    rows = json.loads(RESULTS.read_text())["rows"]
    for r in rows:
        if r["band_row"]:
            low = r["predicted_bytes"] * band.LOW_FACTOR
            high = r["predicted_bytes"] * band.HIGH_FACTOR
            assert low * 0.999 <= r["measured_bytes"] <= high * 1.001, r["id"]


@given(peak=st.integers(1, 10**12), gpu=st.integers(1, 10**12))
def test_verdict_is_consistent_with_the_band(peak, gpu):
    low, high = band.band_bytes(peak)
    assert low <= peak <= high
    verdict = fit_verdict(low, high, gpu)
    assert verdict == (FITS if high <= gpu else OUT_OF_MEMORY if low > gpu else TIGHT)


def test_measurement_has_no_band():
    assert band.band_bytes(123, "measure") == (123, 123)


@pytest.mark.parametrize("gpu, verdict", [("h100", FITS), ("rtx-4090", OUT_OF_MEMORY)])
def test_estimate_carries_band_and_verdict_through_json(gpu, verdict):
    cfg = RunConfig(model="qwen2.5-7b", method="lora", seq_len=2048, hardware={"gpu": gpu})
    est = estimate_training(resolve_model("qwen2.5-7b").spec, cfg, parse_gpu_arg(gpu))
    assert est.low_bytes < est.device_peak_bytes < est.high_bytes
    assert est.verdict == verdict
    data = json.loads(est.to_json())
    assert data["verdict"] == verdict and data["high_bytes"] == est.high_bytes
    assert MemoryEstimate.from_dict(data) == est


def test_tight_when_the_band_straddles_the_card():
    spec = resolve_model("qwen2.5-7b").spec
    cluster = parse_gpu_arg("a100-80gb")
    for seq in range(1024, 65536, 512):  # the first length whose band reaches the card
        cfg = RunConfig(model="qwen2.5-7b", method="lora", seq_len=seq, grad_ckpt=True)
        est = estimate_training(spec, cfg, cluster)
        if est.high_bytes > cluster.gpu.memory_bytes:
            assert est.verdict == TIGHT and est.fits
            return
    pytest.fail("no length reached the card")
