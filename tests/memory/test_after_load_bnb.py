"""What the caching allocator holds after a bitsandbytes QLoRA base loads
(oomless.memory.after_load): the loader's order from transformers' own sort key, the sizes
from bitsandbytes' own quantize functions (run here on CPU), and the replay through the
allocator model."""

from __future__ import annotations

import math

import pytest

from oomless.api import estimate, resolve_model
from oomless.config import RunConfig
from oomless.memory.after_load import (
    BNB_NESTED_MAP_BYTES,
    BNB_QUANT_MAP_BYTES,
    _prequantized_4bit_events,
    _quantize_4bit_events,
    _quantize_8bit_events,
    after_load_tensors,
    checkpoint_tensors,
    load_events,
    reserved_after_load,
)

LLAMA8 = resolve_model("llama-3.1-8b-instruct").spec


def test_tensors_come_in_transformers_loading_order():
    from transformers.core_model_loading import dot_natural_key

    names = [t[0] for t in checkpoint_tensors(LLAMA8)]
    assert names == sorted(names, key=dot_natural_key)
    assert names[0] == "lm_head.weight" and names[-1] == "model.norm.weight"
    elements = sum(t[1] for t in checkpoint_tensors(LLAMA8))
    assert elements == LLAMA8.param_count


def _kept(events):
    live = {}
    for kind, key, size in events:
        if kind == "alloc":
            live[key] = size
        else:
            live.pop(key)
    return sorted(live.values())


@pytest.mark.parametrize("double_quant", [False, True])
def test_kept_sizes_are_bitsandbytes_own(double_quant):
    torch = pytest.importorskip("torch")
    import bitsandbytes as bnb

    w = torch.randn(256, 1024, dtype=torch.bfloat16)
    out, state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=double_quant,
                                              quant_type="nf4")
    real = [out.numel(), state.absmax.numel() * state.absmax.element_size(),
            state.code.numel() * 4]
    if double_quant:
        real += [state.state2.absmax.numel() * 4, 4]  # nested absmax, offset
    kept = _kept(_quantize_4bit_events(w.numel(), double_quant, 0))
    assert kept == sorted(real)
    # a pre-quantized checkpoint stores the nested map with every weight
    pre = _kept(_prequantized_4bit_events(w.numel(), double_quant, 0))
    nested = [state.state2.code.numel() * 4] if double_quant else []
    assert nested == ([BNB_NESTED_MAP_BYTES] if double_quant else [])
    assert state.code.numel() * 4 == BNB_QUANT_MAP_BYTES
    assert pre == sorted(real + nested)


def test_int8_keeps_the_int8_weight_and_row_statistics():
    torch = pytest.importorskip("torch")
    import bitsandbytes as bnb

    w = torch.randn(256, 1024, dtype=torch.float16)
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(w)
    kept = _kept(_quantize_8bit_events(w.numel(), 256, 0))
    assert kept == sorted([cb.numel(), scb.numel() * 4])


def test_freed_16bit_blocks_stay_cached_after_quantizing_at_load():
    cfg = RunConfig(model="llama-3.1-8b-instruct", method="qlora")
    got = reserved_after_load(LLAMA8, cfg)
    kept = sum(_kept(load_events(LLAMA8, cfg)))
    n_kept = len(_kept(load_events(LLAMA8, cfg)))
    # allocated: what stays, each block rounded up to 512 bytes at most
    assert kept <= got["allocated_bytes"] <= kept + 512 * n_kept
    # the last 16-bit weight freed (an MLP matrix) cannot be given back without empty_cache
    largest = max(2 * t[1] for t in checkpoint_tensors(LLAMA8) if t[2])
    assert got["reserved_bytes"] - got["allocated_bytes"] >= largest


def test_prequantized_and_int8():
    four = RunConfig(model="llama-3.1-8b-instruct", method="qlora")
    pre = reserved_after_load(LLAMA8, four.replace(stack="unsloth"))
    fly = reserved_after_load(LLAMA8, four)
    # the same tensors stay (but for the nested map a checkpoint stores with every weight)
    quantized = sum(1 for t in checkpoint_tensors(LLAMA8) if t[2])
    assert pre["allocated_bytes"] - fly["allocated_bytes"] <= quantized * BNB_NESTED_MAP_BYTES
    assert pre["peak_reserved_bytes"] < fly["peak_reserved_bytes"]  # no 16-bit weight passed
    eight = reserved_after_load(LLAMA8, four.replace(**{"quantization.bits": 8}))
    # two 16-bit copies live at once (the GPU tensor and Int8Params' fp16 copy)
    largest = max(2 * t[1] for t in checkpoint_tensors(LLAMA8) if t[2])
    assert eight["reserved_bytes"] - eight["allocated_bytes"] >= 2 * largest
    assert reserved_after_load(LLAMA8, four.replace(method="lora")) is None


def test_estimate_shows_the_reserve_after_load():
    est = estimate(RunConfig(model="llama-3.1-8b-instruct", method="qlora", seq_len=512))
    assert est.extra["reserved_after_load_bytes"] > est.extra["allocated_after_load_bytes"]
    assert any("after loading" in a and "after_load" in a for a in est.assumptions)
    lora = estimate(RunConfig(model="llama-3.1-8b-instruct", method="lora", seq_len=512))
    assert "reserved_after_load_bytes" not in lora.extra


def test_unsloth_gemma_colab_before_training_lies_between_the_sum_and_the_log():
    """unsloth-gemma7b-t4-colab (benchmarks/published_rows.yaml): the notebook prints
    5.938 GiB reserved before training. The plain sum of its tensors is the lower bound a
    replay can give; the replay adds the allocator's segment rounding and must stay
    under what the notebook saw (other allocations only add)."""
    spec = resolve_model("benchmarks/configs/gemma-7b/config.json").spec
    cfg = RunConfig(model="gemma-7b", method="qlora", stack="unsloth", precision="fp16",
                    lora={"r": 16, "alpha": 16,
                          "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"]},
                    stack_options={"stack_version": "2024.3"})
    extra = after_load_tensors(spec, cfg)
    got = reserved_after_load(spec, cfg, extra)
    plain = sum(_kept(load_events(spec, cfg, extra)))
    assert plain < got["reserved_bytes"] <= math.floor(5.938 * 2**30)
