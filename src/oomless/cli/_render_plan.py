"""Rich rendering of plans (`oomless plan`) and checks (`oomless check`)."""

from __future__ import annotations

from typing import Any

from ..units import fmt_bytes
from ._render import render_assumptions


def fmt_duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def _knobs(c: dict[str, Any]) -> str:
    parts = [c["precision"], c["optimizer"]]
    if c["method"] != "full":
        targets = c["lora"]["targets"]
        parts.insert(0, f"r{c['lora']['r']} {targets if isinstance(targets, str) else '+'.join(targets)}")
    if c["grad_ckpt"]:
        parts.append("checkpointing")
    parts.append(f"attn {c['attn']}")
    if c["data"]["packing"]:
        parts.append("packing")
    return ", ".join(parts)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, list):
        return "+".join(map(str, v))
    return str(v)


def change_text(ch: dict[str, Any]) -> str:
    return f"{ch['label']} {_value(ch['from'])} → {_value(ch['to'])}"


def plan_lines(i: int, p: Any) -> list[str]:
    c = p.config
    epoch = f", epoch {fmt_duration(p.epoch_s)}" if p.epoch_s else ""
    lines = [
        f"[bold]{i}. {p.family}[/] — {fmt_bytes(p.device_peak_bytes)} "
        f"(≤ {fmt_bytes(p.high_bytes or p.device_peak_bytes)}) of "
        f"{fmt_bytes(p.budget_bytes)} ({p.peak_phase}) · {p.tokens_per_s:,.0f} tokens/s · "
        f"step {fmt_duration(p.speed['step_s'])}{epoch}",
        f"   {_knobs(c)} · micro batch {c['micro_batch_size']} × accumulation "
        f"{c['grad_accum']} × {c['hardware']['gpus_per_node'] * c['hardware']['nodes']} GPU(s)",
        "   changes: " + ("; ".join(change_text(ch) for ch in p.changes) or "none"),
    ]
    if p.tradeoffs:
        lines.append("   [yellow]trade-offs: " + "; ".join(p.tradeoffs) + "[/]")
    return lines


def render_plan(result: Any, written: list[str], show_assumptions: bool = False) -> None:
    from ._render import console

    out = console()
    out.print(f"[bold]{result.model}[/] on {result.hardware} · effective batch "
              f"{result.effective_batch} · budget {fmt_bytes(result.budget_bytes)} per GPU · "
              f"objective {result.objective}")
    rate = result.searched / result.elapsed_s if result.elapsed_s else 0
    out.print(f"searched {result.searched:,} configurations ({result.evaluated:,} estimated) "
              f"in {result.elapsed_s:.2f} s ({rate:,.0f}/s); {result.fitting:,} fit")
    for note in result.notes:
        out.print(f"[dim]note: {note}[/]")
    if result.data:
        d = result.data
        out.print(f"data: {d['samples']} samples, tokens p50 {d['p50']} / p95 {d['p95']} / "
                  f"p99 {d['p99']} / max {d['max']} ({d['source']})")
    if result.plans:
        out.print("[bold]plans that fit, best first[/]")
        for i, p in enumerate(result.plans, start=1):
            for line in plan_lines(i, p):
                out.print(line)
    else:
        out.print(f"[red]NOTHING FITS[/] on {result.hardware} within "
                  f"{fmt_bytes(result.budget_bytes)} per GPU.")
    render_misses(result.misses, out)
    for s in result.suggestions:
        out.print(f"[green]would fit:[/] {s}")
    for path in written:
        out.print(f"wrote {path}")
    render_assumptions(out, result.assumptions, show_assumptions)


def miss_text(m: Any) -> str:
    c = m.config
    where = (f"micro batch {c['micro_batch_size']}"
             f"{', checkpointing' if c['grad_ckpt'] else ''}")
    if m.over_bytes > 0:
        return (f"{m.group}: needs {fmt_bytes(m.device_peak_bytes)} in {m.peak_phase}, "
                f"{fmt_bytes(m.over_bytes)} over the budget ({where})")
    return (f"{m.group}: fits the GPU ({fmt_bytes(m.device_peak_bytes)}) but offload needs "
            f"{fmt_bytes(m.host_short_bytes)} more host RAM than available ({where})")


MISSES_SHOWN = 5


def render_misses(misses: list[Any], out: Any) -> None:
    if not misses:
        return
    out.print("[bold]families that do not fit[/] (nearest miss):")
    for m in misses[:MISSES_SHOWN]:
        out.print(f"  {miss_text(m)}")
    if len(misses) > MISSES_SHOWN:
        out.print(f"  [dim]... and {len(misses) - MISSES_SHOWN} more (--json)[/]")


def _read_as(c: dict[str, Any]) -> str:
    parts = [c["method"] + (f"-{c['quantization']['bits']}bit" if c["method"] == "qlora" else "")]
    if c["method"] != "full":
        targets = c["lora"]["targets"]
        parts.append(f"r{c['lora']['r']} {_value(targets)}")
    parts += [c["precision"], c["optimizer"],
              f"micro batch {c['micro_batch_size']} × accumulation {c['grad_accum']} × "
              f"{c['hardware']['gpus_per_node'] * c['hardware']['nodes']} GPU(s)",
              f"{c['seq_len']} tokens", f"attn {c['attn']}"]
    if c["grad_ckpt"]:
        parts.append("checkpointing")
    if c["zero"]:
        parts.append(f"ZeRO-{c['zero']}" + (f" offload {c['offload']}" if c["offload"] != "none" else ""))
    if c["eval"]["batch_size"]:
        parts.append(f"eval batch {c['eval']['batch_size']}")
    if c["eval"]["predict_with_generate"]:
        parts.append(f"generation {c['eval']['max_new_tokens']} new tokens")
    return " · ".join(parts)


def render_check(r: Any) -> None:
    from ._render import console

    out = console()
    out.print(f"[bold]{r.label}[/] {', '.join(r.files)} · {r.model} on {r.hardware}")
    out.print(f"read as: {_read_as(r.config)}")
    phases = ", ".join(
        f"{p} {fmt_bytes(v)}" + (" [red]✗[/]" if v > r.gpu_memory_bytes else "")
        for p, v in r.phase_device_bytes.items())
    out.print(f"predicted per GPU (nvidia-smi): {phases}; GPU {fmt_bytes(r.gpu_memory_bytes)}, "
              f"budget {fmt_bytes(r.budget_bytes)}")
    if r.oom_phase:
        out.print(f"[red]OUT OF MEMORY[/] in the {r.oom_phase} phase (the first above "
                  f"{fmt_bytes(r.gpu_memory_bytes)}); peak {fmt_bytes(r.device_peak_bytes)} in "
                  f"{r.peak_phase}.")
    elif not r.within_budget:
        out.print(f"[yellow]FITS, but with less than the headroom[/]: "
                  f"{fmt_bytes(r.device_peak_bytes)} in {r.peak_phase}.")
    else:
        out.print(f"[green]FITS[/]: {fmt_bytes(r.device_peak_bytes)} in {r.peak_phase}, "
                  f"{fmt_bytes(r.gpu_memory_bytes - r.device_peak_bytes)} free.")
    if r.fix:
        f = r.fix
        changes = "; ".join(change_text(ch) for ch in f["changes"])
        out.print(f"smallest change that fits (same effective batch): {changes} — predicted "
                  f"{fmt_bytes(f['device_peak_bytes'])} ({f['peak_phase']}) of "
                  f"{fmt_bytes(f['budget_bytes'])}, {f['speed']['tokens_per_s']:,.0f} tokens/s")
        for diff in r.diffs.values():
            out.print(diff, markup=False, highlight=False, end="")
    elif not r.within_budget:
        out.print("no change this file can express fits; run `oomless plan` for other "
                  "methods, GPUs or sharding")
    for note in r.notes:
        out.print(f"[dim]note: {note}[/]")
