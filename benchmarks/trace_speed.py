"""Speed and host memory of `oomless trace` (issue 3).

    .venv/bin/python benchmarks/trace_speed.py [--repeat 1] [--quick]

Every case runs `oomless trace MODEL ... --json` in a fresh process: cold start
(interpreter, torch/transformers/peft imports, building the model on the meta
device, two traced training steps per traced layer count, the allocator
simulation, JSON). Recorded per case: wall time, the child's peak resident
memory (``os.wait4`` rusage), the trace's own seconds and the layers it traced.
Goals: a 7B LoRA trace at 2048 tokens under 20 s using under 3 GB of host RAM;
70B under 3 minutes. The host is a shared 2-core machine: the load average at
the start of each case is recorded next to its time.

Results: benchmarks/results/trace_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "trace_speed.json"
GOAL_S = {"7b": 20.0, "70b": 180.0}
GOAL_RSS_MB = 3000

CASES = [  # (model, size class, extra options)
    ("llama-2-7b", "7b", ["--method", "lora"]),
    ("qwen2.5-7b-instruct", "7b", ["--method", "lora"]),
    ("llama-2-7b", "7b", ["--method", "qlora"]),
    ("llama-2-7b", "7b", ["--method", "lora", "--grad-ckpt"]),
    ("llama-3.1-70b-instruct", "70b", ["--method", "lora"]),
    ("llama-2-70b", "70b", ["--method", "qlora", "--grad-ckpt"]),
    ("llama-2-7b", "7b-full-trace", ["--method", "lora", "--full"]),
    ("llama-2-7b", "7b-full-trace", ["--method", "lora", "--grad-ckpt", "--full"]),
]


def run_case(model: str, options: list[str]) -> dict:
    cmd = [sys.executable, "-m", "oomless", "trace", model, "--seq-len", "2048",
           "--gpu", "a100-80gb", "--json", *options]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        load = os.getloadavg()[0]
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-2000:]}")
    est = json.loads(stdout)
    return {
        "wall_s": round(wall, 2),
        "max_rss_mb": round(usage.ru_maxrss / 1024),  # Linux: kilobytes
        "load_avg_1m_at_start": round(load, 2),
        "method": est["method"],
        "trace_s": est["extra"].get("trace_seconds"),
        "layers_traced": est["extra"].get("layers_traced"),
        "peak_allocated_gib": round(est["peak_allocated_bytes"] / 2**30, 3),
        "peak_reserved_gib": round(est["peak_reserved_bytes"] / 2**30, 3),
    }


def _extrapolation_check(rows: list[dict]) -> list[dict]:
    """Extrapolated (two small traces) against the full trace of the same case."""
    out = []
    for full in (r for r in rows if r["options"].endswith("--full")):
        base = full["options"].removesuffix(" --full")
        for r in rows:
            if r["model"] == full["model"] and r["options"] == base:
                out.append({
                    "model": r["model"], "options": base,
                    "allocated_rel_diff": round(
                        r["peak_allocated_gib"] / full["peak_allocated_gib"] - 1, 5),
                    "reserved_rel_diff": round(
                        r["peak_reserved_gib"] / full["peak_reserved_gib"] - 1, 5),
                    "speedup": round(full["wall_s"] / r["wall_s"], 2),
                })
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the best counts")
    parser.add_argument("--quick", action="store_true", help="only the two goal cases")
    args = parser.parse_args()
    cases = CASES[:1] + CASES[4:5] if args.quick else CASES
    rows = []
    for model, size, options in cases:
        runs = [run_case(model, options) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["wall_s"])
        goal = GOAL_S.get(size)
        row = {"model": model, "options": " ".join(options), "size": size, **best,
               "goal_s": goal,
               "meets_goal": None if goal is None else (
                   best["wall_s"] < goal and best["max_rss_mb"] < GOAL_RSS_MB),
               "all_wall_s": [r["wall_s"] for r in runs]}
        rows.append(row)
        print(f"{model:24} {row['options']:28} {best['wall_s']:7.1f} s "
              f"{best['max_rss_mb']:6} MB  load {best['load_avg_1m_at_start']:.1f}  "
              f"layers {best['layers_traced']}  {best['peak_allocated_gib']:.2f} GiB"
              + ("" if goal is None else f"  goal {goal:.0f} s: "
                 f"{'met' if row['meets_goal'] else 'MISSED'}"), flush=True)
    result = {
        "extrapolation_check": _extrapolation_check(rows),
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()} (shared host)",
        "goals": {"wall_s": GOAL_S, "max_rss_mb": GOAL_RSS_MB},
        "cases": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, RESULTS)
    print(f"wrote {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
