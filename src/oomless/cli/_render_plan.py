"""Rich rendering of plans (`oomless plan`)."""

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
    why = f" ({ch['why']})" if ch.get("why") else ""
    return f"{ch['label']} {_value(ch['from'])} → {_value(ch['to'])}{why}"


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
    from ._render import console, esc

    out = console()
    out.print(f"[bold]{esc(result.model)}[/] on {result.hardware} · effective batch "
              f"{result.effective_batch} · budget {fmt_bytes(result.budget_bytes)} per GPU · "
              f"objective {result.objective}")
    rate = result.searched / result.elapsed_s if result.elapsed_s else 0
    out.print(f"searched {result.searched:,} configurations ({result.evaluated:,} estimated) "
              f"in {result.elapsed_s:.2f} s ({rate:,.0f}/s); {result.fitting:,} fit")
    for note in result.notes:
        out.print(f"[dim]note: {esc(note)}[/]")
    if result.data:
        d = result.data
        out.print(f"data: {d['samples']} samples, tokens p50 {d['p50']} / p95 {d['p95']} / "
                  f"p99 {d['p99']} / max {d['max']} ({esc(d['source'])})")
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
        out.print(f"wrote {esc(path)}")
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
