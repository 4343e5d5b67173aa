"""The planner: search, rank, and explain.

``search(spec, request)`` walks every candidate family (oomless.planner.candidates),
keeps the configurations that fit, ranks them and, for every family group
(method × ZeRO/offload) where nothing fits, keeps the nearest miss and by how
much it misses. The result is a frozen, JSON-serialisable PlanResult.

Ranking (``objective``):
- ``speed``: fewest trade-offs first (oomless.planner.candidates), then highest predicted
  tokens/s (within 0.5%: a tie); ties keep the search's preference order
  (no ZeRO before ZeRO, no checkpointing before checkpointing, flash first).
- ``memory``: fewest trade-offs, then lowest device peak, then tokens/s.
- ``change`` (``oomless check``): the smallest change to the given
  configuration (weighted knob changes, CHANGE_COST), then tokens/s.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import RunConfig
from ..knobs import OPTIMIZERS
from ..models.spec import ModelSpec
from ..units import fmt_bytes
from .candidates import SEARCH_ASSUMPTIONS, PlanRequest, batch_splits, families
from .scoring import CandidateScorer, Fit, over_budget_bytes
from .speed import ASSUMPTIONS as SPEED_ASSUMPTIONS
from .speed import StepTime

# Knobs a plan may change, with a label and the weight of changing it for the
# "change" objective (check: the smallest edit that fits). Splitting the batch
# differently at the same effective batch is the cheapest fix, as in the seeds.
KNOBS: tuple[tuple[str, str, int], ...] = (
    ("method", "method", 8),
    ("quantization.bits", "quantization bits", 6),
    ("lora.r", "LoRA rank", 6),
    ("lora.targets", "LoRA targets", 6),
    ("precision", "precision", 5),
    ("optimizer", "optimizer", 3),
    ("grad_ckpt", "gradient checkpointing", 2),
    ("attn", "attention", 2),
    ("zero", "ZeRO stage", 3),
    ("offload", "offload", 3),
    ("micro_batch_size", "micro batch", 1),
    ("grad_accum", "gradient accumulation", 0),
    ("hardware.gpus_per_node", "GPUs per node", 8),
    ("seq_len", "max length", 8),
    ("data.packing", "packing", 8),
    ("eval.batch_size", "eval batch", 1),
)


def _get(cfg: RunConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def knob_changes(base: RunConfig, cfg: RunConfig, method_auto: bool = False) -> list[dict]:
    """[{key, label, from, to}] for every knob that differs from the request."""
    out = []
    for key, label, _w in KNOBS:
        before, after = _get(base, key), _get(cfg, key)
        if key == "quantization.bits" and cfg.method != "qlora":
            continue
        if key.startswith("lora.") and cfg.method == "full":
            continue
        if key == "method" and method_auto:
            before = "auto"
        if before != after:
            out.append({"key": key, "label": label, "from": before, "to": after})
    return out


def change_cost(changes: list[dict]) -> int:
    weights = {k: w for k, _l, w in KNOBS}
    return sum(weights[c["key"]] for c in changes)


@dataclass(frozen=True)
class Plan:
    """One configuration that fits, with its memory, speed and what changed."""

    config: dict[str, Any]  # RunConfig.to_dict()
    family: str
    device_peak_bytes: int
    peak_phase: str
    budget_bytes: int
    gpu_memory_bytes: int
    host_ram_bytes: int
    speed: dict[str, float]
    high_bytes: int = 0  # upper bound of the device peak (memory/band.py); it fits the budget
    changes: list[dict] = field(default_factory=list)
    tradeoffs: list[str] = field(default_factory=list)
    epoch_s: float | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    memory_assumptions: list[str] = field(default_factory=list)  # the estimate's own

    @property
    def tokens_per_s(self) -> float:
        return self.speed["tokens_per_s"]

    def run_config(self) -> RunConfig:
        return RunConfig.model_validate(self.config)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Miss:
    """The closest a family group came to fitting."""

    group: str
    config: dict[str, Any]
    device_peak_bytes: int
    peak_phase: str
    over_bytes: int
    host_short_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlanResult:
    model: str
    hardware: str
    budget_bytes: int
    effective_batch: int
    objective: str
    plans: list[Plan]
    misses: list[Miss]
    fitting: int
    searched: int
    evaluated: int
    elapsed_s: float
    assumptions: list[str]
    data: dict[str, Any] | None = None
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    complete: bool = True  # False: the time budget ended the search (see notes)

    @property
    def nothing_fits(self) -> bool:
        return not self.plans

    @property
    def best(self) -> Plan | None:
        return self.plans[0] if self.plans else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nothing_fits"] = self.nothing_fits
        d["candidates_per_s"] = round(self.searched / self.elapsed_s) if self.elapsed_s else None
        return d


@dataclass
class _Found:
    cfg: RunConfig
    fit: Fit
    step: StepTime
    family_order: int
    group: str
    tradeoffs: tuple[str, ...]
    key: tuple = ()


SPEED_TIE = 0.005  # speeds within 0.5% rank as equal: the search's order (simpler first) decides


def _rank_key(req: PlanRequest, f: _Found) -> tuple:
    tps = -round(math.log(max(f.step.tokens_per_s, 1e-9)) / math.log1p(SPEED_TIE))
    if req.objective == "change":
        return (change_cost(knob_changes(req.base, f.cfg, req.method_auto)), tps, f.family_order)
    if req.objective == "memory":
        return (len(f.tradeoffs), f.fit.device_peak_bytes, tps, f.family_order)
    return (len(f.tradeoffs), tps, f.family_order)


def _walk(spec: ModelSpec, req: PlanRequest, ev: CandidateScorer
          ) -> tuple[list[_Found], dict, int, int | None]:
    """Every family's splits, smallest micro batch first; a split that does not
    fit ends its family (a larger micro batch never needs less memory). The last item:
    the families walked when the time budget ended the search (None: it did not)."""
    found: list[_Found] = []
    misses: dict[str, tuple[Fit, RunConfig]] = {}
    searched = 0
    splits = batch_splits(req.per_gpu_batch)
    deadline = time.monotonic() + req.time_budget_s if req.time_budget_s else None
    for walked, fam in enumerate(families(req, spec)):
        if deadline is not None and time.monotonic() > deadline:
            return found, misses, searched, walked
        ctx = None
        states = ev.states(fam.cfg)  # independent of the micro batch and accumulation
        for i, (b, a) in enumerate(splits):
            cfg = fam.cfg.model_copy(update={"micro_batch_size": b, "grad_accum": a})
            fit = ev.memory(cfg, states)
            if not fit.fits:
                searched += len(splits) - i
                best = misses.get(fam.group)
                if i == 0 and (best is None or _closer(fit, best[0])):
                    misses[fam.group] = (fit, cfg)
                break
            searched += 1
            ctx = ctx or ev.family_context(fam, states)
            found.append(_Found(cfg, fit, ev.speed(ctx, cfg, fit), fam.order, fam.group,
                                fam.tradeoffs))
    return found, misses, searched, None


def _closer(a: Fit, b: Fit) -> bool:
    return (a.over_bytes, a.host_short_bytes) < (b.over_bytes, b.host_short_bytes)


def _variety(f: _Found) -> tuple:
    """Plans that differ only in the split, the attention kernel or paging are one alternative."""
    c = f.cfg  # paged or not: the same optimizer math, one alternative
    return (f.group, c.precision, OPTIMIZERS[c.optimizer].eight_bit, c.grad_ckpt, c.lora.r,
            str(c.lora.targets), c.seq_len, c.data.packing, c.eval.batch_size)


def _pick(req: PlanRequest, found: list[_Found]) -> list[_Found]:
    """The top K, best first, one per alternative (see _variety)."""
    for f in found:
        f.key = _rank_key(req, f)
    best: dict[tuple, _Found] = {}
    for f in found:
        cur = best.get(_variety(f))
        if cur is None or f.key < cur.key:
            best[_variety(f)] = f
    return sorted(best.values(), key=lambda f: f.key)[: req.top]


def _verified(spec: ModelSpec, req: PlanRequest, top: list[_Found],
              found: list[_Found]) -> tuple[list[_Found], list[_Found]]:
    """(top, found) after re-estimating the picks with the full estimate: the search
    scores the allocator reserve with the calibrated proxy (a replay per candidate
    would cost milliseconds each), the single estimate replays the step's synthesized
    stream (memory/overheads.py); a pick that no longer fits is dropped and the next
    one picked."""
    from ..memory.training import estimate_training

    while True:
        over = [f for f in top if over_budget_bytes(
            estimate_training(spec, f.cfg, req.cluster).device_peak_bytes, req) > 0]
        if not over:
            return top, found
        found = [f for f in found if all(f is not o for o in over)]
        top = _pick(req, found)


def method_reasons(req: PlanRequest, found: list[_Found], missed: dict) -> dict[str, str]:
    """Why a plan's method is not the requested one (--method auto, or a retry after the
    requested method did not fit): {method: reason}, for the plans' change lists."""
    base = req.base.method
    best: dict[str, float] = {}
    clean = [f for f in found if not f.tradeoffs] or found  # like for like: no trade-offs
    for f in clean:
        best[f.cfg.method] = max(best.get(f.cfg.method, 0.0), f.step.tokens_per_s)
    nearest = _nearest_miss_text(fit for fit, cfg in missed.values() if cfg.method == base)
    out = {}
    for method, tps in best.items():
        if method == base:
            continue
        if base in best:
            ratio = tps / best[base] - 1
            out[method] = (f"{ratio:+.0%} tokens/s against the best {base} plan "
                           f"({tps:,.0f} vs {best[base]:,.0f}; 4-bit/8-bit dequantisation, "
                           "offload and communication counted)")
        else:
            out[method] = f"no {base} configuration fits these GPUs{nearest}"
    return out


def _nearest_miss_text(fits) -> str:
    """The closest miss in words (as cli/_render_plan.miss_text says it): bytes over the
    budget, or — when it fits the GPU (over ≤ 0) — the host RAM its offload lacks."""
    nearest = min(fits, key=lambda f: (f.over_bytes, f.host_short_bytes), default=None)
    if nearest is None:
        return ""
    if nearest.over_bytes > 0:
        return f", the nearest {fmt_bytes(nearest.over_bytes)} over"
    return (f", the nearest fits the GPU but its offload needs "
            f"{fmt_bytes(nearest.host_short_bytes)} more host RAM")


def _to_plan(spec: ModelSpec, req: PlanRequest, f: _Found,
             reasons: dict[str, str] | None = None) -> Plan:
    from ..memory.training import estimate_training

    cfg = RunConfig.model_validate(f.cfg.model_dump())  # validated before it leaves
    est = estimate_training(spec, cfg, req.cluster)
    epoch_s = None
    if req.data is not None:
        images = cfg.data.images_per_sample if spec.vision else 0
        per_image = spec.vision.tokens_per_image if spec.vision else 0
        rows = req.data.samples_per_epoch(cfg.seq_len + images * per_image, cfg.data.packing)
        epoch_s = (rows // req.effective_batch) * f.step.step_s * cfg.training.epochs
    return Plan(
        config=cfg.to_dict(), family=f.group, device_peak_bytes=est.device_peak_bytes,
        peak_phase=est.peak_phase, budget_bytes=req.budget_bytes,
        gpu_memory_bytes=req.cluster.gpu.memory_bytes, host_ram_bytes=est.host_ram_bytes,
        speed=f.step.to_dict(), high_bytes=est.high_bytes or est.device_peak_bytes,
        changes=_with_reasons(knob_changes(req.base, cfg, req.method_auto), reasons or {}),
        tradeoffs=list(f.tradeoffs), epoch_s=epoch_s, phase_peaks=est.phase_peaks(),
        memory_assumptions=list(est.assumptions),
    )


def _with_reasons(changes: list[dict], reasons: dict[str, str]) -> list[dict]:
    return [{**c, "why": reasons[c["to"]]} if c["key"] == "method" and c["to"] in reasons
            else c for c in changes]


def search(spec: ModelSpec, req: PlanRequest) -> PlanResult:
    """Find the configurations that fit, best first, and the nearest misses."""
    t0 = time.perf_counter()
    ev = CandidateScorer(spec, req)
    found, missed, searched, walked = _walk(spec, req, ev)
    top = _pick(req, found)
    fitting_groups = {f.group for f in found}
    misses = [Miss(g, cfg.to_dict(), fit.device_peak_bytes, fit.peak_phase, fit.over_bytes,
                   fit.host_short_bytes)
              for g, (fit, cfg) in sorted(missed.items(), key=lambda kv: kv[1][0].over_bytes)
              if g not in fitting_groups]
    top, found = _verified(spec, req, top, found)
    elapsed = time.perf_counter() - t0
    reasons = method_reasons(req, found, missed)
    plans = [_to_plan(spec, req, f, reasons) for f in top]
    return PlanResult(
        model=spec.name, hardware=req.cluster.describe(), budget_bytes=req.budget_bytes,
        effective_batch=req.effective_batch, objective=req.objective, plans=plans,
        misses=misses, fitting=len(found), searched=searched, evaluated=ev.evaluated,
        elapsed_s=elapsed, assumptions=_assumptions(req, plans),
        data=req.data.summary() if req.data else None,
        notes=list(req.notes) + ([budget_note(req, walked)] if walked is not None else []),
        complete=walked is None,
    )


def budget_note(req: PlanRequest, walked: int) -> str:
    """What the user reads when the time budget ended the search."""
    return (f"the search stopped at its time budget of {req.time_budget_s:g} s after "
            f"walking {walked} candidate families (in preference order: no ZeRO, no "
            "checkpointing first); the plans shown are the best of those. Fix more of the "
            "run (--method, or a smaller --effective-batch) to search it whole")


def _assumptions(req: PlanRequest, plans: list[Plan]) -> list[str]:
    out = [
        f"fits: predicted device peak (nvidia-smi) ≤ {1 - req.headroom:.0%} of the GPU's "
        "memory in every phase (training step, evaluation, generation), its upper bound "
        "(memory/band.py) ≤ the GPU's memory, and offload fits in host RAM",
        f"effective batch {req.effective_batch} = micro batch × accumulation × "
        f"{req.cluster.world_size} data-parallel GPUs, exactly",
    ]
    if req.host_ram_assumed:
        out.append(f"host RAM not stated: assumed {req.host_ram_bytes / 1e9:.0f} GB per node "
                   "usable for offload (pass --host-ram-gb)")
    out += list(SEARCH_ASSUMPTIONS) + list(SPEED_ASSUMPTIONS)
    if plans:  # the memory model's assumptions, for the best plan
        out += [a for a in plans[0].memory_assumptions if a not in out]
    return out
