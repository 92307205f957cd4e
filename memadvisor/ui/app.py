"""The Dash app: the page's layout and the wiring of its callbacks to ``views.Dashboard``.

The only module that builds Dash components.  Every callback body is a ``Dashboard``
method (tests call those directly); here each is bound to component ids.  Dash serves
its own JavaScript from the package (``serve_locally``), so the page works offline.
"""
from __future__ import annotations

from typing import Any

import dash
import dash_ag_grid as dag
from dash import Input, Output, Patch, State, dcc, html, no_update

from ..units import format_bytes
from . import clicks, figures
from . import data as ui_data
from .views import Dashboard

PAGE_STYLE = {"fontFamily": figures.FONT_FAMILY, "maxWidth": "1400px", "margin": "0 auto",
              "padding": "12px 20px", "color": "#222"}
SECTION_STYLE = {"borderTop": "1px solid #ddd", "paddingTop": "8px", "marginTop": "16px"}
META_STYLE = {"color": "#555", "fontSize": "13px"}
#: byte counts stay numbers in the grid (so they sort as numbers) and are shown in KiB/MiB
BYTES_FORMAT = {"function": (
    "params.value == null ? '' : Math.abs(params.value) >= 1073741824 ? "
    "(params.value / 1073741824).toFixed(2) + ' GiB' : Math.abs(params.value) >= 1048576 ? "
    "(params.value / 1048576).toFixed(2) + ' MiB' : Math.abs(params.value) >= 1024 ? "
    "(params.value / 1024).toFixed(1) + ' KiB' : params.value + ' B'")}
BYTE_FIELDS = frozenset({"bytes", "peak_bytes", "reserved_bytes", "bytes_saved"})
CHANGE_FIELDS = ("a_peak", "b_peak", "peak_change", "a_allocated", "b_allocated",
                 "allocated_change")
BYTE_FIELDS = BYTE_FIELDS | set(CHANGE_FIELDS)
RIGHT = BYTE_FIELDS | {"count", "step_time_factor", "ms_per_step"}
WIDE = frozenset({"plan", "changes", "code", "source", "module", "function", "name", "title",
                  "reason"})
GRAPH_CONFIG = {"displaylogo": False, "responsive": True}
#: how long a request for the plan table waits for the background ranking before the page
#: shows "ranking ..." and asks again every ``PLAN_POLL_MS`` (``plan-poll``), each poll
#: waiting less than that (the interval does not wait for the last poll's answer)
PLAN_WAIT_S = 5.0
PLAN_POLL_MS = 250
PLAN_POLL_WAIT_S = 0.2
#: the advice panel the same way: its first request waits ``ADVICE_WAIT_S`` (the worker
#: makes it after the first ranking), then it is asked every ``ADVICE_POLL_MS``
ADVICE_WAIT_S = 1.0
ADVICE_POLL_MS = 500
ADVICE_POLL_WAIT_S = 0.1
#: a clientside callback that passes its input on once the browser has drawn a frame (the
#: page's answer so far on screen) and run what that frame scheduled
AFTER_NEXT_FRAME = """async function(value) {
    await new Promise(done => requestAnimationFrame(() => setTimeout(done, 0)));
    return value;
}"""

MOMENT_COLUMNS = [("bytes", "bytes"), ("category", "category"), ("op", "op"),
                  ("module", "module"), ("dtype", "dtype"), ("shape", "shape"),
                  ("source", "source file:line"), ("function", "function")]
PLAN_COLUMNS = [("plan", "plan"), ("peak_bytes", "predicted peak"),
                ("reserved_bytes", "reserved"), ("step_time_factor", "step time (x baseline)"),
                ("fits", "fits?"), ("changes", "what changes")]
ADVICE_COLUMNS = [("group", "status"), ("kind", "kind"), ("title", "change"),
                  ("bytes_saved", "saves"), ("ms_per_step", "ms per step"),
                  ("source", "where"), ("reason", "why")]
SITE_COLUMNS = [("bytes", "bytes"), ("count", "count"), ("category", "category"), ("op", "op"),
                ("module", "module"), ("source", "source file:line"), ("code", "code")]


def _grid(grid_id: str, pairs, rows=None, *, page_size: int | None = None,
          select_by: str | None = None, row_id: str | None = None, wrap: bool = True,
          height: str = "auto") -> dag.AgGrid:
    """A sortable grid (dash-ag-grid: Dash's own DataTable is deprecated).  ``select_by``:
    single-row selection by clicking, rows identified by that field; ``row_id``: rows
    identified by that (string) field only, so a new rowData redraws only the rows that
    changed; ``wrap``: long text wraps in taller rows (else one line each, the whole text on
    hover: rows of one height draw at once)."""
    columns = []
    for field, name in pairs:
        column: dict[str, Any] = {"field": field, "headerName": name}
        if field in WIDE:  # long text in a wider column; the rest stay one line
            column.update(flex=3, minWidth=180)
            column.update(wrapText=True, autoHeight=True) if wrap else column.update(
                tooltipField=field)
        if field in BYTE_FIELDS:
            column["valueFormatter"] = BYTES_FORMAT
        if field in RIGHT:
            column["type"] = "rightAligned"
        columns.append(column)
    options: dict[str, Any] = {"domLayout": "autoHeight"} if height == "auto" else {}
    options["animateRows"] = False
    if height != "auto":
        # a grid of fixed height draws its rows at once, not spread over animation frames
        # (ag-grid's default, for smooth scrolling): a click waits for every visible row
        options["suppressAnimationFrame"] = True
    if page_size:
        options.update(pagination=True, paginationPageSize=page_size,
                       paginationPageSizeSelector=False)
    if select_by:
        options["rowSelection"] = {"mode": "singleRow", "checkboxes": False,
                                   "enableClickSelection": True}
    identified_by = select_by or row_id
    return dag.AgGrid(
        id=grid_id, columnDefs=columns, rowData=rows or [], dashGridOptions=options,
        defaultColDef={"sortable": True, "resizable": True, "flex": 1, "minWidth": 80,
                       "cellStyle": {"fontSize": "13px"}},
        getRowId=f"params.data.{identified_by}" if identified_by else None,
        selectedRows=[] if select_by else None,
        style={"height": height} if height != "auto" else {"width": "100%"})


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
        _grid("sites-table", SITE_COLUMNS, rows),
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
        return [{"name": r["name"], **{f: int(r[f + "_bytes"]) for f in CHANGE_FIELDS}}
                for r in rows]

    return _section(
        "Against the baseline", html.P(head),
        dcc.Graph(id="comparison", config=GRAPH_CONFIG,
                  figure=figures.comparison_figure(c, a_name="baseline",
                                                   b_name="this trace")),
        _grid("compare-categories", columns, rows_of(c["by_category"])),
        html.H3("Modules that changed most", style={"fontSize": "16px"}),
        _grid("compare-modules", columns, rows_of(c["by_module"])),
        section_id="comparison-section")


def layout(board: Dashboard, budget_text: str = "") -> html.Div:
    """The page as first served: the timeline, what is alive at the peak, the sites and the
    headline are in it already (no callback to wait for); the plan table fills in when the
    background ranking is done."""
    meta = board.data.trace.meta
    summary = board.data.summary
    step = board.default_step()
    figure, caption = board.timeline_view(step, budget_text)
    moment_caption, moment_figure, moment_rows = board.moment_view(step)
    sections = [
        html.H1("memadvisor", style={"fontSize": "22px", "marginBottom": "2px"}),
        html.Div(f"{board.trace_name}: {meta.script or '?'} on {meta.device or '?'}, "
                 f"{summary['events']:,} events, {meta.steps_completed} complete steps, "
                 f"status {meta.status}", style=META_STYLE),
        html.P(board.headline_text(budget_text, board.num_gpus), id="headline",
               style={"fontSize": "16px", "fontWeight": "600"}),
        _controls(board, budget_text),
        _section("Memory timeline",
                 html.P(caption, id="timeline-caption", style=META_STYLE),
                 dcc.Graph(id="timeline", figure=figure, config=GRAPH_CONFIG),
                 dcc.Store(id="timeline-unit", data=board.timeline_unit(step, budget_text)),
                 section_id="timeline-section"),
        _section("What is alive at this moment",
                 html.P(moment_caption, id="moment-caption"),
                 dcc.Store(id="moment-key"), dcc.Store(id="moment-drawn"),
                 dcc.Store(id="moment-clicks"),
                 html.Div([
                     html.Div(dcc.Graph(id="moment-breakdown", figure=moment_figure,
                                        config=GRAPH_CONFIG),
                              style={"flex": "1 1 380px", "minWidth": "320px"}),
                     html.Div(_grid("moment-table", MOMENT_COLUMNS, moment_rows,
                                    page_size=25, row_id="row_id", wrap=False,
                                    height="560px"),
                         style={"flex": "2 1 640px", "minWidth": "480px"}),
                 ], style={"display": "flex", "flexWrap": "wrap", "gap": "12px"}),
                 section_id="moment-section"),
        _sites_section(board),
        _section("Plans",
                 html.P(id="plan-message", style=META_STYLE),
                 _grid("plan-table", PLAN_COLUMNS, select_by="plan"),
                 dcc.Interval(id="plan-poll", interval=PLAN_POLL_MS, disabled=True),
                 dcc.Loading(html.Div(id="plan-detail")),
                 section_id="plans"),
        _section("Advice beyond plans",
                 html.P("Read from the trace: in-place ops, caching-allocator settings, data "
                        "loading. Bytes are off the analysed step's peak (reserved memory for "
                        "allocator settings); refused changes would break autograd or the "
                        "script.", style=META_STYLE),
                 html.P(id="advice-message", style=META_STYLE),
                 _grid("advice-table", ADVICE_COLUMNS, page_size=25, row_id="row_id"),
                 dcc.Interval(id="advice-poll", interval=ADVICE_POLL_MS, disabled=True),
                 section_id="advice"),
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
    # the page is served with the default step's timeline, moment and headline in it:
    # only an edit calls these
    @app.callback(Output("timeline", "figure"), Output("timeline-caption", "children"),
                  Output("timeline-unit", "data"),
                  Input("step", "value"), Input("budget", "value"),
                  State("timeline-unit", "data"), prevent_initial_call=True)
    def _timeline(step, budget, unit):
        new_unit = board.timeline_unit(step, budget)
        if dash.ctx.triggered_id == "budget" and new_unit == unit:
            # the same data in the same unit: only the budget line moves
            patch = Patch()
            patch["layout"] = board.budget_layout(step, budget)
            return patch, no_update, no_update
        figure, caption = board.timeline_view(step, budget)
        return figure, caption, new_unit

    # a click is answered outside Dash's callbacks (``clicks``: the page posts the point
    # and fills the grid itself); a new step starts at its peak, through Dash
    clicks.register(app, board)

    @app.callback(Output("moment-caption", "children"), Output("moment-table", "rowData"),
                  Output("moment-key", "data"), Input("step", "value"),
                  prevent_initial_call=True)
    def _moment(step):
        caption, rows = board.moment_table(step, None)
        return caption, rows, {"step": step, "click": None}

    # the chart is asked once the page has drawn the table (a frame later): its answer,
    # redrawn by plotly, would otherwise hold up the grid's rows behind it
    app.clientside_callback(AFTER_NEXT_FRAME, Output("moment-drawn", "data"),
                            Input("moment-key", "data"), prevent_initial_call=True)

    @app.callback(Output("moment-breakdown", "figure"), Input("moment-drawn", "data"),
                  prevent_initial_call=True)
    def _moment_breakdown(key):
        key = key if isinstance(key, dict) else {}
        return board.moment_breakdown(key.get("step"), key.get("click"))

    @app.callback(Output("sites-caption", "children"), Output("sites-table", "rowData"),
                  Output("modules", "figure"), Input("step", "value"),
                  prevent_initial_call=True)
    def _sites(step):
        return board.sites_view(step)

    @app.callback(Output("headline", "children"), Input("budget", "value"),
                  Input("gpus", "value"), prevent_initial_call=True)
    def _headline(budget, gpus):
        return board.headline_text(budget, gpus)

    @app.callback(Output("plan-table", "rowData"), Output("plan-message", "children"),
                  Output("plan-table", "selectedRows"), Output("plan-poll", "disabled"),
                  Input("budget", "value"), Input("gpus", "value"),
                  Input("plan-poll", "n_intervals"))
    def _plans(budget, gpus, _polls):
        polled = dash.ctx.triggered_id == "plan-poll"
        rows, message, selected, pending = board.plans_view(
            budget, gpus, PLAN_POLL_WAIT_S if polled else PLAN_WAIT_S)
        if pending:  # not ready yet: say so (once), and ask again shortly
            if polled:
                return no_update, no_update, no_update, False
            return [], message, [], False
        return rows, message, [rows[i] for i in selected], True

    @app.callback(Output("advice-table", "rowData"), Output("advice-message", "children"),
                  Output("advice-poll", "disabled"), Input("advice-poll", "n_intervals"))
    def _advice(polls):
        rows, message, pending = board.advice_view(
            ADVICE_POLL_WAIT_S if polls else ADVICE_WAIT_S)
        if pending:
            if polls:
                return no_update, no_update, False
            return [], message, False
        return rows, message, True

    @app.callback(Output("plan-detail", "children"), Input("plan-table", "selectedRows"),
                  State("plan-table", "rowData"), State("budget", "value"))
    def _plan_detail(selected, rows, budget):
        # the grid hands back the selected row itself: its position in the ranking
        plans = [r.get("plan") for r in rows or [] if isinstance(r, dict)]
        index = [plans.index(r["plan"]) for r in selected or []
                 if isinstance(r, dict) and r.get("plan") in plans]
        return plan_detail_children(*board.plan_view(index, rows, budget))


def plan_detail_children(fig: Any, lines: list[str]) -> list:
    children = []
    if fig is not None:
        children.append(dcc.Graph(id="plan-timeline", figure=fig, config=GRAPH_CONFIG))
    children.append(html.Ul([html.Li(line) for line in lines], id="plan-explanation",
                            style={"fontSize": "13px"}))
    return children
