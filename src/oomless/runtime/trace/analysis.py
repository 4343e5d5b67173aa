"""From a tracker's event stream to peaks, breakdowns and a timeline.

The stream is replayed through the caching-allocator simulation
(oomless.allocator), so allocated bytes are block sizes as
``torch.cuda.memory_allocated`` counts them and reserved bytes are segments
as ``memory_reserved`` counts them. Each phase's breakdown is the bytes per
category at the moment that phase's allocated bytes were highest; the
categories add up to that peak.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ...allocator import ALLOC, AllocatorConfig, CachingAllocator, SimulatedOOM, downsample
from .expansion import Stream
from .storage_tracker import PAGED, StorageTracker, _rounded

SKIP_PHASES = ("setup", "teardown")


@dataclass
class TraceStats:
    num_layers: int
    param_count: int
    trainable_params: int
    breakdown: dict[str, dict[str, int]]  # phase → category → bytes at the phase's peak
    tensor_peaks: dict[str, int]  # phase → peak of live tensor bytes (512-rounded)
    peak_reserved_bytes: int
    paged_bytes: int
    allocator: dict[str, Any]
    timeline: list[dict[str, Any]]
    module_peaks: dict[str, dict[str, int]]
    num_events: int
    notes: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # real tensors only
    traced_layers: int = 0  # layers actually run (num_layers after expansion)
    stream: Stream | None = None  # the analysed stream (a run replays it, allocator.run)

    @property
    def phase_peaks(self) -> dict[str, int]:
        return {p: sum(c.values()) for p, c in self.breakdown.items()}


class _Walk:
    """Replay state: the allocator, bytes per category, per-phase peaks, points."""

    def __init__(self, stream: Stream, config: AllocatorConfig):
        self.stream = stream
        self.alloc = CachingAllocator(config)
        self.blocks: dict[int, Any] = {}
        self.cat_bytes: dict[str, int] = defaultdict(int)
        self.best: dict[str, tuple[int, dict[str, int]]] = {}
        self.tensor_peaks: dict[str, int] = {}
        self.live = self.paged = self.paged_peak = 0
        self.points: list[tuple[int, int, int, int]] = []
        self.oom: dict[str, int] | None = None
        self.phase_names = [name for name, _ in stream.phases]

    def run(self) -> _Walk:
        for i, (kind, key, size) in enumerate(self.stream.events):
            if self.event(kind, key, size, i) and self.oom:
                break
        return self

    def event(self, kind: str, key: int, size: int, i: int) -> bool:
        """Apply one event; False when it changes nothing the allocator sees."""
        cat, nbytes = self.stream.category[key], self.stream.nbytes[key]
        if cat == PAGED:  # unified memory: outside the caching allocator
            self.paged += nbytes if kind == ALLOC else -nbytes
            self.paged_peak = max(self.paged_peak, self.paged)
            return False
        if kind == ALLOC:
            if size <= 0:
                return False
            try:
                self.blocks[key] = block = self.alloc.malloc(size)
            except SimulatedOOM as err:  # only with a capacity set
                self.oom = {"event": i, "request_bytes": err.size_bytes}
                return True
            self.cat_bytes[cat] += block.size
            self.live += _rounded(size)
        else:
            block = self.blocks.pop(key, None)
            if block is None:
                return False
            self.cat_bytes[cat] -= block.size
            self.alloc.free(block)
            self.live -= _rounded(nbytes)
        self._observe(i)
        return True

    def _observe(self, i: int) -> None:
        phase = self.phase_names[self.stream.event_phase[i]]
        if phase in SKIP_PHASES:
            return
        allocated = self.alloc.allocated_bytes
        top = self.best.get(phase)
        if top is None or allocated > top[0]:
            self.best[phase] = (allocated, {k: v for k, v in self.cat_bytes.items() if v})
        if self.live > self.tensor_peaks.get(phase, 0):
            self.tensor_peaks[phase] = self.live
        self.points.append((i, allocated, self.alloc.reserved_bytes,
                            self.stream.event_phase[i]))


def analyze(stream: Stream, config: AllocatorConfig, *, num_layers: int, param_count: int,
            trainable_params: int, timeline_points: int = 800,
            module_peaks: dict[str, dict[str, int]] | None = None) -> TraceStats:
    walk = _Walk(stream, config).run()
    alloc = walk.alloc
    allocator = {
        "config": config.describe(),
        "peak_allocated_bytes": alloc.peak_allocated_bytes,
        "peak_reserved_bytes": alloc.peak_reserved_bytes,
        "peak_requested_bytes": alloc.peak_requested_bytes,
        "num_alloc_retries": alloc.num_alloc_retries,
        "num_device_alloc": alloc.num_device_alloc,
        "oom": walk.oom,
    }
    return TraceStats(
        num_layers=num_layers, param_count=param_count, trainable_params=trainable_params,
        breakdown={p: cats for p, (_, cats) in walk.best.items()},
        tensor_peaks=walk.tensor_peaks, peak_reserved_bytes=alloc.peak_reserved_bytes,
        paged_bytes=walk.paged_peak, allocator=allocator,
        timeline=_timeline(stream, walk.points, timeline_points),
        module_peaks=module_peaks or {}, num_events=len(stream.events),
    )


def _timeline(stream: Stream, points: list[tuple[int, int, int, int]],
              n_points: int) -> list[dict[str, Any]]:
    """Allocated and reserved bytes after each event (about ``n_points`` of them,
    every peak kept), with the phase and iteration each belongs to."""
    out = []
    for index, allocated, reserved, phase_idx in downsample(points, n_points):
        phase, iteration = stream.phases[phase_idx]
        out.append({"index": index, "allocated_bytes": allocated,
                    "reserved_bytes": reserved, "phase": phase, "iteration": iteration})
    return out


PEFT_PREFIX = "base_model.model."


def display_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def module_peaks(tracker: StorageTracker) -> dict[str, dict[str, int]]:
    """The most memory each module's run added on top of what was live when it
    started, forward and backward: modules down to a layer's attention and MLP,
    adapter internals and the wrappers around all layers left out."""
    layers = tracker.layers_name
    out = {}
    for name, (fwd, bwd) in tracker.module_peaks.items():
        if name in ("base_model", "base_model.model") or (layers and (
                name == layers or layers.startswith(name + "."))):
            continue  # the whole model: its peak is the estimate's peak
        shown = display_name(name)
        parts = shown.split(".")
        depth = 4 + sum(p in ("language_model", "text_model") for p in parts)
        if len(parts) > depth or any(p.startswith("lora_") or p == "base_layer" for p in parts):
            continue
        out[shown] = {"forward_added_bytes": fwd, "backward_added_bytes": bwd}
    return out


def extrapolate(a: TraceStats, b: TraceStats, layers: int) -> dict[str, Any]:
    """Numbers for ``layers`` layers from traces of ``a.traced_layers`` < ``b.traced_layers``:
    every quantity is affine in the number of repeated layers."""
    span = b.traced_layers - a.traced_layers

    def f(va: float, vb: float) -> int:
        return max(0, round(vb + (vb - va) * (layers - b.traced_layers) / span))

    breakdown = {}
    for phase in b.breakdown:
        pa, pb = a.breakdown.get(phase, {}), b.breakdown[phase]
        breakdown[phase] = {c: f(pa.get(c, 0), pb.get(c, 0)) for c in set(pa) | set(pb)}
        breakdown[phase] = {c: v for c, v in breakdown[phase].items() if v}
    return {
        "breakdown": breakdown,
        "tensor_peaks": {p: f(a.tensor_peaks.get(p, 0), v) for p, v in b.tensor_peaks.items()},
        "peak_reserved_bytes": f(a.peak_reserved_bytes, b.peak_reserved_bytes),
        "paged_bytes": f(a.paged_bytes, b.paged_bytes),
        "param_count": f(a.param_count, b.param_count),
        "trainable_params": f(a.trainable_params, b.trainable_params),
    }
