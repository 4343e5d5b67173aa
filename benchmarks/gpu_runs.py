"""Runs over variable-length batches on a real GPU, against the runs oomless predicts.

A run's reserved memory depends on the caching allocator's history across steps
(oomless.allocator.run); this script measures that history on a GPU, with the
exact step lengths the prediction replays, so that the allocator model is
checked apart from what a published run leaves unknown (its data, its order).
Three commands, so that the GPU does only what needs it:

    .venv/bin/python benchmarks/gpu_runs.py plan           # writes benchmarks/gpu_runs_plan.json
    python3 benchmarks/gpu_runs.py measure --out DIR        # on the GPU: DIR/gpu_runs_measured.jsonl
    .venv/bin/python benchmarks/gpu_runs.py compare FILE    # benchmarks/results/gpu_runs.{json,md}

``plan`` fixes each job: the run configuration, every optimizer step's micro-batch
lengths (oomless.planner.runsim ``micro_lengths``: the loader's order with its seed)
and the PYTORCH_CUDA_ALLOC_CONF it runs under. ``measure`` runs each job in its own
process (a fresh CUDA context and allocator; the setting read when CUDA starts):
the model built from its config on the GPU with random weights (runtime/build.py,
mode "real"), HF Trainer's micro step and optimizer step
(oomless.runtime.trace.hf_step), and after each optimizer step
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` since the step began,
``memory_reserved`` / ``memory_allocated`` at its end and the allocator's
``num_alloc_retries``. ``compare`` predicts each measured job from the step traced
at three lengths (oomless.runtime.trace.run_stream ``scaled_step_stream``) replayed
through the allocator model with the same lengths and setting.

Jobs of kind "shell" measure one configuration of the GLM-4V stand-in
(tests/runtime/glm4v_shell.py) at full size, per phase, against its trace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).parent
ROOT = HERE.parent
PLAN = HERE / "gpu_runs_plan.json"
MEASURED = "gpu_runs_measured.jsonl"
SHELLS = ROOT / "tests" / "runtime"
PREDICT_GPU = "h200"  # the catalog card the predictions are made for (capacity only)
DEVICE = "cuda"  # "cpu" under --dry-run

_LENGTHS = [96, 160, 240, 320, 480, 640, 900, 1280, 2048]
# Runs over lengths fixed here: (id, config, sample lengths, order, steps, alloc_conf)
SYNTHETIC = [
    ("qwen0.5b-lora-b4-random", {"model": "qwen2.5-0.5b-instruct", "method": "lora",
                                 "micro_batch_size": 4}, _LENGTHS, "random", 120, None),
    ("qwen0.5b-lora-b4-random-expandable", {"model": "qwen2.5-0.5b-instruct", "method": "lora",
                                            "micro_batch_size": 4}, _LENGTHS, "random", 120,
     "expandable_segments:True"),
    ("qwen0.5b-lora-b4-sorted", {"model": "qwen2.5-0.5b-instruct", "method": "lora",
                                 "micro_batch_size": 4}, _LENGTHS, "sorted", 120, None),
    ("llama1b-lora-b2-eager-random", {"model": "llama-3.2-1b-instruct", "method": "lora",
                                      "micro_batch_size": 2, "attn": "eager"},
     [128, 256, 384, 512, 768, 1024], "random", 120, None),
]
# ms-swift's Qwen-1 LoRA benchmark rows (benchmarks/run_published.py), with the lengths
# that row's prediction draws: (row id, steps measured at most)
SWIFT = [("swift-qwen-1_8b-chat-lora-1024", 62), ("swift-qwen-7b-chat-lora-512", 29),
         ("swift-qwen-1_8b-chat-lora-2048", 123)]
# GLM-4 finetune_demo's LoRA YAML on GLM-4V (tests/check/test_glm4v_story.py), as the
# stand-in runs it: 512 + 512 tokens, one 1120 px image, r 8 on the language model's
# q/k/v and the tower's query_key_value, language layers checkpointed, no autocast.
GLM4V = {"model": "glm-4v-9b", "method": "lora", "seq_len": 1024, "grad_ckpt": True,
         "data": {"images_per_sample": 1}, "vision": {"freeze_tower": False},
         "lora": {"r": 8, "alpha": 32, "dropout": 0.1, "targets": ["q_proj", "k_proj", "v_proj"]},
         "stack_options": {"autocast": False}}


# ---- plan (here) ---------------------------------------------------------------------
def make_plan() -> list[dict[str, Any]]:
    from oomless.config import RunConfig
    from oomless.planner.runsim import micro_lengths

    jobs = []
    for job_id, conf, lengths, order, steps, alloc_conf in SYNTHETIC:
        cfg = RunConfig.model_validate(conf)
        micro = micro_lengths(lengths, batch=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                              steps=steps, order=order, cap=max(lengths), seed=cfg.training.seed)
        jobs.append({"id": job_id, "kind": "run", "config": conf, "order": order,
                     "alloc_conf": alloc_conf, "micro_lengths": [list(m) for m in micro]})
    jobs += [_swift_job(row_id, steps) for row_id, steps in SWIFT]
    jobs += _diagnostic_jobs(jobs)
    for batch in (1, 2):
        jobs.append({"id": f"glm4v-shell-b{batch}", "kind": "shell", "steps": 2,
                     "config": {**GLM4V, "micro_batch_size": batch}, "alloc_conf": None})
    return jobs


def _diagnostic_jobs(jobs: list[dict]) -> list[dict[str, Any]]:
    """The ms-swift 1.8B row's first two steps, counters after every micro batch and the
    allocator's segments after the first two: as run, and with one setting changed each
    (the loss without swift's accuracy, no checkpointing, no LoRA dropout)."""
    base = next(j for j in jobs if j["id"] == "swift-qwen-1_8b-chat-lora-1024")
    variants = {"": {}, "-hf-loss": {"stack": "hf-trainer"}, "-no-ckpt": {"grad_ckpt": False},
                "-no-dropout": {"lora": {**base["config"]["lora"], "dropout": 0.0}}}
    return [{**base, "id": f"diag-swift-1_8b-1024{name}", "per_micro": True,
             "config": {**base["config"], **change}, "micro_lengths": base["micro_lengths"][:2]}
            for name, change in variants.items()]


def _swift_job(row_id: str, steps: int) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from length_shapes import sample_lengths
    from run_published import ROWS, SWIFT_DATA, SWIFT_SHAPES

    from oomless.config import load_run_config
    from oomless.planner.runsim import micro_lengths

    row = next(r for r in ROWS if r["id"] == row_id)
    d, cap = SWIFT_DATA, row["max_length"]
    path = HERE / row["config"]
    cfg = load_run_config(str(path))
    model = (path.parent / cfg.model).resolve().relative_to(ROOT)
    cfg = cfg.replace(seq_len=cap, model=str(model))
    drawn = sample_lengths(SWIFT_SHAPES[0], d["n"], d["mean"], d["std"], d["min"], d["max"],
                           seed=0)
    kept = [x for x in drawn if x <= cap]
    micro = micro_lengths(kept, batch=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                          steps=min(steps, max(1, len(kept) // cfg.grad_accum)),
                          order=row["order"], cap=cap)
    return {"id": row_id, "kind": "run", "config": cfg.model_dump(mode="json"),
            "order": row["order"], "alloc_conf": None, "source": row["source"],
            "published_reserved_max_bytes": row["published"]["reserved_max"],
            "micro_lengths": [list(m) for m in micro]}


# ---- measure (on the GPU) ---------------------------------------------------------------
def measure_all(plan: list[dict], out: Path, only: list[str], job_timeout_s: int,
                job_seconds: float, dry: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    by_id = {j["id"]: j for j in plan}
    unknown = [i for i in only if i not in by_id]
    if unknown:
        sys.exit(f"--only {' '.join(unknown)}: not in the plan ({', '.join(by_id)})")
    for job in [by_id[i] for i in only] if only else plan:  # --only: in its order
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if job["alloc_conf"]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = job["alloc_conf"]
        argv = [sys.executable, __file__, "_job", job["id"], "--out", str(out),
                "--job-seconds", str(job_seconds)] + (["--dry-run"] if dry else [])
        t0 = time.time()
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=job_timeout_s)
            failed = proc.returncode != 0
            tail = (proc.stderr or proc.stdout)[-1500:]
        except subprocess.TimeoutExpired:
            failed, tail = True, f"timed out after {job_timeout_s} s"
        print(f"{job['id']}: {'FAILED' if failed else 'done'} in {time.time() - t0:.0f} s",
              flush=True)
        if failed:
            print(tail, flush=True)
            _append(out, {"id": job["id"], "error": tail})


def _append(out: Path, record: dict) -> None:
    with open(out / MEASURED, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def dry_run(job: dict) -> dict:
    """``--dry-run``: the same code on CPU, two short steps, the GPU's counters read as 0
    (checks the script before GPU time is spent on it; its figures mean nothing)."""
    import torch

    global DEVICE
    DEVICE = "cpu"
    for name in ("synchronize", "reset_peak_memory_stats", "max_memory_allocated",
                 "max_memory_reserved", "memory_reserved", "memory_allocated"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.memory_stats = lambda *a, **k: {}
    torch.cuda.memory_snapshot = lambda *a, **k: []
    torch.cuda.get_device_name = lambda *a, **k: "cpu (dry run)"
    micro = [[min(x, 48) for x in m] for m in job.get("micro_lengths", [])[:2]]
    return {**job, "micro_lengths": micro, "steps": 1, "dry_run": True,
            "config": {**job["config"], "seq_len": 32} if job["kind"] == "shell"
            else job["config"]}


def run_job(job: dict, out: Path, job_seconds: float) -> None:
    import torch

    record = {"id": job["id"], "date": date.today().isoformat(),
              "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    import transformers

    record["transformers"] = transformers.__version__
    t0 = time.time()
    if job["kind"] == "shell":
        record.update(_measure_shell(job))
    else:
        record["steps"] = _measure_run(job, job_seconds)
        if job.get("micro_points"):
            record["micro_points"] = job["micro_points"]
    stats = torch.cuda.memory_stats()
    record.update(seconds=round(time.time() - t0, 1),
                  num_alloc_retries=stats.get("num_alloc_retries", 0),
                  num_ooms=stats.get("num_ooms", 0))
    _append(out, record)


def _measure_run(job: dict, job_seconds: float) -> list[list[int]]:
    """Per optimizer step: [step, longest length, max allocated, max reserved, reserved at
    the end, allocated at the end, num_alloc_retries so far]; stops after ``job_seconds``."""
    import torch

    from oomless.config import RunConfig
    from oomless.models.catalog import resolve_model
    from oomless.runtime.build import build_model
    from oomless.runtime.trace.hf_step import (
        _micro_step,
        _optimizer_step,
        make_batch,
        make_optimizer,
        training_forward,
    )
    from oomless.runtime.trace.stacks import stack_loss, step_context

    cfg = RunConfig.model_validate(job["config"])
    torch.manual_seed(cfg.training.seed)
    model = build_model(resolve_model(cfg.model).hf_config, cfg, mode="real",
                        device=DEVICE).model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg, DEVICE)
    forward, compute_loss = training_forward(model, cfg), stack_loss(cfg)
    held: list = []
    rows = []
    start = time.time()
    with step_context(cfg):
        for step, micro in enumerate(job["micro_lengths"]):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for i, length in enumerate(micro):
                batch = make_batch(model, cfg.micro_batch_size, length, DEVICE)
                _micro_step(forward, compute_loss, batch, cfg, DEVICE, None,
                            lambda *_: None, step, held)
                del batch
                if job.get("per_micro"):
                    _record_micro(job, step, i, length)
            _optimizer_step(optimizer, params, cfg, None)
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            rows.append([step, max(micro), torch.cuda.max_memory_allocated(),
                         torch.cuda.max_memory_reserved(), torch.cuda.memory_reserved(),
                         torch.cuda.memory_allocated(),
                         torch.cuda.memory_stats().get("num_alloc_retries", 0)])
            if time.time() - start > job_seconds:
                break
    return rows


def _record_micro(job: dict, step: int, index: int, length: int) -> None:
    """``per_micro`` jobs: after each micro batch, the counters and (for the first two
    micro batches) every segment with its blocks as the allocator holds them."""
    import torch

    torch.cuda.synchronize()
    point = {"step": step, "micro": index, "length": length,
             "allocated": torch.cuda.memory_allocated(),
             "reserved": torch.cuda.memory_reserved(),
             "max_allocated": torch.cuda.max_memory_allocated()}
    if step == 0 and index < job.get("snapshots", 2):
        point["segments"] = [[seg["total_size"], seg["segment_type"],
                              [[b["size"], b["state"] == "active_allocated"]
                               for b in seg["blocks"]]]
                             for seg in torch.cuda.memory_snapshot()]
    job.setdefault("micro_points", []).append(point)


def _measure_shell(job: dict) -> dict[str, Any]:
    """Weights, then per step the peak allocated in the forward, in the backward and in
    the optimizer step, and the reserved high water."""
    import torch

    sys.path.insert(0, str(SHELLS))
    from glm4v_shell import build_real_shell, shell_batch

    from oomless.config import RunConfig
    from oomless.memory.vision import image_tokens
    from oomless.models.catalog import get_entry, resolve_model
    from oomless.runtime.trace.hf_step import _optimizer_step, make_optimizer

    cfg = RunConfig.model_validate(job["config"])
    config = get_entry("glm-4v-9b").config
    torch.manual_seed(cfg.training.seed)
    layers = (1, 1) if job.get("dry_run") else (None, None)
    model, _ = build_real_shell(config, cfg, DEVICE, *layers)
    model.train()
    weights = torch.cuda.memory_allocated()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg, DEVICE)
    tokens = image_tokens(resolve_model("glm-4v-9b").spec, cfg)
    steps = []
    for _ in range(job["steps"]):
        one = shell_batch(model, config["vision_config"], cfg.seq_len, tokens, device=DEVICE)
        batch = {k: torch.cat([v] * cfg.micro_batch_size) for k, v in one.items()}
        del one
        torch.cuda.reset_peak_memory_stats()
        loss = model(**batch).loss
        forward = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        del loss, batch
        backward = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _optimizer_step(optimizer, params, cfg, None)
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        steps.append({"forward": forward, "backward": backward,
                      "optimizer": torch.cuda.max_memory_allocated(),
                      "reserved": torch.cuda.memory_reserved()})
    return {"weights_bytes": weights, "trainable_params": sum(p.numel() for p in params),
            "shell_steps": steps, "max_reserved_bytes": max(s["reserved"] for s in steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan")
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--only", nargs="*", default=[])
    m.add_argument("--job-timeout", type=int, default=240)
    m.add_argument("--job-seconds", type=float, default=90.0,
                   help="stop a run job's steps after this many seconds")
    m.add_argument("--dry-run", action="store_true",
                   help="run every job's code on CPU for two short steps (no GPU figures)")
    j = sub.add_parser("_job")
    j.add_argument("id")
    j.add_argument("--out", type=Path, required=True)
    j.add_argument("--job-seconds", type=float, default=90.0)
    j.add_argument("--dry-run", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("measured", type=Path)
    args = ap.parse_args()
    if args.cmd == "plan":
        PLAN.write_text(json.dumps({"jobs": make_plan()}) + "\n")
        print(f"wrote {PLAN}")
    elif args.cmd == "measure":
        plan = json.loads(PLAN.read_text())["jobs"]
        measure_all(plan, args.out, args.only, args.job_timeout, args.job_seconds,
                    args.dry_run)
    elif args.cmd == "_job":
        job = next(j for j in json.loads(PLAN.read_text())["jobs"] if j["id"] == args.id)
        run_job(dry_run(job) if args.dry_run else job, args.out, args.job_seconds)
    else:
        from gpu_runs_compare import compare

        compare(args.measured)


if __name__ == "__main__":
    main()
