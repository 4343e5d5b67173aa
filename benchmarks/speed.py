"""Speed of the analytic estimate (issue 2): one estimate, and a cold CLI start.

Run: .venv/bin/python benchmarks/speed.py  → prints and writes
benchmarks/results/speed.json. Goals: one estimate < 5 ms; `oomless estimate
--json` from a cold start < 1 s.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.models.catalog import resolve_model
from oomless.models.hardware import parse_gpu_arg

RESULTS = Path(__file__).parent / "results" / "speed.json"


def time_estimates(n: int = 2000) -> dict:
    spec = resolve_model("qwen2.5-7b").spec
    cluster = parse_gpu_arg("a100-80gb x8")
    cfgs = [
        RunConfig(model="qwen2.5-7b", method=m, seq_len=s, micro_batch_size=b, zero=z,
                  hardware={"gpu": "a100-80gb", "gpus_per_node": 8})
        for m in ("full", "lora", "qlora") for s in (512, 4096) for b in (1, 4)
        for z in ((0, 1, 2) if m == "qlora" else (0, 3))
    ]
    samples = []
    for i in range(n):
        cfg = cfgs[i % len(cfgs)]
        t0 = time.perf_counter()
        estimate_training(spec, cfg, cluster)
        samples.append(time.perf_counter() - t0)
    return {"estimates": n, "median_ms": statistics.median(samples) * 1e3,
            "p99_ms": sorted(samples)[int(0.99 * n)] * 1e3}


def time_cold_cli(runs: int = 5) -> dict:
    exe = Path(sys.executable).with_name("oomless")
    argv = [str(exe), "estimate", "qwen2.5-7b", "--method", "qlora", "--gpu", "4090", "--json"]
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        samples.append(time.perf_counter() - t0)
    return {"runs": runs, "median_s": statistics.median(samples), "max_s": max(samples)}


def main() -> None:
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "analytic_estimate": time_estimates(),
        "cold_cli_estimate_json": time_cold_cli(),
        "goals": {"estimate_ms": 5, "cold_cli_s": 1},
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
