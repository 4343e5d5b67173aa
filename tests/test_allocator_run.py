"""A run through the allocator model: the scaled step stream, many steps, the loader's
orders and the fixes. The synthetic step below has one tensor of each kind of length
dependence (weights: none, activations and logits: linear, eager attention scores:
quadratic), an output a stack holds until the next step, and optimizer states that
the first step creates and the end of the trace drops (as the trace records them)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomless.allocator import ALLOC, FREE, AllocatorConfig, replay
from oomless.allocator.run import run_events, simulate_run
from oomless.allocator.stepstream import ScaledStream, StreamMismatch, canonical, fit_stream
from oomless.planner.runsim import loader_order, predict_run, step_lengths

MiB = 1 << 20
VOCAB_BYTES = 32_000 * 4  # fp32 logits per token


def synthetic_trace(length: int) -> tuple[list, tuple[int, int]]:
    events: list = []
    keys = itertools.count(1)

    def alloc(n: int) -> int:
        key = next(keys)
        events.append((ALLOC, key, n))
        return key

    def free(key: int) -> None:
        events.append((FREE, key, 0))

    alloc(8 * MiB)  # weights
    held = start = None
    states: list[int] = []
    for step in range(2):
        if step == 1:
            start = len(events)
        act = alloc(length * 4096)
        scores = alloc(length * length * 16)
        if held:
            free(held)
        logits = alloc(length * VOCAB_BYTES)
        free(scores)
        grad = alloc(length * 4096)
        free(logits)
        free(act)
        held = alloc(length * 64)
        if step == 0:
            states = [alloc(2 * MiB), alloc(2 * MiB)]
        free(grad)  # zero_grad
    for key in states:  # the trace ends: the optimizer is dropped (in the same run of
        free(key)  # frees as the last zero_grad, as the trace records it)
    return events, (start, len(events))


def scaled(lengths=(64, 128, 256)):
    traces = {L: synthetic_trace(L) for L in lengths}
    return fit_stream({L: t[0] for L, t in traces.items()}, {L: t[1] for L, t in traces.items()})


def test_scaled_stream_is_the_trace_at_traced_lengths_and_exact_between():
    stream = scaled()
    for length in (64, 128, 256):
        assert stream.events_at(length) == canonical(synthetic_trace(length)[0])
    # every size here is a polynomial of degree ≤ 2 in the length: exact anywhere
    for length in (100, 300, 1000):
        assert stream.events_at(length) == canonical(synthetic_trace(length)[0])
    # per step: activation, logits, gradient, held output linear; scores quadratic; the
    # weights and two optimizer states constant
    assert stream.degree_counts() == {0: 3, 1: 8, 2: 2}
    assert stream.degrees_known == 2


def test_two_lengths_scale_linearly():
    stream = scaled((128, 256))
    assert stream.degrees_known == 1
    assert stream.degree_counts()[2] == 0
    scores = next(i for i, s in enumerate(stream.sizes) if s == (128 * 128 * 16, 256 * 256 * 16))
    # the chord through 128 and 256: exact at both ends, too large between
    assert stream.sizes_at(192)[scores] == (128 * 128 * 16 + 256 * 256 * 16) // 2


def test_sizes_shared_by_equal_rows_are_the_sizes_scaled_event_by_event():
    # the activation and its gradient have one row of traced sizes: scaled once, shared
    for stream in (scaled(), scaled((128, 256)), scaled((64, 100, 256))):
        assert len(stream._distinct_rows()[0]) < sum(k == ALLOC for k, _ in stream.events)
        for length in (1, 63, 64, 77, 128, 200, 256, 1000, 4097):
            assert stream.sizes_at(length) == stream.sizes_at_each(length)


def test_run_with_shared_sizes_equals_the_run_scaled_event_by_event(monkeypatch):
    lengths = [random.Random(0).randint(32, 400) for _ in range(30)]
    fast = simulate_run(scaled(), lengths, curve_points=0)
    monkeypatch.setattr(ScaledStream, "sizes_at", ScaledStream.sizes_at_each)
    assert simulate_run(scaled(), lengths, curve_points=0) == fast


def test_traces_running_other_ops_are_refused():
    a, bounds = synthetic_trace(64)
    b, _ = synthetic_trace(128)
    with pytest.raises(StreamMismatch, match="run different events"):
        fit_stream({64: a, 128: b[:-1]}, {64: bounds, 128: bounds})
    with pytest.raises(StreamMismatch, match="two lengths"):
        fit_stream({64: a}, {64: bounds})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40 * MiB), min_size=4, max_size=30), st.randoms())
def test_order_of_consecutive_frees_does_not_change_the_allocator(sizes, rnd):
    events = [(ALLOC, i, n) for i, n in enumerate(sizes)]
    frees = [(FREE, i, 0) for i in range(len(sizes))]
    rnd.shuffle(frees)
    events += frees[: len(frees) // 2] + [(ALLOC, 999, sizes[0])] + frees[len(frees) // 2:]
    assert replay(canonical(events)) == replay(events)


def test_run_hands_held_outputs_over_and_accumulates_nothing(born_once_freed_once):
    stream = scaled()
    lengths = [64, 256, 128, 100, 256, 64]
    born, freed = born_once_freed_once(run_events(stream, lengths))
    # live at the end: weights, two optimizer states, the last step's held output
    assert len(born - freed) == 4
    states = [k for k in born if isinstance(k, int) and k in (6, 7)]
    assert len(states) == 2 and not set(states) & freed  # the states live through the run


def test_fixed_length_run_repeats_one_step():
    stream = scaled()
    run = simulate_run(stream, [256] * 8)
    assert run.fits and run.steps == 8
    assert len({(p.peak_allocated_bytes, p.peak_reserved_bytes) for p in run.curve[2:]}) == 1
    assert run.high_water_bytes == replay(stream.events_at(256)).peak_reserved_bytes


def test_growing_lengths_fragment_and_expandable_segments_do_not():
    stream = scaled()
    lengths = list(range(100, 1100, 50))  # sorted: every step a little longer
    default = simulate_run(stream, lengths)
    expandable = simulate_run(stream, lengths, AllocatorConfig(expandable_segments=True))
    fixed = simulate_run(stream, [lengths[-1]] * len(lengths))
    # the cache keeps every shorter step's blocks: more reserved than one long step needs
    assert default.high_water_bytes > fixed.high_water_bytes
    assert default.fragmentation_bytes > 0
    assert expandable.high_water_bytes < default.high_water_bytes
    assert default.peak_allocated_bytes == fixed.peak_allocated_bytes


def test_a_run_that_fits_only_with_expandable_segments_is_recognised():
    stream = scaled()
    samples = list(range(100, 1100, 50))
    default = simulate_run(stream, samples)
    expandable = simulate_run(stream, samples, AllocatorConfig(expandable_segments=True))
    assert expandable.high_water_bytes < default.high_water_bytes
    # a card with just what expandable segments reserve: the default allocator fails
    # even after freeing its cache (the free space lies in segments with live blocks)
    capacity = expandable.high_water_bytes
    pred = predict_run(stream, samples, batch=1, grad_accum=1, steps=len(samples),
                       order="sorted", cap=max(samples), capacity_bytes=capacity)
    assert not pred.default.fits and pred.default.oom_step is not None
    assert pred.expandable.fits
    assert pred.verdict() == "fits only with expandable_segments"
    assert pred.fixes[0]["fix"] == "expandable_segments" and pred.fixes[0]["fits"]
    # a random order of the same samples ratchets less
    assert any(f["fix"] == "group_by_length" for f in pred.fixes)


def test_loader_orders():
    lengths = [random.Random(1).randint(10, 2000) for _ in range(1000)]
    shuffled = loader_order(lengths, 4, "random", seed=3)
    assert sorted(shuffled) == sorted(lengths) and shuffled == loader_order(lengths, 4, "random", 3)
    assert loader_order(lengths, 4, "sorted") == sorted(lengths)
    grouped = loader_order(lengths, 4, "group_by_length", seed=3)
    assert sorted(grouped) == sorted(lengths)
    assert grouped[0] == max(lengths)  # the longest batch first (OOM early)
    mega = 50 * 4  # min(1000 // 16, 50) batches of 4
    for start in range(mega, len(grouped), mega):  # later mega-batches: longest first
        chunk = grouped[start:start + mega]
        assert chunk == sorted(chunk, reverse=True)
    with pytest.raises(Exception, match="--order"):
        loader_order(lengths, 4, "bogus")


def test_step_lengths_pad_to_the_longest_of_the_step():
    assert step_lengths([5, 9, 3, 7], batch=2, grad_accum=1, steps=2, order="sorted",
                        cap=100) == [5, 9]
    assert step_lengths([5, 9, 3, 7], batch=1, grad_accum=2, steps=3, order="sorted",
                        cap=8) == [5, 8, 5]  # capped; a second epoch follows
    rows = step_lengths([5, 9, 3, 7], batch=1, grad_accum=1, steps=2, order="packing",
                        cap=10, pack=lambda cap: [8, 9, 7])
    assert set(rows) <= {8, 9, 7}


def test_empty_cache_every_step_gives_back_what_earlier_lengths_left():
    stream = scaled()
    lengths = list(range(100, 1100, 50))
    kept = simulate_run(stream, lengths)
    emptied = simulate_run(stream, lengths, empty_cache_every=1)
    # the cache of shorter steps is released before each longer one
    assert emptied.high_water_bytes < kept.high_water_bytes
    assert emptied.peak_allocated_bytes == kept.peak_allocated_bytes
    # the counters of a step are read before its empty_cache (as a loop logs them)
    assert emptied.curve[0].reserved_end_bytes == kept.curve[0].reserved_end_bytes


def test_length_cap_fix_tries_percentiles_until_one_fits():
    stream = scaled()
    samples = [100] * 85 + [600] * 10 + [1000] * 5  # p95 = 600, p99 = 1000
    fixed = simulate_run(stream, [600] * 10)
    pred = predict_run(stream, samples, batch=1, grad_accum=1, steps=40, order="random",
                       cap=1000, capacity_bytes=fixed.high_water_bytes)
    assert not pred.default.fits
    caps = [f for f in pred.fixes if f["fix"].startswith("cap at")]
    # p99 is the longest sample (no cap); p95 = 600 tokens truncates the 5 longest
    assert [f["fix"] for f in caps] == ["cap at p95"]
    assert caps[0]["fits"] and "max length 600 (truncates 5 of 100 samples)" == caps[0]["change"]


def accum_trace(length: int) -> tuple[list, tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Two micro batches per step (gradient accumulation): the second frees the first's
    held output and replaces the gradient by the accumulated one."""
    events: list = []
    keys = itertools.count(1)

    def alloc(n: int) -> int:
        events.append((ALLOC, key := next(keys), n))
        return key

    def free(key: int) -> None:
        events.append((FREE, key, 0))

    alloc(8 * MiB)
    held = None
    states: list[int] = []
    for step in range(2):
        if step == 1:
            start = len(events)
        grad = None
        for micro in range(2):
            if micro == 1 and step == 0:
                first_mb2 = len(events)
            elif micro == 1:
                mb2 = len(events)
            act = alloc(length * 4096)
            if held:
                free(held)
            logits = alloc(length * VOCAB_BYTES)
            new_grad = alloc(2 * MiB)
            if grad:
                free(grad)  # grad = grad + new
            grad = new_grad
            free(logits)
            free(act)
            held = alloc(length * 64)
        if step == 1:
            opt = len(events)
        if step == 0:
            first_opt = len(events)
            states = [alloc(2 * MiB), alloc(2 * MiB)]
        free(grad)  # zero_grad
    for key in states:
        free(key)
    return events, (start, len(events)), (mb2, opt), (first_mb2, first_opt)


def accum_scaled():
    traces = {L: accum_trace(L) for L in (64, 128, 256)}
    return fit_stream({L: t[0] for L, t in traces.items()}, {L: t[1] for L, t in traces.items()},
                      {L: t[2] for L, t in traces.items()}, {L: t[3] for L, t in traces.items()})


def test_micro_batches_each_run_at_their_own_length(born_once_freed_once):
    stream = accum_scaled()
    steps = [(100, 300, 200, 150), (120, 80, 60, 400), (90, 90, 90, 90)]
    events = list(run_events(stream, [(256,)] + steps))
    born, freed = born_once_freed_once(events)
    logits = [(step, size // VOCAB_BYTES) for step, kind, _key, size in events
              if kind == ALLOC and step and size % VOCAB_BYTES == 0 and size // VOCAB_BYTES > 50]
    # the logits of every micro batch, at its own length, in order
    assert logits == [(s + 1, L) for s, micro in enumerate(steps) for L in micro]
    # live at the end: weights, two optimizer states, the last micro batch's held output
    assert len(born - freed) == 4


def test_the_first_step_runs_each_micro_batch_at_its_own_length(born_once_freed_once):
    """The first step too (setup, then its micro batches, then the optimizer creating
    its states): a run whose first step grows from micro batch to micro batch keeps
    the segments each length left, as the real allocator does."""
    from oomless.allocator import CachingAllocator
    from oomless.allocator.replay import apply_event

    stream = accum_scaled()
    first = (100, 300, 200, 150)
    events = list(run_events(stream, [first, (120, 80)]))
    born, freed = born_once_freed_once(events)
    logits = [size // VOCAB_BYTES for step, kind, _key, size in events
              if kind == ALLOC and step == 0 and size % VOCAB_BYTES == 0
              and size // VOCAB_BYTES > 50]
    assert logits == list(first)
    alloc, live, ends = CachingAllocator(), {}, {}
    for step, kind, key, size in events:
        apply_event(alloc, live, kind, key, size)
        ends[step] = alloc.allocated_bytes
    held = -(-first[-1] * 64 // 512) * 512  # the last micro batch's output, rounded
    assert ends[0] == 8 * MiB + 2 * 2 * MiB + held  # weights, states, held: nothing leaks
    # the history of the first step's lengths: more reserved than one step at its longest
    grown = simulate_run(stream, [first, (120, 80)])
    flat = simulate_run(stream, [(300,) * 4, (120, 80)])
    assert grown.curve[0].reserved_end_bytes > flat.curve[0].reserved_end_bytes


def test_a_long_run_leaks_nothing_between_steps():
    """What a step leaves allocated is the same after every step of any lengths: the
    weights, the optimizer states created once in the first step, and the last micro
    batch's held output; the gradient zero_grad frees and every earlier micro batch's
    output are gone (a leak would show as reserved-but-unallocated growth)."""
    from oomless.allocator import CachingAllocator
    from oomless.allocator.replay import apply_event

    stream = accum_scaled()
    rnd = random.Random(3)
    steps = [(256,)] + [tuple(rnd.randrange(40, 400) for _ in range(rnd.randrange(2, 6)))
                        for _ in range(30)]
    alloc, live, ends = CachingAllocator(), {}, {}
    for step, kind, key, size in run_events(stream, steps):
        apply_event(alloc, live, kind, key, size)
        ends[step] = (alloc.allocated_bytes, len(live))
    for step, micro in enumerate(steps[1:], start=1):
        held = -(-micro[-1] * 64 // 512) * 512  # the last micro batch's output, rounded
        assert ends[step] == (8 * MiB + 2 * 2 * MiB + held, 4)


def test_equal_micro_lengths_replay_the_traced_step():
    stream = accum_scaled()
    as_traced = simulate_run(stream, [256] * 5)
    per_micro = simulate_run(stream, [(256, 256)] * 5)
    assert as_traced.curve == per_micro.curve


@settings(max_examples=25, deadline=None)
@given(st.floats(min_value=0.5, max_value=1.5))
def test_expandable_segments_is_proposed_exactly_when_it_is_the_smallest_fix_that_fits(scale):
    """For any card, the fixes that fit come first, the smallest change first (the
    allocator setting before the loader's order, packing and a length cap); so
    expandable_segments leads the proposals exactly when it fits."""
    from oomless.planner.runsim import FIX_RANK

    stream = scaled()
    samples = list(range(100, 1100, 50))
    exp = simulate_run(stream, samples, AllocatorConfig(expandable_segments=True))
    capacity = round(exp.high_water_bytes * scale)
    pred = predict_run(stream, samples, batch=1, grad_accum=1, steps=len(samples),
                       order="sorted", cap=max(samples), capacity_bytes=capacity)
    if pred.default.fits:
        assert pred.fixes == () and pred.verdict() == "fits"
        return
    fits = [f["fits"] for f in pred.fixes]
    assert fits == sorted(fits, reverse=True)  # every fix that fits before any that does not
    ranks = [FIX_RANK.get(f["fix"], 3) for f in pred.fixes if f["fits"]]
    assert ranks == sorted(ranks)
    first = pred.fixes[0]
    assert (first["fix"] == "expandable_segments" and first["fits"]) == pred.expandable.fits
    assert pred.expandable.fits == (exp.high_water_bytes <= capacity)
    if pred.expandable.fits:
        assert pred.verdict() == "fits only with expandable_segments"
    else:
        assert pred.verdict() == "out of memory"
        assert all(f["fix"] != "expandable_segments" or not f["fits"] for f in pred.fixes)
