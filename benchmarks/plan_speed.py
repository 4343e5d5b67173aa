"""Speed of the planner (issue 4): candidates per second and `oomless plan` end to end.

    .venv/bin/python benchmarks/plan_speed.py [--repeat 5]

Three figures, written to benchmarks/results/plan_speed.json:
- estimator: full candidate evaluations per second (memory through the
  estimator's own functions + the throughput model), no pruning, with the
  ModelSpec memo cleared before every run (cold);
- search: configurations decided per second by `search()` (a family's larger
  micro batches are decided without an estimate once a smaller one misses:
  memory never shrinks with the micro batch), and how many were estimated;
- CLI: wall time of `oomless plan MODEL --gpu ...` in a fresh process (cold
  start: interpreter, imports, catalog, search, rendering).
Goals: ≥ 10,000 candidates/s; `oomless plan` for a catalog model under 1 s.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from oomless.config import RunConfig
from oomless.models.catalog import resolve_model
from oomless.models.hardware import parse_gpu_arg
from oomless.planner import build_request, search
from oomless.planner.candidates import batch_splits, families
from oomless.planner.scoring import CandidateScorer

CASES = [  # (model, gpu, method, seq_len, effective batch)
    ("glm-4-9b", "rtx-4090", "auto", 2048, 16),
    ("llama-2-7b", "a100-80gb x8", "full", 2048, 64),
    ("qwen2.5-14b-instruct", "a100-40gb x4", "auto", 4096, 32),
    ("mixtral-8x7b-v0.1", "h100-sxm x8", "auto", 4096, 64),
    ("moe-llava-phi2-2.7b-4e", "a100-40gb x8", "full", 2048, 128),
]
RESULTS = Path(__file__).resolve().parent / "results" / "plan_speed.json"


def _request(model: str, gpu: str, method: str, seq_len: int, batch: int):
    spec = resolve_model(model).spec
    base = RunConfig(model=model, seq_len=seq_len,
                     method="lora" if method == "auto" else method)
    req = build_request(spec, base, parse_gpu_arg(gpu), effective_batch=batch,
                        method_auto=method == "auto")
    return spec, req


def _cold(spec) -> None:
    """Forget what the ModelSpec memoised (ModelSpec.cached): every run starts cold."""
    spec.__dict__.pop("_derived_cache", None)


def bench_estimator(repeat: int) -> dict:
    """Every candidate of every case, memory + speed, without pruning; memo cold."""
    prepared = []
    specs = []
    for case in CASES:
        spec, req = _request(*case)
        specs.append(spec)
        ev = CandidateScorer(spec, req)
        for fam in families(req, spec):
            states = ev.states(fam.cfg)
            ctx = ev.family_context(fam, states)
            cfgs = [fam.cfg.model_copy(update={"micro_batch_size": b, "grad_accum": a})
                    for b, a in batch_splits(req.per_gpu_batch)]
            prepared.append((ev, states, ctx, cfgs))
    n = sum(len(c) for *_x, c in prepared)
    times = []
    for _ in range(repeat):
        for spec in specs:
            _cold(spec)
        t0 = time.perf_counter()
        for ev, states, ctx, cfgs in prepared:
            for cfg in cfgs:
                fit = ev.memory(cfg, states)
                ev.speed(ctx, cfg, fit)
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"candidates": n, "best_s": round(best, 4), "candidates_per_s": round(n / best),
            "median_candidates_per_s": round(n / statistics.median(times))}


def bench_search(repeat: int) -> list[dict]:
    rows = []
    for case in CASES:
        spec, req = _request(*case)
        times, result = [], None
        for _ in range(repeat):
            _cold(spec)
            t0 = time.perf_counter()
            result = search(spec, req)
            times.append(time.perf_counter() - t0)
        best = min(times)
        rows.append({"model": case[0], "gpu": case[1], "method": case[2],
                     "searched": result.searched, "estimated": result.evaluated,
                     "fit": result.fitting, "best_s": round(best, 4),
                     "searched_per_s": round(result.searched / best),
                     "estimated_per_s": round(result.evaluated / best),
                     "top": result.best.family if result.best else None})
    return rows


def bench_cli(repeat: int) -> list[dict]:
    rows = []
    for argv in (["glm-4-9b", "--gpu", "4090"], ["llama-2-7b", "--gpu", "a100-80gb x8",
                                                 "--method", "full"]):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            subprocess.run([str(Path(sys.executable).parent / "oomless"), "plan", *argv],
                           check=False, capture_output=True)
            times.append(time.perf_counter() - t0)
        rows.append({"command": "oomless plan " + " ".join(argv),
                     "median_s": round(statistics.median(times), 3),
                     "best_s": round(min(times), 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"Python {platform.python_version()} (shared CI-class host)",
        "estimator": bench_estimator(args.repeat),
        "search": bench_search(args.repeat),
        "cli": bench_cli(args.repeat),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(RESULTS)
    est = out["estimator"]
    print(f"estimator: {est['candidates']} candidates, {est['candidates_per_s']:,}/s "
          f"(median {est['median_candidates_per_s']:,}/s)")
    for r in out["search"]:
        print(f"search {r['model']:24s} {r['gpu']:14s} {r['searched']:5d} decided "
              f"({r['estimated']} estimated) in {r['best_s']:.3f}s = {r['searched_per_s']:,}/s"
              f" → {r['top']}")
    for r in out["cli"]:
        print(f"{r['command']:55s} median {r['median_s']:.2f}s (best {r['best_s']:.2f}s)")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
