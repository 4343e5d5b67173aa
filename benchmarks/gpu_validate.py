"""Ground truth on a real GPU: predicted (analytic and trace) vs measured memory.

Run on a machine with an NVIDIA GPU:
    .venv/bin/python benchmarks/gpu_validate.py [--rows N] [--gpu NAME]
Each configuration runs `oomless measure --device cuda --json` in its own
process (a fresh CUDA context, an empty caching allocator), which reports
torch.cuda.max_memory_allocated / max_memory_reserved and the device memory
NVML shows. Predictions are made here for the same GPU. Writes
benchmarks/results/gpu_validate.json and gpu_validate.md with the date and
the GPU's name. Goal: median |error| ≤ 2%, worst ≤ 5%, and never more than 3%
under the measured device peak.

Measure on the GPU and predict elsewhere (the predictions need no GPU):
    python3 benchmarks/gpu_validate.py --measure-only --out DIR    # on the GPU
    .venv/bin/python benchmarks/gpu_validate.py --from DIR/gpu_validate_measured.json
Runs over variable-length batches are benchmarks/gpu_runs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oomless.config import RunConfig  # noqa: E402
from oomless.memory import estimate_training  # noqa: E402
from oomless.models.catalog import resolve_model  # noqa: E402
from oomless.models.hardware import Cluster, get_gpu  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MEASURES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes")

# A subset of benchmarks/accuracy.py's matrix that fits an 80 GB GPU.
ROWS = [
    {"model": "qwen2.5-0.5b-instruct", "method": "lora", "micro_batch_size": 1, "seq_len": 2048},
    {"model": "qwen2.5-0.5b-instruct", "method": "full", "micro_batch_size": 4, "seq_len": 512},
    {"model": "qwen2.5-0.5b-instruct", "method": "lora", "micro_batch_size": 4, "seq_len": 512,
     "attn": "eager"},
    {"model": "qwen2.5-0.5b-instruct", "method": "qlora", "micro_batch_size": 8, "seq_len": 256},
    {"model": "llama-3.2-1b-instruct", "method": "lora", "micro_batch_size": 2, "seq_len": 2048,
     "grad_ckpt": True},
    {"model": "llama-3.2-1b-instruct", "method": "full", "micro_batch_size": 1, "seq_len": 2048},
    {"model": "phi-2", "method": "lora", "micro_batch_size": 1, "seq_len": 2048},
    {"model": "qwen2.5-7b-instruct", "method": "lora", "micro_batch_size": 1, "seq_len": 2048},
    {"model": "qwen2.5-7b-instruct", "method": "qlora", "micro_batch_size": 4, "seq_len": 2048,
     "grad_ckpt": True},
    {"model": "qwen2.5-7b-instruct", "method": "lora", "micro_batch_size": 2, "seq_len": 4096,
     "grad_ckpt": True},
]


def gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_validate.py needs an NVIDIA GPU (torch.cuda.is_available() is False); "
                 "run it on a GPU machine")
    return torch.cuda.get_device_name(0)


def measure(row: dict, gpu: str, timeout_s: int) -> dict:
    argv = [sys.executable, "-m", "oomless", "measure", row["model"], "--device", "cuda", "--json", "--gpu", gpu,
            "--method", row["method"], "--batch-size", str(row["micro_batch_size"]),
            "--seq-len", str(row["seq_len"]), "--attn", row.get("attn", "sdpa")]
    if row.get("grad_ckpt"):
        argv.append("--grad-ckpt")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:300]}
    return json.loads(proc.stdout)


def predict(row: dict, gpu: str, with_trace: bool) -> dict:
    cfg = RunConfig.model_validate({**row, "hardware": {"gpu": gpu}})
    resolved = resolve_model(cfg.model)
    cluster = Cluster(get_gpu(gpu))
    out = {"analytic": estimate_training(resolved.spec, cfg, cluster).to_dict()}
    if with_trace:
        from oomless.runtime.trace.fake import trace_training

        out["trace"] = trace_training(cfg, cluster, resolved=resolved).to_dict()
    return out


def errors(pred: dict, meas: dict) -> dict:
    return {k: (pred[k] - meas[k]) / meas[k] for k in MEASURES if meas.get(k)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=len(ROWS))
    ap.add_argument("--gpu", default="h100-sxm", help="catalog GPU to predict for")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--measure-only", action="store_true",
                    help="measure and write DIR/gpu_validate_measured.json; predict later "
                         "with --from")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--skip", nargs="*", default=[], metavar="METHOD",
                    help="leave out rows of these methods (e.g. qlora without bitsandbytes)")
    ap.add_argument("--from", dest="measured", type=Path, default=None,
                    help="predict the rows of a --measure-only file (no GPU needed)")
    args = ap.parse_args()
    if args.measured is not None:
        done = json.loads(args.measured.read_text())
        device, measured_rows = done["gpu"], done["rows"]
        args.gpu = done["catalog_gpu"]
    else:
        device = gpu_name()
        args.out.mkdir(parents=True, exist_ok=True)
        measured_rows = []
        for row in ROWS[: args.rows]:
            if row["method"] in args.skip:
                continue
            measured_rows.append({"config": row, "measured": measure(row, args.gpu, args.timeout)})
            print(json.dumps(measured_rows[-1]), flush=True)
            if args.measure_only:  # after every row: a run cut short keeps what it measured
                (args.out / "gpu_validate_measured.json").write_text(json.dumps(
                    {"date": date.today().isoformat(), "gpu": device, "catalog_gpu": args.gpu,
                     "rows": measured_rows}, indent=1) + "\n")
        if args.measure_only:
            return
    rows = [_with_predictions(r, args.gpu, not args.no_trace) for r in measured_rows]
    result = {"date": done["date"] if args.measured else date.today().isoformat(),
              "gpu": device, "catalog_gpu": args.gpu, "rows": rows, "summary": summarise(rows)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_validate.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "gpu_validate.md").write_text(markdown(result))
    print(json.dumps(result["summary"], indent=1))


def markdown(result: dict) -> str:
    """Measured vs predicted per row, the errors (predicted − measured) / measured."""
    gib = 2**30
    lines = [f"# Predicted vs measured on {result['gpu']} ({result['date']}; predicted for "
             f"the catalog's {result['catalog_gpu']})", "",
             "| configuration | measured allocated / reserved / device | analytic error | "
             "trace error |", "|---|---|---|---|"]
    for r in result["rows"]:
        m, conf = r["measured"], r["config"]
        name = " ".join(f"{k}={v}" for k, v in conf.items())
        if "error" in m:
            lines.append(f"| {name} | failed: {m['error']} | | |")
            continue
        got = " / ".join(f"{m[k] / gib:.2f}" for k in MEASURES)
        errs = [" / ".join(f"{r[f'{e}_error'][k]:+.1%}" for k in MEASURES if k in r[f"{e}_error"])
                if f"{e}_error" in r else "—" for e in ("analytic", "trace")]
        lines.append(f"| {name} | {got} GiB | {errs[0]} | {errs[1]} |")
    lines += ["", "Errors are listed as allocated / reserved / device. Summary (median |error|, "
              "worst under):", ""]
    for k, v in result["summary"].items():
        lines.append(f"- {k}: {v['rows']} rows, median {v['median_abs']:.2%}, "
                     f"worst under {v['worst_under']:+.1%}")
    return "\n".join(lines) + "\n"


def _with_predictions(rec: dict, gpu: str, with_trace: bool) -> dict:
    rec = dict(rec)
    if "error" not in rec["measured"]:
        for name, est in predict(rec["config"], gpu, with_trace).items():
            rec[f"{name}_predicted"] = {k: est[k] for k in MEASURES}
            rec[f"{name}_error"] = errors(est, rec["measured"])
    print(json.dumps({"config": rec["config"],
                      **{k: v for k, v in rec.items() if k.endswith("error")}}), flush=True)
    return rec


def summarise(rows: list[dict]) -> dict:
    out = {}
    for name in ("analytic", "trace"):
        for k in MEASURES:
            errs = [r[f"{name}_error"][k] for r in rows if f"{name}_error" in r
                    and k in r[f"{name}_error"]]
            if errs:
                out[f"{name}.{k}"] = {"rows": len(errs),
                                      "median_abs": statistics.median(map(abs, errs)),
                                      "max_abs": max(map(abs, errs)),
                                      "worst_under": min(errs)}
    return out


if __name__ == "__main__":
    main()
