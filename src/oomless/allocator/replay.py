"""Replaying an alloc/free stream through the allocator."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .caching import CachingAllocator, _Block
from .config import AllocatorConfig, SimulatedOOM

ALLOC = "alloc"
FREE = "free"


@dataclass(frozen=True)
class AllocatorReport:
    """What replaying a stream through the allocator gave."""

    config: str
    peak_allocated_bytes: int  # max of memory_allocated (block sizes)
    peak_reserved_bytes: int  # max of memory_reserved (segments)
    peak_requested_bytes: int  # max of the sum of requested sizes
    reserved_at_peak_allocated_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    num_events: int
    num_alloc_retries: int
    num_segments_at_end: int
    oom_at_event: int | None = None  # index of the request that did not fit
    oom_request_bytes: int | None = None
    timeline: tuple[tuple[int, int, int], ...] = ()  # (event index, allocated, reserved)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["timeline"] = [list(p) for p in self.timeline]
        return d


def apply_event(alloc: CachingAllocator, live: dict[Any, _Block], kind: str, key: Any,
                size: int) -> bool:
    """One event through ``alloc``: an allocation takes a block for ``key`` in ``live``
    (raises SimulatedOOM when it does not fit even after the allocator freed its cache),
    a free gives ``key``'s block back. False when nothing happened: a zero-byte request
    (PyTorch returns a null pointer for it) or a free of a key that holds no block."""
    if kind == ALLOC:
        if size <= 0:
            return False
        live[key] = alloc.malloc(size)
        return True
    block = live.pop(key, None)
    if block is None:
        return False
    alloc.free(block)
    return True


def replay(
    events: Iterable[tuple[str, int, int]],
    config: AllocatorConfig | None = None,
    timeline_points: int = 0,
) -> AllocatorReport:
    """Replay ``(ALLOC, key, size_bytes)`` / ``(FREE, key, 0)`` events.

    Zero-byte requests take no block (PyTorch returns a null pointer for them).
    ``timeline_points`` > 0 records (event, allocated, reserved) after every
    event and keeps about that many points, each bucket's highest.
    """
    alloc = CachingAllocator(config)
    live: dict[Any, _Block] = {}
    points: list[tuple[int, int, int]] = []
    reserved_at_peak = 0
    oom_at = oom_bytes = None
    n = 0
    for n, (kind, key, size) in enumerate(events):
        try:
            applied = apply_event(alloc, live, kind, key, size)
        except SimulatedOOM as err:
            oom_at, oom_bytes = n, err.size_bytes
            break
        if kind == ALLOC:
            if not applied:
                continue
            if alloc.allocated_bytes == alloc.peak_allocated_bytes:
                reserved_at_peak = alloc.reserved_bytes
        if timeline_points:
            points.append((n, alloc.allocated_bytes, alloc.reserved_bytes))
    return AllocatorReport(
        config=alloc.config.describe(),
        peak_allocated_bytes=alloc.peak_allocated_bytes,
        peak_reserved_bytes=alloc.peak_reserved_bytes,
        peak_requested_bytes=alloc.peak_requested_bytes,
        reserved_at_peak_allocated_bytes=reserved_at_peak,
        final_allocated_bytes=alloc.allocated_bytes,
        final_reserved_bytes=alloc.reserved_bytes,
        num_events=n + 1 if oom_at is None else n,
        num_alloc_retries=alloc.num_alloc_retries,
        num_segments_at_end=alloc.num_segments,
        oom_at_event=oom_at,
        oom_request_bytes=oom_bytes,
        timeline=tuple(downsample(points, timeline_points)) if timeline_points else (),
    )


def downsample(points: list[tuple[int, ...]], target: int) -> list[tuple[int, ...]]:
    """About ``target`` points: per bucket the point with the highest second field,
    so every peak survives."""
    if len(points) <= target:
        return list(points)
    size = -(-len(points) // target)
    out = []
    for i in range(0, len(points), size):
        bucket = points[i : i + size]
        out.append(max(bucket, key=lambda p: p[1]))
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out


def stream_from_sizes(sizes_and_frees: Iterable[int]) -> list[tuple[str, int, int]]:
    """Test helper: positive n allocates n bytes under the next key; negative -k
    frees key k (keys count from 1)."""
    keys = itertools.count(1)
    out: list[tuple[str, int, int]] = []
    for v in sizes_and_frees:
        out.append((ALLOC, next(keys), v) if v > 0 else (FREE, -v, 0))
    return out
