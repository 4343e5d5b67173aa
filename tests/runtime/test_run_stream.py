"""A step's stream at any length: traces of a real tiny model at three lengths, scaled.

The stream at a traced length must be the trace's; at an untraced length it is
compared with a real trace at that length (every tensor of these models is
constant, linear or quadratic in the length, so the scaled stream is exact).
"""

from __future__ import annotations

import pytest
from test_trace import resolved, tiny

from oomless.allocator import AllocatorConfig, replay
from oomless.allocator.run import simulate_run
from oomless.allocator.stepstream import canonical
from oomless.config import RunConfig
from oomless.runtime.trace.fake import plan_layers, trace_once
from oomless.runtime.trace.run_stream import allocator_events, scaled_step_stream, trace_lengths


def _trace(model, cfg: RunConfig, length: int) -> list:
    stats = trace_once(model.hf_config, cfg.model_copy(update={"seq_len": length}), None,
                       plan_layers(model.hf_config), AllocatorConfig(), 2, seq_len=length,
                       spec=model.spec)
    return allocator_events(stats.stream)[0]


@pytest.fixture(scope="module")
def eager():
    model = resolved(tiny(layers=2))
    cfg = RunConfig(model="tiny", method="lora", seq_len=128, micro_batch_size=2, attn="eager")
    return model, cfg, scaled_step_stream(cfg, 128, resolved=model)


def test_trace_lengths_are_a_quarter_half_and_all():
    assert trace_lengths(768) == (192, 384, 768)
    assert trace_lengths(40) == (10, 20, 40)
    assert trace_lengths(100) == (24, 48, 100)


@pytest.mark.slow
def test_stream_at_each_traced_length_is_the_trace(eager):
    model, cfg, stream = eager
    assert stream.lengths == (32, 64, 128)
    for length in stream.lengths:
        traced = _trace(model, cfg, length)
        assert stream.events_at(length) == canonical(traced)
        # what the allocator sees is the same too (canonical only reorders runs of frees)
        assert replay(stream.events_at(length)) == replay(traced)


@pytest.mark.slow
def test_untraced_length_equals_a_real_trace(eager):
    model, cfg, stream = eager
    counts = stream.degree_counts()
    assert counts[2] > 0  # eager attention scores: quadratic in the length
    assert counts[0] > 0 and counts[1] > 0  # weights, activations
    assert stream.events_at(96) == canonical(_trace(model, cfg, 96))
    assert stream.events_at(200) == canonical(_trace(model, cfg, 200))  # extrapolated


@pytest.mark.slow
def test_run_of_one_length_repeats_the_traced_step(eager):
    _, _, stream = eager
    traced = replay(stream.events_at(128))
    run = simulate_run(stream, [128] * 6)
    # steady state: later steps reach what the two traced steps reach
    assert run.high_water_bytes == traced.peak_reserved_bytes
    assert run.peak_allocated_bytes == traced.peak_allocated_bytes
    # from the third step on, every step is the same step (nothing accumulates)
    assert len({(p.peak_allocated_bytes, p.reserved_end_bytes) for p in run.curve[2:]}) == 1


@pytest.mark.slow
def test_real_model_run_that_fits_only_with_expandable_segments(eager):
    from oomless.planner.runsim import predict_run

    _, _, stream = eager
    samples = [32, 48, 64, 80, 96, 112, 128, 160, 200]
    free = predict_run(stream, samples, batch=1, grad_accum=1, steps=18, order="sorted",
                       cap=200, capacity_bytes=None)
    assert free.expandable.high_water_bytes < free.default.high_water_bytes
    # a card with just what expandable segments reserve: the default allocator fails
    pred = predict_run(stream, samples, batch=1, grad_accum=1, steps=18, order="sorted",
                       cap=200, capacity_bytes=free.expandable.high_water_bytes)
    assert pred.verdict() == "fits only with expandable_segments"
    assert pred.fixes[0]["fix"] == "expandable_segments"


@pytest.mark.slow
def test_gradient_accumulation_runs_each_micro_batch_at_its_length(born_once_freed_once):
    from oomless.allocator.run import run_events

    model = resolved(tiny(layers=2))
    cfg = RunConfig(model="tiny", method="lora", seq_len=128, micro_batch_size=2,
                    grad_accum=4, attn="eager")
    stream = scaled_step_stream(cfg, 128, resolved=model)
    assert stream.micro is not None  # the trace ran two micro batches
    # micro batches all at the traced length: the traced step, repeated
    assert simulate_run(stream, [(128,) * 2] * 4).curve == simulate_run(stream, [128] * 4).curve
    born_once_freed_once(run_events(stream, [128, (40, 128, 90, 64), (100, 32, 32, 120)]))
    run = simulate_run(stream, [128, (40, 128, 90, 64), (100, 32, 32, 120)] * 3)
    assert run.fits and run.max_length == 128
