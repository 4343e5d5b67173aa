"""A run over the user's data through the caching allocator, and the fixes it suggests.

Step lengths follow the loader (torch-free):

- ``random``: HF Trainer's RandomSampler, a shuffle with the seed (Python's
  generator: the same distribution of orders as torch's, not the same order);
- ``group_by_length``: transformers' ``get_length_grouped_indices`` —
  a shuffle, cut into mega-batches of min(n // (4·batch), 50) batches, each
  sorted longest first, the mega-batch holding the longest sample first;
- ``sorted``: shortest first (what a length-sorted dataset gives; memory only
  grows, the worst case for a caching allocator that keeps blocks);
- ``packing``: samples concatenated in file order into rows of at most the
  length cap (oomless.planner.datastats ``DataProfile.rows``), rows shuffled.

A micro batch is padded to its longest row. Each optimizer step's length is its
longest micro batch's (a traced step runs its micro batches at one length).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..allocator import AllocatorConfig
from ..allocator.run import RunReport, simulate_run
from ..allocator.stepstream import ScaledStream
from ..errors import ConfigError

ORDERS = ("random", "group_by_length", "sorted", "packing")
MEGA_BATCH_MAX = 50  # transformers' default mega_batch_mult cap
DEFAULT_STEPS = 200


def loader_order(lengths: Sequence[int], batch: int, order: str, seed: int = 42) -> list[int]:
    """Sample lengths in the order the loader yields them."""
    idx = list(range(len(lengths)))
    if order == "sorted":
        return sorted(lengths)
    random.Random(seed).shuffle(idx)
    if order in ("random", "packing"):
        return [lengths[i] for i in idx]
    if order != "group_by_length":
        raise ConfigError(f"--order '{order}': expected one of {', '.join(ORDERS)}")
    mult = max(1, min(len(lengths) // (batch * 4), MEGA_BATCH_MAX))
    size = mult * batch
    megas = [sorted(idx[i:i + size], key=lambda j: lengths[j], reverse=True)
             for i in range(0, len(idx), size)]
    top = max(range(len(megas)), key=lambda m: lengths[megas[m][0]])
    megas[0][0], megas[top][0] = megas[top][0], megas[0][0]
    return [lengths[j] for mega in megas for j in mega]


def micro_lengths(lengths: Sequence[int], *, batch: int, grad_accum: int, steps: int,
                  order: str, cap: int, seed: int = 42,
                  pack: Any = None) -> list[tuple[int, ...]]:
    """Each optimizer step's micro batches, each padded to its longest row; epochs
    repeat with the next seed, the last short batch of an epoch kept (drop_last False)."""
    if not lengths:
        raise ConfigError("the run simulation needs at least one sample length")
    batches: list[int] = []
    epoch = 0
    while len(batches) < steps * grad_accum:
        rows = pack(cap) if order == "packing" and pack else [min(x, cap) for x in lengths]
        seq = loader_order(rows, batch, order, seed + epoch)
        batches += [max(seq[s:s + batch]) for s in range(0, len(seq), batch)]
        epoch += 1
    return [tuple(batches[i * grad_accum:(i + 1) * grad_accum]) for i in range(steps)]


def step_lengths(lengths: Sequence[int], *, batch: int, grad_accum: int, steps: int,
                 order: str, cap: int, seed: int = 42, pack: Any = None) -> list[int]:
    """The longest micro batch of each optimizer step (micro_lengths)."""
    return [max(m) for m in micro_lengths(lengths, batch=batch, grad_accum=grad_accum,
                                          steps=steps, order=order, cap=cap, seed=seed,
                                          pack=pack)]


@dataclass(frozen=True)
class RunPrediction:
    """The run with the user's settings, with expandable segments, and fixes."""

    order: str
    steps: int
    capacity_bytes: int | None
    lengths: dict[str, int]  # p50, p90, max of the step lengths
    default: RunReport
    expandable: RunReport
    fixes: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def verdict(self) -> str:
        """fits | fits only with expandable_segments | out of memory | unknown (no GPU)."""
        if self.capacity_bytes is None:
            return "no GPU named"
        if self.default.fits:
            return "fits"
        if self.expandable.fits:
            return "fits only with expandable_segments"
        return "out of memory"

    def to_dict(self) -> dict[str, Any]:
        return {"order": self.order, "steps": self.steps,
                "capacity_bytes": self.capacity_bytes, "lengths": self.lengths,
                "verdict": self.verdict(), "default": self.default.to_dict(),
                "expandable_segments": self.expandable.to_dict(),
                "fixes": list(self.fixes), "notes": list(self.notes)}


def _pct(values: Sequence[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(len(ordered) * q / 100) - 1))]


def predict_run(stream: ScaledStream, samples: Sequence[int], *, batch: int, grad_accum: int,
                steps: int, order: str, cap: int, capacity_bytes: int | None,
                alloc_conf: AllocatorConfig | None = None, seed: int = 42,
                pack: Any = None, fixes: bool = True, empty_cache_every: int = 0) -> RunPrediction:
    """Replay the run (and, where it fails, the candidate fixes) through the allocator.
    ``empty_cache_every``: torch.cuda.empty_cache() after every N-th step (0: never)."""
    base = replace(alloc_conf or AllocatorConfig(), capacity_bytes=capacity_bytes)
    expandable = replace(base, expandable_segments=True)
    lens = micro_lengths(samples, batch=batch, grad_accum=grad_accum, steps=steps, order=order,
                        cap=cap, seed=seed, pack=pack)
    def sim(lengths: list[tuple[int, ...]], config: AllocatorConfig) -> RunReport:
        return simulate_run(stream, lengths, config, empty_cache_every=empty_cache_every)

    default = sim(lens, base)
    exp = default if base.expandable_segments else sim(lens, expandable)
    found: list[dict[str, Any]] = []
    if fixes and capacity_bytes is not None and not default.fits:
        found = _fixes(sim, samples, batch=batch, grad_accum=grad_accum, steps=steps,
                       order=order, cap=cap, config=base, seed=seed, pack=pack,
                       expandable=exp)
    longest = [max(m) for m in lens]
    summary = {"p50": _pct(longest, 50), "p90": _pct(longest, 90), "max": max(longest)}
    return RunPrediction(order, len(lens), capacity_bytes, summary, default, exp, tuple(found))


# how much each fix changes the run, smallest first: an allocator setting, the
# loader's order, packing (changes the batches), a length cap (drops tokens)
FIX_RANK = {"expandable_segments": 0, "group_by_length": 1, "packing": 2}
CAP_PERCENTILES = (99.0, 95.0, 90.0)  # length caps tried, each truncating more samples


def _fix(name: str, change: str, report: RunReport) -> dict[str, Any]:
    return {"fix": name, "change": change, "fits": report.fits,
            "high_water_bytes": report.high_water_bytes,
            "fragmentation_bytes": report.fragmentation_bytes,
            "oom_step": report.oom_step}


def _fixes(sim: Any, samples: Sequence[int], *, batch: int, grad_accum: int,
           steps: int, order: str, cap: int, config: AllocatorConfig, seed: int, pack: Any,
           expandable: RunReport) -> list[dict[str, Any]]:
    """Each fix replayed; those that fit first, the smallest change first (FIX_RANK)."""
    out = []
    if not config.expandable_segments:
        out.append(_fix("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                        expandable))
    for new_order, change in (("group_by_length", "group_by_length: true"),
                              ("packing", "packing: true")):
        if order != new_order and (new_order != "packing" or pack is not None):
            lens = micro_lengths(samples, batch=batch, grad_accum=grad_accum, steps=steps,
                                order=new_order, cap=cap, seed=seed, pack=pack)
            out.append(_fix(new_order, change, sim(lens, config)))
    ordered = sorted(min(x, cap) for x in samples)
    tried: set[int] = set()
    for q in CAP_PERCENTILES:  # the mildest cap first, down to the first that fits
        limit = _pct(ordered, q)
        if limit >= min(cap, ordered[-1]) or limit in tried:
            continue
        tried.add(limit)
        lens = micro_lengths(samples, batch=batch, grad_accum=grad_accum, steps=steps,
                            order=order, cap=limit, seed=seed, pack=pack)
        cut = sum(1 for x in ordered if x > limit)
        out.append(_fix(f"cap at p{q:g}", f"max length {limit} (truncates {cut} of "
                        f"{len(ordered)} samples)", sim(lens, config)))
        if out[-1]["fits"]:
            break
    return sorted(out, key=lambda f: (not f["fits"], FIX_RANK.get(f["fix"], 3)))
