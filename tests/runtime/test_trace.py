"""`oomless trace`: real tiny models from configs, traced on fake tensors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from oomless.allocator import AllocatorConfig
from oomless.config import RunConfig
from oomless.models.catalog import ResolvedModel
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
from oomless.result import MemoryEstimate
from oomless.runtime.trace.analysis import extrapolate
from oomless.runtime.trace.fake import LayerPlan, plan_layers, trace_once, trace_training


def tiny(model_type: str = "qwen2", layers: int = 2, **extra) -> dict:
    config = dict(model_type=model_type, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, max_position_embeddings=512)
    return {**config, **extra}


def resolved(config: dict) -> ResolvedModel:
    return ResolvedModel(spec=spec_from_hf_config(config, "tiny"),
                         hf_config=buildable_hf_config(config), source="test")


def run_cfg(**kw) -> RunConfig:
    return RunConfig(model="tiny", seq_len=64, micro_batch_size=2, **kw)


@pytest.fixture(scope="module")
def lora_trace() -> MemoryEstimate:
    return trace_training(run_cfg(method="lora", eval={"batch_size": 2}),
                          resolved=resolved(tiny(tie_word_embeddings=True)))


def test_trace_result_is_a_consistent_memory_estimate(lora_trace):
    est = lora_trace
    assert est.method == "trace"
    peaks = est.phase_peaks()
    assert set(peaks) == {"forward", "backward", "optimizer", "evaluation"}
    assert est.peak_allocated_bytes == max(peaks.values()) == peaks[est.peak_phase]
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes
    assert est.device_peak_bytes == est.peak_reserved_bytes + sum(est.non_pytorch_bytes.values())
    for cat in ("weights", "lora_adapters", "activations", "logits", "cublas_workspace"):
        assert est.breakdown["forward"][cat] > 0, cat
    assert est.breakdown["optimizer"]["gradients"] > 0
    assert est.breakdown["optimizer"]["optimizer"] > 0
    assert 0 < est.trainable_params < est.param_count
    assert MemoryEstimate.from_dict(json.loads(est.to_json())) == est


def test_trace_extra_has_modules_timeline_and_allocator(lora_trace):
    extra = lora_trace.extra
    modules = extra["per_module_peak"]
    attn = modules["model.layers.0.self_attn"]
    assert attn["forward_added_bytes"] > 0 and attn["backward_added_bytes"] > 0
    # the same layer structure adds the same memory in every layer
    assert modules["model.layers.1.mlp"] == modules["model.layers.0.mlp"]
    # lm_head's forward adds at least its logits: tokens × vocab in bf16
    assert modules["lm_head"]["forward_added_bytes"] >= 2 * 64 * 1000 * 2
    assert "model" not in modules and "model.layers" not in modules
    timeline = extra["timeline"]  # the list of points the report draws
    assert set(timeline[0]) == {"index", "allocated_bytes", "reserved_bytes", "phase",
                                "iteration"}
    assert max(p["allocated_bytes"] for p in timeline) == lora_trace.peak_allocated_bytes
    runs = []
    for p in timeline:
        if not runs or runs[-1] != (p["phase"], p["iteration"]):
            runs.append((p["phase"], p["iteration"]))
    assert runs == [("forward", 0), ("backward", 0), ("optimizer", 0), ("forward", 1),
                    ("backward", 1), ("optimizer", 1), ("evaluation", 2)]
    assert extra["allocator"]["peak_reserved_bytes"] == lora_trace.peak_reserved_bytes
    assert extra["layers_traced"] == [2]  # two layers: traced in full


def test_adapter_and_gradient_bytes_match_the_adapter_shapes(lora_trace):
    # r=16 on q,k,v,o,gate,up,down of 2 layers: (in + out) × r fp32 each
    h, kv, inter, r = 64, 2 * 16, 128, 16
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    params = 2 * sum((i + o) * r for i, o in shapes)
    assert lora_trace.trainable_params == params
    # one storage per adapter matrix, each rounded up to the allocator's 512 bytes
    blocks = 2 * sum(-(-4 * n * r // 512) * 512 for shape in shapes for n in shape)
    assert lora_trace.breakdown["optimizer"]["lora_adapters"] == blocks
    assert lora_trace.breakdown["optimizer"]["gradients"] == blocks
    assert lora_trace.breakdown["optimizer"]["optimizer"] >= 2 * blocks  # exp_avg, exp_avg_sq


EXPANSION_CASES = [
    (tiny("qwen2", layers=7), {"method": "lora", "eval": {"batch_size": 2}}),
    (tiny("llama", layers=6), {"method": "full", "grad_ckpt": True, "grad_accum": 2}),
    (tiny("qwen2", layers=6), {"method": "qlora", "attn": "eager"}),
    # sliding and full attention alternate: a 2-layer period
    pytest.param(tiny("gemma2", layers=10, head_dim=16, sliding_window=32),
                 {"method": "lora", "attn": "eager"}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("config", "options"), EXPANSION_CASES,
                         ids=["qwen2-lora", "llama-full-ckpt-accum", "qwen2-qlora", "gemma2"])
def test_layer_expansion_equals_a_full_trace(config, options):
    cfg = run_cfg(**options)
    plan = plan_layers(config)
    assert not plan.full and plan.traced < plan.total
    expanded = trace_once(config, cfg, None, plan, AllocatorConfig())
    full = trace_once(config, cfg, None, LayerPlan(plan.total), AllocatorConfig())
    assert expanded.num_events == full.num_events
    assert expanded.tensor_peaks == full.tensor_peaks
    assert expanded.breakdown == full.breakdown
    assert expanded.peak_reserved_bytes == full.peak_reserved_bytes
    # reserved bytes event by event; allocated may differ inside a burst of frees whose
    # order is arbitrary (autocast's cache of weight casts is a hash map)
    ours, theirs = expanded.timeline, full.timeline
    assert [p["reserved_bytes"] for p in ours] == [p["reserved_bytes"] for p in theirs]
    assert max(p["allocated_bytes"] for p in ours) == max(p["allocated_bytes"] for p in theirs)
    assert (expanded.param_count, expanded.trainable_params) == (
        full.param_count, full.trainable_params)


@pytest.mark.slow
def test_linear_extrapolation_equals_a_full_trace_in_allocated_bytes():
    """Every phase's peak is affine in the number of layers as long as the same moment is
    the peak at every count. The optimizer phase's peak is the larger of two moments: its
    start, when the checkpointed first layer's input (a leaf that requires grad, PEFT's
    enable_input_require_grads) and its .grad are still held, and the gradient-norm
    computation, 512 B per trained tensor. At 64 tokens per row the two cross between 2
    and 3 layers (a 16 KiB input against 14 norms a layer), so the rows here are 256
    tokens, where the first moment leads at every count traced here (1, 2 and 6 layers),
    as the layer inputs do at a real model's size."""
    config = tiny("llama", layers=6)
    cfg = RunConfig(model="tiny", seq_len=256, micro_batch_size=2, method="lora", grad_ckpt=True)
    small = [trace_once(config, cfg, None, n, AllocatorConfig())
             for n in plan_layers(config).linear_counts()]
    full = trace_once(config, cfg, None, 6, AllocatorConfig())
    ext = extrapolate(small[0], small[1], 6)
    assert ext["tensor_peaks"] == full.tensor_peaks
    assert ext["breakdown"] == full.breakdown
    assert ext["param_count"] == full.param_count
    assert ext["trainable_params"] == full.trainable_params


def test_layer_plans_follow_the_layer_pattern():
    assert plan_layers(tiny(layers=4)) == LayerPlan(4)
    assert plan_layers(tiny(layers=32), full=True) == LayerPlan(32)
    plan = plan_layers(tiny("llama", layers=32))
    assert (plan.traced, plan.copies, plan.block(1)) == (3, 30, {1})
    gemma = plan_layers(tiny("gemma2", layers=26, head_dim=16, sliding_window=32))
    assert (gemma.period, gemma.traced, gemma.copies, gemma.block(1)) == (2, 6, 11, {2, 3})
    assert gemma.linear_counts() == [2, 4]


def test_qlora_weights_are_packed_4bit_with_double_quantized_absmax():
    import bitsandbytes as bnb
    import peft

    from oomless.runtime.build import build_model

    cfg = run_cfg(method="qlora")
    built = build_model(tiny("llama"), cfg, mode="fake")
    layer = built.model.base_model.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, peft.tuners.lora.bnb.Linear4bit)
    base = layer.base_layer
    assert isinstance(base, bnb.nn.Linear4bit)
    n = 64 * 128
    assert base.weight.untyped_storage().nbytes() == n // 2  # two 4-bit values per byte
    state = base.weight.quant_state
    assert state.absmax.dtype.itemsize == 1 and state.absmax.numel() == n // 64
    assert state.state2.absmax.numel() == -(-(n // 64) // 256)  # fp32 per 256 blocks
    # lm_head and embeddings stay 16-bit
    head = built.model.base_model.model.lm_head
    assert head.weight.element_size() == 2


def test_qlora_trace_weights_are_smaller_than_lora():
    config = tiny("llama", intermediate_size=256)
    lora = trace_once(config, run_cfg(method="lora"), None, 2, AllocatorConfig())
    qlora = trace_once(config, run_cfg(method="qlora"), None, 2, AllocatorConfig())
    assert qlora.breakdown["optimizer"]["weights"] < lora.breakdown["optimizer"]["weights"]
    assert qlora.trainable_params == lora.trainable_params


def test_full_fine_tuning_keeps_fp32_grads_and_adam_states():
    est = trace_training(run_cfg(method="full", precision="bf16"),
                         resolved=resolved(tiny("llama")))
    opt = est.breakdown["optimizer"]
    assert est.trainable_params == est.param_count
    assert opt["gradients"] >= 4 * est.param_count  # fp32 module under AMP
    assert opt["optimizer"] >= 8 * est.param_count  # AdamW exp_avg + exp_avg_sq, fp32
    assert "lora_adapters" not in opt


def test_unknown_architecture_falls_back_to_the_analytic_estimate():
    model = resolved(tiny())
    model = ResolvedModel(spec=model.spec, hf_config=None, source="test")
    est = trace_training(run_cfg(method="lora"), resolved=model)
    assert est.method == "analytic"
    assert est.assumptions[0].startswith("no trace: transformers does not implement")
    assert "trace_fallback" in est.extra


def test_failure_inside_the_model_names_the_module():
    # 4 query heads over 3 key/value heads: the layers build, attention fails in forward
    model = resolved(tiny(num_key_value_heads=3))
    est = trace_training(run_cfg(method="lora", attn="eager"), resolved=model)
    assert est.method == "analytic"
    assert "failed in module 'model.layers.0.self_attn'" in est.extra["trace_fallback"]


def test_cli_trace_json_and_user_errors(tmp_path, capsys, monkeypatch):
    from oomless.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny()))
    assert main(["trace", str(config), "--seq-len", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "trace" and data["config"]["seq_len"] == 32
    assert main(["trace", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "nope" in err


def test_cli_modules_do_not_import_torch():
    code = ("import sys, oomless.cli.trace, oomless.cli.measure; "
            "from oomless.cli import build_parser; build_parser(); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
