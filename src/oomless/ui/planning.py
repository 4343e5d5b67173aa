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

import shutil
from typing import Any

from ..config import RunConfig, dump_run_config
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


def _run_plan(ws: Workspace, knobs: dict[str, Any], request: dict[str, Any]):
    from ..planner import plan

    base = run_config(ws, knobs)
    folder = ws.folder("plan-base")
    try:
        path = ws.save(folder, "oomless.yaml", dump_run_config(base))
        options = _plan_request(request, base)
        opts, spec, req = _plan_options(options, path, knobs)
        result = plan(spec, req)
        method_note = None
        if not result.plans and request.get("method") in (None, "", KEEP):
            # the planner's own way out (its "another method" suggestion): --method auto,
            # each plan's method change carrying the planner's reason
            tried = _plan_options({**options, "method": "auto"}, path, knobs)
            auto_result = plan(tried[1], tried[2])
            if auto_result.plans:
                opts, spec, req = tried
                result, options = auto_result, {**options, "method": "auto"}
                method_note = (f"nothing fits with {base.method} at sequence {opts.seq_len} "
                               f"and effective batch {opts.effective_batch}: the planner chose "
                               "the method (--method auto); each plan says why")
        files = [plan_files(ws, p.run_config(), spec, req.cluster) for p in result.plans]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    kept = {"seq_len": opts.seq_len, "effective_batch": opts.effective_batch,
            "method": None if opts.method == "auto" else opts.method, "stage": base.stage,
            "stack": base.stack}
    return base, options, result, files, kept, method_note


def _plan_options(options: dict[str, Any], path, knobs: dict[str, Any]):
    """PlanOptions, spec and request of `oomless plan oomless.yaml [options]`."""
    from ..planner import PlanOptions, request_from_options

    args = commands.parse(options, "plan", str(path), uploaded=True)
    opts = PlanOptions(
        model=str(path), gpu=gpu_text(knobs), seq_len=args.seq_len,
        effective_batch=args.effective_batch, method=args.method or "auto",
        method_from_file=args.method is None, headroom=args.headroom,
        objective=args.objective, top=args.top,
        lora_r=args.lora_r if args.method != "full" else None)
    return (opts, *request_from_options(opts))


def _plain_plan(ws: Workspace, request: dict[str, Any]):
    """`oomless plan MODEL --gpu … [options]`: no Estimate run to start from."""
    from ..planner import PlanOptions, plan, request_from_options

    model, _shown, uploaded = _model(ws, request)
    args = commands.parse(request, "plan", model, uploaded)
    opts = PlanOptions(
        model=args.model, gpu=args.gpu, seq_len=args.seq_len,
        effective_batch=args.effective_batch, method=args.method or "auto",
        method_from_file=args.method is None, headroom=args.headroom,
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
        changes = [_from_the_estimate(c, knobs) for c in p.changes]
        row = views.plan_row(p.to_dict(), [change_text({**c, "why": None}) for c in changes],
                             read_as(p.config), fmt_duration(p.speed["step_s"]))
        row["reasons"] = [f"{change_text({**c, 'why': None})}: {c['why']}"
                          for c in changes if c.get("why")]  # the planner's own reason
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


def _from_the_estimate(change: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    """A change as the page's user reads it: under --method auto the planner counts the
    method from "auto"; the Estimate tab's method is what it changed."""
    if change["key"] == "method" and change["from"] == "auto" and knobs.get("method"):
        return {**change, "from": knobs["method"]}
    return change


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
    """`oomless estimate --inference`: HF generate's memory, or vLLM's per-GPU budget (KV
    blocks, the most sequences held, the smallest utilization; tensor, pipeline and data
    parallel sizes as vLLM takes them) and the engine arguments. The command line's
    library call (oomless.api.estimate_inference), with its defaults."""
    from ..api import estimate_inference
    from ..cli._options import inference_options, run_config_from_args

    with ws.clean_errors():
        args = estimate_options(ws, request, "inference")
        inf = estimate_inference(run_config_from_args(args), inference_options(args),
                                 gpu_fix="pick a GPU")
        command = commands.command_line(request, "inference", _model(ws, request)[1])
        if inf.generate is not None:
            return views.generate_payload(inf.model_name, inf.generate.to_dict(), inf.cluster,
                                          command)
    return views.vllm_payload(inf.model_name, inf.cluster.gpu.display_name, inf.budget,
                              inf.engine_args, command, inf.suggested_parallel)
