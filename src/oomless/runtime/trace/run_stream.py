"""A step's alloc/free stream at any length: the trace at three lengths, scaled.

The step is traced (runtime/trace/fake.py ``trace_once``, layer expansion
included) at three lengths up to the run's longest batch; the three streams are
fitted per allocation (oomless.allocator.stepstream) so every length of the
run gets its stream without tracing it.
"""

from __future__ import annotations

from typing import Any

from ...allocator import AllocatorConfig
from ...allocator.stepstream import ScaledStream, StreamMismatch, fit_stream
from ...config import RunConfig
from ...errors import ConfigError
from ...models.hardware import Cluster
from .expansion import ExpansionError, Stream
from .storage_tracker import PAGED

STEP_PHASES_SKIPPED = ("setup", "teardown", "evaluation")


def trace_lengths(longest: int) -> tuple[int, ...]:
    """Three lengths to trace: a quarter, half and all of the longest (the first two
    multiples of 8 from 64 tokens on, as tokenizers' padding multiples are)."""
    quarter, half = max(1, longest // 4), max(1, longest // 2)
    if longest >= 64:
        quarter, half = 8 * (quarter // 8), 8 * (half // 8)
    return tuple(sorted({quarter, half, longest}))


def step_bounds(stream: Stream) -> tuple[int, int]:
    """(first, one past last) event of the trace's second optimizer step."""
    def in_step(i: int, it: int) -> bool:
        name, iteration = stream.phases[stream.event_phase[i]]
        return iteration == it and name not in STEP_PHASES_SKIPPED

    n = len(stream.events)
    start = next((i for i in range(n) if in_step(i, 1)), None)
    if start is None:
        raise ConfigError("the trace has no second optimizer step to repeat")
    end = next((i for i in range(start, n) if not in_step(i, 1)), n)
    return start, end


def micro_bounds(stream: Stream, start: int, end: int,
                 iteration: int = 1) -> tuple[int, int] | None:
    """(first event of the second micro batch, first of the optimizer) in optimizer step
    ``iteration`` (the events [start, end)), where the trace ran two micro batches
    (gradient accumulation)."""
    forwards = [p for p, (name, it) in enumerate(stream.phases)
                if name == "forward" and it == iteration]
    if len(forwards) < 2:
        return None
    mb2 = next((i for i in range(start, end) if stream.event_phase[i] == forwards[1]), None)
    opt = next((i for i in range(start, end)
                if stream.phases[stream.event_phase[i]] == ("optimizer", iteration)), None)
    return None if mb2 is None or opt is None else (mb2, opt)


def allocator_events(stream: Stream) -> tuple[list[tuple[str, int, int]], tuple[int, int]]:
    """The events the caching allocator sees (paged optimizer states live in unified
    memory, outside it) up to the end of the repeated step, and that step's bounds.
    Evaluation and teardown are left out: a run does not repeat them, and what the
    teardown frees depends on who else holds the model (a warning's frame)."""
    start, end = step_bounds(stream)
    kept = [i for i, (_, key, _) in enumerate(stream.events) if stream.category[key] != PAGED]

    def index(event: int) -> int:
        return next((n for n, i in enumerate(kept) if i >= event), len(kept))

    new_end = index(end)
    return [stream.events[i] for i in kept[:new_end]], (index(start), new_end)


def allocator_micro_bounds(stream: Stream, iteration: int = 1) -> tuple[int, int] | None:
    """micro_bounds among the events the allocator sees (allocator_events): of the
    repeated step (``iteration`` 1), or of the first step (0), which runs before it."""
    start, end = step_bounds(stream)
    bounds = (micro_bounds(stream, start, end) if iteration else
              micro_bounds(stream, 0, start, iteration=0))
    if bounds is None:
        return None
    kept = [i for i, (_, key, _) in enumerate(stream.events) if stream.category[key] != PAGED]
    return tuple(next(n for n, i in enumerate(kept) if i >= b) for b in bounds)  # type: ignore[return-value]


def scaled_step_stream(cfg: RunConfig, longest: int, cluster: Cluster | None = None,
                       resolved: Any = None) -> ScaledStream:
    """Trace ``cfg`` at three lengths up to ``longest`` and fit the stream."""
    from ...models.catalog import resolve_model
    from .fake import _other_models, plan_layers, trace_once
    from .stacks import trace_unsupported

    resolved = resolved or resolve_model(cfg.model)
    if resolved.hf_config is None:
        raise ConfigError(f"a run simulation needs a trace, and transformers does not "
                          f"implement model type '{resolved.spec.model_type}'")
    reason = trace_unsupported(cfg)
    if reason:
        raise ConfigError(f"a run simulation needs a trace: {reason}")
    plan = plan_layers(resolved.hf_config, _other_models(cfg))
    shortest = trace_lengths(longest)
    closer = tuple(sorted({max(1, longest // 2), max(1, 3 * longest // 4), longest}))
    for attempt, lengths in enumerate((shortest, closer)):
        streams: dict[int, list] = {}
        bounds: dict[int, tuple[int, int]] = {}
        micro: dict[int, tuple[int, int] | None] = {}
        first_micro: dict[int, tuple[int, int] | None] = {}
        for length in lengths:
            run_cfg = cfg.model_copy(update={"seq_len": length})
            try:
                stats = trace_once(resolved.hf_config, run_cfg, cluster, plan,
                                   AllocatorConfig(), timeline_points=2, seq_len=length,
                                   spec=resolved.spec)
            except ExpansionError as err:
                raise ConfigError(f"can't tell the run's memory: the layers do not repeat "
                                  f"cleanly ({err})") from None
            assert stats.stream is not None
            streams[length], bounds[length] = allocator_events(stats.stream)
            micro[length] = allocator_micro_bounds(stats.stream)
            first_micro[length] = allocator_micro_bounds(stats.stream, iteration=0)
        try:
            return fit_stream(streams, bounds, micro, first_micro)
        except StreamMismatch as err:
            if attempt:  # short lengths run other kernels: the closer lengths failed too
                raise ConfigError(
                    f"can't tell the run's memory from traces at {lengths}: {err}; "
                    "estimate at a fixed length with --seq-len instead") from None
    raise AssertionError("unreachable")


def capacity_bytes(cluster: Cluster | None, world_size: int) -> int | None:
    """What the caching allocator may reserve: the card minus CUDA context and libraries."""
    if cluster is None:
        return None
    from ...memory.overheads import non_pytorch_bytes

    return cluster.gpu.memory_bytes - sum(non_pytorch_bytes(cluster, world_size).values())


def predict_run_for(cfg: RunConfig, samples: list[int], *, cluster: Cluster | None,
                    steps: int, order: str, seed: int = 42, cap: int | None = None,
                    pack: Any = None, alloc_conf: str | None = None,
                    resolved: Any = None, empty_cache_every: int = 0) -> tuple[Any, ScaledStream]:
    """The run of ``cfg`` over ``samples`` (token lengths, in file order)."""
    from ...planner.runsim import predict_run, step_lengths

    config = AllocatorConfig.from_conf(alloc_conf)  # a bad setting stops before tracing
    cap = cap or max(samples)
    lens = step_lengths(samples, batch=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                        steps=steps, order=order, cap=cap, seed=seed, pack=pack)
    # packing (a fix, or the order) fills rows up to the cap: trace up to it
    longest = max(max(lens), cap if pack is not None else 0)
    stream = scaled_step_stream(cfg, longest, cluster, resolved)
    pred = predict_run(stream, samples, batch=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                       steps=steps, order=order, cap=cap,
                       capacity_bytes=capacity_bytes(cluster, cfg.world_size),
                       alloc_conf=config, seed=seed, pack=pack,
                       empty_cache_every=empty_cache_every)
    return pred, stream


def run_over(cfg: RunConfig, *, data: str | None = None, lengths: list[int] | None = None,
             steps: int, order: str, seed: int = 42, cap: int | None = None,
             alloc_conf: str | None = None, empty_cache_every: int = 0) -> dict[str, Any]:
    """The run of ``cfg`` over a data file's samples (tokenized as ``plan --data`` does)
    or over given lengths, as a JSON-ready dict (``RunPrediction.to_dict`` + sources).
    ``cap``: the longest a sample may be (truncation); None: the data's longest."""
    from ...api import cluster_for
    from ...models.catalog import resolve_model

    resolved = resolve_model(cfg.model)
    pack = None
    if data:
        from ...planner.datastats import profile_data

        profile = profile_data(data, resolved.spec, resolved, fmt=cfg.data.format, seq_cap=cap)
        samples = list(profile.file_order or profile.lengths)
        cap = cap or profile.cutoffs[0].length

        def pack(c: int) -> list[int]:
            return profile.rows(c, True)[0]

        source = f"{data} ({profile.source})"
    elif lengths:
        samples, cap = list(lengths), cap or max(lengths)
        source = "--lengths " + ",".join(map(str, lengths))
    else:
        raise ConfigError("a run simulation needs --data FILE or --lengths L1,L2,…")
    pred, stream = predict_run_for(cfg, samples, cluster=cluster_for(cfg), steps=steps,
                                   order=order, seed=seed, cap=cap, pack=pack,
                                   alloc_conf=alloc_conf, resolved=resolved,
                                   empty_cache_every=empty_cache_every)
    note = (f"run: {pred.steps} steps over {source} in {order} order, the step traced at "
            f"{', '.join(map(str, stream.lengths))} tokens and scaled per tensor (constant, "
            "linear or quadratic in the length), replayed through the caching-allocator model")
    return {**pred.to_dict(), "source": source, "traced_lengths": list(stream.lengths),
            "length_dependence": stream.degree_counts(), "assumption": note}
