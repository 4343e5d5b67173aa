"""The analytic allocator reserve against reserved bytes measured on a GPU.

benchmarks/results/gpu_validate_measured.json and benchmarks/results/gpu_streams hold
``torch.cuda.max_memory_reserved`` of real runs (NVIDIA H200, 2026-11-26). In full
fine-tuning the reserved peak is reached when the embedding's dense gradient is
requested at the end of the backward (the recorded event stream shows it), on top of
the share of the loss's block that every run keeps cached
(oomless.memory.overheads.late_dense_block_bytes)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.memory.overheads import late_dense_block_bytes
from oomless.models.catalog import resolve_model
from oomless.models.hardware import Cluster, get_gpu

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"


def _measured(config: dict) -> dict:
    for row in json.loads((RESULTS / "gpu_validate_measured.json").read_text())["rows"]:
        if row["config"] == config:
            return row["measured"]
    for path in (RESULTS / "gpu_streams").glob("*.json.gz"):
        with gzip.open(path, "rt") as f:
            rec = json.load(f)
        if rec["config"] == config:
            return rec["measured"]
    raise LookupError(config)


@pytest.mark.parametrize("config", [
    {"model": "llama-3.2-1b-instruct", "method": "full", "micro_batch_size": 1, "seq_len": 2048},
    {"model": "qwen2.5-0.5b-instruct", "method": "full", "micro_batch_size": 4, "seq_len": 512},
], ids=["llama-3.2-1b-full", "qwen2.5-0.5b-full"])
def test_full_fine_tuning_reserve_includes_the_late_embedding_gradient(config):
    measured = _measured(config)
    cfg = RunConfig.model_validate({**config, "hardware": {"gpu": "h200"}})
    spec = resolve_model(cfg.model).spec
    est = estimate_training(spec, cfg, Cluster(get_gpu("h200")))
    assert late_dense_block_bytes(spec, cfg) == 4 * spec.vocab_size * spec.hidden_size
    # reserved within 0.5% of the GPU (before this mechanism: -4.0% and -3.2%)
    assert abs(est.peak_reserved_bytes / measured["peak_reserved_bytes"] - 1) < 0.005
    lora = estimate_training(spec, cfg.replace(method="lora"), Cluster(get_gpu("h200")))
    assert late_dense_block_bytes(spec, cfg.replace(method="lora")) == 0
    assert "dense gradient" not in " ".join(lora.assumptions)


STREAM_ROWS = [
    {"model": "gemma-2-2b-it", "method": "full", "micro_batch_size": 2, "seq_len": 1024},
    {"model": "llama-3.2-1b-instruct", "method": "full", "micro_batch_size": 1, "seq_len": 2048},
    {"model": "llama-3.2-1b-instruct", "method": "lora", "micro_batch_size": 4, "seq_len": 512,
     "grad_ckpt": True, "attn": "eager"},
    {"model": "phi-2", "method": "lora", "micro_batch_size": 1, "seq_len": 2048,
     "grad_ckpt": True},
    {"model": "qwen2.5-0.5b-instruct", "method": "full", "micro_batch_size": 1,
     "seq_len": 2048, "grad_ckpt": True},
    {"model": "qwen2.5-7b-instruct", "method": "full", "micro_batch_size": 1, "seq_len": 1024,
     "grad_ckpt": True},
]


def _reserved_errors(config: dict) -> tuple[float, float]:
    """(streamed, proxy) relative error of the analytic reserved bytes against the GPU."""
    measured = _measured(config)["peak_reserved_bytes"]
    cfg = RunConfig.model_validate({**config, "hardware": {"gpu": "h200"}})
    spec = resolve_model(cfg.model).spec
    streamed = estimate_training(spec, cfg, Cluster(get_gpu("h200")))
    assert "replayed through the caching-allocator model" in " ".join(streamed.assumptions)
    proxy = estimate_training(spec, cfg, Cluster(get_gpu("h200")), synthesize_stream=False)
    return (streamed.peak_reserved_bytes / measured - 1, proxy.peak_reserved_bytes / measured - 1)


@pytest.mark.slow
def test_the_synthesized_stream_beats_the_proxy_on_the_gpu_streams():
    """The six GPU event streams the stream covers (H200; the QLoRA row is not
    synthesized): no row more than one point worse than the calibrated proxy, and both
    the median and the worst |error| smaller (proxy: 5.6% and 7.5%; synthesized: 2.9% and
    5.9%, measured 2026-11-26)."""
    errors = [_reserved_errors(c) for c in STREAM_ROWS]
    for streamed, proxy in errors:
        assert abs(streamed) <= abs(proxy) + 0.01
    streamed, proxy = ([abs(e[i]) for e in errors] for i in (0, 1))
    assert sorted(streamed)[len(streamed) // 2] < sorted(proxy)[len(proxy) // 2]
    assert max(streamed) < max(proxy)


@pytest.mark.parametrize(("change", "why"), [
    ({"zero": 2, "hardware": {"gpu": "h200", "gpus_per_node": 2}}, "DeepSpeed ZeRO / FSDP"),
    ({"method": "qlora"}, "method qlora"),
    ({"stage": "dpo"}, "stage dpo"),
    ({"optimizer": "adafactor"}, "optimizer adafactor"),
])
def test_the_proxy_stays_where_the_stream_is_not_modelled_and_says_so(change, why):
    base = {"model": "qwen2.5-0.5b-instruct", "method": "lora", "seq_len": 512,
            "hardware": {"gpu": "h200"}}
    spec = resolve_model(base["model"]).spec
    streamed = estimate_training(spec, RunConfig.model_validate(base))
    assert any("in the order the step requests them" in a for a in streamed.assumptions)
    proxy = estimate_training(spec, RunConfig.model_validate({**base, **change}))
    text = " ".join(proxy.assumptions)
    assert f"the step's stream is not synthesized for {why}" in text
    assert "in the order the step requests them" not in text
