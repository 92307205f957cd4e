"""The Dash app: the page's layout and the wiring of its callbacks to ``views.Dashboard``.

The only module that builds Dash components.  Every callback body is a ``Dashboard``
method (tests call those directly); here each is bound to component ids.  Dash serves
its own JavaScript from the package (``serve_locally``), so the page works offline.
"""
from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, dash_table, dcc, html

from ..units import format_bytes
from . import data as ui_data
from . import figures
from .views import Dashboard

PAGE_STYLE = {"fontFamily": figures.FONT_FAMILY, "maxWidth": "1400px", "margin": "0 auto",
              "padding": "12px 20px", "color": "#222"}
SECTION_STYLE = {"borderTop": "1px solid #ddd", "paddingTop": "8px", "marginTop": "16px"}
META_STYLE = {"color": "#555", "fontSize": "13px"}
TABLE_STYLE = dict(
    style_table={"overflowX": "auto", "maxHeight": "420px", "overflowY": "auto"},
    style_cell={"fontFamily": figures.FONT_FAMILY, "fontSize": "13px", "textAlign": "left",
                "padding": "3px 8px", "whiteSpace": "normal", "height": "auto",
                "maxWidth": "420px"},
    style_header={"fontWeight": "600", "backgroundColor": "#f4f4f4"},
    style_cell_conditional=[{"if": {"column_id": c}, "textAlign": "right"}
                            for c in ("size", "peak", "reserved", "step_time", "count")],
)
GRAPH_CONFIG = {"displaylogo": False, "responsive": True}

MOMENT_COLUMNS = [("size", "bytes"), ("category", "category"), ("op", "op"),
                  ("module", "module"), ("dtype", "dtype"), ("shape", "shape"),
                  ("source", "source file:line"), ("function", "function")]
PLAN_COLUMNS = [("plan", "plan"), ("peak", "predicted peak"), ("reserved", "reserved"),
                ("step_time", "step time"), ("fits", "fits?"), ("changes", "what changes")]
SITE_COLUMNS = [("size", "bytes"), ("count", "count"), ("category", "category"), ("op", "op"),
                ("module", "module"), ("source", "source file:line"), ("code", "code")]


def _columns(pairs) -> list[dict[str, str]]:
    return [{"id": key, "name": name} for key, name in pairs]


def _section(title: str, *children, section_id: str) -> html.Section:
    return html.Section([html.H2(title, style={"fontSize": "18px"}), *children],
                        id=section_id, style=SECTION_STYLE)


def _controls(board: Dashboard, budget_text: str) -> html.Div:
    label_style = {"marginRight": "6px", "fontWeight": "600"}
    return html.Div([
        html.Label("step", htmlFor="step", style=label_style),
        html.Div(dcc.Dropdown(id="step", options=ui_data.step_options(board.data),
                              value=board.default_step(), clearable=False),
                 style={"width": "300px", "display": "inline-block", "marginRight": "24px",
                        "verticalAlign": "middle"}),
        html.Label("budget per GPU", htmlFor="budget", style=label_style),
        dcc.Input(id="budget", type="text", value=budget_text, placeholder="e.g. 24GiB",
                  debounce=True, style={"width": "110px", "marginRight": "24px"}),
        html.Label("GPUs", htmlFor="gpus", style=label_style),
        dcc.Input(id="gpus", type="number", value=board.num_gpus, min=1, step=1,
                  debounce=True, style={"width": "70px", "marginRight": "24px"}),
        html.Span(f"target: {board.advisor.hardware.describe()}", style=META_STYLE),
    ], style={"display": "flex", "alignItems": "center", "flexWrap": "wrap", "gap": "4px"})


def _sites_section(board: Dashboard) -> html.Section:
    caption, rows, modules = board.sites_view(board.default_step())
    return _section(
        "Largest allocation sites alive at the peak",
        html.P(caption, id="sites-caption", style=META_STYLE),
        dash_table.DataTable(id="sites-table", columns=_columns(SITE_COLUMNS), data=rows,
                             **TABLE_STYLE),
        html.H3("Activations per module", style={"fontSize": "16px"}),
        dcc.Graph(id="modules", figure=modules, config=GRAPH_CONFIG),
        section_id="sites")


def _comparison_section(board: Dashboard) -> html.Section | None:
    c = board.data.comparison
    if c is None:
        return None
    ratio = c["peak_change_ratio"]
    pct = f" ({100 * ratio:+.1f}%)" if ratio is not None else ""
    change = c["peak_change_bytes"]
    head = (f"Baseline {board.baseline_name} step {c['a']['step']}: peak "
            f"{format_bytes(c['a']['peak_bytes'])} -> this trace "
            f"{format_bytes(c['b']['peak_bytes'])}, {'+' if change >= 0 else ''}"
            f"{format_bytes(change)}{pct}.")
    columns = [("name", ""), ("a_peak", "baseline at peak"), ("b_peak", "now at peak"),
               ("peak_change", "change"), ("a_allocated", "baseline allocated"),
               ("b_allocated", "now allocated"), ("allocated_change", "change")]

    def rows_of(rows):
        return [{"name": r["name"], "a_peak": format_bytes(r["a_peak_bytes"]),
                 "b_peak": format_bytes(r["b_peak_bytes"]),
                 "peak_change": format_bytes(r["peak_change_bytes"]),
                 "a_allocated": format_bytes(r["a_allocated_bytes"]),
                 "b_allocated": format_bytes(r["b_allocated_bytes"]),
                 "allocated_change": format_bytes(r["allocated_change_bytes"])}
                for r in rows]

    return _section(
        "Against the baseline", html.P(head),
        dcc.Graph(id="comparison", config=GRAPH_CONFIG,
                  figure=figures.comparison_figure(c, a_name="baseline",
                                                   b_name="this trace")),
        dash_table.DataTable(id="compare-categories", columns=_columns(columns),
                             data=rows_of(c["by_category"]), **TABLE_STYLE),
        html.H3("Modules that changed most", style={"fontSize": "16px"}),
        dash_table.DataTable(id="compare-modules", columns=_columns(columns),
                             data=rows_of(c["by_module"]), **TABLE_STYLE),
        section_id="comparison-section")


def layout(board: Dashboard, budget_text: str = "") -> html.Div:
    meta = board.data.trace.meta
    summary = board.data.summary
    sections = [
        html.H1("memadvisor", style={"fontSize": "22px", "marginBottom": "2px"}),
        html.Div(f"{board.trace_name}: {meta.script or '?'} on {meta.device or '?'}, "
                 f"{summary['events']:,} events, {meta.steps_completed} complete steps, "
                 f"status {meta.status}", style=META_STYLE),
        html.P(board.headline_text(budget_text, board.num_gpus), id="headline",
               style={"fontSize": "16px", "fontWeight": "600"}),
        _controls(board, budget_text),
        _section("Memory timeline",
                 html.P(id="timeline-caption", style=META_STYLE),
                 dcc.Loading(dcc.Graph(id="timeline", config=GRAPH_CONFIG)),
                 section_id="timeline-section"),
        _section("What is alive at this moment",
                 html.P(id="moment-caption"),
                 html.Div([
                     html.Div(dcc.Graph(id="moment-breakdown", config=GRAPH_CONFIG),
                              style={"flex": "1 1 380px", "minWidth": "320px"}),
                     html.Div(dash_table.DataTable(
                         id="moment-table", columns=_columns(MOMENT_COLUMNS),
                         page_size=25, sort_action="native", **TABLE_STYLE),
                         style={"flex": "2 1 640px", "minWidth": "480px"}),
                 ], style={"display": "flex", "flexWrap": "wrap", "gap": "12px"}),
                 section_id="moment-section"),
        _sites_section(board),
        _section("Plans",
                 html.P(id="plan-message", style=META_STYLE),
                 dcc.Loading(dash_table.DataTable(
                     id="plan-table", columns=_columns(PLAN_COLUMNS), data=[],
                     row_selectable="single", selected_rows=[], **TABLE_STYLE)),
                 dcc.Loading(html.Div(id="plan-detail")),
                 section_id="plans"),
    ]
    comparison = _comparison_section(board)
    if comparison is not None:
        sections.append(comparison)
    return html.Div(sections, style=PAGE_STYLE)


def build_app(board: Dashboard, budget_text: str = "") -> dash.Dash:
    """The Dash app for one trace (not started: ``server.serve`` runs it)."""
    app = dash.Dash(__name__, title="memadvisor", serve_locally=True,
                    update_title=None)
    app.layout = layout(board, budget_text)
    register_callbacks(app, board)
    return app


def register_callbacks(app: dash.Dash, board: Dashboard) -> None:
    @app.callback(Output("timeline", "figure"), Output("timeline-caption", "children"),
                  Input("step", "value"), Input("budget", "value"),
                  Input("timeline", "clickData"))
    def _timeline(step, budget, click_data):
        # a new step has no selected moment yet: the last click belonged to the old figure
        if dash.ctx.triggered_id == "step":
            click_data = None
        return board.timeline_view(step, budget, click_data)

    @app.callback(Output("moment-caption", "children"), Output("moment-breakdown", "figure"),
                  Output("moment-table", "data"),
                  Input("step", "value"), Input("timeline", "clickData"))
    def _moment(step, click_data):
        # a new step starts at its peak: the last click belonged to the old figure
        if dash.ctx.triggered_id == "step":
            click_data = None
        return board.moment_view(step, click_data)

    @app.callback(Output("sites-caption", "children"), Output("sites-table", "data"),
                  Output("modules", "figure"), Input("step", "value"),
                  prevent_initial_call=True)
    def _sites(step):
        return board.sites_view(step)

    @app.callback(Output("headline", "children"), Input("budget", "value"),
                  Input("gpus", "value"))
    def _headline(budget, gpus):
        return board.headline_text(budget, gpus)

    @app.callback(Output("plan-table", "data"), Output("plan-message", "children"),
                  Output("plan-table", "selected_rows"),
                  Input("budget", "value"), Input("gpus", "value"))
    def _plans(budget, gpus):
        return board.plans_view(budget, gpus)

    @app.callback(Output("plan-detail", "children"), Input("plan-table", "selected_rows"),
                  Input("plan-table", "data"), State("budget", "value"))
    def _plan_detail(selected_rows, rows, budget):
        return plan_detail_children(*board.plan_view(selected_rows, rows, budget))


def plan_detail_children(fig: Any, lines: list[str]) -> list:
    children = []
    if fig is not None:
        children.append(dcc.Graph(id="plan-timeline", figure=fig, config=GRAPH_CONFIG))
    children.append(html.Ul([html.Li(line) for line in lines], id="plan-explanation",
                            style={"fontSize": "13px"}))
    return children
