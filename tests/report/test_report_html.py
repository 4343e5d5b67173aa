"""`oomless report`: reading run folders and estimates, and the offline HTML it writes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from report_fixtures import make_estimate, write_run_dir

from oomless.cli import main
from oomless.errors import DataError
from oomless.report import load_report_data, render_html
from oomless.report.data import read_memlog
from oomless.units import GiB


def test_run_dir_reads_steps_events_config_and_estimate(run_dir: Path) -> None:
    data = load_report_data(run_dir)
    assert len(data.steps) == 30 and data.num_devices == 2
    assert [e.kind for e in data.events] == ["oom", "recovery"]
    assert data.events[0].is_oom and not data.events[1].is_oom
    assert data.config["grad_accum"] == 4
    assert data.estimate is not None and len(data.timeline) == 21
    assert data.gpu_memory_bytes == 48 * GiB
    lines = [json.loads(x) for x in (run_dir / "memlog.jsonl").read_text().splitlines()]
    assert data.measured_peak_bytes == max(max(x["peak_bytes"]) for x in lines)


def test_scalar_bytes_are_one_device(tmp_path: Path) -> None:
    path = tmp_path / "memlog.jsonl"
    path.write_text(json.dumps({"step": 1, "allocated_bytes": 5, "host_rss_bytes": 7}) + "\n")
    (step,) = read_memlog(path)
    assert step.allocated_bytes == (5,) and step.host_rss_bytes == 7


def test_torn_last_line_is_skipped_but_a_bad_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "memlog.jsonl"
    good = json.dumps({"step": 1, "peak_bytes": [1, 2]})
    path.write_text(good + "\n" + '{"step": 2, "peak_by')
    assert [s.step for s in read_memlog(path)] == [1]
    path.write_text('{"step": 2, "peak_by\n' + good + "\n")
    with pytest.raises(DataError, match=r"memlog.jsonl:1: not valid JSON"):
        read_memlog(path)


@pytest.mark.parametrize("line, match", [
    ({"loss": 1.0}, "missing integer 'step'"),
    ({"step": 1, "peak_bytes": "lots"}, "'peak_bytes' is 'lots'; expected bytes"),
    ({"step": 1, "peak_bytes": True}, "'peak_bytes' is True"),
])
def test_bad_records_name_the_line_and_field(tmp_path: Path, line: dict, match: str) -> None:
    path = tmp_path / "memlog.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(DataError, match=match):
        read_memlog(path)


def test_folder_without_a_log_or_estimate_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="has no memory log"):
        load_report_data(tmp_path)


def test_json_that_is_not_an_estimate_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"model": "x"}')
    with pytest.raises(DataError, match="is not a MemoryEstimate"):
        load_report_data(path)


def test_html_is_self_contained_and_escapes_text(tmp_path: Path) -> None:
    folder = write_run_dir(tmp_path / "run")
    with (folder / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 20, "event": "oom", "message": "<script>alert(1)</script>"}))
        fh.write("\n")
    text = render_html(load_report_data(folder))
    assert not re.search(r"<script[^>]+src=", text), "no external scripts: works offline"
    assert not re.search(r"<link[^>]+href=\"http", text)
    assert "<script>alert(1)</script>" not in text and "&lt;script&gt;alert(1)" in text
    assert text.count("Plotly.newPlot") == 4  # memory, breakdown, timeline, training
    from plotly.offline import get_plotlyjs

    assert text.count(get_plotlyjs()[:200]) == 1, "plotly.js embedded exactly once"


def test_estimate_only_report_has_the_breakdown_and_no_step_chart(estimate_file: Path) -> None:
    text = render_html(load_report_data(estimate_file))
    assert 'id="breakdown"' in text and 'id="memory-steps"' not in text
    assert "No OOM or recovery events" in text
    estimate = make_estimate()
    for category in estimate.components:
        assert json.dumps(category) in text


def test_cli_writes_report_next_to_the_source(run_dir: Path, estimate_file: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").stat().st_size > 100_000
    assert main(["report", str(estimate_file), "--out", str(run_dir / "e.html")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["report", str(run_dir / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_report_leaves_torch_out(run_dir: Path) -> None:
    import subprocess

    code = ("import sys; from oomless.cli import main; main(['report', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'report imported torch'")
    subprocess.run([sys.executable, "-c", code, str(run_dir)], check=True)


def test_reads_what_the_training_loop_writes(tmp_path: Path) -> None:
    """The memory log written by oomless.runtime.train.memlog (train's writer), CPU and GPU shapes."""
    from oomless.runtime.train.memlog import RunLog

    log = RunLog(tmp_path)
    log.step({"step": 1, "loss": 2.0, "host_rss_bytes": 400 * 2**20,
              "simulated_peak_bytes": 3 * 2**20, "predicted_peak_bytes": 5 * 2**20})
    log.step({"step": 2, "loss": 1.9, "allocated_bytes": [2 * GiB, 3 * GiB],
              "reserved_bytes": [4 * GiB, 4 * GiB], "peak_bytes": [5 * GiB, 6 * GiB],
              "predicted_peak_bytes": 5 * GiB})
    log.event("oom", "OOM at step 2 on rank(s) [0]: micro batch 4 -> 2", 2, ranks=[0],
              micro_batch_before=4, micro_batch_after=2)
    log.event("checkpoint", "checkpoint step-000002", 2, path="x")
    data = load_report_data(tmp_path)
    assert [s.step for s in data.steps] == [1, 2]
    assert data.steps[0].simulated_peak_bytes == 3 * 2**20 and data.num_devices == 2
    assert data.measured_peak_bytes == 6 * GiB and data.measured_peak_label == "measured peak"
    oom, ckpt = data.events
    assert oom.is_oom and oom.data["micro_batch_after"] == 2 and "time" not in oom.data
    assert ckpt.is_routine and not ckpt.is_oom


@pytest.mark.slow
def test_report_of_a_real_tiny_training_run(tmp_path: Path) -> None:
    """Train the tiny model for 3 steps on CPU with an injected OOM, then report the run."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from oomless.config import RunConfig
    from oomless.runtime.tiny import build_tiny_model, demo_data_path
    from oomless.runtime.train.loop import train

    model = build_tiny_model(tmp_path / "tiny")
    cfg = RunConfig.model_validate({
        "model": str(model), "method": "lora", "precision": "fp32", "micro_batch_size": 4,
        "grad_accum": 1, "seq_len": 64, "lora": {"r": 4},
        "data": {"train_file": str(demo_data_path())},
        "training": {"max_steps": 3, "output_dir": str(tmp_path / "run"),
                     "memory_budget_gb": 64, "inject_oom": [{"step": 2, "rank": 0}]},
    })
    run_dir = train(cfg).run_dir
    data = load_report_data(run_dir)
    assert len(data.steps) == 3 and any(e.is_oom for e in data.events)
    assert data.estimate is not None and data.measured_peak_label == "simulated peak (CPU)"
    text = render_html(data)
    assert 'id="memory-steps"' in text and 'id="breakdown"' in text


def test_timeline_as_allocator_replay_triples(tmp_path: Path) -> None:
    """oomless.allocator.replay's timeline: (event index, allocated, reserved) points."""
    from dataclasses import replace

    from oomless.allocator import replay

    events = [("alloc", i, (i + 1) * 2**20) for i in range(20)]
    events += [("free", i, 0) for i in range(0, 20, 2)]
    report = replay(events, timeline_points=16)
    estimate = replace(make_estimate(), extra={"timeline": report.to_dict()["timeline"]})
    path = tmp_path / "trace.json"
    path.write_text(estimate.to_json())
    data = load_report_data(path)
    assert len(data.timeline) == len(report.timeline) > 0
    assert max(p["allocated_bytes"] for p in data.timeline) == report.peak_allocated_bytes
    assert 'id="timeline"' in render_html(data)
