"""What the page shows, shaped from the library's JSON forms (``to_dict()``).

Pure functions of plain values: service.py calls the library and hands over
the same dictionaries ``--json`` prints; nothing here computes memory. Byte
quantities stay integers (for the charts) and come with their text, formatted
as the command line formats them.
"""

from __future__ import annotations

from typing import Any, get_args

from ..config import Precision
from ..knobs import ATTENTIONS, METHODS, OPTIMIZERS
from ..units import fmt_bytes

# The stacked bar's groups: the estimate's categories (result.py) in the words of the
# issue tracker and the calculators people know; a category not listed is "other".
GROUPS: dict[str, tuple[str, ...]] = {
    "weights": ("weights", "lora_adapters", "saved_modules", "zero3_gathered"),
    "gradients": ("gradients", "grad_partition_fp32", "ddp_buckets"),
    "optimizer": ("optimizer", "master_weights"),
    "activations": ("activations", "kv_cache"),
    "logits": ("logits",),
    "overheads": ("cublas_workspace", "temporaries"),
}
GROUP_ORDER = (*GROUPS, "other")
_GROUP_OF = {category: group for group, members in GROUPS.items() for category in members}


def _labels() -> dict[str, str]:
    from ..cli._render import _LABELS  # the CLI's names of the categories

    return _LABELS


def _phase_bar(phase: str, parts: dict[str, int], device_bytes: int | None,
               non_pytorch: dict[str, int]) -> dict[str, Any]:
    """One phase: bytes per group, and the categories inside each group."""
    labels = _labels()
    groups = dict.fromkeys(GROUP_ORDER, 0)
    members: dict[str, list[list[Any]]] = {g: [] for g in GROUP_ORDER}
    for category, n_bytes in parts.items():
        group = _GROUP_OF.get(category, "other")
        groups[group] += n_bytes
        members[group].append([labels.get(category, category.replace("_", " ")), n_bytes])
    allocated = sum(parts.values())
    if device_bytes is not None:  # nvidia-smi view: allocator reserve + non-PyTorch memory
        outside = sum(non_pytorch.values())
        groups["overheads"] += device_bytes - allocated
        members["overheads"].append(["allocator reserve", device_bytes - allocated - outside])
        members["overheads"] += [[name.replace("_", " "), b] for name, b in non_pytorch.items()]
    return {"phase": phase, "allocated_bytes": allocated,
            "total_bytes": device_bytes if device_bytes is not None else allocated,
            "groups": groups, "members": members}


def estimate_payload(est: dict[str, Any], device: dict[str, int] | None,
                     verdict: dict[str, Any], command: str) -> dict[str, Any]:
    """The Estimate tab: stacked phases, the peak, the verdict and its band."""
    phases = [_phase_bar(p, parts, device.get(p) if device else None, est["non_pytorch_bytes"])
              for p, parts in est["breakdown"].items()]
    cfg = est["config"]
    return {
        "model": est["model"], "param_count": est["param_count"],
        "trainable_params": est["trainable_params"], "phases": phases,
        "group_order": list(GROUP_ORDER), "peak_phase": est["peak_phase"],
        "peak_allocated_bytes": est["peak_allocated_bytes"],
        "peak_reserved_bytes": est["peak_reserved_bytes"],
        "device_peak_bytes": est["device_peak_bytes"], "gpu": est["gpu"],
        "gpu_memory_bytes": est["gpu_memory_bytes"], "host_ram_bytes": est["host_ram_bytes"],
        "verdict": verdict, "assumptions": est["assumptions"], "command": command,
        "effective_batch": cfg["micro_batch_size"] * cfg["grad_accum"]
        * cfg["hardware"]["gpus_per_node"] * cfg["hardware"]["nodes"],
        "text": {k: fmt_bytes(est[k]) for k in (
            "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes")},
    }


def knob_alternatives(request: dict[str, Any], cfg: dict[str, Any]) -> list[tuple]:
    """(knob, from, to, page change) for one other value of every knob."""
    out: list[tuple] = []

    def add(label: str, old: Any, new: Any, flag: str) -> None:
        if new != old:
            out.append((label, old, new, {flag: new}))

    mb, seq = cfg["micro_batch_size"], cfg["seq_len"]
    for value in (mb * 2, mb // 2):
        if value >= 1:
            add("micro batch", mb, value, "batch_size")
    for value in (seq * 2, seq // 2):
        if value >= 64:
            add("sequence length", seq, value, "seq_len")
    add("gradient checkpointing", cfg["grad_ckpt"], not cfg["grad_ckpt"], "grad_ckpt")
    for name in ATTENTIONS:
        add("attention", cfg["attn"], name, "attn")
    for name in METHODS:
        add("method", cfg["method"], name, "method")
    for name in get_args(Precision):
        add("precision", cfg["precision"], name, "precision")
    for name in OPTIMIZERS:
        add("optimizer", cfg["optimizer"], name, "optim")
    if cfg["method"] != "full":
        r = cfg["lora"]["r"]
        for value in (r * 2, r // 2):
            if value >= 1:
                add("LoRA rank", r, value, "lora_r")
    for stage in (0, 1, 2, 3):
        add("ZeRO stage", cfg["zero"], stage, "zero")
    for name in ("none", "optimizer", "all"):
        add("offload", cfg["offload"], name, "offload")
    gpus = cfg["hardware"]["gpus_per_node"]
    if request.get("gpu"):
        add("GPUs", gpus, gpus * 2, "gpus")
    return out


def _on_off(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def effect_row(knob: tuple, peak_bytes: int, verdict: dict[str, Any],
               base_bytes: int) -> dict[str, Any]:
    label, old, new, change = knob
    delta = peak_bytes - base_bytes
    return {"knob": label, "from": _on_off(old), "to": _on_off(new), "change": change,
            "device_peak_bytes": peak_bytes, "delta_bytes": delta,
            "text": fmt_bytes(peak_bytes),
            "delta_text": ("+" if delta > 0 else "±" if delta == 0 else "") + fmt_bytes(delta),
            "state": verdict["state"]}


def plan_row(plan: dict[str, Any], changes: list[str], read_as: str,
             step_text: str) -> dict[str, Any]:
    """One plan that fits: memory, speed, what changed and its knobs."""
    return {"family": plan["family"], "device_peak_bytes": plan["device_peak_bytes"],
            "budget_bytes": plan["budget_bytes"], "peak_phase": plan["peak_phase"],
            "tokens_per_s": plan["speed"]["tokens_per_s"], "step": step_text,
            "changes": changes, "tradeoffs": plan["tradeoffs"], "read_as": read_as,
            "config": plan["config"],
            "text": f"{fmt_bytes(plan['device_peak_bytes'])} of "
                    f"{fmt_bytes(plan['budget_bytes'])} ({plan['peak_phase']})"}


def check_payload(result: dict[str, Any], folder: str, fix_changes: list[str],
                  read_as: str) -> dict[str, Any]:
    """The Check tab: per-phase bytes, the verdict, and the fix as a diff."""
    gpu = result["gpu_memory_bytes"]
    band = f"likely {fmt_bytes(result['low_bytes'])}–{fmt_bytes(result['high_bytes'])}"
    state = result["verdict"].replace("_", "-")
    if state == "out-of-memory":
        text = (f"OUT OF MEMORY in the {result['oom_phase']} phase (the first above "
                f"{fmt_bytes(gpu)}); peak {fmt_bytes(result['device_peak_bytes'])} ({band}) in "
                f"{result['peak_phase']}.")
    elif state == "tight":
        text = (f"TIGHT: {fmt_bytes(result['device_peak_bytes'])} ({band}) in "
                f"{result['peak_phase']} on a {fmt_bytes(gpu)} GPU: within the estimate's "
                "uncertainty or the headroom; it may run out of memory.")
    else:
        text = (f"FITS: {fmt_bytes(result['device_peak_bytes'])} ({band}) in "
                f"{result['peak_phase']}, {fmt_bytes(gpu - result['device_peak_bytes'])} free.")
    fix = result["fix"]
    names = [f.removeprefix(folder) for f in result["files"]]
    return {
        "label": result["label"], "files": names, "model": result["model"],
        "hardware": result["hardware"], "read_as": read_as,
        "phases": [{"phase": p, "device_bytes": b, "text": fmt_bytes(b), "over": b > gpu}
                   for p, b in result["phase_device_bytes"].items()],
        "gpu_memory_bytes": gpu, "budget_bytes": result["budget_bytes"],
        "state": state, "text": text,
        "fix": None if not fix else {
            "changes": fix_changes, "device_peak_bytes": fix["device_peak_bytes"],
            "text": f"predicted {fmt_bytes(fix['device_peak_bytes'])} ({fix['peak_phase']}) "
                    f"of {fmt_bytes(fix['budget_bytes'])}, "
                    f"{fix['speed']['tokens_per_s']:,.0f} tokens/s"},
        "diff": "".join(result["diffs"].values()),
        "diff_name": (names[0].rsplit(".", 1)[0] if names else "fix") + ".oomless.diff",
        "no_fix": not fix and not result["within_budget"],
        "notes": [n.replace(folder, "") for n in result["notes"]],
        "assumptions": result["assumptions"],
    }


def diagnosis_payload(diagnosis: dict[str, Any], headings: list[tuple[str, str]]) -> dict:
    """The Diagnose tab: every event with its numbers, causes and fixes."""
    events = []
    for finding, (title, numbers) in zip(diagnosis["events"], headings, strict=True):
        e = finding["event"]
        events.append({
            "title": title, "numbers": numbers, "line": e["line"], "message": e["message"],
            "causes": [{"title": c["title"], "evidence": c["evidence"]}
                       for c in finding["causes"]],
            "fixes": [{"text": f["summary"], "keeps_training": f["keeps_training"],
                       "fits": f["fits"], "inference": _inference_fields(f)}
                      for f in finding["fixes"]],
        })
    return {"found": diagnosis["found"], "summary": diagnosis["summary"], "events": events,
            "notes": diagnosis["notes"], "gpu": diagnosis["gpu"]}


def _inference_fields(fix: dict[str, Any]) -> dict[str, Any] | None:
    """A serving fix's engine settings that the Inference tab takes (its fields are
    commands.INFERENCE_OPTIONS, vLLM's own names): the tab opens with them; else None."""
    from .commands import INFERENCE_OPTIONS

    fields = {k: v for k, v in fix["changes"].items() if k in INFERENCE_OPTIONS}
    return fields if fix["domain"] == "serving" and fields else None


def page_knobs(config: dict[str, Any]) -> dict[str, Any]:
    """The page's knobs (and GPU count) that stand for a RunConfig's JSON form: what
    "open in Estimate" sets, so the Estimate tab estimates exactly this configuration."""
    quant = config["quantization"]
    targets = config["lora"]["targets"]
    knobs = {"method": config["method"], "precision": config["precision"],
             "optim": config["optimizer"], "lora_r": config["lora"]["r"],
             "lora_targets": targets if isinstance(targets, str) else ",".join(targets),
             "batch_size": config["micro_batch_size"], "grad_accum": config["grad_accum"],
             "seq_len": config["seq_len"], "grad_ckpt": config["grad_ckpt"],
             "attn": config["attn"], "zero": config["zero"], "offload": config["offload"],
             "stack": config["stack"], "stage": config["stage"],
             "gpus": config["hardware"]["gpus_per_node"]}
    if config["method"] == "qlora":
        knobs["quant"] = "int8" if quant["bits"] == 8 else quant["type"]
    if config["hardware"].get("gpu"):
        knobs["gpu"] = config["hardware"]["gpu"]
    return knobs


_STATE_RANK = {"fits": 0, "tight": 1, None: 2, "out-of-memory": 3}


def sort_effects(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What gets the configuration to fit first: by the verdict each change gives
    (fits, tight, out of memory), then by the device peak it leaves."""
    return sorted(rows, key=lambda r: (_STATE_RANK.get(r["state"], 2), r["device_peak_bytes"]))


def _plain(markup: str) -> str:
    from rich.text import Text

    return Text.from_markup(markup).plain


def vllm_payload(model: str, gpu_name: str, budget: Any, engine: dict[str, Any],
                 command: str, hint: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Inference tab for vLLM: the budget's parts per GPU (the fullest rank under
    tensor/pipeline parallel), the KV blocks, the most sequences held and the smallest
    utilization, in the CLI's words, the engine arguments, and the parallel sizes that
    would fit on the GPUs named (``hint``, the CLI's suggested_parallel)."""
    from ..cli._render_infer import budget_verdict, engine_args_text, parallel_text

    b = budget.to_dict()
    parallel = parallel_text(budget).removeprefix(" · ")
    comm = (", NCCL, all-reduce buffers"
            if budget.tensor_parallel_size * budget.pipeline_parallel_size > 1 else "")
    weights = "weights (with LoRA slots)" if engine.get("enable_lora") else "weights"
    rows = [[weights + (" — this GPU's shard" if parallel else ""), b["weights_bytes"]],
            ["profile-run peak (activations, sampler)", b["profile_peak_bytes"]],
            [f"non-torch (CUDA context, CUDA graphs{comm})", b["non_torch_bytes"]],
            ["KV cache", b["kv_cache_bytes"]]]
    state = ("out-of-memory" if not b["fits"] else "fits" if b["holds_max_num_seqs"]
             else "tight")
    hint_text = (None if not hint else "with the GPUs named, vLLM fits with: " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in hint.items()))
    return {"engine": "vllm", "model": model, "gpu": gpu_name, "budget": b,
            "rows": [[name, n, fmt_bytes(n)] for name, n in rows], "state": state,
            "text": _plain(budget_verdict(budget)), "engine_args": engine,
            "engine_args_text": engine_args_text(engine), "command": command,
            "parallel": parallel, "suggested_parallel": hint, "hint_text": hint_text}


def generate_payload(model: str, est: dict[str, Any], cluster: Any,
                     command: str) -> dict[str, Any]:
    """The Inference tab for transformers' generate(): its parts against the GPU."""
    rows = [["weights", est["weights_bytes"]], ["KV cache", est["kv_cache_bytes"]],
            ["prefill activations", est["activations_bytes"]],
            ["logits (last token, fp32)", est["logits_bytes"]],
            ["non-PyTorch (CUDA context)", est["non_pytorch_bytes"]]]
    total = est["device_peak_bytes"]  # the library's nvidia-smi peak (allocator reserve in)
    gpu = cluster.gpu.memory_bytes if cluster else None
    state = None if gpu is None else ("fits" if total <= gpu else "out-of-memory")
    text = (f"device peak {fmt_bytes(total)} (no GPU chosen)" if gpu is None else
            f"device peak {fmt_bytes(total)} of {fmt_bytes(gpu)} on {cluster.gpu.display_name}")
    return {"engine": "hf", "model": model, "estimate": est, "total_bytes": total,
            "rows": [[name, n, fmt_bytes(n)] for name, n in rows], "state": state,
            "text": text, "command": command}
