"""The Plan and Inference tabs: `oomless plan` from the Estimate tab's run, and
`oomless estimate --inference` (torch-free, no web framework).

Plan starts from every value the Estimate tab holds: the page's knobs become the
RunConfig the CLI builds (service.run_config), written as the oomless.yaml that
`oomless plan oomless.yaml` reads, so the planner keeps the stage, the stack and
everything it does not search, and reports each change against what the user set.
Sequence length and effective batch are the Estimate's unless the Plan tab says
otherwise; the method is kept when any plan with it fits (else the plans that
change it are shown, with the reason).
"""

from __future__ import annotations

import dataclasses
import shutil
from typing import Any

from ..config import RunConfig, dump_run_config
from ..errors import ConfigError
from . import commands, views
from .service import Workspace, _model, _object, estimate_options, gpu_text, run_config

KEEP = "keep"  # the Plan tab's method choice: the Estimate's method


def _plan_request(request: dict[str, Any], base: RunConfig) -> dict[str, Any]:
    """The plan options, the Estimate's values where the Plan tab leaves them empty."""
    world = base.hardware.gpus_per_node * base.hardware.nodes
    out = {k: request.get(k) for k in ("headroom", "objective", "top", "effective_batch",
                                        "seq_len", "method")}
    if out["seq_len"] in (None, ""):
        out["seq_len"] = base.seq_len
    if out["effective_batch"] in (None, ""):
        out["effective_batch"] = base.micro_batch_size * base.grad_accum * world
    if out["method"] in (None, "", KEEP):
        out["method"] = base.method
    if base.method != "full":
        out["lora_r"] = base.lora.r
    return out


def _lighter_methods(method: str) -> list[str]:
    """The methods after ``method`` in knobs.METHODS (full, lora, qlora: each trains or
    stores less than the one before), tried in turn when nothing fits with it."""
    from ..knobs import METHODS

    names = list(METHODS)
    return names[names.index(method) + 1:] if method in names else []


def _run_plan(ws: Workspace, knobs: dict[str, Any], request: dict[str, Any]):
    from ..planner import PlanOptions, plan, request_from_options

    base = run_config(ws, knobs)
    folder = ws.folder("plan-base")
    try:
        path = ws.save(folder, "oomless.yaml", dump_run_config(base))
        options = _plan_request(request, base)
        args = commands.parse(options, "plan", str(path), uploaded=True)
        opts = PlanOptions(
            model=str(path), gpu=gpu_text(knobs), seq_len=args.seq_len,
            effective_batch=args.effective_batch, method=args.method,
            headroom=args.headroom, objective=args.objective, top=args.top,
            lora_r=args.lora_r if args.method != "full" else None)
        spec, req = request_from_options(opts)
        result = plan(spec, req)
        method_note = None
        if not result.plans and request.get("method") in (None, "", KEEP):
            for method in _lighter_methods(base.method):  # the next method down, in turn
                trial = dataclasses.replace(opts, method=method,
                                            lora_r=opts.lora_r if method != "full" else None)
                spec_t, req_t = request_from_options(trial)
                tried = plan(spec_t, req_t)
                if tried.plans:
                    opts, spec, req, result = trial, spec_t, req_t, tried
                    options = {**options, "method": method}
                    method_note = (f"nothing fits with {base.method} at sequence "
                                   f"{args.seq_len} and effective batch "
                                   f"{args.effective_batch}: these plans use {method}")
                    break
        files = [plan_files(ws, p.run_config(), spec, req.cluster) for p in result.plans]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    kept = {"seq_len": args.seq_len, "effective_batch": args.effective_batch,
            "method": opts.method, "stage": base.stage, "stack": base.stack}
    return base, options, result, files, kept, method_note


def _plain_plan(ws: Workspace, request: dict[str, Any]):
    """`oomless plan MODEL --gpu … [options]`: no Estimate run to start from."""
    from ..planner import PlanOptions, plan, request_from_options

    model, _shown, uploaded = _model(ws, request)
    args = commands.parse(request, "plan", model, uploaded)
    opts = PlanOptions(
        model=args.model, gpu=args.gpu, seq_len=args.seq_len,
        effective_batch=args.effective_batch, method=args.method, headroom=args.headroom,
        objective=args.objective, top=args.top, lora_r=args.lora_r,
        host_ram_gb=args.host_ram_gb, images=args.images, max_new_tokens=args.max_new_tokens,
        stack=args.stack)
    spec, req = request_from_options(opts)
    result = plan(spec, req)
    files = [plan_files(ws, p.run_config(), spec, req.cluster) for p in result.plans]
    return result, files


def plan_view(ws: Workspace, request: dict[str, Any]) -> dict[str, Any]:
    """`oomless plan` of the Estimate tab's run (``request["knobs"]``: its request) and,
    for each plan, the files `plan --out` writes and the knobs that reopen it. Without
    ``knobs``: `oomless plan` of the model and GPUs the request names."""
    from ..cli._render_check import read_as
    from ..cli._render_plan import change_text, fmt_duration, miss_text

    extra: dict[str, Any] = {}
    with ws.clean_errors():
        if request.get("knobs") is None:
            knobs = request
            result, files = _plain_plan(ws, request)
            extra["command"] = commands.command_line(request, "plan", _model(ws, request)[1])
        else:
            knobs = _object(request["knobs"], "knobs")
            base, options, result, files, kept, method_note = _run_plan(ws, knobs, request)
            extra = {"kept": kept, "method_note": method_note,
                     "base_yaml": dump_run_config(base),
                     "command": commands.command_line({**options, **_gpu(knobs)}, "plan",
                                                      "oomless.yaml")}
    shown = _model(ws, knobs)[1]
    plans = []
    for p, f in zip(result.plans, files, strict=True):
        row = views.plan_row(p.to_dict(), [change_text(c) for c in p.changes],
                             read_as(p.config), fmt_duration(p.speed["step_s"]))
        page = views.page_knobs(p.config)
        row |= {"files": f, "knobs": page,
                "command": commands.command_line({**knobs, **page}, "estimate", shown)}
        plans.append(row)
    return {"model": result.model, "hardware": result.hardware,
            "effective_batch": result.effective_batch, "budget_bytes": result.budget_bytes,
            "objective": result.objective, "searched": result.searched,
            "fitting": result.fitting, "elapsed_s": result.elapsed_s, "plans": plans,
            "misses": [miss_text(m) for m in result.misses],
            "suggestions": list(result.suggestions), "notes": list(result.notes),
            "assumptions": list(result.assumptions), "kept": None, "method_note": None,
            "base_yaml": None, **extra}


def _gpu(knobs: dict[str, Any]) -> dict[str, Any]:
    return {k: knobs[k] for k in ("gpu", "gpus") if k in knobs}


def plan_files(ws: Workspace, cfg: RunConfig, spec, cluster) -> dict[str, str]:
    """{file name: text} of what `plan --out` writes for ``cfg``; paths between the
    files name the sibling file (they are downloaded into one folder)."""
    from ..planner.options import model_id_for
    from ..planner.writers import write_plan_files

    folder = ws.folder("plan")
    model_id, family = model_id_for(cfg.model)
    paths = write_plan_files(folder, cfg, spec, cluster, model_id, family)
    prefix = f"{folder.resolve()}/"
    files = {p.name: p.read_text(encoding="utf-8").replace(prefix, "") for p in paths}
    shutil.rmtree(folder, ignore_errors=True)
    return files


# ---- inference ---------------------------------------------------------------
def inference_view(ws: Workspace, request: dict[str, Any]) -> dict[str, Any]:
    """`oomless estimate --inference`: HF generate's memory, or vLLM's budget (KV blocks,
    the most sequences held, the smallest utilization) and the engine arguments.
    The same library calls as cli/estimate.py's inference path, with its defaults."""
    from ..api import cluster_for
    from ..cli._options import run_config_from_args
    from ..memory import estimate_generate
    from ..memory.inference import EngineRequest, vllm_engine_args
    from ..models.catalog import resolve_model

    with ws.clean_errors():
        args = estimate_options(ws, request, "inference")
        cfg = run_config_from_args(args)
        spec = resolve_model(cfg.model).spec
        new_tokens = cfg.eval.max_new_tokens or 512
        cluster = cluster_for(cfg)
        command = commands.command_line(request, "inference", _model(ws, request)[1])
        if args.engine == "hf":
            est = estimate_generate(spec, cfg.micro_batch_size, cfg.seq_len, new_tokens)
            return views.generate_payload(spec.name, est.to_dict(), cluster, command)
        if cluster is None:
            raise ConfigError("--inference --engine vllm needs --gpu (vLLM's budget is a "
                              "fraction of the card's memory); pick a GPU")
        adapter = cfg.method != "full" and "method" in cfg.model_fields_set
        req = EngineRequest(
            model=cfg.model, max_model_len=args.max_model_len or cfg.seq_len + new_tokens,
            max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
            lora_rank=cfg.lora.r if adapter else 0, kv_cache_dtype=args.kv_cache_dtype,
            trust_remote_code=cfg.training.trust_remote_code)
        engine, budget = vllm_engine_args(spec, cluster.gpu, req)
    return views.vllm_payload(spec.name, cluster.gpu.display_name, budget, engine, command)
