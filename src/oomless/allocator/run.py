"""A training run through the caching allocator: many steps, each at its own length.

The run is the trace's stream up to the repeated step (model setup and the
first step, at the first step's length), then the repeated step once per
further optimizer step at that step's length. Storages of one step that the
next step frees (outputs a stack holds until its next forward) are handed over:
a storage the step frees that an earlier step allocated is the previous step's
storage of the same size that it left allocated, matched in order. A storage a step leaves that no
later step frees (the trace's loss values, which the trace keeps in a list) is
freed at the end of the next step, so a long run does not accumulate them.

With gradient accumulation the trace runs two micro batches per step; a run's
step runs the first at its own length, then the second once per further micro
batch, each at its length (what a micro batch frees of the one before is handed
over the same way), then the optimizer.

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
from .replay import ALLOC, FREE, apply_event, downsample
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


def _pairs(stream: ScaledStream, start: int, end: int) -> tuple[dict[int, int], list[int]]:
    """For the events [start, end): ({event freeing a storage allocated before start:
    its counterpart among the allocations the segment leaves, or -1}, allocations
    left live). A storage allocated before is handed over when the segment leaves
    one of the same size at every traced length (its own output, or the gradient it
    accumulated, for the next step or micro batch to free), matched in order."""
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


def _micro(step_lengths: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(step_lengths) if isinstance(step_lengths, (list, tuple)) else (step_lengths,)


class _Step:
    """Names the storages of one step: the first (setup included, the events before
    ``step_start``) or a repeated one. Where the trace ran two micro batches, the second
    (B) runs once per further micro batch, each copy at its own length."""

    def __init__(self, stream: ScaledStream, step: int, micro: tuple[int, ...]):
        self.stream, self.step, self.micro = stream, step, micro
        self.start, self.end = (stream.step_start, stream.step_end) if step else (
            0, stream.step_start)
        self.born = {key: i for i, (kind, key) in enumerate(stream.events) if kind == ALLOC}
        bounds = stream.micro if step else stream.first_micro
        self.b = bounds if bounds and len(micro) > 1 else None
        self.last = len(micro) - 1 if self.b else 0

    def in_b(self, i: int) -> bool:
        return self.b is not None and self.b[0] <= i < self.b[1]

    def name(self, i: int, copy: int) -> Any:
        """Name of the storage allocated by event ``i`` (in copy ``copy`` when in B);
        the first step's others keep the trace's own key."""
        key = self.stream.events[i][1]
        if self.in_b(i):
            return (self.step, copy, key)
        return (self.step, key) if self.step else key


def run_events(stream: ScaledStream, lengths: Sequence[int | Sequence[int]]
               ) -> Iterator[tuple[int, str, Any, int]]:
    """(step, kind, key, bytes) of the whole run, step 0 included. ``lengths[i]``: the
    step's length, or its micro batches' lengths."""
    first = _Step(stream, 0, _micro(lengths[0]))
    pairs, left = _pairs(stream, stream.step_start, stream.step_end)
    b_pairs = [_pairs(stream, *b)[0] if b else {} for b in (stream.first_micro, stream.micro)]
    prev_left: dict[int, Any] = {}  # step allocation event → its name in the previous step
    for step in range(len(lengths)):
        st = _Step(stream, step, _micro(lengths[step])) if step else first
        yield from _replay_step(st, first, pairs, b_pairs[min(step, 1)], prev_left)
        prev_left = {i: st.name(i, st.last) for i in left} if step else {}


def _replay_step(st: _Step, first: _Step, pairs: dict[int, int], b_pairs: dict[int, int],
                 prev_left: dict[int, Any]) -> Iterator[tuple[int, str, Any, int]]:
    """One step's events, each micro batch's at its length."""
    stream, step, micro = st.stream, st.step, st.micro
    handed: set[Any] = set()
    b_live: set[Any] = set()
    for copy, (lo, hi) in _segments(st):
        sizes = stream.sizes_at(micro[min(copy, len(micro) - 1)] if st.b else max(micro))
        for i in range(lo, hi):
            kind, key = stream.events[i]
            if kind == ALLOC:
                name = st.name(i, copy)
                if st.in_b(i):
                    b_live.add(name)
                yield step, kind, name, sizes[i]
                continue
            target = _free_target(st, first, i, copy, pairs, b_pairs, prev_left)
            if target is None:
                continue
            handed.add(target)
            b_live.discard(target)
            yield step, FREE, target, 0
    for name in b_live:  # what earlier micro batches left and nothing freed
        if name[1] != st.last:
            yield step, FREE, name, 0
    for name in prev_left.values():  # left by the previous step, not freed by this one
        if name not in handed:
            yield step, FREE, name, 0


def _segments(st: _Step) -> list[tuple[int, tuple[int, int]]]:
    """(copy, event range) in replay order: A, B once per further micro batch, C."""
    if st.b is None:
        return [(0, (st.start, st.end))]
    mb2, opt = st.b
    return ([(0, (st.start, mb2))] + [(c, (mb2, opt)) for c in range(1, st.last + 1)]
            + [(st.last, (opt, st.end))])


def _free_target(st: _Step, first: _Step, i: int, copy: int, pairs: dict[int, int],
                 b_pairs: dict[int, int], prev_left: dict[int, Any]) -> Any:
    """The name a free event releases in this step (None: nothing to release)."""
    stream = st.stream
    key = stream.events[i][1]
    j = st.born.get(key, -1)
    if j < st.start:  # allocated by an earlier step
        if st.in_b(i) and copy > 1:
            return None  # the first copy released it
        twin = pairs.get(i, -1)
        if twin < 0:
            return None  # the trace closing (optimizer states): the storage lives on
        return first.name(j, first.last) if st.step == 1 else prev_left.get(twin)
    if st.in_b(i) and not st.in_b(j):  # B frees what the micro batch before left
        if copy == 1:
            return st.name(j, 0)
        twin = b_pairs.get(i, -1)
        return None if twin < 0 else st.name(twin, copy - 1)
    if st.in_b(j):  # allocated in B: this copy's, or (from C) the last copy's
        return st.name(j, copy if st.in_b(i) else st.last)
    return st.name(j, 0)

def simulate_run(stream: ScaledStream, lengths: Sequence[int | Sequence[int]],
                 config: AllocatorConfig | None = None,
                 curve_points: int = CURVE_POINTS, empty_cache_every: int = 0) -> RunReport:
    """Replay ``len(lengths)`` steps (the i-th at ``lengths[i]``, a length or one per
    micro batch) through the allocator.

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
            points.append(StepPoint(current, max(_micro(lengths[current])), step_alloc,
                                    step_res, alloc.reserved_bytes))
            if empty_cache_every and (current + 1) % empty_cache_every == 0:
                alloc.empty_cache()
            current, step_alloc, step_res = step, 0, 0
        try:
            if not apply_event(alloc, live, kind, key, size):
                continue
        except SimulatedOOM as err:
            oom = (step, err.size_bytes)
            break
        step_alloc = max(step_alloc, alloc.allocated_bytes)
        step_res = max(step_res, alloc.reserved_bytes)
        if alloc.reserved_bytes > high:
            high, high_step = alloc.reserved_bytes, step
            frag = alloc.reserved_bytes - alloc.allocated_bytes
    points.append(StepPoint(current, max(_micro(lengths[current])), step_alloc, step_res,
                            alloc.reserved_bytes))
    return RunReport(
        config=alloc.config.describe(), steps=current + 1, high_water_bytes=high,
        high_water_step=high_step, peak_allocated_bytes=alloc.peak_allocated_bytes,
        fragmentation_bytes=frag,
        max_length=max(max(_micro(x)) for x in lengths[: current + 1]),
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
