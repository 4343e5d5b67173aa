"""Properties the analytic model must keep for every catalog model and run."""

from hypothesis import given, settings
from hypothesis import strategies as st

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.models.catalog import list_models

MODELS = {e.name: e.spec for e in list_models()}
BIG = sorted(n for n, s in MODELS.items() if s.param_count >= 6e9)

runs = st.fixed_dictionaries({
    "model": st.sampled_from(sorted(MODELS)),
    "method": st.sampled_from(["full", "lora", "qlora"]),
    "precision": st.sampled_from(["bf16", "fp16", "pure-bf16"]),
    "optimizer": st.sampled_from(["adamw", "adamw-8bit", "sgd", "adafactor"]),
    "micro_batch_size": st.integers(1, 8),
    "seq_len": st.integers(64, 8192),
    "grad_ckpt": st.booleans(),
    "attn": st.sampled_from(["eager", "sdpa", "flash"]),
})


def _est(d, **over):
    cfg = RunConfig.model_validate({**d, **over})
    return estimate_training(MODELS[cfg.model], cfg)


@settings(max_examples=60, deadline=None)
@given(runs, st.integers(1, 4), st.integers(1, 1024))
def test_more_batch_or_sequence_never_needs_less(d, more_b, more_s):
    base = _est(d)
    assert _est(d, micro_batch_size=d["micro_batch_size"] + more_b).peak_allocated_bytes >= \
        base.peak_allocated_bytes
    assert _est(d, seq_len=d["seq_len"] + more_s).peak_allocated_bytes >= \
        base.peak_allocated_bytes


@settings(max_examples=60, deadline=None)
@given(runs)
def test_checkpointing_never_raises_activation_memory(d):
    on, off = _est(d, grad_ckpt=True), _est(d, grad_ckpt=False)
    for phase in ("forward", "backward"):
        assert on.breakdown[phase].get("activations", 0) + on.breakdown[phase].get(
            "temporaries", 0) <= off.breakdown["forward"]["activations"] + off.breakdown[
            "backward"].get("temporaries", 0) + 1
    assert on.peak_allocated_bytes <= off.peak_allocated_bytes


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(BIG), st.sampled_from(["full", "lora"]), st.integers(2, 16),
       st.integers(1, 4), st.sampled_from([512, 2048, 4096]))
def test_zero_stages_order_per_gpu(model, method, gpus, b, s):
    d = {"model": model, "method": method, "micro_batch_size": b, "seq_len": s,
         "hardware": {"gpus_per_node": gpus}}
    peaks = [_est(d, zero=z).peak_allocated_bytes for z in (3, 2, 1, 0)]
    assert peaks == sorted(peaks), dict(zip((3, 2, 1, 0), peaks, strict=True))


@settings(max_examples=30, deadline=None)
@given(runs)
def test_phase_breakdowns_add_up_and_serialise(d):
    est = _est(d)
    assert est.peak_allocated_bytes == max(est.phase_peaks().values())
    assert est.peak_allocated_bytes <= est.peak_reserved_bytes <= est.device_peak_bytes
    assert all(v > 0 for parts in est.breakdown.values() for v in parts.values())
    again = type(est).from_dict(__import__("json").loads(est.to_json()))
    assert again == est
