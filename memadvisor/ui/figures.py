"""Plotly figures of memory data: the one source of charts for the HTML report and the
dashboard, so both draw the same thing the same way.

Functions take plain data (a ``StepTimeline``, dicts from ``summarize``/``compare``) and
return ``go.Figure``; none reads files.  No dash import here (the report must not need a
server).  Every string that came from the user's code -- module, file, plan names -- goes
through ``label()``: plotly draws text as markup, and it turns entities back into the
characters, so escaped names display as written and never as tags.

No remote fonts: the font family is the system's own stack.
"""
from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..trace import schema
from ..units import format_bytes

if TYPE_CHECKING:
    from ..report.timeline import StepTimeline

FONT_FAMILY = ('system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, '
               '"Noto Sans", "Liberation Sans", sans-serif')
CATEGORY_COLORS = {
    schema.PARAMETER: "#4c78a8", schema.BUFFER: "#9ecae9", schema.GRADIENT: "#f58518",
    schema.OPTIMIZER_STATE: "#e45756", schema.ACTIVATION: "#54a24b",
    schema.AUTOCAST_WEIGHT: "#72b7b2", schema.TEMPORARY: "#b279a2", schema.INPUT: "#eeca3b",
    schema.OTHER: "#bab0ac",
}
PHASE_COLORS = {schema.FORWARD: "rgba(84,162,75,0.10)", schema.BACKWARD: "rgba(245,133,24,0.10)",
                schema.OPTIMIZER: "rgba(228,87,86,0.10)"}
BUDGET_COLOR = "#d62728"
TOP_LEVEL = "(top level)"


def label(text: Any) -> str:
    """A user-derived string made safe for plotly text, hover and tick labels."""
    return html.escape(str(text))


def byte_scale(max_bytes: float) -> tuple[str, int]:
    """The binary unit a chart's axis is drawn in: ('MiB', 1048576)."""
    for unit, divisor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if max_bytes >= divisor:
            return unit, divisor
    return "B", 1


def _scaled(values: Sequence[float] | np.ndarray, divisor: int) -> np.ndarray:
    # float32 halves the embedded size; 7 significant digits is beyond what a chart shows
    return (np.asarray(values, dtype=np.float64) / divisor).astype(np.float32)


def _layout(**overrides) -> dict[str, Any]:
    layout = dict(template="none", font=dict(family=FONT_FAMILY, size=12),
                  margin=dict(l=60, r=20, t=40, b=50), paper_bgcolor="white",
                  plot_bgcolor="white", hoverlabel=dict(font=dict(family=FONT_FAMILY)))
    layout.update(overrides)
    return layout


def _budget_line(fig: go.Figure, budget_bytes: int | None, divisor: int, **where) -> None:
    if budget_bytes:
        fig.add_hline(y=budget_bytes / divisor, line=dict(color=BUDGET_COLOR, dash="dash",
                                                          width=1.5),
                      annotation_text=f"budget {format_bytes(budget_bytes)}",
                      annotation_position="top left",
                      annotation_font=dict(color=BUDGET_COLOR), **where)


def timeline_figure(timeline: "StepTimeline", *, budget_bytes: int | None = None,
                    title: str | None = None) -> go.Figure:
    """Live memory during a step stacked by category (one trace per category), phases as
    bands, the peak marked, the budget as a dashed line."""
    top = max(float(timeline.peak_bytes), float(budget_bytes or 0))
    unit, divisor = byte_scale(top)
    x = np.asarray(timeline.time_ms, dtype=np.float32)
    fig = go.Figure()
    for category, values in timeline.by_category.items():
        color = CATEGORY_COLORS.get(category, "#7f7f7f")
        fig.add_trace(go.Scatter(
            x=x, y=_scaled(values, divisor), name=label(category), mode="lines",
            stackgroup="live", line=dict(width=0.5, color=color), fillcolor=color,
            hovertemplate=f"{label(category)}: %{{y:.3f}} {unit}<extra></extra>"))
    for band in timeline.phases:
        fig.add_vrect(x0=band.start_ms, x1=band.end_ms, fillcolor=PHASE_COLORS[band.phase],
                      line_width=0, layer="below", annotation_text=band.phase,
                      annotation_position="top left", annotation_font=dict(size=10,
                                                                           color="#555"))
    peak = timeline.peak or {}
    where = " · ".join(p for p in (label(peak.get("phase", "")),
                                   label(peak.get("module") or TOP_LEVEL),
                                   label(peak.get("op", ""))) if p)
    fig.add_annotation(x=float(timeline.peak_ms), y=timeline.peak_bytes / divisor,
                       text=f"<b>peak {format_bytes(timeline.peak_bytes)}</b><br>{where}",
                       showarrow=True, arrowhead=2, ax=40, ay=-40, bgcolor="white",
                       bordercolor="#333", borderwidth=1, font=dict(size=11))
    _budget_line(fig, budget_bytes, divisor)
    step = "the whole run" if timeline.step is None else f"step {timeline.step}"
    fig.update_layout(**_layout(
        title=dict(text=label(title or f"Live memory during {step}"), x=0.01),
        xaxis=dict(title=dict(text="time since the step began (ms)"), showgrid=True,
                   gridcolor="#eee", zeroline=False),
        yaxis=dict(title=dict(text=f"live memory ({unit})"), gridcolor="#eee",
                   rangemode="tozero"),
        # the x axis is time, so one slow op leaves a wide gap between events: with
        # Plotly's default 20 px reach a hover (and so a click) inside such a gap finds
        # nothing; an unlimited reach answers every point with the nearest event
        hovermode="x unified", hoverdistance=-1,
        legend=dict(orientation="h", y=-0.2, traceorder="normal"),
        height=460))
    return fig


def breakdown_figure(by_category: dict[str, int], *, title: str = "At the peak, by category"
                     ) -> go.Figure:
    """Bytes per category alive at the peak, largest first."""
    items = sorted(by_category.items(), key=lambda kv: -kv[1])
    total = max(sum(by_category.values()), 1)
    unit, divisor = byte_scale(max((v for _, v in items), default=0))
    fig = go.Figure(go.Bar(
        y=[label(c) for c, _ in items], x=_scaled([v for _, v in items], divisor),
        orientation="h", marker_color=[CATEGORY_COLORS.get(c, "#7f7f7f") for c, _ in items],
        text=[f"{format_bytes(v)} ({100 * v / total:.0f}%)" for _, v in items],
        textposition="auto", hovertemplate=f"%{{y}}: %{{x:.3f}} {unit}<extra></extra>"))
    fig.update_layout(**_layout(
        title=dict(text=label(title), x=0.01), height=80 + 32 * max(len(items), 1),
        xaxis=dict(title=dict(text=unit), gridcolor="#eee"),
        yaxis=dict(autorange="reversed", automargin=True), showlegend=False))
    return fig


def modules_figure(modules: Iterable[dict[str, Any]], *,
                   title: str = "Activation bytes per module (when activations peak)"
                   ) -> go.Figure:
    """Horizontal bars of ``[{'module', 'bytes'}]`` (e.g. ``top_activation_modules``)."""
    rows = list(modules)
    unit, divisor = byte_scale(max((r["bytes"] for r in rows), default=0))
    fig = go.Figure(go.Bar(
        y=[label(r["module"] or TOP_LEVEL) for r in rows],
        x=_scaled([r["bytes"] for r in rows], divisor), orientation="h",
        marker_color=CATEGORY_COLORS[schema.ACTIVATION],
        text=[format_bytes(r["bytes"]) for r in rows], textposition="auto",
        hovertemplate=f"%{{y}}: %{{x:.3f}} {unit}<extra></extra>"))
    fig.update_layout(**_layout(
        title=dict(text=label(title), x=0.01), height=90 + 26 * max(len(rows), 1),
        xaxis=dict(title=dict(text=unit), gridcolor="#eee"),
        yaxis=dict(autorange="reversed", automargin=True), showlegend=False))
    return fig


def plan_timeline_figure(measured: "StepTimeline", predicted: Sequence[tuple[float, int]],
                         plan_name: str, *, budget_bytes: int | None = None) -> go.Figure:
    """The measured step's live bytes beside a plan's predicted ones, on one byte scale.

    Both are drawn against the event position in the step: the simulator replays the
    measured step's events, so the two x axes line up."""
    predicted_x = np.asarray([p[0] for p in predicted], dtype=np.float32)
    predicted_y = np.asarray([p[1] for p in predicted], dtype=np.float64)
    top = max(float(measured.peak_bytes), float(predicted_y.max(initial=0)),
              float(budget_bytes or 0))
    unit, divisor = byte_scale(top)
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=("measured", f"predicted: {label(plan_name)}"))
    fig.add_trace(go.Scatter(x=np.asarray(measured.positions, dtype=np.float32),
                             y=_scaled(measured.total_bytes, divisor), mode="lines",
                             name="measured", line=dict(color="#4c78a8"),
                             hovertemplate=f"%{{y:.3f}} {unit}<extra>measured</extra>"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=predicted_x, y=_scaled(predicted_y, divisor), mode="lines",
                             name="predicted", line=dict(color="#54a24b"),
                             hovertemplate=f"%{{y:.3f}} {unit}<extra>predicted</extra>"),
                  row=1, col=2)
    for col in (1, 2):
        _budget_line(fig, budget_bytes, divisor, row=1, col=col)
        fig.update_xaxes(title_text="event in the step", row=1, col=col, gridcolor="#eee")
    fig.update_yaxes(title_text=f"live memory ({unit})", row=1, col=1, rangemode="tozero",
                     gridcolor="#eee")
    fig.update_layout(**_layout(height=360, showlegend=False))
    return fig


def comparison_figure(result: dict[str, Any], *, a_name: str = "A", b_name: str = "B"
                      ) -> go.Figure:
    """Bytes at the peak per category, A beside B (``compare_traces``'s result)."""
    rows = result["by_category"]
    top = max([r["a_peak_bytes"] for r in rows] + [r["b_peak_bytes"] for r in rows] + [0])
    unit, divisor = byte_scale(top)
    names = [label(r["name"]) for r in rows]
    fig = go.Figure()
    for side, name, color in (("a", a_name, "#9ecae9"), ("b", b_name, "#4c78a8")):
        fig.add_trace(go.Bar(x=names, y=_scaled([r[f"{side}_peak_bytes"] for r in rows],
                                                 divisor),
                             name=label(name), marker_color=color,
                             hovertemplate=f"%{{x}}: %{{y:.3f}} {unit}<extra>{label(name)}"
                                           f"</extra>"))
    fig.update_layout(**_layout(
        title=dict(text="At the peak, by category", x=0.01), barmode="group", height=360,
        yaxis=dict(title=dict(text=unit), gridcolor="#eee"),
        legend=dict(orientation="h", y=-0.25)))
    return fig
