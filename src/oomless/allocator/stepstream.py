"""A training step's alloc/free stream at any sequence length, from traces at a few.

The trace (oomless.runtime.trace) records every storage a step allocates and
frees at one length. Traced at two or three lengths, the streams have the same
events in the same order (the model runs the same ops); only sizes change.
Each allocation's size is then a function of the length, of the lowest degree
that passes through its traced sizes exactly:

- degree 0: weights, adapters, optimizer states, workspaces (no length);
- degree 1: activations, logits, gradients of activations (tokens × width);
- degree 2: eager attention scores and probabilities (heads × length²).

At a traced length the stream is the trace's, byte for byte (rational
interpolation through the traced points); elsewhere a size is interpolated or
extrapolated on its polynomial and rounded to a byte. With two traced lengths
every size is at most linear (a quadratic tensor is then not told apart from a
linear one; ``degrees_known`` says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from .replay import ALLOC, FREE

MAX_CACHED_LENGTHS = 64  # streams kept per length: a run of 5000 lengths stays small


class StreamMismatch(ValueError):
    """The traces at different lengths do not run the same events."""


@dataclass(frozen=True)
class ScaledStream:
    """Events (kind, key) with per-allocation sizes at each traced length.

    ``step_start``/``step_end``: the events of one steady optimizer step (the
    trace's second), which a run repeats; everything before is model setup and
    the first step, which also creates the optimizer states.
    """

    lengths: tuple[int, ...]
    events: tuple[tuple[str, int], ...]
    sizes: tuple[tuple[int, ...], ...]  # per event: bytes at each traced length; () for frees
    step_start: int
    step_end: int
    # (first event of the second micro batch, first event of the optimizer) in the
    # repeated step, where the trace ran two micro batches (gradient accumulation)
    micro: tuple[int, int] | None = None
    # the same two events in the first step (before step_start), where it has them
    first_micro: tuple[int, int] | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)
    _rows: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def degrees_known(self) -> int:
        """The highest degree the traced lengths can tell apart (points − 1, at most 2)."""
        return min(len(self.lengths) - 1, 2)

    def degree(self, i: int) -> int:
        """Lowest polynomial degree through event ``i``'s traced sizes."""
        pts = list(zip(self.lengths, self.sizes[i], strict=True))
        if len({s for _, s in pts}) == 1:
            return 0
        if len(pts) == 2 or _on_line(pts):
            return 1
        return 2

    def degree_counts(self) -> dict[int, int]:
        out = {0: 0, 1: 0, 2: 0}
        for i, (kind, _) in enumerate(self.events):
            if kind == ALLOC:
                out[self.degree(i)] += 1
        return out

    def sizes_at(self, length: int) -> tuple[int, ...]:
        """Every event's size at ``length`` (0 for frees), cached per length.

        A size depends only on the event's traced sizes, and the layers repeat, so
        each distinct row of traced sizes is scaled once (``_size`` of its first
        event) and shared by the events that have it: the same bytes as scaling
        every event (``sizes_at_each``), a few hundred evaluations instead of one
        per event."""
        if length not in self._cache:
            if len(self._cache) >= MAX_CACHED_LENGTHS:  # a long run of many lengths
                self._cache.clear()
            firsts, rows = self._distinct_rows()
            scaled = [self._size(i, length) for i in firsts]
            self._cache[length] = tuple(0 if r < 0 else scaled[r] for r in rows)
        return self._cache[length]

    def sizes_at_each(self, length: int) -> tuple[int, ...]:
        """``sizes_at`` computed event by event (the reference it must equal)."""
        return tuple(self._size(i, length) if kind == ALLOC else 0
                     for i, (kind, _) in enumerate(self.events))

    def _distinct_rows(self) -> tuple[list[int], list[int]]:
        """(first event of each distinct row of traced sizes, per event its row's
        index or -1 for a free), computed once."""
        if not self._rows:
            index: dict[tuple[int, ...], int] = {}
            firsts: list[int] = []
            rows: list[int] = []
            for i, (kind, _) in enumerate(self.events):
                if kind != ALLOC:
                    rows.append(-1)
                    continue
                if self.sizes[i] not in index:
                    index[self.sizes[i]] = len(firsts)
                    firsts.append(i)
                rows.append(index[self.sizes[i]])
            self._rows["firsts"], self._rows["rows"] = firsts, rows
        return self._rows["firsts"], self._rows["rows"]

    def _size(self, i: int, length: int) -> int:
        sizes = self.sizes[i]
        if length in self.lengths:
            return sizes[self.lengths.index(length)]
        d = self.degree(i)
        if d == 0:
            return sizes[0]
        # the d + 1 traced points nearest to the length
        near = sorted(zip(self.lengths, sizes, strict=True),
                      key=lambda p: (abs(p[0] - length), p[0]))[: d + 1]
        return max(0, round(_lagrange(near, length)))

    def events_at(self, length: int) -> list[tuple[str, int, int]]:
        """The whole traced stream at one length, as (kind, key, bytes)."""
        sizes = self.sizes_at(length)
        return [(kind, key, sizes[i]) for i, (kind, key) in enumerate(self.events)]


def _lagrange(points: list[tuple[int, int]], x: int) -> Fraction:
    total = Fraction(0)
    for j, (xj, yj) in enumerate(points):
        term = Fraction(yj)
        for m, (xm, _) in enumerate(points):
            if m != j:
                term *= Fraction(x - xm, xj - xm)
        total += term
    return total


def _on_line(points: list[tuple[int, int]]) -> bool:
    (x0, y0), (x1, y1) = points[0], points[1]
    return all((y - y0) * (x1 - x0) == (y1 - y0) * (x - x0) for x, y in points[2:])


def canonical(events: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Keys renumbered by first allocation (0, 1, …); frees of unknown keys get -1.

    Consecutive frees are sorted by key: the order in which Python drops several
    references at once varies from run to run, and the allocator's state after a
    run of frees does not depend on their order (merging neighbours commutes)."""
    names: dict[int, int] = {}
    out: list[tuple[str, int, int]] = []
    frees: list[tuple[str, int, int]] = []
    for kind, key, size in events:
        if kind == ALLOC:
            out.extend(sorted(frees, key=lambda e: e[1]))
            frees = []
            names[key] = len(names)
            out.append((kind, names[key], size))
        else:
            frees.append((kind, names.get(key, -1), size))
    out.extend(sorted(frees, key=lambda e: e[1]))
    return out


def fit_stream(traces: dict[int, list[tuple[str, int, int]]],
               step_bounds: dict[int, tuple[int, int]],
               micro_bounds: dict[int, tuple[int, int] | None] | None = None,
               first_micro_bounds: dict[int, tuple[int, int] | None] | None = None,
               ) -> ScaledStream:
    """One ScaledStream from the streams traced at each length.

    ``step_bounds[length]``: (first, one past last) event of the repeated step in
    that trace. Raises StreamMismatch where the traces differ in anything but
    sizes (the lengths then change which ops run: trace closer lengths).
    """
    if len(traces) < 2:
        raise StreamMismatch("scaling a stream needs traces at two lengths or more")
    lengths = tuple(sorted(traces))
    canon = {L: canonical(traces[L]) for L in lengths}
    first = canon[lengths[0]]
    for L in lengths[1:]:
        other = canon[L]
        if len(other) != len(first) or any(
                a[:2] != b[:2] for a, b in zip(first, other, strict=True)):
            raise StreamMismatch(
                f"the traces at {lengths[0]} and {L} tokens run different events "
                f"({len(first)} vs {len(other)}): the ops depend on the length")
        if step_bounds[L] != step_bounds[lengths[0]] or any(
                b and b[L] != b[lengths[0]] for b in (micro_bounds, first_micro_bounds)):
            raise StreamMismatch(f"the step starts at different events at {lengths[0]} "
                                 f"and {L} tokens")
    sizes = tuple(
        tuple(canon[L][i][2] for L in lengths) if kind == ALLOC else ()
        for i, (kind, _, _) in enumerate(first))
    start, end = step_bounds[lengths[0]]
    micro = micro_bounds[lengths[0]] if micro_bounds else None
    first_micro = first_micro_bounds[lengths[0]] if first_micro_bounds else None
    return ScaledStream(lengths, tuple((k, key) for k, key, _ in first), sizes, start, end,
                        micro, first_micro)


__all__ = ["FREE", "ScaledStream", "StreamMismatch", "canonical", "fit_stream"]
