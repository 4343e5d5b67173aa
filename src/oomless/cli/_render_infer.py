"""Human output of `oomless estimate --inference` (and the budget line of
`oomless infer --engine-args`): a table like training's, not a key dump."""

from __future__ import annotations

import json
from typing import Any

from ..units import fmt_bytes

CUDAGRAPH_WARNING = ("[yellow]CUDA graphs may not fit[/]: vLLM captures them after the KV "
                     "cache, above the budget, and the card has less than that left; lower "
                     "gpu_memory_utilization or set enforce_eager")


def engine_args_text(args: dict[str, Any]) -> str:
    """vLLM engine arguments as printed by every command (byte for byte the same)."""
    return json.dumps(args, indent=2)


def _table(title: str, rows: list[tuple[str, int, str]], total_label: str, total: int):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("memory", justify="right")
    table.add_column("", justify="left")
    for name, n_bytes, note in rows:
        table.add_row(name, fmt_bytes(n_bytes), note)
    table.add_section()
    table.add_row(f"[bold]{total_label}[/]", fmt_bytes(total), "")
    return table


def budget_verdict(b: Any) -> str:
    """What the budget holds, and what it does not, in words."""
    seqs, length = b.max_num_seqs, b.max_model_len
    held = int(b.max_concurrency)
    if not b.fits:
        non_kv = b.weights_bytes + b.profile_peak_bytes + b.non_torch_bytes
        return (f"[red]OUT OF MEMORY[/]: weights, the profile run and non-torch memory take "
                f"{fmt_bytes(non_kv)} of the {fmt_bytes(b.budget_bytes)} budget; not one sequence "
                f"of {length:,} tokens fits (smaller max_model_len, a quantized model, more GPUs)")
    if b.holds_max_num_seqs:
        return (f"[green]FITS[/]: {seqs} sequences of {length:,} tokens at once at "
                f"gpu_memory_utilization {b.gpu_memory_utilization:.2f} "
                f"({fmt_bytes(b.budget_bytes)} of {fmt_bytes(b.total_memory_bytes)})")
    need = (f"{fmt_bytes(b.required_bytes)}, "
            + (f"utilization {b.required_utilization:.2f}" if b.required_utilization else
               f"{b.required_bytes / b.total_memory_bytes:.1f} × this GPU"))
    return (f"[green]FITS[/] (vLLM starts; [yellow]not all {seqs} sequences at once[/]): at "
            f"gpu_memory_utilization {b.gpu_memory_utilization:.2f} the KV cache holds {held} "
            f"sequences of {length:,} tokens at once and vLLM queues the rest; {seqs} at once "
            f"would need {need}, no utilization ≤ 0.95 holds them: lower max_num_seqs to "
            f"{max(1, held)} or max_model_len")


def _parallel_text(b: Any) -> str:
    tp, pp, dp = b.tensor_parallel_size, b.pipeline_parallel_size, b.data_parallel_size
    if tp * pp * dp == 1:
        return ""
    return f" · TP {tp} × PP {pp} × DP {dp} ({tp * pp * dp} GPUs)"


def render_vllm(model: str, gpu_name: str, b: Any, args: dict[str, Any],
                hint: dict[str, Any] | None = None) -> None:
    from ._render import console, esc

    out = console()
    out.print(f"[bold]{esc(model)}[/] · vLLM on {gpu_name} ({fmt_bytes(b.total_memory_bytes)}) · "
              f"max_model_len {b.max_model_len:,} · max_num_seqs {b.max_num_seqs}"
              f"{_parallel_text(b)}", soft_wrap=True)
    comm = " + NCCL, all-reduce buffers" if b.tensor_parallel_size * b.pipeline_parallel_size > 1 else ""
    rows = [("weights (with LoRA slots)" if args.get("enable_lora") else "weights",
             b.weights_bytes, "this GPU's shard" if _parallel_text(b) else ""),
            ("profile-run peak (activations, sampler)", b.profile_peak_bytes, ""),
            (f"non-torch (CUDA context{comm})", b.non_torch_bytes, ""),
            ("KV cache", b.kv_cache_bytes,
             f"{b.num_blocks:,} blocks: {b.max_concurrency:g} sequences of {b.max_model_len:,}")]
    out.print(_table(f"Per-GPU memory at gpu_memory_utilization {b.gpu_memory_utilization:.2f}",
                     rows, "budget (utilization × GPU memory)", b.budget_bytes))
    out.print(f"CUDA graphs (captured after the KV cache, above the budget): about "
              f"{fmt_bytes(b.cudagraph_bytes)}", soft_wrap=True)
    out.print(budget_verdict(b), soft_wrap=True)
    if not b.cudagraphs_fit:
        out.print(CUDAGRAPH_WARNING, soft_wrap=True)
    if hint:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in hint.items())
        out.print(f"With the GPUs named, vLLM fits with: {flags}", soft_wrap=True)
    out.print("vLLM engine arguments (as `oomless infer --engine-args` prints them):")
    print(engine_args_text(args))


def render_generate(model: str, est: Any, gpu: Any | None) -> None:
    from ._render import console, esc

    out = console()
    out.print(f"[bold]{esc(model)}[/] · transformers generate()", soft_wrap=True)
    rows = [("weights", est.weights_bytes, ""), ("KV cache", est.kv_cache_bytes, ""),
            ("prefill activations", est.activations_bytes, ""),
            ("logits (last token, fp32)", est.logits_bytes, ""),
            ("non-PyTorch (CUDA context)", est.non_pytorch_bytes, "")]
    out.print(_table("Per-GPU memory at the peak", rows, "device peak (nvidia-smi)",
                     est.device_peak_bytes))
    if gpu is not None:
        fits = est.device_peak_bytes <= gpu.memory_bytes
        word = "[green]FITS[/]" if fits else "[red]OUT OF MEMORY[/]"
        out.print(f"{word} on {gpu.display_name}: {fmt_bytes(est.device_peak_bytes)} of "
                  f"{fmt_bytes(gpu.memory_bytes)}")
