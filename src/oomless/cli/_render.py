"""Rich rendering of estimates (shared by estimate, trace, measure, check)."""

from __future__ import annotations

from ..result import FITS, TIGHT, MemoryEstimate
from ..units import fmt_bytes, fmt_count

_LABELS = {
    "weights": "weights", "lora_adapters": "LoRA adapters", "master_weights": "fp32 master weights",
    "saved_modules": "modules_to_save copies",
    "optimizer": "optimizer states", "gradients": "gradients",
    "grad_partition_fp32": "fp32 grad partitions", "ddp_buckets": "DDP gradient buckets",
    "zero3_gathered": "ZeRO-3 gathered layer", "cublas_workspace": "cuBLAS workspaces",
    "rope_tables": "RoPE tables (Unsloth, fp32)",
    "activations": "activations", "logits": "logits + loss", "temporaries": "temporaries",
    "kv_cache": "KV cache", "inputs": "image pixels",
    "image_embeddings": "image + text embeddings", "vision_forward": "vision tower forward",
    "reference_model": "reference model", "reference_forward": "reference forward",
    "reward_model": "reward model", "value_model": "value model + AdamW",
    "value_gradients": "value model gradients", "rollout_scores": "PPO rollout scores",
}


def console():
    from rich.console import Console

    return Console(highlight=False)


def esc(value: object) -> str:
    """A user's text (a path, a model name, a message) shown as is: rich markup in it
    (``run[link=...]x[/link]``) is escaped, never interpreted."""
    from rich.markup import escape

    return escape(str(value))


def band_text(est: MemoryEstimate) -> str:
    """'(−1.2 GiB / +0.9 GiB)' around the device peak, or '' without a band."""
    if est.low_bytes is None or est.high_bytes is None or est.low_bytes == est.high_bytes:
        return ""
    return (f"−{fmt_bytes(est.device_peak_bytes - est.low_bytes)} / "
            f"+{fmt_bytes(est.high_bytes - est.device_peak_bytes)}")


def verdict(est: MemoryEstimate) -> str:
    band = band_text(est)
    span = (f" ({fmt_bytes(est.low_bytes)}–{fmt_bytes(est.high_bytes)})"
            if band else "")
    if est.verdict is None:
        return (f"Needs {fmt_bytes(est.device_peak_bytes)}{span} per GPU "
                "(add --gpu to check a fit).")
    gpu = est.gpu or "GPU"
    if est.verdict == FITS:
        return (f"[green]FITS[/] on {gpu}: {fmt_bytes(est.device_peak_bytes)}{span} of "
                f"{fmt_bytes(est.gpu_memory_bytes)}, {fmt_bytes(est.headroom_bytes)} headroom.")
    if est.verdict == TIGHT:
        return (f"[yellow]TIGHT[/] on {gpu}: {fmt_bytes(est.device_peak_bytes)}{span} of "
                f"{fmt_bytes(est.gpu_memory_bytes)} — within the estimate's uncertainty; "
                "it may run out of memory. Try `oomless plan`.")
    return (f"[red]OUT OF MEMORY[/] on {gpu} in the {est.peak_phase} phase: needs "
            f"{fmt_bytes(est.device_peak_bytes)}{span} of {fmt_bytes(est.gpu_memory_bytes)} "
            f"({fmt_bytes(-est.headroom_bytes)} short). Try `oomless plan`.")


def render_estimate(est: MemoryEstimate, show_assumptions: bool = False) -> None:
    from rich.table import Table

    out = console()
    cfg = est.config
    out.print(
        f"[bold]{esc(est.model)}[/] · {fmt_count(est.param_count)} params, "
        f"{fmt_count(est.trainable_params)} trainable · {cfg['method']} · {cfg['precision']} · "
        f"micro batch {cfg['micro_batch_size']} × seq {cfg['seq_len']}"
        f"{' · grad ckpt' if cfg['grad_ckpt'] else ''} · attn {cfg['attn']}"
        f"{' · ZeRO-' + str(cfg['zero']) if cfg['zero'] else ''} · {est.method} estimate"
    )
    peak = est.peak_allocated_bytes
    table = Table(title=f"Per-GPU memory at the peak ({est.peak_phase})", title_justify="left")
    table.add_column("component")
    table.add_column("memory", justify="right")
    table.add_column("share", justify="right")
    for name, n_bytes in sorted(est.components.items(), key=lambda kv: -kv[1]):
        table.add_row(_LABELS.get(name, name), fmt_bytes(n_bytes), f"{n_bytes / peak:.0%}")
    table.add_section()
    table.add_row("[bold]peak allocated[/] (max_memory_allocated)", fmt_bytes(peak), "")
    table.add_row("[bold]peak reserved[/] (max_memory_reserved)",
                  fmt_bytes(est.peak_reserved_bytes), "")
    for name, n_bytes in est.non_pytorch_bytes.items():
        table.add_row(f"  + {name.replace('_', ' ')}", fmt_bytes(n_bytes), "")
    table.add_row("[bold]device peak[/] (nvidia-smi)", fmt_bytes(est.device_peak_bytes), "")
    if band_text(est):
        table.add_row("  uncertainty band (low–high)",
                      f"{fmt_bytes(est.low_bytes)}–{fmt_bytes(est.high_bytes)}", "")
    out.print(table)
    phases = "  ".join(f"{p} {fmt_bytes(v)}" for p, v in est.phase_peaks().items())
    out.print(f"phases (allocated): {phases}")
    if est.host_ram_bytes:
        out.print(f"host RAM for offload: {fmt_bytes(est.host_ram_bytes)} per node")
    if est.extra.get("reserved_after_load_bytes"):
        loaded = est.extra["reserved_after_load_bytes"]
        cached = loaded - est.extra.get("allocated_after_load_bytes", loaded)
        out.print(f"reserved after loading (before the first step): {fmt_bytes(loaded)}, "
                  f"{fmt_bytes(cached)} of it cached but free")
    if est.extra.get("paged_optimizer_bytes"):
        out.print(f"paged optimizer states (unified memory): "
                  f"{fmt_bytes(est.extra['paged_optimizer_bytes'])}")
    out.print(verdict(est))
    render_assumptions(out, est.assumptions, show_assumptions)


def render_assumptions(out, assumptions, show: bool) -> None:
    """Every assumption, or a one-line hint of how many there are."""
    if show:
        out.print("[bold]assumptions[/]")
        for a in assumptions:
            out.print(f"  - {esc(a)}")
    else:
        out.print(f"[dim]{len(assumptions)} assumptions: --assumptions to list them, "
                  "--json for all fields[/]")
