"""``oomless check``: will a configuration people already have run out of memory,
in which phase, and what is the smallest change to the same file that fits.

The files are read by oomless.check.reading and assembled into a RunConfig
by oomless.check.assemble, estimated with the analytic model, and, when the
predicted device peak is above the budget ((1 − headroom) × GPU memory), the
planner searches with the "change" objective — the fewest, cheapest knob
changes at the same effective batch, restricted to what the file's format can
express — and the first candidate that no rule of check/rules.py forbids is
the fix. The change is written back as edits of the same file(s), shown as a
unified diff, and read back again to make sure the edited file says what the
plan says.

Verdicts: "fits" (within the headroom, exit 0), "tight" (fits the GPU but
not the headroom, exit 1 with the fix), "out_of_memory" (exit 1).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..models.hardware import Cluster
from ..models.spec import ModelSpec
from ..planner.plan import KNOBS as PLAN_KNOBS
from ..planner.plan import _get, search
from ..planner.request import build_request
from ..result import EVAL_PHASES, TRAIN_PHASES
from .assemble import CheckOptions, gpu_cluster, read_files, resolve, run_config
from .reading import ReadOptions, edits_for, read_sources
from .rules import RuleContext, allowed_shardings, broken_rules, config_warnings
from .scripts.decide import settle
from .settings import apply_data, unmodelled_settings
from .sources import Reading, load_source, source_from_text
from .textedit import new_file_diff, set_value, unified_diff

# What the command line, the UI, the trainer's configs and the tests import from here
# (CheckOptions, read_files, resolve and run_config live in oomless.check.assemble).
__all__ = ["CANDIDATES", "CheckOptions", "CheckResult", "apply_edits", "check", "check_task",
           "diff_name", "edits_for", "phase_device_bytes", "read_files", "resolve",
           "run_config"]

CANDIDATES = 40  # planner candidates tried against the rules, smallest change first


@dataclass(frozen=True)
class CheckResult:
    kind: str
    label: str
    files: list[str]
    model: str
    hardware: str
    config: dict[str, Any]
    phase_device_bytes: dict[str, int]
    device_peak_bytes: int
    peak_phase: str
    gpu_memory_bytes: int
    budget_bytes: int
    oom_phase: str | None  # first phase, in run order, predicted above the GPU's memory
    low_bytes: int = 0  # uncertainty band around device_peak_bytes (memory/band.py)
    high_bytes: int = 0
    fix: dict[str, Any] | None = None  # Plan.to_dict() of the smallest change that fits
    diffs: dict[str, str] = field(default_factory=dict)
    new_texts: dict[str, str] = field(default_factory=dict)  # edited text per file
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # keys no version of the tool knows
    refused: list[str] = field(default_factory=list)  # candidate fixes a rule refused
    assumptions: list[str] = field(default_factory=list)
    task: str = "train"  # or what a file that does not train runs (check/tasks.py TASKS)
    lora_reach: str = ""  # where the LoRA targets land (oomless.check.lora_names.lora_reach)

    @property
    def fits(self) -> bool:
        """Within the GPU's memory (the headroom aside)."""
        return self.oom_phase is None

    @property
    def within_budget(self) -> bool:
        """What `plan` asks of a configuration: the peak keeps the headroom and the
        band's upper bound fits the GPU (planner/scoring.py)."""
        return (self.device_peak_bytes <= self.budget_bytes
                and self.high_bytes <= self.gpu_memory_bytes)

    @property
    def verdict(self) -> str:
        """fits (within the budget), out_of_memory (even the band's lower bound is above
        the GPU's memory), or tight (in between: it may run out of memory)."""
        if self.within_budget:
            return "fits"
        return "out_of_memory" if self.low_bytes > self.gpu_memory_bytes else "tight"

    @property
    def exit_code(self) -> int:
        return 0 if self.within_budget else 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("new_texts")
        d.update(fits=self.fits, within_budget=self.within_budget, verdict=self.verdict)
        return d


def phase_device_bytes(spec: ModelSpec, cfg: RunConfig, cluster: Cluster) -> dict[str, int]:
    """Predicted device bytes (nvidia-smi) at each phase's own peak."""
    from ..memory.overheads import (
        STREAMED_PHASES,
        allocator_reserve_bytes,
        late_dense_block_bytes,
        non_pytorch_bytes,
        streamed_reserve_bytes,
    )
    from ..memory.training import largest_block_bytes, step_kit, training_phases

    phases, persistent, st = training_phases(spec, cfg, cluster)
    block, late = largest_block_bytes(spec, cfg), late_dense_block_bytes(spec, cfg)
    fixed = sum(persistent.values())
    non_pt = sum(non_pytorch_bytes(cluster, cfg.world_size).values())
    # where the step's stream is synthesized, its replayed reserve (the estimate's own)
    streamed, _ = streamed_reserve_bytes(spec, cfg, persistent, lambda: step_kit(spec, cfg),
                                         False, st.paged_bytes)
    out = {}
    for phase, parts in phases.items():
        alloc = sum(parts.values())
        reserve = streamed if streamed is not None and phase in STREAMED_PHASES else \
            allocator_reserve_bytes(alloc, fixed, False, block, late)
        out[phase] = alloc + reserve + non_pt
    return out


def apply_edits(reading: Reading, edits: list) -> dict[str, str]:
    """New text per role."""
    texts = {role: src.text for role, src in reading.sources.items()}
    for role, path, value in edits:
        src = reading.sources[role]
        texts[role] = set_value(src, texts[role], path, value)
    return texts


def _reread(reading: Reading, texts: dict[str, str], opts: CheckOptions) -> Reading:
    edited = [source_from_text(src.path, src.role, texts[role])
              for role, src in reading.sources.items()]
    back = read_sources(edited, ReadOptions(opts.model, opts.method, opts.seq_len))
    settle(back, opts)
    return back


def diff_name(path: Path) -> str:
    """The file's name in the diff: relative to the working directory when it is below
    it (``patch -p1`` run there finds it), else its base name."""
    try:
        return Path(os.path.relpath(path)).as_posix() if not os.path.relpath(path).startswith(
            "..") else path.name
    except ValueError:  # another drive
        return path.name


@dataclass
class _Search:
    spec: ModelSpec
    reading: Reading
    cfg: RunConfig
    cluster: Cluster
    opts: CheckOptions
    ctx: RuleContext
    refused: list[str] = field(default_factory=list)
    # the file's evaluation or generation is itself over the budget: its batch may change
    # (it is no part of the effective training batch); otherwise a fix keeps it
    eval_over: bool = False
    over_budget: bool = False  # the file's own peak is above the budget


def _request(s: _Search):
    shardings = allowed_shardings(s.cfg, s.ctx, s.reading.shardings)
    fixed = set(s.reading.fixed)
    if s.eval_over:
        fixed.discard("eval_batch")
    if s.cfg.precision == "fp16":  # the planner's 16-bit is bf16 where the GPU has it: the
        fixed.add("precision")     # same bytes (rule no_saving_precision), so keep fp16
    return build_request(s.spec, s.cfg, s.cluster, headroom=s.opts.headroom, objective="change",
                         top=CANDIDATES, fixed=frozenset(fixed), shardings=shardings)


_BATCH_KEYS = {"micro_batch_size", "grad_accum"}


def _written(s: _Search, plan: Any) -> tuple[dict[str, str], dict[str, str]] | None:
    """The plan as edits of the files (diffs, new texts), read back to make sure the
    edited files say what the plan says; None when the format cannot write the batch.
    A DeepSpeed file the fix points to and the checkout lacks is a new file here
    (check/dsfiles.py deepspeed_ref), read back with the edited configuration."""
    from .dsfiles import PENDING

    new = plan.run_config()
    s.reading.facts["new_files"] = {}
    texts = apply_edits(s.reading, edits_for(s.reading, new, s.cfg, s.spec.model_type))
    created: dict[str, str] = s.reading.facts.pop("new_files")
    token = PENDING.set({Path(p).resolve(): t for p, t in created.items()})
    try:
        back_reading = _reread(s.reading, texts, s.opts)
    finally:
        PENDING.reset(token)
    back = run_config(apply_data(back_reading, s.opts, s.spec), s.opts, s.cluster, s.spec)
    wrong = {k for k, _l, _w in PLAN_KNOBS if _get(back, k) != _get(new, k)}
    loose = set(s.reading.facts.get("may_not_express", ())) | (
        _BATCH_KEYS if s.reading.facts.get("batch_not_in_file") else set())
    if wrong and wrong <= loose:
        return None
    if wrong:
        raise RuntimeError(f"internal error: the edited file reads back differently for "
                           f"{sorted(wrong)}; please report this configuration")
    diffs, new_texts = {}, {}
    for role, src in s.reading.sources.items():
        if texts[role] != src.text:
            diffs[str(src.path)] = unified_diff(src.text, texts[role], diff_name(src.path))
            new_texts[str(src.path)] = texts[role]
    for path, text in created.items():
        diffs[path] = new_file_diff(text, diff_name(Path(path)))
        new_texts[path] = text
    return diffs, new_texts


def _fix(s: _Search) -> tuple[Any, dict[str, str], dict[str, str]]:
    """The first planner candidate that no rule refuses and the files can express; where
    none keeps the band's upper bound on the card, the first that keeps the budget (the
    fix is then tight: ``Plan.high_bytes`` above the card)."""
    request = _request(s)
    found = _first_fix(s, request)
    if found[0] is None and s.over_budget:
        found = _first_fix(s, replace(request, within_band=False))
    return found


def _first_fix(s: _Search, request: Any) -> tuple[Any, dict[str, str], dict[str, str]]:
    for plan in search(s.spec, request).plans:
        if not plan.changes:
            continue
        changes = ", ".join(f"{c['label']} → {c['to']}" for c in plan.changes)
        broken = broken_rules(s.cfg, plan.run_config(), s.ctx)
        if broken:
            s.refused.append(f"{changes}: refused ({'; '.join(r.forbids for r in broken)})")
            continue
        written = _written(s, plan)
        if written is None:
            s.refused.append(f"{changes}: {s.reading.label} cannot say it as written (a "
                             "computed batch, or a flag it only turns on)")
            continue
        return plan, *written
    return None, {}, {}


def check_task(src: Any, task: str, opts: CheckOptions) -> CheckResult:
    """``oomless check`` of a file that does not train (check/tasks.py): the memory of
    what it runs, never a fix."""
    from ..memory.band import band_bytes
    from .tasks import LABELS, task_memory

    d = src.data
    reading = Reading(task, LABELS[task], {"main": src},
                      {"model": d.get("model" if task == "vllm-serve" else "model_name_or_path")})
    spec = resolve(reading, opts)
    cluster = gpu_cluster(opts, {})
    mem = task_memory(task, d, spec, cluster)
    total = cluster.gpu.memory_bytes
    limit, peak = mem["limit"] or total, mem["peak"]
    low, high = band_bytes(peak)
    return CheckResult(
        kind=task, label=LABELS[task], files=[str(src.path)], model=spec.name,
        hardware=cluster.describe(), config={}, phase_device_bytes={mem["phase"]: peak},
        device_peak_bytes=peak, peak_phase=mem["phase"], gpu_memory_bytes=limit,
        budget_bytes=limit if mem["limit"] else int((1 - opts.headroom) * total),
        oom_phase=mem["phase"] if peak > limit else None, low_bytes=low, high_bytes=high,
        notes=[*reading.notes, *mem["notes"]], assumptions=mem["assumptions"], task=task)


def check(opts: CheckOptions) -> CheckResult:
    from ..memory.band import band_bytes
    from ..planner.speed import ASSUMPTIONS
    from .lora_names import lora_reach

    if len(opts.files) == 1:
        from .tasks import file_task

        src = load_source(opts.files[0], "main")
        task = file_task(src)
        if task != "train":
            return check_task(src, task, opts)
    reading = read_files(opts)
    settle(reading, opts)  # "can't tell" unless an option settles it
    spec = resolve(reading, opts)
    cluster = gpu_cluster(opts, reading.run)
    reading = apply_data(reading, opts, spec)
    cfg = run_config(reading, opts, cluster, spec)
    per_phase = phase_device_bytes(spec, cfg, cluster)
    peak_phase = max(per_phase, key=per_phase.__getitem__)
    memory = cluster.gpu.memory_bytes
    budget = int((1 - opts.headroom) * memory)
    oom = next((p for p in TRAIN_PHASES if per_phase.get(p, 0) > memory), None)
    ctx = RuleContext(reading.facts, spec, cfg.world_size, fits_gpu=oom is None)
    reading.warnings.extend(config_warnings(cfg, ctx))
    search_state = _Search(spec, reading, cfg, cluster, opts, ctx, eval_over=any(
        per_phase.get(p, 0) > budget for p in EVAL_PHASES),
        over_budget=per_phase[peak_phase] > budget)
    fix, diffs, new_texts = (None, {}, {})
    low, high = band_bytes(per_phase[peak_phase])
    if per_phase[peak_phase] > budget or high > memory:
        fix, diffs, new_texts = _fix(search_state)
    return CheckResult(
        kind=reading.kind, label=reading.label, files=[str(s.path) for s in reading.sources.values()],
        model=spec.name, hardware=cluster.describe(), config=cfg.to_dict(),
        phase_device_bytes=per_phase, device_peak_bytes=per_phase[peak_phase],
        peak_phase=peak_phase, gpu_memory_bytes=memory, budget_bytes=budget, oom_phase=oom,
        low_bytes=low, high_bytes=high,
        fix=fix.to_dict() if fix else None, diffs=diffs, new_texts=new_texts,
        notes=reading.notes, warnings=reading.warnings, refused=search_state.refused,
        lora_reach=lora_reach(spec, cfg),
        assumptions=[*reading.assumptions, *unmodelled_settings(spec, cfg, cluster),
                     *ASSUMPTIONS])
