"""``oomless check``: will a configuration people already have run out of memory,
in which phase, and what is the smallest change to the same file that fits.

The files are read by oomless.check.readers into a RunConfig, estimated with
the analytic model, and, when the predicted device peak exceeds the budget
((1 − headroom) × GPU memory), the planner searches with the "change"
objective — the fewest, cheapest knob changes at the same effective batch,
restricted to what the file's format can express. The change is written back
as edits of the same file(s), shown as a unified diff, and read back again to
make sure the edited file says what the plan says.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import RunConfig, build_run_config
from ..errors import ConfigError
from ..models.hardware import Cluster, parse_gpu_arg
from ..models.spec import ModelSpec
from ..planner.plan import KNOBS as PLAN_KNOBS
from ..planner.plan import _get, search
from ..planner.request import build_request
from ..result import TRAIN_PHASES
from .readers import (
    glm_edits,
    hf_edits,
    lf_edits,
    oomless_edits,
    read_glm4,
    read_hf_deepspeed,
    read_llamafactory,
    read_oomless,
)
from .sources import Reading, detect_kind, load_source, source_from_text
from .textedit import set_json, set_yaml, unified_diff


@dataclass(frozen=True)
class CheckOptions:
    files: tuple[str, ...]
    gpu: str | None = None
    nodes: int | None = None
    model: str | None = None
    seq_len: int | None = None
    method: str | None = None
    images: int | None = None
    headroom: float = 0.10
    host_ram_gb: float | None = None


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
    fix: dict[str, Any] | None = None  # Plan.to_dict() of the smallest change that fits
    diffs: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.oom_phase is None

    @property
    def within_budget(self) -> bool:
        return self.device_peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(fits=self.fits, within_budget=self.within_budget)
        return d


def read_files(opts: CheckOptions) -> Reading:
    if not 1 <= len(opts.files) <= 2:
        raise ConfigError("oomless check takes one configuration file, or a DeepSpeed JSON "
                          "and a TrainingArguments JSON")
    sources = [load_source(f, "main") for f in opts.files]
    kinds = [detect_kind(s) for s in sources]
    if len(sources) == 2 or kinds[0] in ("deepspeed", "training_args"):
        if len(set(kinds)) != len(kinds) or not set(kinds) <= {"deepspeed", "training_args"}:
            raise ConfigError(f"two files must be a DeepSpeed JSON and a TrainingArguments "
                              f"JSON; got {', '.join(kinds)}")
        by = {k: s for k, s in zip(kinds, sources, strict=True)}
        for role, src in by.items():
            src.role = role
        return read_hf_deepspeed(by.get("training_args"), by.get("deepspeed"), opts.model,
                                 opts.method, opts.seq_len)
    src = sources[0]
    if kinds[0] == "glm4":
        return read_glm4(src, opts.model)
    if kinds[0] == "llamafactory":
        return read_llamafactory(src, opts.model)
    return read_oomless(src)


def _cluster(opts: CheckOptions, run: dict[str, Any]) -> Cluster:
    hw = run.get("hardware") or {}
    host = round(opts.host_ram_gb * 1e9) if opts.host_ram_gb else None
    if opts.gpu:
        return parse_gpu_arg(opts.gpu, nodes=opts.nodes or hw.get("nodes", 1), host_ram_bytes=host)
    if hw.get("gpu"):
        return parse_gpu_arg(f"{hw['gpu']} x{hw.get('gpus_per_node', 1)}",
                             nodes=opts.nodes or hw.get("nodes", 1), host_ram_bytes=host)
    raise ConfigError("oomless check needs the GPUs: --gpu NAME[xN] (e.g. --gpu 'a100-80gb x8')")


def run_config(reading: Reading, opts: CheckOptions, cluster: Cluster,
               spec_vision: bool) -> RunConfig:
    run = dict(reading.run)
    if opts.model:
        run["model"] = opts.model
    run["hardware"] = {**(run.get("hardware") or {}), "gpu": cluster.gpu.name,
                       "gpus_per_node": cluster.gpus_per_node, "nodes": cluster.nodes}
    if spec_vision:
        data = dict(run.get("data") or {})
        if opts.images is not None or not data.get("images_per_sample"):
            data["images_per_sample"] = 1 if opts.images is None else opts.images
        run["data"] = data
    main = reading.sources.get("main") or next(iter(reading.sources.values()))
    return build_run_config(run, str(main.path), main.lines)


def phase_device_bytes(spec: ModelSpec, cfg: RunConfig, cluster: Cluster) -> dict[str, int]:
    """Predicted device bytes (nvidia-smi) at each phase's own peak."""
    from ..memory.overheads import allocator_reserve_bytes, non_pytorch_bytes
    from ..memory.training import largest_block_bytes, training_phases

    phases, persistent, _st = training_phases(spec, cfg, cluster)
    block = largest_block_bytes(spec, cfg)
    fixed = sum(persistent.values())
    non_pt = sum(non_pytorch_bytes(cluster, cfg.world_size).values())
    out = {}
    for phase, parts in phases.items():
        alloc = sum(parts.values())
        out[phase] = alloc + allocator_reserve_bytes(alloc, fixed, False, block) + non_pt
    return out


def edits_for(reading: Reading, new: RunConfig, old: RunConfig, model_type: str) -> list:
    if reading.kind == "llamafactory":
        return lf_edits(new, old, model_type)
    if reading.kind == "glm4":
        return glm_edits(new, old, model_type)
    if reading.kind == "hf-deepspeed":
        return hf_edits(new, old, reading)
    return oomless_edits(new, old)


def apply_edits(reading: Reading, edits: list) -> dict[str, str]:
    """New text per role."""
    texts = {role: src.text for role, src in reading.sources.items()}
    for role, path, value in edits:
        src = reading.sources[role]
        setter = set_json if src.fmt == "json" else set_yaml
        texts[role] = setter(texts[role], path, value)
    return texts


def _reread(reading: Reading, texts: dict[str, str], opts: CheckOptions) -> Reading:
    edited = {role: source_from_text(src.path, role, texts[role])
              for role, src in reading.sources.items()}
    if reading.kind == "llamafactory":
        return read_llamafactory(edited["main"], opts.model)
    if reading.kind == "glm4":
        return read_glm4(edited["main"], opts.model)
    if reading.kind == "hf-deepspeed":
        return read_hf_deepspeed(edited.get("training_args"), edited.get("deepspeed"),
                                 opts.model, opts.method, opts.seq_len)
    return read_oomless(edited["main"])


def _fix(spec: ModelSpec, reading: Reading, cfg: RunConfig, cluster: Cluster,
         opts: CheckOptions) -> tuple[Any, dict[str, str]]:
    req = build_request(spec, cfg, cluster, headroom=opts.headroom, objective="change", top=1,
                        fixed=frozenset(reading.fixed), shardings=reading.shardings)
    result = search(spec, req)
    if not result.plans:
        return None, {}
    best = result.best
    new = best.run_config()
    texts = apply_edits(reading, edits_for(reading, new, cfg, spec.model_type))
    back = run_config(_reread(reading, texts, opts), opts, cluster, spec.vision is not None)
    wrong = [k for k, _l, _w in PLAN_KNOBS if _get(back, k) != _get(new, k)]
    if wrong:
        raise RuntimeError(f"internal error: the edited file reads back differently for "
                           f"{wrong}; please report this configuration")
    diffs = {str(src.path): unified_diff(src.text, texts[role], src.path.name)
             for role, src in reading.sources.items() if texts[role] != src.text}
    return best, diffs


def check(opts: CheckOptions) -> CheckResult:
    from ..models.catalog import resolve_model

    reading = read_files(opts)
    model = opts.model or reading.run.get("model")
    if not model:
        raise ConfigError("no model: pass --model")
    spec = resolve_model(str(model)).spec
    cluster = _cluster(opts, reading.run)
    cfg = run_config(reading, opts, cluster, spec.vision is not None)
    per_phase = phase_device_bytes(spec, cfg, cluster)
    peak_phase = max(per_phase, key=per_phase.__getitem__)
    memory = cluster.gpu.memory_bytes
    budget = int((1 - opts.headroom) * memory)
    oom = next((p for p in TRAIN_PHASES if per_phase.get(p, 0) > memory), None)
    fix, diffs = (None, {})
    if per_phase[peak_phase] > budget:
        fix, diffs = _fix(spec, reading, cfg, cluster, opts)
    from ..planner.speed import ASSUMPTIONS

    return CheckResult(
        kind=reading.kind, label=reading.label, files=[str(s.path) for s in reading.sources.values()],
        model=spec.name, hardware=cluster.describe(), config=cfg.to_dict(),
        phase_device_bytes=per_phase, device_peak_bytes=per_phase[peak_phase],
        peak_phase=peak_phase, gpu_memory_bytes=memory, budget_bytes=budget, oom_phase=oom,
        fix=fix.to_dict() if fix else None, diffs=diffs, notes=reading.notes,
        assumptions=list(ASSUMPTIONS))
