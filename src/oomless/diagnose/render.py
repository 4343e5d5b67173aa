"""Human output of a diagnosis: one rich panel per event."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from ..units import fmt_bytes
from .events import NO_EVENT, Diagnosis, Finding

_SOURCES = {
    "pytorch-2.x": "PyTorch CUDA allocator", "pytorch-1.x": "PyTorch 1.x CUDA allocator",
    "cuda-malloc-async": "PyTorch cudaMallocAsync", "pytorch": "PyTorch", "cuda": "CUDA",
    "bitsandbytes": "bitsandbytes", "nccl": "NCCL", "torch-nccl": "NCCL (via torch.distributed)",
    "vllm": "vLLM", "kernel": "Linux OOM killer", "pytorch-cpu": "PyTorch CPU allocator",
    "dataloader": "DataLoader worker", "scheduler": "job scheduler", "torchrun": "torchrun",
    "launcher": "launcher",
}
_NUMBER_LABELS = (
    ("requested_bytes", "requested"), ("free_bytes", "free"), ("total_bytes", "of"),
    ("allocated_bytes", "allocated by PyTorch"), ("reserved_unallocated_bytes", "reserved, unallocated"),
    ("kv_needed_bytes", "KV needed"), ("kv_available_bytes", "KV available"), ("rss_bytes", "RSS"),
)


_CHANGES = {"training": "  (changes the training)",
            "serving": "  (changes what the engine serves)"}


def _title(finding: Finding, index: int, count: int) -> Text:
    e = finding.event
    parts = [f"Out of memory {index}/{count}"]
    if e.rank is not None:
        parts.append(f"rank {e.rank}")
    source = _SOURCES.get(e.source, e.source)
    parts.append(source + (f" in {e.library}" if e.library and e.library not in source.lower() else ""))
    if e.phase != "unknown":
        parts.append(e.phase.replace("_", " "))
    if e.occurrences > 1:
        parts.append(f"×{e.occurrences}")
    return Text(" · ".join(parts), style="bold")


def _numbers(finding: Finding) -> Text | None:
    n = finding.event.numbers
    shown = [f"{label} {fmt_bytes(n[key])}" for key, label in _NUMBER_LABELS if key in n]
    for key in ("gpu_memory_utilization", "max_model_len", "exit_code", "pid"):
        if key in n:
            shown.append(f"{key.replace('_', ' ')} {n[key]:g}")
    return Text(" · ".join(shown), style="cyan") if shown else None


def _block(finding: Finding) -> Group:
    e = finding.event
    rows: list[Text] = [Text(f"line {e.line}: {e.message[:300]}", style="dim")]
    numbers = _numbers(finding)
    if numbers is not None:
        rows.append(numbers)
    for i, cause in enumerate(finding.causes):
        head = "Cause" if i == 0 else "Also"
        rows.append(Text.assemble((f"{head}: ", "bold red" if i == 0 else "yellow"),
                                  (cause.title, "bold"), f" — {cause.evidence}"))
    if not finding.causes:
        rows.append(Text("Cause: not recognised from this message", style="yellow"))
    for i, fix in enumerate(finding.fixes, 1):
        note = "" if fix.keeps_training else _CHANGES.get(fix.domain, "")
        rows.append(Text.assemble((f"Fix {i}: ", "bold green"), fix.summary, (note, "dim")))
    return Group(*rows)


def render(diagnosis: Diagnosis, console: Console | None = None) -> None:
    console = console or Console()
    if not diagnosis.found:
        console.print(Text(NO_EVENT))
        for note in diagnosis.notes:
            console.print(Text(f"note: {note}", style="dim"))
        return
    estimated = any(f.prediction == "estimator" for x in diagnosis.findings for f in x.fixes)
    if estimated and diagnosis.gpu and diagnosis.gpu_memory_bytes:
        console.print(Text(f"Predictions for {diagnosis.gpu} "
                           f"({fmt_bytes(diagnosis.gpu_memory_bytes)})", style="dim"))
    count = len(diagnosis.findings)
    for index, finding in enumerate(diagnosis.findings, 1):
        console.print(Panel(_block(finding), title=_title(finding, index, count), title_align="left"))
    for note in diagnosis.notes:
        console.print(Text(f"note: {note}", style="dim"))
