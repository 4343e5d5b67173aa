"""Entry points: plan from command-line style options, and best_fit for train's preflight."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig, build_run_config, load_run_config, set_dotted
from ..errors import ConfigError
from ..limits import PLAN_TIME_BUDGET_S, check_cap
from ..models.catalog import resolve_model
from ..models.hardware import Cluster, parse_gpu_arg
from ..models.spec import ModelSpec
from .candidates import PlanRequest
from .plan import PlanResult, search
from .request import build_request, default_effective_batch
from .suggest import plan

DEFAULT_SEQ_LEN = 2048  # RunConfig's default; stated in the plan when used


@dataclass(frozen=True)
class PlanOptions:
    """What `oomless plan` accepts (see cli/plan.py)."""

    model: str
    gpu: str | None = None
    nodes: int | None = None
    data: str | None = None
    seq_len: int | None = None
    effective_batch: int | None = None
    method: str = "auto"
    # An oomless.yaml with method "auto": True keeps the file's method (no --method given),
    # False lets the search choose any method (`--method auto` said explicitly).
    method_from_file: bool = True
    headroom: float = 0.10
    objective: str = "speed"
    top: int = 5
    host_ram_gb: float | None = None
    images: int | None = None
    eval_batch_size: int | None = None
    max_new_tokens: int | None = None
    lora_r: int | None = None
    stack: str | None = None  # the training stack (docs/stacks.md); kept by the search
    transformers_version: str | None = None
    stack_version: str | None = None
    time_budget_s: float = PLAN_TIME_BUDGET_S  # the search stops after this long, and says so


def _base_config(opts: PlanOptions, spec: ModelSpec) -> tuple[RunConfig, list[str], set[str]]:
    """The requested run, notes on defaults taken, and knobs the user fixed."""
    notes: list[str] = []
    fixed: set[str] = set()
    if opts.model.endswith((".yaml", ".yml")) and Path(opts.model).is_file():
        base = load_run_config(opts.model)
        if opts.method == "auto" and opts.method_from_file:
            fixed.add("method")  # the file's method stays unless --method says otherwise
    else:
        base = RunConfig(model=opts.model)
    changes: dict = {}
    if opts.stack:
        changes["stack"] = opts.stack
    for key in ("transformers_version", "stack_version"):
        if getattr(opts, key):
            changes[f"stack_options.{key}"] = getattr(opts, key)
    if opts.method not in ("auto",):
        changes["method"] = opts.method
        fixed.add("method")
    if opts.seq_len:
        changes["seq_len"] = opts.seq_len
        if not opts.data:
            fixed.add("seq_len")
    elif not opts.data and "seq_len" not in base.model_fields_set:
        notes.append(f"no --seq-len or --data: every sample is taken as {base.seq_len} tokens")
    if opts.lora_r:
        changes["lora.r"] = opts.lora_r
        fixed.add("lora")
    if spec.vision and opts.data and opts.images is None:
        pass  # the data's own image counts decide (request_from_options)
    elif spec.vision and (opts.images is not None or not base.data.images_per_sample):
        images = 1 if opts.images is None else opts.images
        changes["data.images_per_sample"] = images
        if opts.images is None:
            notes.append(f"{spec.name} is a vision-language model: 1 image per sample assumed "
                         "(--images N)")
    if opts.eval_batch_size:
        changes["eval.batch_size"] = opts.eval_batch_size
    if opts.max_new_tokens:
        changes.update({"eval.max_new_tokens": opts.max_new_tokens,
                        "eval.predict_with_generate": True})
    data = base.model_dump()
    for key, value in changes.items():
        set_dotted(data, key, value)
    return build_run_config(data, "<plan options>"), notes, fixed


def _cluster(opts: PlanOptions, base: RunConfig) -> Cluster:
    check_cap("hardware.host_ram_gb", opts.host_ram_gb, "--host-ram-gb")
    host = round(opts.host_ram_gb * 1e9) if opts.host_ram_gb else (
        round(base.hardware.host_ram_gb * 1e9) if base.hardware.host_ram_gb else None)
    if opts.gpu is not None:
        return parse_gpu_arg(opts.gpu, nodes=opts.nodes or base.hardware.nodes,
                             host_ram_bytes=host)
    if base.hardware.gpu:
        return parse_gpu_arg(f"{base.hardware.gpu} x{base.hardware.gpus_per_node}",
                             nodes=opts.nodes or base.hardware.nodes, host_ram_bytes=host)
    raise ConfigError("oomless plan needs the GPUs: --gpu NAME[xN] (e.g. --gpu 4090, "
                      "--gpu 'a100-80gb x8'); see `oomless gpus`")


def request_from_options(opts: PlanOptions) -> tuple[ModelSpec, PlanRequest]:
    """The model's spec and a PlanRequest, from command-line style options."""
    if opts.objective not in ("speed", "memory"):
        raise ConfigError(f"--objective {opts.objective}: expected speed or memory")
    model_text = opts.model
    if model_text.endswith((".yaml", ".yml")) and Path(model_text).is_file():
        model_text = load_run_config(model_text).model
    resolved = resolve_model(model_text)
    spec = resolved.spec
    if opts.images and spec.vision is None:
        raise ConfigError(f"--images {opts.images}: {spec.name} is a text model (no vision "
                          "tower) and cannot take images; drop --images, or plan a "
                          "vision-language model")
    base, notes, fixed = _base_config(opts, spec)
    cluster = _cluster(opts, base)
    profile = None
    if opts.data:
        from .datastats import profile_data

        profile = profile_data(opts.data, spec, resolved, base.data.format,
                               seq_cap=opts.seq_len, images_per_sample=opts.images)
        if spec.vision and opts.images is None:  # memory: the most images one sample has
            base = base.model_copy(update={"data": base.data.model_copy(
                update={"images_per_sample": profile.max_images})})
    if profile is not None:  # the request: every sample whole (cut only by --seq-len)
        base = base.model_copy(update={"seq_len": max(1, profile.cutoffs[0].length - (
            base.data.images_per_sample * spec.vision.tokens_per_image if spec.vision else 0))})
    given_batch = opts.effective_batch
    if given_batch is None and not opts.model.endswith((".yaml", ".yml")):
        given_batch = default_effective_batch(cluster.world_size)
        notes.append(f"no --effective-batch: {given_batch} samples per optimizer step")
    req = build_request(spec, base, cluster, effective_batch=given_batch,
                        method_auto=opts.method == "auto" and "method" not in fixed,
                        headroom=opts.headroom, objective=opts.objective, top=opts.top,
                        data=profile, fixed=frozenset(fixed), notes=tuple(notes),
                        time_budget_s=opts.time_budget_s)
    return spec, req


def plan_from_options(opts: PlanOptions) -> PlanResult:
    spec, req = request_from_options(opts)
    return plan(spec, req)


# Knobs train's preflight keeps: what is trained and how exactly. It may change
# the micro batch × accumulation split, checkpointing and the evaluation batch;
# ZeRO stage and offload only for runs that already use DeepSpeed.
PREFLIGHT_FIXED = frozenset({"method", "quantization", "lora", "precision", "optimizer",
                             "seq_len", "packing", "attn"})


def best_fit(cfg: RunConfig, cluster: Cluster, headroom: float = 0.0) -> RunConfig | None:
    """The fastest configuration that fits and keeps cfg's effective batch and
    training (see PREFLIGHT_FIXED), or None. ``headroom`` 0: the preflight's own
    fit test (device peak ≤ the GPU's memory)."""
    spec = resolve_model(cfg.model).spec
    fixed = PREFLIGHT_FIXED | ({"zero"} if cfg.zero == 0 else set())
    req = build_request(spec, cfg, cluster, headroom=headroom, top=1, fixed=fixed)
    result = search(spec, req)
    if not result.plans:
        return None
    return result.best.run_config().model_copy(update={"hardware": cfg.hardware})


def model_id_for(text: str) -> tuple[str, str]:
    """(id other tools load the model by, catalog family): the Hugging Face id
    of a catalog model, else the path or id the user gave."""
    resolved = resolve_model(text)
    if resolved.entry is not None:
        return resolved.entry.hf_id, resolved.entry.family
    if resolved.source.startswith(("file:", "hf-cache:")):
        path = Path(resolved.source.split(":", 1)[1])
        return str(path if path.is_dir() else path.parent), ""
    return text, ""


def write_best(result: PlanResult, req: PlanRequest, spec: ModelSpec, out_dir: str,
               force: bool = False, inputs: tuple[str | None, ...] = ()) -> list[str]:
    """Write the best plan's files (oomless.yaml, deepspeed.json when ZeRO, ...);
    ``inputs`` (the plan's own files) are never written over."""
    from .writers import write_plan_files

    if not result.plans:
        return []
    cfg = result.best.run_config()
    model_id, family = model_id_for(cfg.model)
    paths = write_plan_files(out_dir, cfg, spec, req.cluster, model_id, family, data=req.data,
                             force=force, inputs=inputs)
    return [str(p) for p in paths]
