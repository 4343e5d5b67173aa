"""Plotly figures of a report (torch-free; plotly is imported by the caller's first use)."""

from __future__ import annotations

from typing import Any

from ..units import GiB
from .data import ReportData

_DASH = {"allocated": "solid", "reserved": "dash", "peak": "dot"}
_LAYOUT = dict(
    template="plotly_white",
    height=420,
    margin=dict(l=60, r=20, t=40, b=50),
    legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0),
)


def _go():
    from .plotly_dep import require_plotly

    return require_plotly().graph_objects


def _gib(values: list[int | None]) -> list[float | None]:
    return [None if v is None else v / GiB for v in values]


def _device_series(data: ReportData, key: str, device: int) -> list[int | None]:
    out: list[int | None] = []
    for s in data.steps:
        values = getattr(s, key)
        out.append(values[device] if device < len(values) else None)
    return out


def _capacity_line(fig: Any, capacity_bytes: int | None, label: str = "GPU memory") -> None:
    if capacity_bytes:
        fig.add_hline(y=capacity_bytes / GiB, line=dict(color="#b22222", width=1),
                      annotation_text=f"{label} {capacity_bytes / GiB:.1f} GiB",
                      annotation_position="top left")


def _event_markers(fig: Any, data: ReportData) -> None:
    for event in data.events:
        if event.step is None or event.is_routine:
            continue
        color = "#d62728" if event.is_oom else "#2ca02c"
        side = "top left" if event.is_oom else "top right"  # an OOM and its recovery share a step
        fig.add_vline(x=event.step, line=dict(color=color, width=1, dash="dash"),
                      annotation_text=event.kind, annotation_position=side,
                      annotation_font_color=color)


def memory_figure(data: ReportData) -> Any:
    """Allocated, reserved and peak per GPU over the steps, the prediction, the events."""
    go = _go()
    fig = go.Figure()
    steps = [s.step for s in data.steps]
    many = data.num_devices > 1
    for device in range(data.num_devices):
        for kind, dash in _DASH.items():
            series = _device_series(data, f"{kind}_bytes", device)
            if all(v is None for v in series):
                continue
            name = f"GPU {device} {kind}" if many else kind
            fig.add_trace(go.Scatter(x=steps, y=_gib(series), mode="lines+markers", name=name,
                                     line=dict(dash=dash), marker=dict(size=4)))
    host = [s.host_rss_bytes for s in data.steps]
    if any(v is not None for v in host):
        fig.add_trace(go.Scatter(x=steps, y=_gib(host), mode="lines", name="host RSS",
                                 line=dict(color="#7f7f7f")))
    simulated = [s.simulated_peak_bytes for s in data.steps]
    if any(v is not None for v in simulated):
        fig.add_trace(go.Scatter(x=steps, y=_gib(simulated), mode="lines+markers",
                                 name="simulated peak (CPU)", line=dict(dash="dot")))
    logged_prediction = [s.predicted_peak_bytes for s in data.steps]
    if any(v is not None for v in logged_prediction):
        fig.add_trace(go.Scatter(x=steps, y=_gib(logged_prediction), mode="lines",
                                 name="predicted peak", line=dict(color="#9467bd", width=3)))
    elif data.predicted_peak_bytes and steps:
        value = data.predicted_peak_bytes / GiB
        fig.add_trace(go.Scatter(x=[steps[0], steps[-1]], y=[value, value], mode="lines",
                                 name="predicted peak", line=dict(color="#9467bd", width=3)))
    _capacity_line(fig, data.gpu_memory_bytes)
    _event_markers(fig, data)
    fig.update_layout(xaxis_title="optimizer step",
                      yaxis_title="GiB", **_LAYOUT)
    return fig


def breakdown_figure(data: ReportData) -> Any:
    """Predicted memory per phase, stacked by category, next to the measured peak."""
    go = _go()
    estimate = data.estimate
    assert estimate is not None
    phases = list(estimate.breakdown)
    categories: list[str] = []
    for parts in estimate.breakdown.values():
        categories += [c for c in parts if c not in categories]
    fig = go.Figure()
    for category in categories:
        values = [estimate.breakdown[p].get(category, 0) / GiB for p in phases]
        fig.add_trace(go.Bar(x=[f"predicted {p}" for p in phases], y=values, name=category,
                             hovertemplate="%{x}<br>" + category + ": %{y:.2f} GiB<extra></extra>"))
    measured = data.measured_peak_bytes
    if measured is not None:
        label = data.measured_peak_label
        fig.add_trace(go.Bar(x=[label], y=[measured / GiB], name=label,
                             marker=dict(color="#333333"),
                             hovertemplate=label + ": %{y:.2f} GiB<extra></extra>"))
    fig.add_hline(y=estimate.device_peak_bytes / GiB, line=dict(color="#9467bd", dash="dot"),
                  annotation_text=f"predicted device peak {estimate.device_peak_bytes / GiB:.2f} GiB",
                  annotation_position="top left")
    _capacity_line(fig, data.gpu_memory_bytes)
    fig.update_layout(barmode="stack", yaxis_title="GiB", **_LAYOUT)
    return fig


def _timeline_x(points: list[dict[str, Any]]) -> tuple[list[Any], str]:
    for key, label in (("time_s", "seconds"), ("t", "time"), ("index", "event"), ("step", "step")):
        if all(key in p for p in points):
            return [p[key] for p in points], label
    return list(range(len(points))), "event"


def timeline_figure(data: ReportData) -> Any:
    """Allocated (and reserved) bytes over a traced step, coloured by phase."""
    go = _go()
    points = data.timeline
    x, x_label = _timeline_x(points)
    labels = [str(p.get("phase") or p.get("label") or p.get("name") or "") for p in points]
    fig = go.Figure()
    for key in ("allocated_bytes", "reserved_bytes"):
        ys = [p.get(key) for p in points]
        if all(v is None for v in ys):
            continue
        fig.add_trace(go.Scatter(x=x, y=_gib(ys), mode="lines", name=key.removesuffix("_bytes"),
                                 text=labels, line=dict(shape="hv"),
                                 hovertemplate="%{text}<br>%{y:.3f} GiB<extra></extra>"))
    for start, end, phase in _phase_spans(x, labels):
        fig.add_vrect(x0=start, x1=end, annotation_text=phase, annotation_position="top left",
                      fillcolor="#1f77b4", opacity=0.05, line_width=0)
    fig.update_layout(xaxis_title=x_label, yaxis_title="GiB", **_LAYOUT)
    return fig


def _phase_spans(x: list[Any], labels: list[str]) -> list[tuple[Any, Any, str]]:
    """(start, end, phase) of each run of one phase; a span ends where the next begins."""
    spans: list[tuple[Any, Any, str]] = []
    for i, label in enumerate(labels):
        end = x[i + 1] if i + 1 < len(x) else x[i]
        if label and spans and spans[-1][2] == label:
            spans[-1] = (spans[-1][0], end, label)
        elif label:
            spans.append((x[i], end, label))
    return spans if len(spans) <= 12 else []


def training_figure(data: ReportData) -> Any:
    """Loss and throughput over the steps."""
    go = _go()
    steps = [s.step for s in data.steps]
    fig = go.Figure()
    loss = [s.loss for s in data.steps]
    if any(v is not None for v in loss):
        fig.add_trace(go.Scatter(x=steps, y=loss, mode="lines+markers", name="loss"))
    speed = [s.tokens_per_s for s in data.steps]
    if any(v is not None for v in speed):
        fig.add_trace(go.Scatter(x=steps, y=speed, mode="lines", name="tokens/s", yaxis="y2"))
    fig.update_layout(xaxis_title="optimizer step",
                      yaxis=dict(title="loss"),
                      yaxis2=dict(title="tokens/s", overlaying="y", side="right"), **_LAYOUT)
    return fig


def run_figure(data: ReportData) -> Any:
    """The predicted run over the data (estimate --data/--lengths): reserved and
    allocated per step, with expandable segments, and the measured reserved if logged."""
    go = _go()
    run = data.run or {}
    fig = go.Figure()
    # curve rows: step, length, peak allocated, peak reserved, reserved at the step's end
    for key, label, col, dash in (("default", "predicted reserved", 3, "solid"),
                                  ("default", "predicted allocated", 2, "dot"),
                                  ("expandable_segments", "reserved, expandable_segments", 3,
                                   "dash")):
        rows = (run.get(key) or {}).get("curve") or []
        if key == "expandable_segments" and run.get(key, {}).get("config") == \
                run.get("default", {}).get("config"):
            continue
        fig.add_trace(go.Scatter(x=[r[0] for r in rows], y=_gib([r[col] for r in rows]),
                                 mode="lines", name=label, line=dict(shape="hv", dash=dash),
                                 text=[f"length {r[1]}" for r in rows],
                                 hovertemplate="step %{x} · %{text}<br>%{y:.2f} GiB<extra></extra>"))
    if data.steps and data.num_devices:
        fig.add_trace(go.Scatter(x=[s.step for s in data.steps],
                                 y=_gib(_device_series(data, "reserved_bytes", 0)),
                                 mode="lines", name="measured reserved",
                                 line=dict(color="#333333")))
    oom = (run.get("default") or {}).get("oom_step")
    if oom is not None:
        fig.add_vline(x=oom, line=dict(color="#d62728", dash="dash"),
                      annotation_text="predicted OOM", annotation_font_color="#d62728")
    _capacity_line(fig, run.get("capacity_bytes"), "memory PyTorch may reserve")
    fig.update_layout(xaxis_title="optimizer step", yaxis_title="GiB", **_LAYOUT)
    return fig


def has_training_metrics(data: ReportData) -> bool:
    return any(s.loss is not None or s.tokens_per_s is not None for s in data.steps)
