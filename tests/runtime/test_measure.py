"""`oomless measure`: the real-tensor run, and its agreement with the fake-tensor trace."""

from __future__ import annotations

import math

import pytest
import torch

from oomless.allocator import AllocatorConfig
from oomless.config import RunConfig
from oomless.errors import ConfigError, GPUUnavailableError
from oomless.models.catalog import ResolvedModel
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
from oomless.runtime.trace.fake import trace_once, trace_training
from oomless.runtime.trace.measure import measure_cpu_stats, measure_training


def tiny(model_type: str, **extra) -> dict:
    config = dict(model_type=model_type, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, max_position_embeddings=512)
    return {**config, **extra}


def resolved(config: dict) -> ResolvedModel:
    return ResolvedModel(spec=spec_from_hf_config(config, "tiny"),
                         hf_config=buildable_hf_config(config), source="test")


CASES = [
    ("qwen2", {"method": "lora"}),
    ("llama", {"method": "full", "grad_ckpt": True, "eval": {"batch_size": 3}}),
    ("qwen2", {"method": "qlora", "attn": "eager"}),
    ("mistral", {"method": "lora", "precision": "fp32", "optimizer": "sgd-momentum"}),
]


@pytest.mark.parametrize(("model_type", "options"), CASES,
                         ids=[f"{m}-{o['method']}" for m, o in CASES])
def test_real_cpu_tracker_agrees_with_the_fake_trace(model_type, options):
    config = tiny(model_type)
    cfg = RunConfig(model="tiny", seq_len=48, micro_batch_size=2, **options)
    fake = trace_once(config, cfg, None, 2, AllocatorConfig())
    real = measure_cpu_stats(config, cfg, None)
    assert real.tensor_peaks == fake.tensor_peaks
    assert real.breakdown == fake.breakdown
    assert real.peak_reserved_bytes == fake.peak_reserved_bytes
    assert (real.param_count, real.trainable_params) == (fake.param_count, fake.trainable_params)


def test_measure_on_cpu_returns_a_measure_result():
    config = tiny("qwen2")
    cfg = RunConfig(model="tiny", seq_len=32, micro_batch_size=1, method="lora")
    est = measure_training(cfg, resolved=resolved(config), device="cpu", steps=2)
    assert est.method == "measure" and est.extra["device"] == "cpu"
    assert est.peak_allocated_bytes == max(est.phase_peaks().values())
    losses = est.extra["losses"]  # a real run: finite losses from real random weights
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    traced = trace_training(cfg, resolved=resolved(config))
    assert est.peak_allocated_bytes == traced.peak_allocated_bytes


def test_measure_rejects_bad_requests():
    cfg = RunConfig(model="tiny", seq_len=32, method="lora")
    model = resolved(tiny("qwen2"))
    with pytest.raises(ConfigError, match="at least 2 steps"):
        measure_training(cfg, resolved=model, device="cpu", steps=1)
    if not torch.cuda.is_available():
        with pytest.raises(GPUUnavailableError, match="no CUDA GPU"):
            measure_training(cfg, resolved=model, device="cuda")
    no_class = ResolvedModel(spec=model.spec, hf_config=None, source="test")
    with pytest.raises(ConfigError, match="no transformers class"):
        measure_training(cfg, resolved=no_class, device="cpu")
    from oomless.models.catalog import resolve_model

    with pytest.raises(ConfigError, match="meant for small models"):  # refused before building
        measure_training(cfg, resolved=resolve_model("llama-2-7b"), device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_on_gpu_against_the_trace():
    config = tiny("qwen2", hidden_size=256, intermediate_size=512, vocab_size=32000)
    cfg = RunConfig(model="tiny", seq_len=512, micro_batch_size=2, method="lora")
    est = measure_training(cfg, resolved=resolved(config), device="cuda", steps=3)
    assert est.method == "measure" and est.extra["device"] == "cuda"
    assert est.non_pytorch_bytes["cuda_context"] > 0
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes > 0
    assert est.device_peak_bytes >= est.peak_reserved_bytes
    assert set(est.breakdown) == {"forward", "backward", "optimizer"}
    traced = trace_training(cfg, resolved=resolved(config))
    error = abs(traced.peak_allocated_bytes - est.peak_allocated_bytes) / est.peak_allocated_bytes
    assert error < 0.10, (traced.peak_allocated_bytes, est.peak_allocated_bytes)
