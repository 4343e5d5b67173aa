"""Writes src/oomless/data/compiled_saved.json: what torch.compile saves for backward.

Runs oomless.runtime.trace.compiled (AOTAutograd with inductor's decompositions and
``min_cut_rematerialization_partition`` on fake tensors, the installed torch) on the
regions torchtune compiles — one decoder layer (transformers' own class for Llama,
Mistral, Qwen2 and Qwen3; full fine-tuning, frozen, and PEFT LoRA on every linear) and one chunk of the chunked
cross-entropy — and records each saved tensor as a width per token (a model dimension),
its element size and whether it is the region's own input. The pure core
(oomless.memory.activations.compiled_layer_bytes) evaluates the table at a model's dimensions;
tests/runtime/test_compiled_partition.py re-traces and checks the file.

    python benchmarks/compiled_partition.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from oomless.fileio import write_atomic
from oomless.runtime.trace.compiled import (
    LAYER_FAMILIES,
    PROBE,
    chunk_loss_saved,
    decoder_layer_saved,
    saved_widths,
)

OUT = Path(__file__).resolve().parents[1] / "src" / "oomless" / "data" / "compiled_saved.json"


def table() -> dict:
    tokens = PROBE["batch"] * PROBE["seq"]
    regions = {f"{family}-layer-{m}": saved_widths(decoder_layer_saved(PROBE, m, family),
                                                   tokens, PROBE)
               for family in LAYER_FAMILIES for m in ("full", "frozen", "lora")}
    regions["chunked-ce"] = saved_widths(chunk_loss_saved(), tokens, PROBE)
    return {
        "source": (f"torch {torch.__version__.split('+')[0]} torch._functorch.partitioners."
                   "min_cut_rematerialization_partition (compiler='inductor', inductor's "
                   "decomposition table) on fake tensors, traced by "
                   "benchmarks/compiled_partition.py (oomless.runtime.trace.compiled)"),
        "regions": regions,
    }


def main() -> int:
    write_atomic(OUT, json.dumps(table(), indent=1) + "\n")
    print(OUT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
