"""``gpu_runs.py compare``: each measured GPU run against the run oomless predicts.

Run jobs: the step traced at three lengths up to the run's longest
(oomless.runtime.trace.run_stream ``scaled_step_stream``), replayed through the
allocator model (oomless.allocator.run ``simulate_run``) with the measured steps'
micro-batch lengths and the job's PYTORCH_CUDA_ALLOC_CONF. Shell jobs: the trace of
the GLM-4V stand-in at the same size (oomless.runtime.trace.module_trace
``trace_module``). Writes benchmarks/results/gpu_runs.json and .md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from gpu_runs import HERE, PLAN, PREDICT_GPU, ROOT, SHELLS

RESULTS = HERE / "results"
GIB = 2**30


def compare(measured_file: Path) -> None:
    plan = {j["id"]: j for j in json.loads(PLAN.read_text())["jobs"]}
    records = [json.loads(line) for line in measured_file.read_text().splitlines() if line]
    rows = []
    for rec in records:
        job = plan[rec["id"]]
        if "error" in rec:
            rows.append({"id": rec["id"], "error": rec["error"][-300:]})
            continue
        row = _compare_shell(job, rec) if job["kind"] == "shell" else _compare_run(job, rec)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("curve")}), flush=True)
        rows.append(row)
    meta = next((r for r in records if "device" in r), {})
    result = {"measured_file": str(measured_file.name), "date": meta.get("date"),
              "device": meta.get("device"),
              "torch_on_gpu": meta.get("torch"), "transformers_on_gpu": meta.get("transformers"),
              "predicted_for": PREDICT_GPU, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_runs.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "gpu_runs.md").write_text(markdown(result))


def _compare_run(job: dict, rec: dict) -> dict[str, Any]:
    from oomless.allocator import AllocatorConfig
    from oomless.allocator.run import simulate_run
    from oomless.config import RunConfig
    from oomless.models.hardware import Cluster, get_gpu
    from oomless.runtime.trace.run_stream import capacity_bytes, scaled_step_stream

    cfg = RunConfig.model_validate(job["config"])
    if (ROOT / cfg.model).exists():  # a model folder named from the repository's root
        cfg = cfg.replace(model=str(ROOT / cfg.model))
    steps = rec["steps"]
    micro = [tuple(m) for m in job["micro_lengths"][: len(steps)]]
    cluster = Cluster(get_gpu(PREDICT_GPU))
    stream = scaled_step_stream(cfg, max(max(m) for m in micro), cluster)
    alloc = AllocatorConfig.from_conf(job["alloc_conf"], capacity_bytes(cluster, 1))
    pred = simulate_run(stream, micro, alloc, curve_points=0)
    by_step = {p.step: p for p in pred.curve}
    real_high = max(s[3] for s in steps)
    real_alloc = max(s[2] for s in steps)
    alloc_errors = [(by_step[s[0]].peak_allocated_bytes - s[2]) / s[2] for s in steps]
    return {"id": job["id"], "kind": "run", "order": job["order"],
            "alloc_conf": job["alloc_conf"], "steps_measured": len(steps),
            "steps_planned": len(job["micro_lengths"]), "traced_lengths": list(stream.lengths),
            "measured_high_water_bytes": real_high,
            "predicted_high_water_bytes": pred.high_water_bytes,
            "high_water_error": (pred.high_water_bytes - real_high) / real_high,
            "measured_high_water_step": next(s[0] for s in steps if s[3] == real_high),
            "predicted_high_water_step": pred.high_water_step,
            "measured_peak_allocated_bytes": real_alloc,
            "predicted_peak_allocated_bytes": pred.peak_allocated_bytes,
            "peak_allocated_error": (pred.peak_allocated_bytes - real_alloc) / real_alloc,
            "step_allocated_median_abs_error": statistics.median(map(abs, alloc_errors)),
            "step_allocated_worst_error": max(alloc_errors, key=abs),
            "measured_num_alloc_retries": rec["num_alloc_retries"],
            "predicted_num_alloc_retries": pred.num_alloc_retries,
            "published_reserved_max_bytes": job.get("published_reserved_max_bytes"),
            "source": job.get("source"),
            "measured_curve": steps,
            "predicted_curve": [[p.step, p.length, p.peak_allocated_bytes, p.peak_reserved_bytes,
                                 p.reserved_end_bytes] for p in pred.curve]}


def _compare_shell(job: dict, rec: dict) -> dict[str, Any]:
    sys.path.insert(0, str(SHELLS))
    from glm4v_shell import trace_full_shell

    from oomless.config import RunConfig

    cfg = RunConfig.model_validate(job["config"])
    stats, _spec = trace_full_shell(cfg)
    measured = {p: max(s[p] for s in rec["shell_steps"]) for p in ("forward", "backward")}
    phases = stats.phase_peaks
    return {"id": job["id"], "kind": "shell", "micro_batch_size": cfg.micro_batch_size,
            "measured_phase_peak_allocated_bytes": measured,
            "predicted_phase_peak_allocated_bytes": {p: phases.get(p) for p in measured},
            "measured_reserved_by_step_bytes": [s["reserved"] for s in rec["shell_steps"]],
            "predicted_reserved_bytes": stats.peak_reserved_bytes,
            "peak_allocated_error": (max(phases.get(p, 0) for p in measured)
                                     - max(measured.values())) / max(measured.values()),
            "reserved_error": (stats.peak_reserved_bytes - rec["max_reserved_bytes"])
            / rec["max_reserved_bytes"],
            "measured_weights_bytes": rec["weights_bytes"],
            "trainable_params_measured": rec["trainable_params"],
            "trainable_params_traced": stats.trainable_params}


def markdown(result: dict) -> str:
    lines = [f"# Runs on a GPU against oomless's predictions ({result['device']}, "
             f"{result['date']}; torch {result['torch_on_gpu']}, transformers "
             f"{result['transformers_on_gpu']})", "",
             "Runs over variable-length batches: the same micro-batch lengths, in the same "
             "order, run on the GPU and replayed through the allocator model "
             "(benchmarks/gpu_runs.py). Errors are (predicted − measured) / measured.", "",
             "| run | steps | reserved high water: measured / predicted (error) | "
             "peak allocated: measured / predicted (error) | per-step allocated, median |err| |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("kind") != "run":
            continue
        lines.append(
            f"| {r['id']}{' (' + r['alloc_conf'] + ')' if r['alloc_conf'] else ''} | "
            f"{r['steps_measured']} of {r['steps_planned']} | "
            f"{r['measured_high_water_bytes'] / GIB:.2f} / "
            f"{r['predicted_high_water_bytes'] / GIB:.2f} GiB ({r['high_water_error']:+.1%}) | "
            f"{r['measured_peak_allocated_bytes'] / GIB:.2f} / "
            f"{r['predicted_peak_allocated_bytes'] / GIB:.2f} GiB "
            f"({r['peak_allocated_error']:+.1%}) | {r['step_allocated_median_abs_error']:.1%} |")
    lines += ["", "GLM-4V stand-in (tests/runtime/glm4v_shell.py) at full size, one step per "
              "row measured twice:", "",
              "| batch | peak allocated: measured / traced (error) | reserved: measured by step "
              "/ traced (error) |", "|---|---|---|"]
    for r in result["rows"]:
        if r.get("kind") != "shell":
            continue
        m, p = r["measured_phase_peak_allocated_bytes"], r["predicted_phase_peak_allocated_bytes"]
        lines.append(
            f"| {r['micro_batch_size']} | {max(m.values()) / GIB:.2f} / "
            f"{max(v or 0 for v in p.values()) / GIB:.2f} GiB ({r['peak_allocated_error']:+.1%}) "
            f"| {' → '.join(f'{x / GIB:.2f}' for x in r['measured_reserved_by_step_bytes'])} / "
            f"{r['predicted_reserved_bytes'] / GIB:.2f} GiB ({r['reserved_error']:+.1%}) |")
    errors = [r["id"] for r in result["rows"] if "error" in r]
    if errors:
        lines += ["", "Failed on the GPU: " + ", ".join(errors)]
    return "\n".join(lines) + "\n"
