"""The alloc/free stream of a deep model, from a trace of a shallow one.

Decoder layers repeat. A model traced with ``prefix + 3·P`` layers (P: the
layer pattern's period) has a middle block of P layers, the *template*, that
runs between a block before it and a block after it exactly as every middle
block of the real model does. ``expand`` writes the stream of the model with
``copies`` template blocks in the middle: each template run of events is
repeated (in layer order in forward, in reverse in backward), every storage
the template owns gets one key per copy, and the storages that pass between
neighbouring blocks are re-wired copy to copy:

- what the block before hands over (its output, freed while the template
  runs) is, for copy c > 0, the template's own hand-over of copy c − 1 — the
  storages the block after frees of the template, matched in order;
- in backward, what the block after hands back (the gradient of its input)
  is, for copy c < last, the template's hand-back of copy c + 1 — the
  storages the block before frees of the template, matched in order.

Storages of the template freed elsewhere (zero_grad, the end of a step) are
freed once per copy. The result is checked (every storage allocated once,
freed at most once, after its allocation); a mismatch raises ExpansionError
and the caller falls back to linear extrapolation. tests/runtime/test_trace.py
checks that an expanded stream equals a full trace's, event for event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...allocator import ALLOC, FREE


class ExpansionError(Exception):
    """The traced layers do not repeat cleanly enough to expand."""


@dataclass
class Stream:
    """An alloc/free stream with what analysis needs to know about each storage."""

    events: list[tuple[str, int, int]]
    event_phase: list[int]
    phases: list[tuple[str, int]]
    category: dict[int, str]
    nbytes: dict[int, int]


def stream_of(tracker: Any) -> Stream:
    return Stream(
        events=tracker.events,
        event_phase=tracker.event_phase,
        phases=tracker.phases,
        category={k: tracker.final_category(r) for k, r in tracker.records.items()},
        nbytes={k: r.nbytes for k, r in tracker.records.items()},
    )


def _runs(tracker: Any, template: set[int]) -> list[tuple[int, int, bool]]:
    """Maximal runs of events inside / outside the template, within one phase."""
    runs: list[tuple[int, int, bool]] = []
    start = 0
    owners, phases = tracker.event_owner, tracker.event_phase
    for i in range(1, len(owners) + 1):
        if i == len(owners) or (owners[i] in template) != (owners[start] in template) \
                or phases[i] != phases[start]:
            runs.append((start, i, owners[start] in template))
            start = i
    return runs


def _handovers(tracker: Any, runs: list, template: set[int], giver: set[int],
               taker: set[int]) -> dict[int, int]:
    """Match, in order, the giver's storages freed in template runs with the
    template's storages freed in the taker's runs."""
    owner = {k: r.owner for k, r in tracker.records.items()}
    into_template, out_of_template = [], []
    for start, end, is_template in runs:
        for i in range(start, end):
            kind, key, _ = tracker.events[i]
            if kind != FREE:
                continue
            if is_template and owner[key] in giver:
                into_template.append(key)
            elif not is_template and tracker.event_owner[i] in taker \
                    and owner[key] in template:
                out_of_template.append(key)
    if len(into_template) != len(out_of_template):
        raise ExpansionError(
            f"{len(into_template)} storages handed into the template layers but "
            f"{len(out_of_template)} handed on by them")
    return dict(zip(into_template, out_of_template, strict=True))


def expand(tracker: Any, template: set[int], before: set[int], after: set[int],
           copies: int) -> Stream:
    """The stream with ``copies`` template blocks (see the module docstring)."""
    if copies < 1:
        raise ExpansionError("need at least one copy of the template layers")
    base = stream_of(tracker)
    owner = {k: r.owner for k, r in tracker.records.items()}
    stride = max(tracker.records, default=0) + 1
    runs = _runs(tracker, template)
    fwd = _handovers(tracker, runs, template, before, after)  # before's key → template key
    bwd = _handovers(tracker, runs, template, after, before)  # after's key → template key
    last = copies - 1
    sizes = _grown_sizes(tracker, template, copies)
    out = Stream([], [], base.phases, {}, {})
    for start, end, is_template in runs:
        phase = tracker.event_phase[start]
        if not is_template:
            _emit_outside(tracker, out, start, end, template, before | after, after, copies,
                          stride, sizes)
            continue
        backward = tracker.phases[phase][0] == "backward"
        for c in (range(last, -1, -1) if backward else range(copies)):
            for i in range(start, end):
                kind, key, size = tracker.events[i]
                new = _in_copy(key, owner[key], c, last, template, fwd, bwd, stride, backward)
                if new is not None:
                    out.events.append((kind, new, size))
                    out.event_phase.append(phase)
    events, event_phase = out.events, out.event_phase
    nbytes = {**_copy_map(base.nbytes, owner, template, copies, stride), **sizes}
    return _checked(Stream(events, event_phase, base.phases,
                           _copy_map(base.category, owner, template, copies, stride), nbytes))


def _grown_sizes(tracker: Any, template: set[int], copies: int) -> dict[int, int]:
    """Sizes of outputs over a list of per-layer tensors (a stack of gradient norms)
    in the deeper model: the template's inputs count once per copy."""
    out = {}
    for key, rec in tracker.records.items():
        if rec.grows:
            total = sum(n for _, n in rec.grows)
            mine = sum(n for o, n in rec.grows if o in template)
            if total and mine:
                out[key] = rec.nbytes + round(rec.nbytes * mine / total) * (copies - 1)
    return out


def _emit_outside(tracker: Any, out: Stream, start: int, end: int, template: set[int],
                  neighbours: set[int], after: set[int], copies: int, stride: int,
                  sizes: dict[int, int]) -> None:
    """Events outside the template: its storages' weights, gradients and states are
    emitted for every copy, layer after layer; hand-overs to or from a neighbour
    block concern one copy only."""
    phase = tracker.event_phase[start]
    group: list[tuple[str, int, int]] = []  # consecutive events of every copy
    for i in range(start, end + 1):
        kind, key, size = tracker.events[i] if i < end else (FREE, -1, 0)
        owned = i < end and tracker.records[key].owner in template
        if owned and not (kind == FREE and tracker.event_owner[i] in neighbours):
            group.append((kind, key, size))
            continue
        for c in range(copies):
            for g_kind, g_key, g_size in group:
                out.events.append((g_kind, g_key + c * stride, g_size))
                out.event_phase.append(phase)
        group = []
        if i == end:
            break
        if not owned:
            event = (kind, key, sizes.get(key, size) if kind == ALLOC else size)
        elif tracker.event_owner[i] in after:
            event = (kind, key + (copies - 1) * stride, size)  # the last copy hands on
        else:
            event = (kind, key, size)  # copy 0 hands back
        out.events.append(event)
        out.event_phase.append(phase)


def _in_copy(key: int, key_owner: int, c: int, last: int, template: set[int],
             fwd: dict[int, int], bwd: dict[int, int], stride: int,
             backward: bool) -> int | None:
    """The key an event of the template stands for in copy ``c`` (None: not in this copy)."""
    if key_owner in template:
        return key + c * stride
    if key in fwd:  # the previous block's hand-over
        return key if c == 0 else fwd[key] + (c - 1) * stride
    if key in bwd:  # the next block's hand-back
        return key if c == last else bwd[key] + (c + 1) * stride
    # anything else happens once: in the copy that runs last
    return key if c == (0 if backward else last) else None


def _copy_map(values: dict[int, Any], owner: dict[int, int], template: set[int],
              copies: int, stride: int) -> dict[int, Any]:
    out = dict(values)
    for key, value in values.items():
        if owner[key] in template:
            for c in range(1, copies):
                out[key + c * stride] = value
    return out


def _checked(stream: Stream) -> Stream:
    allocated: set[int] = set()
    freed: set[int] = set()
    for kind, key, _ in stream.events:
        if kind == ALLOC:
            if key in allocated:
                raise ExpansionError(f"storage {key} allocated twice in the expanded stream")
            allocated.add(key)
        else:
            if key not in allocated or key in freed:
                raise ExpansionError(f"storage {key} freed before allocation or twice")
            freed.add(key)
    return stream
