"""The report's curve of a predicted run over variable-length data (estimate --data)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from report_fixtures import make_estimate

from oomless.allocator import AllocatorConfig
from oomless.allocator.run import simulate_run
from oomless.planner.runsim import predict_run
from oomless.report import load_report_data, render_html

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_allocator_run import scaled  # noqa: E402  (the synthetic step of the run tests)


def test_report_draws_the_predicted_run_and_its_failure(tmp_path: Path) -> None:
    stream = scaled()
    samples = list(range(100, 1100, 50))
    expandable = simulate_run(stream, samples, AllocatorConfig(expandable_segments=True))
    pred = predict_run(stream, samples, batch=1, grad_accum=1, steps=len(samples),
                       order="sorted", cap=max(samples),
                       capacity_bytes=expandable.high_water_bytes)
    run = {**pred.to_dict(), "source": "--lengths <synthetic>"}
    est = make_estimate()
    est = dataclasses.replace(est, extra={**est.extra, "run": run})
    path = tmp_path / "estimate.json"
    path.write_text(est.to_json())
    data = load_report_data(path)
    assert data.run is not None and data.run["verdict"] == "fits only with expandable_segments"
    text = render_html(data)
    assert 'id="run"' in text and "Predicted run over the data" in text
    assert f"fails at step {pred.default.oom_step}" in text
    for label in ("predicted reserved", "reserved, expandable_segments", "predicted OOM"):
        assert json.dumps(label) in text
