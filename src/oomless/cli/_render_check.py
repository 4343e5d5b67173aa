"""Human output of `oomless check`: what was read, the verdict, the fix. The diff is
written raw to standard output (never through a wrapping renderer), so that
`oomless check X > fix.patch; patch -p1 < fix.patch` applies it."""

from __future__ import annotations

import sys
from typing import Any

from ..units import fmt_bytes
from ._render_plan import _value, change_text


def read_as(c: dict[str, Any], lora_reach: str = "") -> str:
    """The run configuration in one line; ``lora_reach`` (oomless.check.lora_names.lora_reach) says
    where the LoRA targets land, vision tower included."""
    parts = [c["method"] + (f"-{c['quantization']['bits']}bit" if c["method"] == "qlora" else "")]
    if c.get("stage", "sft") != "sft":
        parts.append(f"stage {c['stage']}")
    if c["method"] != "full":
        parts.append(f"r{c['lora']['r']} " + (lora_reach or _value(c['lora']['targets'])))
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


def _verdict(r: Any, out: Any) -> None:
    """The three-valued verdict (CheckResult.verdict) with the band (memory/band.py)."""
    peak, gpu = fmt_bytes(r.device_peak_bytes), fmt_bytes(r.gpu_memory_bytes)
    band = f"likely {fmt_bytes(r.low_bytes)}–{fmt_bytes(r.high_bytes)}"
    if r.verdict == "out_of_memory":
        out.print(f"[red]OUT OF MEMORY[/] in the {r.oom_phase} phase (the first above {gpu}); "
                  f"peak {peak} ({band}) in {r.peak_phase}.")
    elif r.verdict == "tight":
        why = ("above the GPU's memory, but within the estimate's uncertainty"
               if r.oom_phase else "the GPU's memory is within the estimate's uncertainty"
               if r.high_bytes > r.gpu_memory_bytes else "fits the GPU but not the headroom")
        out.print(f"[yellow]TIGHT[/]: {peak} ({band}) in {r.peak_phase} on a {gpu} GPU, budget "
                  f"{fmt_bytes(r.budget_bytes)}: {why}; it may run out of memory.")
    else:
        out.print(f"[green]FITS[/]: {peak} ({band}) in {r.peak_phase}, "
                  f"{fmt_bytes(r.gpu_memory_bytes - r.device_peak_bytes)} free.")


def render_check(r: Any, done: list[str] = ()) -> None:  # type: ignore[assignment]
    from ._render import console, esc

    out = console()
    out.soft_wrap = True  # long lines stay whole: paths, keys and numbers are copied from here
    out.print(f"[bold]{r.label}[/] {esc(', '.join(r.files))} · {esc(r.model)} on {r.hardware}",
              soft_wrap=True)
    for warning in r.warnings:
        out.print(f"[yellow]warning:[/] {esc(warning)}", soft_wrap=True, highlight=False)
    read = (read_as(r.config, getattr(r, "lora_reach", "")) if r.task == "train"
            else r.task + " (not training)")
    out.print(f"read as: {read}", soft_wrap=True)
    phases = ", ".join(
        f"{p} {fmt_bytes(v)}" + (" [red]✗[/]" if v > r.gpu_memory_bytes else "")
        for p, v in r.phase_device_bytes.items())
    out.print(f"predicted per GPU (nvidia-smi): {phases}; GPU {fmt_bytes(r.gpu_memory_bytes)}, "
              f"budget {fmt_bytes(r.budget_bytes)}", soft_wrap=True)
    _verdict(r, out)
    if r.fix:
        f = r.fix
        changes = "; ".join(change_text(ch) for ch in f["changes"])
        tight = f["high_bytes"] > f["gpu_memory_bytes"]
        out.print(f"smallest change that {'keeps the budget' if tight else 'fits'} (same "
                  f"effective batch): {changes} — predicted "
                  f"{fmt_bytes(f['device_peak_bytes'])} ({f['peak_phase']}) of "
                  f"{fmt_bytes(f['budget_bytes'])}, {f['speed']['tokens_per_s']:,.0f} tokens/s",
                  soft_wrap=True)
        if tight:
            out.print(f"tight: its upper bound {fmt_bytes(f['high_bytes'])} is above the "
                      f"GPU's {fmt_bytes(f['gpu_memory_bytes'])}; no change this file can "
                      "express keeps the whole band on the card", soft_wrap=True)
        sys.stdout.flush()
        for diff in r.diffs.values():
            sys.stdout.write(diff)
        sys.stdout.flush()
    elif not r.within_budget and r.task == "train":
        out.print("no change this file can express fits; run `oomless plan` for other "
                  "methods, GPUs or sharding")
    for line in r.refused:
        out.print(f"[dim]not proposed: {esc(line)}[/]", soft_wrap=True, highlight=False)
    for line in done:
        out.print(esc(line), soft_wrap=True)
    for note in r.notes:
        out.print(f"[dim]note: {esc(note)}[/]", soft_wrap=True, highlight=False)
    for a in r.assumptions[:len(r.assumptions) - _planner_assumptions()]:
        out.print(f"[dim]assumption: {esc(a)}[/]", soft_wrap=True, highlight=False)


def _planner_assumptions() -> int:
    from ..planner.speed import ASSUMPTIONS

    return len(ASSUMPTIONS)


_SPARK = "▁▂▃▄▅▆▇█"


def reserved_sparkline(curve: list[list[int]], width: int = 60) -> str:
    """Reserved memory per step (the curve's peak_reserved column) as a text sparkline."""
    values = [row[3] for row in curve]
    if not values:
        return ""
    if len(values) > width:
        size = -(-len(values) // width)
        values = [max(values[i:i + size]) for i in range(0, len(values), size)]
    low, high = min(values), max(values)
    span = (high - low) or 1
    return "".join(_SPARK[min(7, int((v - low) * 8 / span))] for v in values)


def render_run(run: dict[str, Any]) -> None:
    """A run over variable-length data: high water, fragmentation, failure, fixes."""
    out = sys.stdout.write
    d, e = run["default"], run["expandable_segments"]
    lens = run["lengths"]
    out(f"\nRun over {run['steps']} steps ({run['order']} order; step lengths p50 {lens['p50']}"
        f" / p90 {lens['p90']} / max {lens['max']}; traced at "
        f"{', '.join(map(str, run['traced_lengths']))} tokens)\n")
    out(f"  reserved high-water {fmt_bytes(d['high_water_bytes'])} at step "
        f"{d['high_water_step']}; allocated peak {fmt_bytes(d['peak_allocated_bytes'])}; "
        f"reserved − allocated there {fmt_bytes(d['fragmentation_bytes'])} "
        f"({d['fragmentation_bytes'] / max(1, d['high_water_bytes']):.0%} of reserved; "
        f"{d['config']})\n")
    out(f"  reserved per step  {reserved_sparkline(d['curve'])}\n")
    if d["oom_step"] is not None:
        out(f"  OUT OF MEMORY at step {d['oom_step']}: {fmt_bytes(d['oom_request_bytes'])} "
            "could not be allocated even after the allocator freed its cache\n")
    if e is not d and e["config"] != d["config"]:
        state = "fits" if e["oom_step"] is None else f"out of memory at step {e['oom_step']}"
        out(f"  with expandable_segments:True: high-water {fmt_bytes(e['high_water_bytes'])} "
            f"at step {e['high_water_step']} — {state}\n")
    if run["capacity_bytes"] is not None:
        out(f"  verdict on the card ({fmt_bytes(run['capacity_bytes'])} for PyTorch): "
            f"{run['verdict']}\n")
    for fix in run["fixes"]:
        state = "fits" if fix["fits"] else f"still out of memory at step {fix['oom_step']}"
        out(f"  fix {fix['fix']}: {fix['change']} → high-water "
            f"{fmt_bytes(fix['high_water_bytes'])}, {state}\n")
