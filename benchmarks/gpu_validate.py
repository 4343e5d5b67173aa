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

With --variable, a run over variable-length batches (VARIABLE_ROWS): the same
step lengths (the loader's order with a seed, oomless.planner.runsim) run on the
GPU, one optimizer, the caching allocator keeping its blocks from step to step,
and are predicted by oomless.allocator.run from the step traced at three
lengths; per step, the real and predicted max_memory_reserved / allocated are
written to benchmarks/results/gpu_validate_variable.json (curves and the
high-water error). --alloc-conf TEXT runs it under PYTORCH_CUDA_ALLOC_CONF=TEXT
(set before CUDA starts) and predicts it with the same settings, e.g.
expandable_segments:True, the setting a run that "fits only with
expandable_segments" depends on. Each row starts from an empty allocator (what
was left before is collected and the cache emptied; what stays reserved is
recorded) and records the allocator's retries (num_alloc_retries: cudaMalloc
failed, the cache was freed and the request retried) beside the predicted ones.
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
from typing import Any

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


# Runs over variable-length batches: sample lengths (each equally frequent), the loader's
# order and the steps replayed; one optimizer over all steps.
VARIABLE_ROWS = [
    {"config": {"model": "qwen2.5-0.5b-instruct", "method": "lora", "micro_batch_size": 4},
     "lengths": [96, 160, 240, 320, 480, 640, 900, 1280, 2048], "order": "random", "steps": 120},
    {"config": {"model": "qwen2.5-0.5b-instruct", "method": "lora", "micro_batch_size": 4},
     "lengths": [96, 160, 240, 320, 480, 640, 900, 1280, 2048], "order": "sorted", "steps": 120},
    {"config": {"model": "llama-3.2-1b-instruct", "method": "lora", "micro_batch_size": 2,
                "attn": "eager"},
     "lengths": [128, 256, 384, 512, 768, 1024], "order": "random", "steps": 120},
]


def gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_validate.py needs an NVIDIA GPU (torch.cuda.is_available() is False); "
                 "run it on a GPU machine")
    return torch.cuda.get_device_name(0)


def measure(row: dict, gpu: str, timeout_s: int) -> dict:
    exe = Path(sys.executable).with_name("oomless")
    argv = [str(exe), "measure", row["model"], "--device", "cuda", "--json", "--gpu", gpu,
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


def variable_run_on_gpu(cfg: RunConfig, lengths: list[int]) -> list[list[int]]:
    """Per step: [step, length, max allocated, max reserved, reserved at the end,
    allocated at the end, num_alloc_retries so far] (the first five as the prediction's
    StepPoint has them)."""
    import torch

    from oomless.runtime.build import build_model
    from oomless.runtime.trace.hf_step import (
        _micro_step,
        _optimizer_step,
        make_batch,
        make_optimizer,
        training_forward,
    )
    from oomless.runtime.trace.stacks import stack_loss, step_context

    torch.manual_seed(cfg.training.seed)
    model = build_model(resolve_model(cfg.model).hf_config, cfg, mode="real",
                        device="cuda").model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg, "cuda")
    forward, compute_loss = training_forward(model, cfg), stack_loss(cfg)
    held: list = []
    rows = []
    with step_context(cfg):
        for step, length in enumerate(lengths):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(cfg.grad_accum):
                batch = make_batch(model, cfg.micro_batch_size, length, "cuda")
                _micro_step(forward, compute_loss, batch, cfg, "cuda", None,
                            lambda *_: None, step, held)
                del batch
            _optimizer_step(optimizer, params, cfg, None)
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            rows.append([step, length, torch.cuda.max_memory_allocated(),
                         torch.cuda.max_memory_reserved(), torch.cuda.memory_reserved(),
                         torch.cuda.memory_allocated(),
                         torch.cuda.memory_stats().get("num_alloc_retries", 0)])
    return rows


def empty_allocator() -> int:
    """Drop what an earlier row left (reference cycles included) and give the cache back;
    the bytes still reserved after it (0 for a clean start)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def compare_curves(measured: list[list[int]], pred: Any) -> dict:
    """High water, its step, the reserved-but-unallocated share at the end of the run,
    the worst per-step error of the step's peak reserved, and the retries, measured and
    predicted."""
    real_high = max(r[3] for r in measured)
    by_step = {p.step: p for p in pred.curve}
    step_errors = [(by_step[r[0]].peak_reserved_bytes - r[3]) / r[3]
                   for r in measured if r[0] in by_step and r[3]]
    last = pred.curve[-1] if pred.curve else None
    return {"measured_high_water_bytes": real_high,
            "predicted_high_water_bytes": pred.high_water_bytes,
            "high_water_error": (pred.high_water_bytes - real_high) / real_high,
            "measured_high_water_step": next(r[0] for r in measured if r[3] == real_high),
            "predicted_high_water_step": pred.high_water_step,
            "step_peak_reserved_worst_error": max(step_errors, key=abs, default=None),
            "measured_reserved_end_bytes": measured[-1][4],
            "predicted_reserved_end_bytes": last.reserved_end_bytes if last else None,
            "measured_num_alloc_retries": measured[-1][6],
            "predicted_num_alloc_retries": pred.num_alloc_retries,
            "predicted_fits": pred.fits}


def variable_rows(args: argparse.Namespace) -> list[dict]:
    """Each VARIABLE_ROWS run measured in this process, then predicted."""
    from oomless.allocator import AllocatorConfig
    from oomless.allocator.run import simulate_run
    from oomless.planner.runsim import step_lengths
    from oomless.runtime.trace.run_stream import capacity_bytes, scaled_step_stream

    out = []
    for row in VARIABLE_ROWS[: args.rows]:
        cfg = RunConfig.model_validate({**row["config"], "hardware": {"gpu": args.gpu}})
        lens = step_lengths(row["lengths"], batch=cfg.micro_batch_size,
                            grad_accum=cfg.grad_accum, steps=row["steps"], order=row["order"],
                            cap=max(row["lengths"]), seed=cfg.training.seed)
        left_reserved = empty_allocator()
        measured = variable_run_on_gpu(cfg, lens)
        empty_allocator()
        cluster = Cluster(get_gpu(args.gpu))
        stream = scaled_step_stream(cfg, max(lens), cluster)
        alloc_cfg = AllocatorConfig.from_conf(args.alloc_conf, capacity_bytes(cluster, 1))
        pred = simulate_run(stream, lens, alloc_cfg, curve_points=0)
        rec = {"config": row, "alloc_conf": args.alloc_conf,
               "predicted_allocator": alloc_cfg.describe(),
               "reserved_before_row_bytes": left_reserved,
               "traced_lengths": list(stream.lengths),
               "measured_curve": measured,
               "predicted_curve": [list(p.__dict__.values()) for p in pred.curve],
               **compare_curves(measured, pred)}
        print(json.dumps({k: v for k, v in rec.items() if not k.endswith("curve")}), flush=True)
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variable", action="store_true",
                    help="runs over variable-length batches (VARIABLE_ROWS) instead")
    ap.add_argument("--rows", type=int, default=len(ROWS))
    ap.add_argument("--gpu", default="h100-sxm", help="catalog GPU to predict for")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--alloc-conf", default=None, metavar="TEXT",
                    help="with --variable: run under PYTORCH_CUDA_ALLOC_CONF=TEXT and predict "
                         "with it (e.g. expandable_segments:True)")
    args = ap.parse_args()
    if args.alloc_conf is not None:  # read when CUDA starts: before torch touches the GPU
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    device = gpu_name()
    if args.variable:
        result = {"date": date.today().isoformat(), "gpu": device, "catalog_gpu": args.gpu,
                  "alloc_conf": args.alloc_conf, "rows": variable_rows(args)}
        RESULTS.mkdir(exist_ok=True)
        name = "gpu_validate_variable" + ("_" + args.alloc_conf.replace(":", "-").replace(",", "_")
                                          if args.alloc_conf else "")
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        return
    rows = []
    for row in ROWS[: args.rows]:
        measured = measure(row, args.gpu, args.timeout)
        pred = predict(row, args.gpu, not args.no_trace)
        rec = {"config": row, "measured": measured}
        if "error" not in measured:
            for name, est in pred.items():
                rec[f"{name}_predicted"] = {k: est[k] for k in MEASURES}
                rec[f"{name}_error"] = errors(est, measured)
        rows.append(rec)
        print(json.dumps({"config": row, **{k: v for k, v in rec.items() if k.endswith("error")}}),
              flush=True)
    result = {"date": date.today().isoformat(), "gpu": device, "catalog_gpu": args.gpu,
              "rows": rows, "summary": summarise(rows)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_validate.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


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
