"""torch.compile's saved tensors: the partitioner trace on fake tensors
(oomless.runtime.trace.compiled) against eager autograd and against a real compiled run
on CPU, and the pure core's table (oomless/data/compiled_saved.json) against a fresh
trace at other dimensions."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from oomless.config import RunConfig
from oomless.memory.activations import (
    compiled_chunk_loss_bytes,
    compiled_layer_bytes,
    compiled_table,
)
from oomless.models.spec import ModelSpec
from oomless.runtime.trace.compiled import (
    LAYER_FAMILIES,
    PROBE,
    chunk_loss,
    chunk_loss_saved,
    decoder_layer_saved,
    layer_inputs,
    saved_widths,
    tiny_layer,
    with_lora,
)

# other dimensions than the probe's, to show the table is not the probe's numbers
OTHER = {"hidden": 64, "intermediate": 176, "heads": 4, "kv_heads": 2, "head_dim": 24,
         "vocab": 500, "batch": 1, "seq": 40, "lora_r": 4}


def _saved_by_hooks(run) -> list[torch.Tensor]:
    """Every tensor autograd saves while ``run()`` builds the graph (the pack hook)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.float().sum().backward()  # the graph is whole: backward runs on what was saved
    return saved


def _activations(saved: list[torch.Tensor], params) -> list[torch.Tensor]:
    """Saved tensors that are not (views of) parameters, each storage once."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen, out = set(), []
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in seen:
            seen.add(ptr)
            out.append(t)
    return out


def _hooked_layer(backend: str | None, method: str = "full",
                  family: str = "llama") -> list[tuple[int, str]]:
    """(storage bytes, dtype) of what autograd saves for one real layer call on CPU."""
    layer, rotary = tiny_layer(family, PROBE)
    if method == "lora":
        layer = with_lora(layer, PROBE["lora_r"])
        for name, p in layer.named_parameters():
            p.requires_grad_("lora_" in name)
    x, (cos, sin) = layer_inputs(rotary, PROBE)
    torch._dynamo.reset()
    call = layer if backend is None else torch.compile(layer, backend=backend, fullgraph=True)

    def run():
        out = call(x, position_embeddings=(cos, sin), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    tensors = _activations(_saved_by_hooks(run), layer.parameters())
    return [(t.untyped_storage().nbytes(), str(t.dtype).removeprefix("torch."))
            for t in tensors]


@pytest.mark.slow  # about 15 s: dynamo and a real layer on CPU
@pytest.mark.parametrize("family,method", [("llama", "full"), ("llama", "lora"),
                                           ("qwen3", "full")])
def test_the_trace_is_what_a_compiled_run_saves(family, method):
    """torch.compile with the partitioning backend that runs inductor's decompositions and
    the min-cut partitioner without generating code (PEFT's LoRA layers included, whole
    graph): the saved tensors autograd's hooks see are the fake trace's, tensor for tensor,
    and fewer bytes than eager autograd keeps."""
    traced = Counter((s.nbytes, s.dtype) for s in decoder_layer_saved(PROBE, method, family))
    compiled = Counter(_hooked_layer("aot_eager_decomp_partition", method, family))
    assert compiled == traced
    eager = _hooked_layer(None, method, family)
    assert sum(n * k for (n, _), k in compiled.items()) < sum(n for n, _ in eager)
    # what it leaves out is recomputed: no fp32 copy of a hidden-wide tensor is kept
    hidden = PROBE["batch"] * PROBE["seq"] * PROBE["hidden"]
    assert (4 * hidden, "float32") in eager and (4 * hidden, "float32") not in compiled


@pytest.mark.slow
def test_the_trace_is_what_inductor_saves_on_cpu():
    traced = Counter((s.nbytes, s.dtype) for s in decoder_layer_saved(PROBE, "full"))
    assert Counter(_hooked_layer("inductor")) == traced


def test_the_compiled_chunk_loss_keeps_its_16bit_input_not_fp32_log_probabilities():
    rows = PROBE["batch"] * PROBE["seq"]
    logits = torch.randn(rows, PROBE["vocab"], dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, PROBE["vocab"], (rows,))
    eager = _saved_by_hooks(lambda: chunk_loss(logits, labels))
    assert any(t.dtype == torch.float32 and t.shape == logits.shape for t in eager)
    traced = chunk_loss_saved(rows, PROBE["vocab"])
    assert [s.input_index for s in traced if s.shape == (rows, PROBE["vocab"])] == [0]
    assert sum(s.nbytes for s in traced if s.input_index is None) == 2 * 4 * rows
    torch._dynamo.reset()
    compiled = torch.compile(chunk_loss, backend="aot_eager_decomp_partition")
    seen = _saved_by_hooks(lambda: compiled(logits, labels))
    assert Counter((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in seen) == \
        Counter((s.shape, s.dtype) for s in traced)


def _spec(d: dict, family: str = "llama") -> ModelSpec:
    return ModelSpec(name="probe", model_type=family, vocab_size=d["vocab"],
                     hidden_size=d["hidden"], num_layers=1, num_heads=d["heads"],
                     num_kv_heads=d["kv_heads"], head_dim=d["head_dim"],
                     intermediate_size=d["intermediate"])


@pytest.mark.parametrize("family,method", [
    ("llama", "full"),
    pytest.param("llama", "lora", marks=pytest.mark.slow),
    pytest.param("qwen3", "full", marks=pytest.mark.slow)])
def test_the_table_evaluated_at_other_dimensions_is_a_fresh_trace_there(family, method):
    saved = decoder_layer_saved(OTHER, method, family)
    traced = sum(s.nbytes for s in saved if s.input_index != 1 and s.input_index != 2)
    cfg = RunConfig(model="probe", method=method, lora={"r": OTHER["lora_r"]})
    tokens = OTHER["batch"] * OTHER["seq"]
    assert compiled_layer_bytes(_spec(OTHER, family), cfg, 2, tokens) == traced
    rows = chunk_loss_saved(tokens, OTHER["vocab"])
    pure = compiled_chunk_loss_bytes(tokens, 2)
    assert pure["logits"] * OTHER["vocab"] + pure["labels"] + pure["rows"] == sum(
        s.nbytes for s in rows)


@pytest.mark.slow
def test_the_committed_table_is_the_installed_torch_trace():
    tokens = PROBE["batch"] * PROBE["seq"]
    regions = compiled_table()["regions"]
    assert regions["chunked-ce"] == saved_widths(chunk_loss_saved(), tokens, PROBE)
    for family in LAYER_FAMILIES:
        for method in ("full", "frozen", "lora"):
            assert regions[f"{family}-layer-{method}"] == saved_widths(
                decoder_layer_saved(PROBE, method, family), tokens, PROBE)


def test_a_compiled_run_is_estimated_from_the_partitioner_not_the_eager_tracker():
    from oomless.runtime.trace.stacks import trace_unsupported

    cfg = RunConfig(model="qwen2.5-0.5b-instruct", method="lora",
                    stack_options={"compile": True})
    assert "partitioner's trace" in trace_unsupported(cfg)
    assert trace_unsupported(RunConfig(model="qwen2.5-0.5b-instruct", method="lora")) is None
