"""A click on the timeline answered without Dash's callback cycle (issue 16: click to a
filled table <= 0.1 s at 1M events, the worst click too).

Through Dash a click went: plotly's click -> ``dcc.Graph`` sets ``clickData`` -> Dash's
renderer works out the callbacks and posts them (~11 ms after the click, more when a frame
is being painted) -> the answer goes through Dash's store and React before the grid gets
its rows (20-35 ms after the answer).  Measured on the 1M-event benchmark (quiet machine,
Chrome trace): the server answered in ~7 ms; the rest was the renderer's steps.  Here the
page listens to plotly's click itself (first in line, before ``dcc.Graph``'s own
listener), posts the clicked point to ``MOMENT_ROUTE`` at once, and hands the answer's
rows straight to the grid (``api.setGridOption``: rows are known by their storage id, so
a storage alive at both moments keeps its row).  The caption and the ``moment-key`` store
(which asks for the chart of bytes per category, two frames later) go through
``dash_clientside.set_props``, so Dash's copy of them stays what the page shows; the
grid's ``rowData`` in Dash's store stays the step's peak (nothing reads it back).

A pointer resting on the chart already asks for the point under it (plotly's hover; one
request at a time, the newest point next, those passed over dropped), so a click usually
finds its answer in the page: at load 6-7 on this 2-core machine, a median 21 ms from the
button going up to the rows drawn, against 43 ms when the click has to ask.

The server's side is ``Dashboard.moment_table``, as before; the route takes whatever a
client posts and answers a malformed body with 400 and one line, never a traceback.
"""
from __future__ import annotations

from typing import Any

from dash import Input, Output

from ..errors import UserError
from . import data as ui_data
from .views import Dashboard

#: answers the page keeps (a click on a point asked for before is answered at once)
KEPT_ANSWERS = 16
#: where the page posts a click: {"step": int, "click": {"points": [{"pointIndex", "x"}]}}
MOMENT_ROUTE = "/_memadvisor/moment"

#: installs the listeners on the timeline's plotly div; run (clientside) whenever the figure
#: changes (plotly may have made its div anew).  plotly adds ``gd.on`` when it first plots,
#: so installing waits for that (a frame at a time).  An answer is drawn only for the last
#: click, and only while the chart still shows the step clicked.
#: ``answers``: the last ``KEPT_ANSWERS`` answers (promises) by point; ``prefetch`` (default on):
#: the point under the pointer is asked for while it rests there, one request at a time
#: (the newest point waits its turn, those passed over are dropped), and at once when the
#: button goes down on it.
INSTALL_CLICKS = """function(figure) {
    const clicks = window.memadvisorClicks = window.memadvisorClicks ||
        {ticket: 0, answers: new Map(), prefetch: true, busy: false, next: null};
    const pointOf = event => {
        const point = ((event && event.points) || [])[0];
        const gd = document.querySelector('#timeline .js-plotly-plot');
        if (!point || !gd) return null;
        const meta = (gd.layout && gd.layout.meta) || {};
        const index = point.pointIndex !== undefined ? point.pointIndex : point.pointNumber;
        const step = meta.step === undefined ? null : meta.step;
        return {step: step, click: {points: [{pointIndex: index, x: point.x,
                                              curveNumber: point.curveNumber}]},
                key: step + ':' + index + ':' + point.x};
    };
    const ask = p => {
        let known = clicks.answers.get(p.key);
        if (known) {  // the most recent last
            clicks.answers.delete(p.key);
            clicks.answers.set(p.key, known);
            return known;
        }
        known = fetch(ROUTE, {method: 'POST', headers: {'Content-Type': 'application/json'},
                              body: JSON.stringify({step: p.step, click: p.click})})
            .then(answer => answer.ok ? answer.json() : answer.text().then(
                text => ({caption: text.trim() || ('no answer: ' + answer.status),
                          rows: null})))
            .catch(error => ({caption: 'no answer from the dashboard: ' + error,
                              rows: null}))
            .then(answer => {
                if (!answer.rows) clicks.answers.delete(p.key);  // ask again next time
                return answer;
            });
        clicks.answers.set(p.key, known);
        while (clicks.answers.size > KEEP) clicks.answers.delete(
            clicks.answers.keys().next().value);
        return known;
    };
    if (!clicks.onClick) {
        clicks.onHover = function(event) {
            const p = pointOf(event);
            if (!clicks.prefetch || !p || clicks.answers.has(p.key)) return;
            if (clicks.busy) { clicks.next = event; return; }
            clicks.busy = true;
            ask(p).then(() => {
                clicks.busy = false;
                const next = clicks.next;
                clicks.next = null;
                if (next) clicks.onHover(next);
            });
        };
        // a press on the chart: the point under the pointer is asked for now, not after
        // the passed-over point still being asked for, nor at the release
        clicks.onPress = function() {
            const gd = document.querySelector('#timeline .js-plotly-plot');
            const p = clicks.prefetch && gd && pointOf({points: gd._hoverdata});
            if (p && !clicks.answers.has(p.key)) ask(p);
        };
        clicks.onClick = function(event) {
            const p = pointOf(event);
            if (!p) return;
            clicks.lastClick = p.click;  // what the page asked for (read by the browser test)
            const ticket = ++clicks.ticket;
            ask(p).then(answer => {
                // a later click won, or the chart has another step now
                const gd = document.querySelector('#timeline .js-plotly-plot');
                const meta = (gd && gd.layout && gd.layout.meta) || {};
                if (ticket !== clicks.ticket || meta.step !== p.step) return;
                if (answer.rows) {
                    const api = window.dash_ag_grid && window.dash_ag_grid.getApi(
                        'moment-table');
                    if (api) api.setGridOption('rowData', answer.rows);
                    else dash_clientside.set_props('moment-table', {rowData: answer.rows});
                    // the chart beside the grid is asked for once a frame has drawn
                    // the rows (and one more, in app.AFTER_NEXT_FRAME): plotly's redraw of
                    // it must not come before them
                    requestAnimationFrame(() => setTimeout(() => dash_clientside.set_props(
                        'moment-key', {data: {step: p.step, click: p.click}}), 0));
                }
                dash_clientside.set_props('moment-caption', {children: answer.caption});
            });
        };
    }
    const install = () => {
        const gd = document.querySelector('#timeline .js-plotly-plot');
        if (!gd || !gd._ev || !gd.on) { requestAnimationFrame(install); return; }
        if (gd._ev.listeners('plotly_click').indexOf(clicks.onClick) >= 0) return;
        // before dcc.Graph's own listeners: the request leaves first
        const on = gd._ev.prependListener ? gd._ev.prependListener.bind(gd._ev) : gd.on;
        on('plotly_click', clicks.onClick);
        on('plotly_hover', clicks.onHover);
        gd.addEventListener('mousedown', clicks.onPress, true);  // once: the same function
    };
    install();
    return window.dash_clientside.no_update;
}""".replace("ROUTE", repr(MOMENT_ROUTE)).replace("KEEP", str(KEPT_ANSWERS))


def moment_answer(board: Dashboard, body: Any, steps: frozenset[int]
                  ) -> tuple[dict[str, Any], int]:
    """The JSON answer to a posted click and its HTTP status: the caption and rows of
    ``Dashboard.moment_table`` (200), or a one-line reason (400) for a body that is not a
    click on one of ``steps`` (``known_steps``)."""
    if not isinstance(body, dict):
        return {"error": "expected a JSON object with 'step' and 'click'"}, 400
    step, click = body.get("step"), body.get("click")
    if not isinstance(step, int) or isinstance(step, bool) or step not in steps:
        return {"error": f"no step {step!r:.40} in this trace"}, 400
    points = click.get("points") if isinstance(click, dict) else None
    if not isinstance(points, list) or not points or not isinstance(points[0], dict):
        return {"error": "expected click.points, a list of plotly points"}, 400
    point = points[0]
    index, x = point.get("pointIndex"), point.get("x")
    if (index is not None and (not isinstance(index, int) or isinstance(index, bool))) or (
            x is not None and (not isinstance(x, (int, float)) or isinstance(x, bool))):
        return {"error": "a point's pointIndex and x must be numbers"}, 400
    if index is None and x is None:
        return {"error": "a point needs its pointIndex or x"}, 400
    try:
        caption, rows = board.moment_table(step, {"points": [{"pointIndex": index,
                                                              "x": x}]})
    except UserError as exc:
        return {"error": str(exc)}, 400
    return {"step": step, "caption": caption, "rows": rows}, 200


def known_steps(board: Dashboard) -> frozenset[int]:
    """The steps a click may name: the step selector's values (found once: a pass over
    every event is not for each click)."""
    return frozenset(o["value"] for o in ui_data.step_options(board.data))


def register(app, board: Dashboard) -> None:
    """The route a click posts to, and the clientside callback that listens for clicks."""
    from flask import jsonify, request

    steps = known_steps(board)

    def moment():
        board.advisor.hold_off()  # the plans made ahead wait: this page is in use
        answer, status = moment_answer(board, request.get_json(silent=True), steps)
        if status != 200:
            return answer["error"] + "\n", status, {"Content-Type": "text/plain"}
        return jsonify(answer)

    app.server.add_url_rule(MOMENT_ROUTE, "memadvisor_moment", moment, methods=["POST"])
    app.clientside_callback(INSTALL_CLICKS, Output("moment-clicks", "data"),
                            Input("timeline", "figure"))
