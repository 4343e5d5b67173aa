"""QLoRA's LoRA layers keep their input itself under CUDA autocast.

PEFT's LoRA layer over a bitsandbytes linear (peft/tuners/lora/bnb.py ``Linear4bit.forward``)
casts its input to the adapters' dtype only when ``not torch.is_autocast_enabled()``, a
call without a device that asks about CUDA. On the GPU it answers True: lora_A keeps the
16-bit input itself, shared by the adapters that read it. Asked on CPU it answered False,
so a trace cast each adapter's input to fp32 and lora_A's autocast cast it back, one new
16-bit copy per adapter (the plain LoRA layer, peft/tuners/lora/layer.py, always casts).
The GPU's own allocator stream of Qwen2.5-0.5B QLoRA 8 × 256 on an H200
(benchmarks/results/gpu_streams) kept 4 hidden-size tensors per layer fewer than that
trace: q, k and v share one input, gate and up another, o_proj reads SDPA's output.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
import torch

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.memory.quantized import KERNELS
from oomless.models.catalog import ResolvedModel, resolve_model
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
from oomless.runtime.trace.fake import trace_training

QWEN2 = dict(model_type="qwen2", hidden_size=256, intermediate_size=768, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
             max_position_embeddings=1024, tie_word_embeddings=True)
SEQ, BATCH = 512, 2
STREAM = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu_streams" / \
    "qwen2.5-0.5b-qlora-8x256.json.gz"


def test_autocast_state_is_asked_of_the_emulated_device():
    from oomless.runtime.trace.cuda_emulation import cuda_autocast_state

    original = torch.is_autocast_enabled
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.is_autocast_enabled()  # no device: CUDA's state
        with cuda_autocast_state():
            assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cuda")
            assert torch.is_autocast_enabled("cpu")
    with cuda_autocast_state():
        assert not torch.is_autocast_enabled()  # CPU autocast off: CUDA's would be too
    assert torch.is_autocast_enabled is original


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_the_analytic_plan_says_what_peft_does_with_the_adapters_input(method):
    """memory/quantized.py's row against PEFT's own layer: real tiny weights (bitsandbytes
    quantizes and multiplies on CPU), the forward under CPU autocast answering for CUDA;
    lora_A gets the input itself or a cast copy."""
    from oomless.memory.training import layer_plan
    from oomless.runtime.build import build_model
    from oomless.runtime.trace.cuda_emulation import cuda_autocast_state

    config = dict(model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, max_position_embeddings=512)
    cfg = RunConfig(model="tiny", method=method, seq_len=8, micro_batch_size=1)
    layer = build_model(config, cfg, mode="real").model.base_model.model.model.layers[0].mlp.up_proj
    seen = []
    layer.lora_A["default"].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    x = torch.randn(1, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    with cuda_autocast_state(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    plan = layer_plan(spec_from_hf_config(config, "tiny"), cfg)
    assert (seen[0] is x) == ("up_proj" in plan.lora_uncast)


@pytest.mark.parametrize("method", sorted(KERNELS))
def test_each_kernel_row_names_the_peft_layer_and_its_cast(method):
    """Every quantization row's PEFT LoRA layer, read from the installed PEFT: the layers
    that ask ``torch.is_autocast_enabled()`` before casting are the rows that keep the
    input uncast; the others cast in every case."""
    import importlib.util

    row = KERNELS[method]
    origin = importlib.util.find_spec("peft.tuners.lora").submodule_search_locations[0]
    source = (Path(origin) / f"{row.peft_layer}.py").read_text()
    asks = "requires_conversion = not torch.is_autocast_enabled()" in source
    casts = "self._cast_input_dtype(x, lora_A.weight.dtype)" in source
    assert asks == (not row.peft_casts_input)
    assert casts or asks


def _both(method: str, dropout: float) -> tuple:
    cfg = RunConfig(model="tiny", seq_len=SEQ, micro_batch_size=BATCH, method=method,
                    attn="sdpa", lora={"dropout": dropout})
    resolved = ResolvedModel(spec=spec_from_hf_config(QWEN2, "tiny"),
                             hf_config=buildable_hf_config(QWEN2), source="test")
    traced = trace_training(cfg, resolved=resolved)
    assert not traced.extra.get("trace_fallback"), traced.extra.get("trace_fallback")
    return estimate_training(resolved.spec, cfg), traced


def test_qlora_adapters_share_their_16bit_input_in_the_trace_and_the_estimate():
    # per layer, LoRA keeps a copy per adapter where QLoRA keeps the input itself:
    # q, k, v (3 copies for 1 input), o_proj (1 copy; SDPA keeps its output anyway),
    # gate, up (2 for 1), down (1 for 1): 4 hidden-size 16-bit tensors more
    copies = QWEN2["num_hidden_layers"] * 4 * 2 * BATCH * SEQ * QWEN2["hidden_size"]
    lora_ours, lora_traced = _both("lora", 0.0)
    qlora_ours, qlora_traced = _both("qlora", 0.0)
    for lora, qlora in ((lora_traced, qlora_traced), (lora_ours, qlora_ours)):
        diff = lora.breakdown["forward"]["activations"] - qlora.breakdown["forward"]["activations"]
        assert diff == copies
    gap = abs(qlora_ours.peak_allocated_bytes - qlora_traced.peak_allocated_bytes)
    assert gap < copies / 4


def test_with_lora_dropout_every_adapter_keeps_its_dropped_copy():
    # dropout returns a new tensor per adapter whatever the cast: LoRA and QLoRA agree
    lora, qlora = _both("lora", 0.1)[1], _both("qlora", 0.1)[1]
    assert lora.breakdown["forward"]["activations"] == qlora.breakdown["forward"]["activations"]


@pytest.mark.slow
def test_trace_of_the_recorded_qlora_run_gives_the_gpu_peaks():
    """The H200 measured 7,143,737,344 B allocated and 9,149,874,176 B reserved; the
    trace of the same configuration matches reserved to the byte and allocated up to the
    1 MiB cuBLASLt workspace it gives the autograd thread (the GPU's backward asked for
    none), less what it does not allocate: flash attention's RNG seed and offset (8 B
    each, a 512 B block each, per layer) and one small block (1.5 KiB) not identified."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg, measured = _recorded()
    traced = trace_training(cfg, resolved=resolve_model(cfg.model))
    assert traced.peak_reserved_bytes == measured["peak_reserved_bytes"]
    layers = 24
    gap = traced.peak_allocated_bytes - measured["peak_allocated_bytes"]
    assert 2**20 - 2 * layers * 512 - 2048 <= gap <= 2**20


def _recorded() -> tuple[RunConfig, dict]:
    with gzip.open(STREAM, "rt") as f:
        rec = json.load(f)
    return RunConfig.model_validate({**rec["config"], "hardware": {"gpu": "h200"}}), \
        rec["measured"]


def _analytic(cfg: RunConfig):
    from oomless.models.hardware import Cluster, get_gpu

    return estimate_training(resolve_model(cfg.model).spec, cfg, Cluster(get_gpu("h200")))


def test_analytic_allocated_of_the_recorded_qlora_run():
    """+4.9% (7,493,817,408 B) while every adapter was counted its own input copy."""
    cfg, measured = _recorded()
    ours = _analytic(cfg)
    assert abs(ours.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1) < 0.001
    assert any("the adapters keep the 16-bit input itself" in a for a in ours.assumptions)


@pytest.mark.xfail(strict=True, reason=(
    "documented miss: the analytic reserve (70% of the largest transient block, the "
    "1,187 MiB fp32 logits) is 12.4% under; the GPU's stream shows the backward thread's "
    "32 MiB cuBLAS workspace split from a cached logits block, so the second step's loss "
    "needs one more logits-sized segment (the trace replays it to the byte)"))
def test_analytic_reserved_of_the_recorded_qlora_run():
    cfg, measured = _recorded()
    ours = _analytic(cfg)
    assert abs(ours.peak_reserved_bytes / measured["peak_reserved_bytes"] - 1) < 0.05
