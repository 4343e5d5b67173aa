"""Helpers: a run folder as `oomless train` writes it, and an estimate as `oomless estimate --json` writes it."""

from __future__ import annotations

import json
from pathlib import Path

from oomless.result import MemoryEstimate
from oomless.units import GiB, MiB


def make_estimate(timeline: bool = False) -> MemoryEstimate:
    breakdown = {
        "forward": {"weights": 15 * GiB, "activations": 6 * GiB, "lora+optimizer": 300 * MiB},
        "backward": {"weights": 15 * GiB, "activations": 4 * GiB, "gradients": 200 * MiB,
                     "lora+optimizer": 300 * MiB},
        "optimizer": {"weights": 15 * GiB, "gradients": 200 * MiB, "lora+optimizer": 600 * MiB},
    }
    peak_phase = max(breakdown, key=lambda p: sum(breakdown[p].values()))
    peak = sum(breakdown[peak_phase].values())
    extra = {}
    if timeline:
        extra["timeline"] = [
            {"index": i, "phase": phase, "allocated_bytes": 15 * GiB + i * 200 * MiB,
             "reserved_bytes": 16 * GiB + i * 200 * MiB}
            for i, phase in enumerate(["forward"] * 10 + ["backward"] * 8 + ["optimizer"] * 3)
        ]
    return MemoryEstimate(
        method="trace" if timeline else "analytic", model="qwen2.5-7b", param_count=7_615_616_512,
        trainable_params=40_370_176, peak_phase=peak_phase, peak_allocated_bytes=peak,
        peak_reserved_bytes=peak + GiB, device_peak_bytes=peak + GiB + 600 * MiB,
        breakdown=breakdown, non_pytorch_bytes={"cuda_context": 600 * MiB},
        assumptions=("activations of frozen linears are not kept",),
        config={"model": "qwen2.5-7b", "method": "lora", "micro_batch_size": 4,
                "hardware": {"gpu": "a6000"}},
        gpu="rtx-a6000", gpu_memory_bytes=48 * GiB, extra=extra,
    )


def write_run_dir(folder: Path, gpus: int = 2, steps: int = 30) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    estimate = make_estimate(timeline=True)
    (folder / "estimate.json").write_text(estimate.to_json())
    lines = []
    for step in range(1, steps + 1):
        allocated = [15 * GiB + (step % 5) * 300 * MiB + g * 500 * MiB for g in range(gpus)]
        lines.append({
            "step": step, "loss": 2.5 / step ** 0.3, "lr": 2e-4, "tokens": 8192,
            "step_time_s": 1.5, "tokens_per_s": 8192 / 1.5,
            "allocated_bytes": allocated,
            "reserved_bytes": [a + 2 * GiB for a in allocated],
            "peak_bytes": [a + 5 * GiB for a in allocated],
            "predicted_peak_bytes": estimate.peak_allocated_bytes,
        })
    (folder / "memlog.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    events = [
        {"step": 12, "event": "oom", "message": "CUDA out of memory. Tried to allocate 6.56 GiB",
         "micro_batch_size": 4},
        {"step": 12, "event": "recovery", "message": "retrying with micro batch 2, accumulation 8",
         "micro_batch_size": 2},
    ]
    (folder / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in events))
    (folder / "oomless.yaml").write_text(
        "model: qwen2.5-7b\nmethod: lora\nmicro_batch_size: 4\ngrad_accum: 4\n"
        "hardware:\n  gpu: a6000\n  gpus_per_node: 2\n"
    )
    return folder
