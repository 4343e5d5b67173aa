"""Pre-quantized checkpoints: predicted weight bytes against the published files,
and what reading the quantization changes in a LoRA estimate.

Run: .venv/bin/python benchmarks/prequantized.py
Writes benchmarks/results/prequantized.json and prequantized.md.

Reality here is the checkpoints' safetensors files (their sizes as the Hugging
Face file pages print them, tests/fixtures/quantized/): the quantized layers'
buffers plus the 16-bit remainder. The layers themselves cannot be built on a
CPU (transformers needs gptqmodel/aqlm and a GPU), so the activation side of a
GPTQ/AWQ LoRA step is analytic only.
"""

from __future__ import annotations

import copy
import json
import sys
from datetime import date
from pathlib import Path

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.memory.precision import dtypes_for
from oomless.memory.states import model_states
from oomless.models.catalog import get_entry
from oomless.models.hardware import parse_gpu_arg
from oomless.models.hf_config import spec_from_hf_config

HERE = Path(__file__).parent
RESULTS = HERE / "results"
FIXTURE = HERE.parent / "tests" / "fixtures" / "quantized" / "checkpoints.json"
GiB = 2**30


def _spec(base: str, qcfg: dict, dtype: str):
    config = copy.deepcopy(get_entry(base).config)
    config["quantization_config"] = copy.deepcopy(qcfg)
    config["torch_dtype"] = dtype
    return spec_from_hf_config(config, f"{base} ({qcfg['quant_method']})")


def storage_rows() -> list[dict]:
    rows = []
    for ckpt in json.loads(FIXTURE.read_text())["checkpoints"]:
        spec = _spec(ckpt["base"], ckpt["quantization_config"], ckpt["torch_dtype"])
        cfg = RunConfig(model="x", method="lora")
        predicted = model_states(spec, cfg, dtypes_for(cfg)).gpu["weights"]
        published = sum(ckpt["files_gb"]) * 1e9
        rows.append({"checkpoint": ckpt["repo"], "format": spec.quantization.label,
                     "published_gb": round(published / 1e9, 3),
                     "predicted_gb": round(predicted / 1e9, 3),
                     "error": round((predicted - published) / published, 4)})
    return rows


def lora_rows() -> list[dict]:
    """Meta-Llama-3-8B-Instruct GPTQ 4-bit g128 + LoRA (rank 8, all linear layers),
    batch 1, on an RTX 4090: the checkpoint read as bf16 (before) and as GPTQ."""
    gptq_cfg = json.loads(FIXTURE.read_text())["checkpoints"][0]
    gptq = _spec(gptq_cfg["base"], gptq_cfg["quantization_config"], "float16")
    as_bf16 = get_entry("meta-llama-3-8b-instruct").spec
    cluster = parse_gpu_arg("4090")
    rows = []
    for seq in (512, 1024, 2048):
        for ckpt in (True, False):
            cfg = RunConfig(model="x", method="lora", seq_len=seq, grad_ckpt=ckpt,
                            lora={"r": 8, "targets": "all-linear"}, stack="llamafactory")
            new, old = estimate_training(gptq, cfg, cluster), estimate_training(as_bf16, cfg, cluster)
            rows.append({"seq_len": seq, "grad_ckpt": ckpt,
                         "read_as_bf16_gib": round(old.device_peak_bytes / GiB, 2),
                         "gptq_gib": round(new.device_peak_bytes / GiB, 2),
                         "gptq_weights_gib": round(new.breakdown[new.peak_phase]["weights"] / GiB, 2)})
    return rows


def markdown(storage: list[dict], lora: list[dict]) -> str:
    lines = [f"# Pre-quantized checkpoints — {date.today().isoformat()}", "",
             "Weight bytes predicted from `quantization_config` against the published "
             "safetensors files (GB = 10^9 bytes; the pages print 3 significant figures).", "",
             "| checkpoint | format | published GB | predicted GB | error |", "|---|---|---|---|---|"]
    for r in storage:
        lines.append(f"| {r['checkpoint']} | {r['format']} | {r['published_gb']} | "
                     f"{r['predicted_gb']} | {r['error']:+.2%} |")
    lines += ["", "Meta-Llama-3-8B-Instruct GPTQ 4-bit g128 + LoRA r8 on all linear layers, "
              "batch 1, RTX 4090, device peak (GiB). `read as bf16`: what the estimate said "
              "before it read quantization_config. The GPTQ training kernel (gptqmodel "
              "TorchLinear) keeps a 16-bit copy of each weight for backward, so without "
              "gradient checkpointing GPTQ needs more than bf16 LoRA. Not yet measured on a GPU.",
              "", "| seq | grad ckpt | read as bf16 | GPTQ | GPTQ weights |", "|---|---|---|---|---|"]
    for r in lora:
        lines.append(f"| {r['seq_len']} | {'yes' if r['grad_ckpt'] else 'no'} | "
                     f"{r['read_as_bf16_gib']} | {r['gptq_gib']} | {r['gptq_weights_gib']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    storage, lora = storage_rows(), lora_rows()
    RESULTS.mkdir(exist_ok=True)
    from oomless.fileio import write_atomic, write_json_atomic

    write_json_atomic(RESULTS / "prequantized.json", {"storage": storage, "lora": lora})
    write_atomic(RESULTS / "prequantized.md", markdown(storage, lora))
    print(markdown(storage, lora))
    worst = max(abs(r["error"]) for r in storage)
    return 0 if worst < 0.005 else 1


if __name__ == "__main__":
    sys.exit(main())
