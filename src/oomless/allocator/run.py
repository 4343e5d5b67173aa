"""A training run through the caching allocator: many steps, each at its own length.

The run is the trace's stream up to the repeated step (model setup and the
first step, at the first step's length), then the repeated step once per
further optimizer step at that step's length. Storages of one step that the
next step frees (outputs a stack holds until its next forward) are handed over:
a storage the step frees that an earlier step allocated is the previous step's
storage of the same size that it left allocated, matched in order. A storage a step leaves that no
later step frees (the trace's loss values, which the trace keeps in a list) is
freed at the end of the next step, so a long run does not accumulate them.

A free of an earlier storage that the step has no counterpart for (the same
size at every traced length) is the trace closing — the optimizer and its
states dropped after the last traced step — and is not repeated: optimizer
states live through the run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .caching import CachingAllocator, _Block
from .config import AllocatorConfig, SimulatedOOM
from .replay import ALLOC, FREE, downsample
from .stepstream import ScaledStream

CURVE_POINTS = 200


@dataclass(frozen=True)
class StepPoint:
    """One step of the run: its length and the allocator's counters."""

    step: int
    length: int
    peak_allocated_bytes: int  # highest memory_allocated during the step
    peak_reserved_bytes: int  # highest memory_reserved during the step
    reserved_end_bytes: int  # memory_reserved after the step (the cache it keeps)


@dataclass(frozen=True)
class RunReport:
    """What replaying a run through the allocator gave."""

    config: str
    steps: int  # steps replayed (up to and including a failing one)
    high_water_bytes: int  # max_memory_reserved over the run
    high_water_step: int  # first step that reached it
    peak_allocated_bytes: int  # max_memory_allocated over the run
    fragmentation_bytes: int  # reserved − allocated at the moment of the high water
    max_length: int
    oom_step: int | None = None  # step whose allocation failed after freeing the cache
    oom_request_bytes: int | None = None
    num_alloc_retries: int = 0  # cudaMalloc failures that freed the cache and retried
    curve: tuple[StepPoint, ...] = ()

    @property
    def fits(self) -> bool:
        return self.oom_step is None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["curve"] = [list(p.__dict__.values()) for p in self.curve]
        return d


def _handover(stream: ScaledStream) -> tuple[dict[int, int], list[int]]:
    """({step event freeing an earlier storage: the step allocation that is its
    counterpart}, step allocations left live). A storage the step frees that an
    earlier step allocated is handed over when the step itself leaves one of the
    same size at every traced length (its own output, for the next step to free),
    matched in order; the other frees of earlier storages are the trace closing
    (the optimizer and its states dropped after the last step): not repeated."""
    start, end = stream.step_start, stream.step_end
    born = {key: i for i, (kind, key) in enumerate(stream.events) if kind == ALLOC}
    freed = {stream.events[i][1] for i in range(start, end) if stream.events[i][0] != ALLOC}
    left = [i for i in range(start, end)
            if stream.events[i][0] == ALLOC and stream.events[i][1] not in freed]
    unmatched = list(left)
    pairs: dict[int, int] = {}
    for i in range(start, end):
        kind, key = stream.events[i]
        if kind == ALLOC or born.get(key, start) >= start:
            continue
        twin = next((j for j in unmatched if stream.sizes[j] == stream.sizes[born[key]]), None)
        if twin is not None:
            unmatched.remove(twin)
        pairs[i] = -1 if twin is None else twin
    return pairs, left


def run_events(stream: ScaledStream, lengths: Sequence[int]) -> Iterator[tuple[int, str, Any, int]]:
    """(step, kind, key, bytes) of the whole run, step 0 included."""
    sizes = stream.sizes_at(lengths[0])
    for i in range(stream.step_start):
        kind, key = stream.events[i]
        yield 0, kind, key, sizes[i]
    pairs, left = _handover(stream)
    prev_left: dict[int, Any] = {}  # step allocation event → its key in the previous step
    for step in range(1, len(lengths)):
        sizes = stream.sizes_at(lengths[step])
        handed: set[Any] = set()
        for i in range(stream.step_start, stream.step_end):
            kind, key = stream.events[i]
            if kind == ALLOC:
                yield step, kind, (step, key), sizes[i]
            elif i in pairs:
                twin = pairs[i]
                if twin < 0:
                    continue  # the trace closing: the storage lives on
                target = key if step == 1 else prev_left.get(twin)
                if target is not None:
                    handed.add(target)
                    yield step, kind, target, 0
            else:
                yield step, kind, (step, key), 0
        for key in prev_left.values():  # left by the previous step, not freed by this one
            if key not in handed:
                yield step, FREE, key, 0
        prev_left = {i: (step, stream.events[i][1]) for i in left}


def simulate_run(stream: ScaledStream, lengths: Sequence[int],
                 config: AllocatorConfig | None = None,
                 curve_points: int = CURVE_POINTS, empty_cache_every: int = 0) -> RunReport:
    """Replay ``len(lengths)`` steps (the i-th at ``lengths[i]``) through the allocator.

    ``empty_cache_every`` N > 0: ``torch.cuda.empty_cache()`` after every N-th step
    (transformers' ``torch_empty_cache_steps``, or a loop's own schedule), after the
    step's counters are read."""
    alloc = CachingAllocator(config)
    live: dict[Any, _Block] = {}
    points: list[StepPoint] = []
    step_alloc = step_res = 0
    high = high_step = frag = 0
    current = 0
    oom: tuple[int, int] | None = None
    for step, kind, key, size in run_events(stream, lengths):
        if step != current:
            points.append(StepPoint(current, lengths[current], step_alloc, step_res,
                                    alloc.reserved_bytes))
            if empty_cache_every and (current + 1) % empty_cache_every == 0:
                alloc.empty_cache()
            current, step_alloc, step_res = step, 0, 0
        if kind == ALLOC:
            if size <= 0:
                continue
            try:
                live[key] = alloc.malloc(size)
            except SimulatedOOM as err:
                oom = (step, err.size_bytes)
                break
        else:
            block = live.pop(key, None)
            if block is None:
                continue
            alloc.free(block)
        step_alloc = max(step_alloc, alloc.allocated_bytes)
        step_res = max(step_res, alloc.reserved_bytes)
        if alloc.reserved_bytes > high:
            high, high_step = alloc.reserved_bytes, step
            frag = alloc.reserved_bytes - alloc.allocated_bytes
    points.append(StepPoint(current, lengths[current], step_alloc, step_res,
                            alloc.reserved_bytes))
    return RunReport(
        config=alloc.config.describe(), steps=current + 1, high_water_bytes=high,
        high_water_step=high_step, peak_allocated_bytes=alloc.peak_allocated_bytes,
        fragmentation_bytes=frag, max_length=max(lengths[: current + 1]),
        oom_step=oom[0] if oom else None, oom_request_bytes=oom[1] if oom else None,
        num_alloc_retries=alloc.num_alloc_retries,
        curve=_curve(points, curve_points),
    )


def _curve(points: list[StepPoint], target: int) -> tuple[StepPoint, ...]:
    """About ``target`` steps, each bucket's highest reserved, the last step kept."""
    if not target or len(points) <= target:
        return tuple(points)
    rows = [(p.step, p.peak_reserved_bytes, i) for i, p in enumerate(points)]
    return tuple(points[r[2]] for r in downsample(rows, target))
