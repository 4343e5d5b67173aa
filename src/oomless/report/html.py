"""One self-contained HTML file: plotly.js inline (no CDN), works offline."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..fileio import ORIG, check_output_file, ensure_folder, keep_orig, refuse_inputs, write_atomic
from ..units import fmt_bytes, fmt_count
from . import figures
from .data import ReportData

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto;
       max-width: 1200px; padding: 16px 24px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.source { color: #666; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.oom td { background: #fde8e8; } .ok { color: #1a7f37; } .bad { color: #b22222; }
.chart { border: 1px solid #eee; margin: 8px 0; }
"""


def _plotly_js() -> str:
    from .plotly_dep import require_plotly

    require_plotly()
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _chart(fig: Any, div_id: str) -> str:
    from plotly.io import to_html

    body = to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id,
                   config={"displaylogo": False, "responsive": True})
    return f'<div class="chart">{body}</div>'


def _table(rows: list[tuple[str, str]], header: tuple[str, str] | None = None) -> str:
    head = f"<tr><th>{html.escape(header[0])}</th><th>{html.escape(header[1])}</th></tr>" \
        if header else ""
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                   for k, v in rows)
    return f"<table>{head}{body}</table>"


def _flatten(config: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += _flatten(value, name + ".")
        else:
            rows.append((name, str(value)))
    return rows


def _summary(data: ReportData) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    est = data.estimate
    if est is not None:
        rows += [
            ("model", est.model),
            ("parameters", f"{fmt_count(est.param_count)} ({fmt_count(est.trainable_params)} "
                           "trainable)"),
            ("predicted peak (allocated)", f"{fmt_bytes(est.peak_allocated_bytes)} in "
                                           f"{est.peak_phase}"),
            ("predicted peak (reserved)", fmt_bytes(est.peak_reserved_bytes)),
            ("predicted device peak (nvidia-smi)", fmt_bytes(est.device_peak_bytes)),
            ("estimate method", est.method),
        ]
    if data.gpu_memory_bytes:
        rows.append(("GPU memory", fmt_bytes(data.gpu_memory_bytes)))
    if est is not None and est.headroom_bytes is not None:
        verdict = "fits" if est.fits else "does not fit"
        rows.append(("prediction", f"{verdict}: {fmt_bytes(abs(est.headroom_bytes))} "
                                   f"{'free' if est.fits else 'over'} on {est.gpu}"))
    if data.steps:
        rows.append(("logged steps", f"{len(data.steps)} (step {data.steps[0].step} to "
                                     f"{data.steps[-1].step})"))
    measured = data.measured_peak_bytes
    if measured is not None:
        rows.append((data.measured_peak_label, fmt_bytes(measured)))
    predicted = data.predicted_peak_bytes
    if measured is not None and predicted:
        rows.append((f"{data.measured_peak_label} / predicted", f"{measured / predicted:.2f}"))
    ooms = sum(1 for e in data.events if e.is_oom)
    rows.append(("OOM events", str(ooms)))
    return rows


def _events_table(data: ReportData) -> str:
    if not data.events:
        return "<p>No OOM or recovery events were logged.</p>"
    rows = []
    for e in data.events:
        cls = ' class="oom"' if e.is_oom else ""
        details = ", ".join(f"{k}={v}" for k, v in e.data.items())
        details = details if len(details) <= 300 else details[:297] + "..."
        rows.append(f"<tr{cls}><td>{'' if e.step is None else e.step}</td>"
                    f"<td>{html.escape(e.kind)}</td><td>{html.escape(e.message)}</td>"
                    f"<td>{html.escape(details)}</td></tr>")
    return ("<table><tr><th>step</th><th>event</th><th>message</th><th>details</th></tr>"
            + "".join(rows) + "</table>")


def _sections(data: ReportData) -> list[str]:
    parts = [f"<h2>Summary</h2>{_table(_summary(data))}"]
    if data.steps:
        parts.append("<h2>Memory over the steps</h2>"
                     + _chart(figures.memory_figure(data), "memory-steps"))
    if data.estimate is not None:
        phase = html.escape(data.estimate.peak_phase)
        measured = f" and {data.measured_peak_label}" if data.measured_peak_bytes else ""
        parts.append(f"<h2>Predicted breakdown (peak phase: {phase}){measured}</h2>"
                     + _chart(figures.breakdown_figure(data), "breakdown"))
    if data.run:
        parts.append("<h2>Predicted run over the data (caching allocator, per step)</h2>"
                     + f"<p>{html.escape(_run_summary(data.run))}</p>"
                     + _chart(figures.run_figure(data), "run"))
    parts.append(f"<h2>OOM and recovery events</h2>{_events_table(data)}")
    if data.timeline:
        parts.append("<h2>Trace timeline</h2>"
                     + _chart(figures.timeline_figure(data), "timeline"))
    if figures.has_training_metrics(data):
        parts.append("<h2>Loss and throughput</h2>"
                     + _chart(figures.training_figure(data), "training"))
    if data.config:
        parts.append("<h2>Configuration</h2>"
                     + _table(_flatten(data.config), ("key", "value")))
    if data.estimate is not None and data.estimate.assumptions:
        items = "".join(f"<li>{html.escape(a)}</li>" for a in data.estimate.assumptions)
        parts.append(f"<h2>Assumptions of the estimate</h2><ul>{items}</ul>")
    return parts


def _run_summary(run: dict[str, Any]) -> str:
    d = run["default"]
    failure = (f"fails at step {d['oom_step']} even after freeing the cache"
               if d["oom_step"] is not None else "no failure")
    return (f"{run['steps']} steps, {run['order']} order, {run.get('source', '')}: reserved "
            f"high-water {d['high_water_bytes'] / 2**30:.2f} GiB at step {d['high_water_step']}"
            f", reserved − allocated there {d['fragmentation_bytes'] / 2**30:.2f} GiB, "
            f"{failure}; verdict: {run['verdict']}")


def render_html(data: ReportData) -> str:
    """The whole report as one HTML document (plotly.js embedded once)."""
    title = html.escape(data.title)
    body = "\n".join(_sections(data))
    return (
        f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">{GENERATOR}"
        f"<title>{title}</title><style>{_STYLE}</style>"
        f"<script type=\"text/javascript\">{_plotly_js()}</script></head>\n<body>"
        f"<h1>{title}</h1><div class=\"source\">{html.escape(data.source)}</div>\n"
        f"{body}\n</body></html>\n"
    )


GENERATOR = '<meta name="generator" content="oomless report">'


def is_oomless_report(path: Path) -> bool:
    """Whether ``path`` is a report this command wrote (its generator tag near the top)."""
    try:
        with open(path, "rb") as fh:
            return GENERATOR.encode() in fh.read(4096)
    except OSError:
        return False


def write_report(data: ReportData, out: str | Path, force: bool = False,
                 inputs: tuple[Path, ...] = ()) -> Path:
    """Render and write atomically (oomless.fileio). Never over an input; an existing
    file that is not an oomless report is replaced only with ``force`` (kept as .orig)."""
    out = check_output_file(out)
    refuse_inputs(out, inputs, "--out")
    if out.exists() and not is_oomless_report(out):
        if not force:
            raise OutputError(f"'{out}' exists and is not an oomless report; choose another "
                              "--out, or pass --force (it is then kept as "
                              f"{out.name}{ORIG})")
        keep_orig(out)
    ensure_folder(out.parent, "--out")
    return write_atomic(out, render_html(data))
