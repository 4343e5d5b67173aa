"""Accuracy of the analytic estimate against the trace, with the peers beside it.

Run: .venv/bin/python benchmarks/accuracy.py [--quick]
Writes benchmarks/results/accuracy.json and accuracy.md.

For every configuration of the matrix: ``oomless trace`` (the real
transformers/PEFT model on fake tensors, two training steps, every storage
tracked) gives the reference ``peak_allocated_bytes``; our analytic estimate,
accelerate's, DeepSpeed's, a gpu_poor-style formula and PyTorch's MemTracker
(where it runs) are compared with it. Relative error = (predicted − trace) /
trace; negative means an under-estimate. Goal for ours: median |error| ≤ 3%,
maximum ≤ 8%.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from peers import (  # noqa: E402
    accelerate_estimate,
    deepspeed_estimate,
    gpu_poor_estimate,
    memtracker_estimate,
)

from oomless.config import RunConfig  # noqa: E402
from oomless.memory import estimate_training  # noqa: E402
from oomless.memory.states import largest_module_params  # noqa: E402
from oomless.models.catalog import resolve_model  # noqa: E402

HERE = Path(__file__).parent
RESULTS = HERE / "results"
MQA = str(HERE / "configs" / "llama-mqa")
GEMMA3 = str(HERE / "configs" / "gemma-3-1b-it")
QWEN2VL = str(HERE / "configs" / "qwen2-vl-2b-instruct")
SHELLS = HERE.parent / "tests" / "runtime"  # glm4v_shell.py: GLM-4V's tower, test-only

# (model, what it stands for)
ARCHS = [
    ("qwen2.5-0.5b-instruct", "152k vocabulary, GQA 14/2, tied"),
    ("llama-3.2-1b-instruct", "GQA 32/8, tied, 128k vocabulary"),
    (MQA, "MQA (Llama-3.2-1B with one KV head)"),
    ("phi-2", "MHA, plain GELU MLP, LayerNorm, parallel block"),
    ("qwen1.5-moe-a2.7b", "MoE: 60 experts, top-4, shared expert"),
    ("llava-1.5-7b", "vision-language (LLaVA, 576 image tokens)"),
    ("qwen2.5-7b-instruct", "7B, GQA 28/4, 152k vocabulary"),
]


def matrix(quick: bool) -> list[dict]:
    rows: list[dict] = []
    small = ARCHS[:4]
    # 4 architectures × method × checkpointing × (batch, sequence, attention)
    shapes = [(1, 2048, "sdpa"), (4, 512, "eager"), (8, 256, "sdpa")]
    grid = itertools.product(small, ["lora", "full"], [False, True], shapes)
    for (model, _), method, ckpt, (b, s, attn) in grid:
        if ckpt and b == 8:
            continue
        rows.append({"model": model, "method": method, "grad_ckpt": ckpt,
                     "micro_batch_size": b, "seq_len": s, "attn": attn})
    rows += [
        {"model": "qwen2.5-0.5b-instruct", "method": "qlora", "micro_batch_size": 8, "seq_len": 256},
        {"model": "qwen2.5-0.5b-instruct", "method": "lora", "micro_batch_size": 1, "seq_len": 8192,
         "grad_ckpt": True},
        {"model": "llama-3.2-1b-instruct", "method": "lora", "micro_batch_size": 2, "seq_len": 4096,
         "lora": {"r": 64, "targets": ["q_proj", "v_proj"]}},
        {"model": "qwen1.5-moe-a2.7b", "method": "lora", "micro_batch_size": 1, "seq_len": 1024},
        {"model": "qwen1.5-moe-a2.7b", "method": "lora", "micro_batch_size": 2, "seq_len": 1024,
         "grad_ckpt": True},
        {"model": "llava-1.5-7b", "method": "lora", "micro_batch_size": 1, "seq_len": 1024,
         "data": {"images_per_sample": 1}},
        {"model": "llava-1.5-7b", "method": "lora", "micro_batch_size": 2, "seq_len": 512,
         "grad_ckpt": True, "data": {"images_per_sample": 1}},
        {"model": "qwen2.5-7b-instruct", "method": "lora", "micro_batch_size": 1, "seq_len": 2048},
        {"model": "qwen2.5-7b-instruct", "method": "qlora", "micro_batch_size": 4, "seq_len": 2048,
         "grad_ckpt": True},
        {"model": "qwen2.5-7b-instruct", "method": "full", "micro_batch_size": 1, "seq_len": 1024,
         "grad_ckpt": True},
    ]
    rows += issue12_rows()
    if quick:
        rows = rows[::8]
    return rows


def issue12_rows() -> list[dict]:
    """Gemma-2/3, vision towers, training stages, MoE + LoRA on the fused experts."""
    img = {"images_per_sample": 1}
    lm = {"r": 8, "dropout": 0.1, "targets": ["q_proj", "k_proj", "v_proj"]}
    return [
        # Gemma-2: soft-capping, eager (no SDPA path), four norms; Gemma-3: sliding masks
        {"model": "gemma-2-2b-it", "method": "lora", "micro_batch_size": 1, "seq_len": 1024},
        {"model": "gemma-2-2b-it", "method": "full", "micro_batch_size": 2, "seq_len": 1024},
        {"model": "gemma-2-9b-it", "method": "qlora", "micro_batch_size": 2, "seq_len": 2048,
         "grad_ckpt": True, "attn": "flash"},
        {"model": GEMMA3, "method": "lora", "micro_batch_size": 1, "seq_len": 2048},
        # vision towers run with the language model
        {"model": "llava-1.5-7b", "method": "lora", "micro_batch_size": 1, "seq_len": 1024,
         "data": img, "vision": {"freeze_tower": False}},
        {"model": QWEN2VL, "method": "lora", "micro_batch_size": 1, "seq_len": 512, "data": img,
         "vision": {"image_size": 448}},
        {"model": QWEN2VL, "method": "lora", "micro_batch_size": 1, "seq_len": 512, "data": img,
         "vision": {"image_size": 1344}},
        {"model": QWEN2VL, "method": "lora", "micro_batch_size": 1, "seq_len": 512, "data": img,
         "vision": {"image_size": 1344, "freeze_tower": False}},
        {"model": QWEN2VL, "method": "full", "micro_batch_size": 1, "seq_len": 256, "attn": "eager",
         "data": {"images_per_sample": 2}, "vision": {"image_size": 672}},
        {"model": "glm-4v-9b", "shell": "glm4v", "method": "lora", "micro_batch_size": 1,
         "seq_len": 1024, "data": img, "lora": lm},
        {"model": "glm-4v-9b", "shell": "glm4v", "method": "lora", "micro_batch_size": 1,
         "seq_len": 1024, "data": img, "lora": lm, "vision": {"freeze_tower": False}},
        # training stages through TRL's trainers (PPO: TRL's last PPOTrainer step)
        {"model": "qwen2.5-0.5b-instruct", "stage": "dpo", "method": "lora",
         "micro_batch_size": 2, "seq_len": 1024},
        {"model": "qwen2.5-0.5b-instruct", "stage": "dpo", "method": "full",
         "micro_batch_size": 2, "seq_len": 512},
        {"model": "llama-3.2-1b-instruct", "stage": "dpo", "method": "lora",
         "micro_batch_size": 1, "seq_len": 2048, "grad_ckpt": True},
        {"model": "qwen2.5-0.5b-instruct", "stage": "rm", "method": "lora",
         "micro_batch_size": 2, "seq_len": 1024},
        {"model": "qwen2.5-0.5b-instruct", "stage": "kto", "method": "lora",
         "micro_batch_size": 2, "seq_len": 1024},
        {"model": "qwen2.5-0.5b-instruct", "stage": "orpo", "method": "lora",
         "micro_batch_size": 2, "seq_len": 512},
        {"model": "qwen2.5-0.5b-instruct", "stage": "simpo", "method": "lora",
         "micro_batch_size": 2, "seq_len": 512},
        {"model": "qwen2.5-0.5b-instruct", "stage": "ppo", "method": "lora",
         "micro_batch_size": 2, "grad_accum": 2, "seq_len": 256},
        # MoE + LoRA all-linear: PEFT's merged expert copies
        {"model": "mixtral-8x7b-v0.1", "method": "lora", "micro_batch_size": 1, "seq_len": 512},
        {"model": "qwen3-30b-a3b", "method": "lora", "micro_batch_size": 1, "seq_len": 512},
    ]


def _err(pred: int | None, ref: int) -> float | None:
    return None if pred is None else (pred - ref) / ref


def _memtracker(resolved, cfg: RunConfig) -> tuple[int | None, str]:
    from oomless.runtime.build import TraceUnsupported, build_model, fake_mode
    from oomless.runtime.trace.hf_step import make_batch, run_steps

    try:
        built = build_model(resolved.hf_config, cfg, mode="fake")
    except TraceUnsupported as err:
        return None, str(err)
    fake = fake_mode()

    def step(tracker) -> None:
        run_steps(built.model, cfg, batch, device_type="cpu",
                  on_phase=lambda name, it: tracker.reset_mod_stats()
                  if (name == "forward" and it == 1) else None)

    with fake:
        batch = make_batch(built.model, cfg.micro_batch_size, cfg.seq_len, "cpu")
        return memtracker_estimate(step, built.model)


def _accelerate(resolved, cfg: RunConfig) -> int | None:
    import torch
    from transformers import AutoModelForCausalLM

    from oomless.runtime.build import transformers_config

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(transformers_config(resolved.hf_config))
    except (ValueError, KeyError):  # not a causal-LM class (e.g. LLaVA)
        return None
    return accelerate_estimate(model, cfg)


_MT_FROZEN_FAILURE: list[str] = []


def _glm4v_shell(cfg: RunConfig):
    """GLM-4V at 1120 px: a trace of the test-only stand-in of its EVA2-CLIP tower in front
    of transformers' GLM-4 port (running GLM-4V's eager CoreAttention and ChatGLM's loss),
    and the spec of exactly that model (LM: the port)."""
    sys.path.insert(0, str(SHELLS))
    from glm4v_shell import trace_full_shell

    stats, spec = trace_full_shell(cfg)
    peak = max(stats.phase_peaks, key=stats.phase_peaks.__getitem__)
    traced = SimpleNamespace(peak_allocated_bytes=stats.phase_peaks[peak], peak_phase=peak,
                             extra={})
    return spec, traced


def run_row(row: dict, with_memtracker: bool) -> dict:
    from oomless.runtime.trace.fake import trace_training

    cfg = RunConfig.model_validate({k: v for k, v in row.items() if k != "shell"})
    resolved = resolve_model(cfg.model)
    spec = resolved.spec
    t0 = time.perf_counter()
    if row.get("shell") == "glm4v":
        spec, traced = _glm4v_shell(cfg)
    else:
        traced = trace_training(cfg, resolved=resolved)
    trace_s = time.perf_counter() - t0
    ref = traced.peak_allocated_bytes
    ours = estimate_training(spec, cfg)
    out = {
        "config": {k: v for k, v in row.items()},
        "model": spec.name,
        "trace_bytes": ref,
        "trace_phase": traced.peak_phase,
        "trace_s": round(trace_s, 1),
        "trace_fallback": traced.extra.get("trace_fallback"),
        "ours_bytes": ours.peak_allocated_bytes,
        "ours_phase": ours.peak_phase,
        "deepspeed_bytes": deepspeed_estimate(spec, cfg, largest_module_params(spec)),
        "gpu_poor_bytes": gpu_poor_estimate(spec, cfg),
    }
    plain = cfg.stage == "sft" and not cfg.data.images_per_sample
    out["accelerate_bytes"] = _accelerate(resolved, cfg) if resolved.hf_config else None
    if not with_memtracker:
        mt, why = None, "not run"
    elif not plain:
        mt, why = None, "not run (its step is the causal-LM loss without images)"
    elif cfg.method != "full" and _MT_FROZEN_FAILURE:
        mt, why = None, _MT_FROZEN_FAILURE[0]  # it failed on the first frozen-weight row
    else:
        mt, why = _memtracker(resolved, cfg)
        if mt is None and cfg.method != "full":
            _MT_FROZEN_FAILURE.append(why)
    out["memtracker_bytes"], out["memtracker_failure"] = mt, why
    for peer in ("ours", "accelerate", "deepspeed", "gpu_poor", "memtracker"):
        out[f"{peer}_error"] = _err(out[f"{peer}_bytes"], ref)
    return out


def summary(rows: list[dict]) -> dict:
    out = {}
    for peer in ("ours", "accelerate", "deepspeed", "gpu_poor", "memtracker"):
        errs = [abs(r[f"{peer}_error"]) for r in rows
                if r[f"{peer}_error"] is not None and not r["trace_fallback"]]
        out[peer] = {
            "rows": len(errs),
            "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None,
        }
    return out


def _images(c: dict) -> str:
    """Images per sample, their size and whether the tower trains."""
    n = (c.get("data") or {}).get("images_per_sample", 0)
    if not n:
        return "—"
    vision = c.get("vision") or {}
    size = vision.get("image_size", "native")
    tower = "tower trained" if vision.get("freeze_tower") is False else "tower frozen"
    return f"{n}×{size}px, {tower}"


def markdown(result: dict) -> str:
    gib = 2**30
    s = result["summary"]
    lines = [
        f"# Analytic estimate vs trace — {result['date']}, {result['machine']}",
        "",
        "Peak allocated bytes per GPU; error = (predicted − trace) / trace.",
        "",
        "| estimator | rows | median abs error | max abs error |",
        "|---|---|---|---|",
    ]
    for peer, v in s.items():
        med = "—" if v["median_abs_error"] is None else f"{v['median_abs_error']:.1%}"
        mx = "—" if v["max_abs_error"] is None else f"{v['max_abs_error']:.1%}"
        lines.append(f"| {peer} | {v['rows']} | {med} | {mx} |")
    lines += ["", "| model | method | stage | b×s | ckpt | attn | images | trace GiB | ours | "
              "accelerate | DeepSpeed | gpu_poor | MemTracker |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def pct(x):
        return "—" if x is None else f"{x:+.1%}"

    for r in result["rows"]:
        c = r["config"]
        lines.append(
            f"| {r['model']} | {c.get('method')} | {c.get('stage', 'sft')} | "
            f"{c.get('micro_batch_size', 1)}×{c.get('seq_len')}"
            f"{'×' + str(c['grad_accum']) if c.get('grad_accum') else ''} | "
            f"{'yes' if c.get('grad_ckpt') else 'no'} | "
            f"{c.get('attn', 'sdpa')} | {_images(c)} | {r['trace_bytes'] / gib:.2f} | "
            f"{pct(r['ours_error'])} | "
            f"{pct(r['accelerate_error'])} | {pct(r['deepspeed_error'])} | "
            f"{pct(r['gpu_poor_error'])} | {pct(r['memtracker_error'])} |")
    fails = sorted({r["memtracker_failure"] for r in result["rows"] if r["memtracker_failure"]})
    if fails:
        lines += ["", "MemTracker failures: " + "; ".join(fails)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="every 8th row only")
    ap.add_argument("--no-memtracker", action="store_true")
    ap.add_argument("--rows", default=":", help="a slice of the matrix, e.g. 30: (to split runs)")
    ap.add_argument("--merge", nargs="*", default=[], help="result JSON files to combine")
    args = ap.parse_args()
    import platform

    rows = []
    suffix = "-quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    if args.merge:
        rows = [r for f in args.merge for r in json.loads(Path(f).read_text())["rows"]]
        result = {"date": date.today().isoformat(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores (CPU trace, no GPU)",
                  "summary": summary(rows), "rows": rows}
        (RESULTS / "accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / "accuracy.md").write_text(markdown(result))
        print(json.dumps(result["summary"], indent=1))
        return
    start, _, stop = args.rows.partition(":")
    selected = matrix(args.quick)[int(start) if start else None:int(stop) if stop else None]
    if args.rows != ":":
        suffix += f"-rows{start}-{stop}"
    for row in selected:
        r = run_row(row, not args.no_memtracker)
        rows.append(r)
        print(f"{r['model']:28s} {str(row):90.90s} ours {r['ours_error']:+.1%}", flush=True)
        result = {
            "date": date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores (CPU trace, no GPU)",
            "summary": summary(rows),
            "rows": rows,
        }
        # written after every row, so an interrupted run keeps what it measured
        (RESULTS / f"accuracy{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / f"accuracy{suffix}.md").write_text(markdown(result))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
