"""benchmarks/gpu_runs.py: the committed plan is what the code makes, and the committed
measurements belong to it (the GPU ran exactly the lengths the predictions replay)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _gpu_runs():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_runs
    finally:
        sys.path.remove(str(BENCH))
    return gpu_runs


def test_committed_plan_is_the_plan_the_code_makes():
    gpu_runs = _gpu_runs()
    committed = json.loads(gpu_runs.PLAN.read_text())["jobs"]
    assert json.loads(json.dumps(gpu_runs.make_plan())) == committed


def test_committed_measurements_ran_the_planned_lengths():
    gpu_runs = _gpu_runs()
    plan = {j["id"]: j for j in json.loads(gpu_runs.PLAN.read_text())["jobs"]}
    measured = [json.loads(line) for line in
                (BENCH / "results" / gpu_runs.MEASURED).read_text().splitlines() if line]
    assert measured
    for rec in measured:
        job = plan[rec["id"]]
        assert rec["date"] and rec["device"].startswith("NVIDIA")
        if job["kind"] == "run":  # each measured step's longest micro batch, in order
            steps = rec["steps"]
            assert [s[1] for s in steps] == [max(m) for m in job["micro_lengths"][:len(steps)]]
            # the reserved high water never falls: no empty_cache in these runs
            assert all(b[4] >= a[4] for a, b in zip(steps, steps[1:], strict=False))
