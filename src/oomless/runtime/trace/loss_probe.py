"""Logits-path bytes of the installed transformers: a probe that runs on any release.

The bytes a training step spends on the logits and the loss grow with tokens ×
vocabulary. This probe measures that growth with the real model code of whatever
transformers is importable (4.3x to 5.x): a tiny Llama is built twice, with two
vocabulary sizes and everything else equal, and one training step of each runs on
real CPU tensors under the storage tracker. The difference of the two step peaks,
divided by tokens × the vocabulary difference, is the logits path's bytes per
token per vocabulary entry — everything that does not depend on the vocabulary
cancels. The embedding and lm_head are frozen and already in the step's dtype, so
no weight, gradient or autocast copy depends on the vocabulary either.

Two step conventions (``oomless.memory.stacks`` names them):

- ``hf-trainer``: forward under bf16 autocast, its outputs converted to fp32 as
  accelerate does for mixed precision, outputs dropped before ``backward``;
- ``custom-loop``: no autocast, the outputs kept alive through ``backward`` and the
  next forward (PEFT's method-comparison loop).

Two steps run, so that the second forward meets what the first step left alive.

Run as ``python -m oomless.runtime.trace.loss_probe`` it prints one JSON object;
``benchmarks/loss_versions.py`` runs it under several transformers releases.
Only torch, transformers and oomless' own tracker and allocator are imported.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

PROBE_HIDDEN = 64
PROBE_VOCABS = (8192, 40960)
PROBE_BATCH = 2
PROBE_SEQ = 256


def _tiny_llama(vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=PROBE_HIDDEN, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=PROBE_SEQ, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    for name, p in model.named_parameters():
        p.requires_grad = "embed_tokens" not in name and "lm_head" not in name
    return model.train()


def _step_events(model: torch.nn.Module, convention: str) -> list[tuple[str, int, int]]:
    """One forward + backward under the tracker; the alloc/free stream."""
    from .storage_tracker import StorageTracker

    gen = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (PROBE_BATCH, PROBE_SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    tracker = StorageTracker()
    for t in [*model.parameters(), *model.buffers(), *batch.values()]:
        tracker.track(t, "setup", "weights")  # known before the step: views of them are no allocation
    registered = len(tracker.events)
    kept = None  # a custom loop's outputs live until its next forward has returned
    with tracker:
        for it in range(2):
            tracker.start_phase("forward", it)
            if convention == "hf-trainer":
                from accelerate.utils import convert_outputs_to_fp32

                with torch.autocast("cpu", dtype=torch.bfloat16):
                    outputs = convert_outputs_to_fp32(model.forward)(**batch)
                loss = outputs.loss
                del outputs
            else:
                outputs = model(**batch)
                kept = outputs
                loss = outputs.loss
                del outputs
            tracker.start_phase("backward", it)
            loss.backward()
            del loss
            model.zero_grad(set_to_none=True)
        del kept
    return tracker.events[registered:]  # the step's own allocations and releases


def _peaks(events: list[tuple[str, int, int]]) -> tuple[int, int]:
    """(peak allocated, peak reserved) of a stream under the caching-allocator model."""
    from ...allocator import replay

    report = replay(events)
    return report.peak_allocated_bytes, report.peak_reserved_bytes


def probe(convention: str) -> dict[str, Any]:
    """Bytes per token per vocabulary entry of ``convention``'s step, allocated and reserved."""
    peaks = []
    for vocab in PROBE_VOCABS:
        peaks.append(_peaks(_step_events(_tiny_llama(vocab), convention)))
    per = PROBE_BATCH * PROBE_SEQ * (PROBE_VOCABS[1] - PROBE_VOCABS[0])
    return {
        "allocated_bytes_per_token_vocab": round((peaks[1][0] - peaks[0][0]) / per, 3),
        "reserved_bytes_per_token_vocab": round((peaks[1][1] - peaks[0][1]) / per, 3),
    }


def main() -> int:
    import transformers

    out = {"transformers": transformers.__version__, "torch": torch.__version__}
    for convention in ("hf-trainer", "custom-loop"):
        out[convention] = probe(convention)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
