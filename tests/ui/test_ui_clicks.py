"""A click's answer outside Dash (``ui.clicks``): the route the page posts a clicked point
to answers with ``Dashboard.moment_table``'s caption and rows for that point, and anything
else a client may post with 400 and one line."""
from __future__ import annotations

import pytest

from memadvisor.ui import clicks
from memadvisor.ui import data as ui_data
from memadvisor.ui.app import build_app
from memadvisor.ui.views import Dashboard


@pytest.fixture(scope="module")
def board(ui_model_trace) -> Dashboard:
    return Dashboard(ui_data.load(ui_model_trace), num_gpus=1)


@pytest.fixture(scope="module")
def client(board):
    return build_app(board).server.test_client()


def _click(board, step, index):
    time_ms = float(board.data.timeline(step).time_ms[index])
    return {"step": step, "click": {"points": [{"pointIndex": index, "x": time_ms,
                                                "curveNumber": 0}]}}


def test_a_posted_click_is_answered_with_the_moment_at_that_point(board, client):
    step = board.default_step()
    timeline = board.data.timeline(step)
    index = timeline.points // 2
    answer = client.post(clicks.MOMENT_ROUTE, json=_click(board, step, index))
    assert answer.status_code == 200
    body = answer.get_json()
    caption, rows = board.moment_table(step, _click(board, step, index)["click"])
    assert body == {"step": step, "caption": caption, "rows": rows}
    # the rows are the storages alive just after that event: they sum to the live bytes
    position = board.data.step_window(step).start + int(timeline.positions[index])
    assert sum(r["bytes"] for r in body["rows"]) == int(board.data.live[position])
    assert body["caption"].startswith("At the selected moment:")
    assert f"event {int(board.data.trace.events['seq'].iat[position])}" in body["caption"]
    # a row is known to the grid by its storage: the same storage, the same row id
    assert len({r["row_id"] for r in rows}) == len(rows)
    # another step's point: that step's own moment
    other = client.post(clicks.MOMENT_ROUTE, json=_click(board, 0, 1)).get_json()
    assert other["step"] == 0 and other["caption"] != body["caption"]


def test_the_figure_names_its_step_for_the_page(board):
    # the page posts the step of the figure clicked, which the figure carries
    assert board.timeline_view(0)[0].layout.meta == {"step": 0}
    assert board.timeline_view(2)[0].layout.meta == {"step": 2}


@pytest.mark.parametrize("body, why", [
    ("not json", "expected a JSON object"),
    ([1, 2], "expected a JSON object"),
    ({"step": 99, "click": {"points": [{"pointIndex": 1}]}}, "no step 99"),
    ({"step": "2", "click": {"points": [{"pointIndex": 1}]}}, "no step '2'"),
    ({"step": True, "click": {"points": [{"pointIndex": 1}]}}, "no step True"),
    ({"step": 2, "click": None}, "expected click.points"),
    ({"step": 2, "click": {"points": []}}, "expected click.points"),
    ({"step": 2, "click": {"points": [{"pointIndex": "1"}]}}, "must be numbers"),
    ({"step": 2, "click": {"points": [{"x": [1]}]}}, "must be numbers"),
    ({"step": 2, "click": {"points": [{}]}}, "needs its pointIndex or x"),
])
def test_a_bad_post_is_one_line_and_400(client, body, why):
    if isinstance(body, str):
        answer = client.post(clicks.MOMENT_ROUTE, data=body,
                             content_type="application/json")
    else:
        answer = client.post(clicks.MOMENT_ROUTE, json=body)
    text = answer.get_data(as_text=True)
    assert answer.status_code == 400 and why in text
    assert text.count("\n") == 1 and "Traceback" not in text


def test_a_stale_point_falls_back_to_the_nearest_time(board, client):
    step = board.default_step()
    timeline = board.data.timeline(step)
    x = float(timeline.time_ms[3])
    stale = client.post(clicks.MOMENT_ROUTE, json={
        "step": step, "click": {"points": [{"pointIndex": 10**6, "x": x}]}}).get_json()
    fresh = client.post(clicks.MOMENT_ROUTE, json=_click(board, step, 3)).get_json()
    assert stale["rows"] == fresh["rows"]
    # no index and no x that fits: the step's peak, as before any click
    lost = client.post(clicks.MOMENT_ROUTE, json={
        "step": step, "click": {"points": [{"pointIndex": 10**6}]}}).get_json()
    assert lost["caption"].startswith("At the peak:")


def test_the_page_listens_for_clicks_and_hovers(board):
    app = build_app(board)
    installs = [spec for output, spec in app.callback_map.items()
                if "moment-clicks.data" in output]
    assert len(installs) == 1
    assert installs[0]["inputs"] == [{"id": "timeline", "property": "figure"}]
    script = clicks.INSTALL_CLICKS
    assert repr(clicks.MOMENT_ROUTE) in script and "ROUTE" not in script and "KEEP" not in script
    assert "'plotly_click'" in script and "'plotly_hover'" in script and "'mousedown'" in script


def test_a_click_holds_off_the_plans_made_ahead(board, client, monkeypatch):
    # the worker's speculative plans wait while the page is in use: the CPU answers clicks
    calls = []
    monkeypatch.setattr(board.advisor, "hold_off", lambda: calls.append(1))
    client.post(clicks.MOMENT_ROUTE, json=_click(board, board.default_step(), 2))
    assert calls == [1]


def test_hold_off_delays_the_plans_made_ahead(board):
    before = board.advisor._last_asked
    board.advisor.hold_off()
    assert board.advisor._last_asked > before


def test_a_trace_without_a_complete_step_is_clicked_as_the_whole_run(ui_model_trace):
    from memadvisor.trace.io import read_trace

    trace = read_trace(ui_model_trace)
    trace.meta.steps_completed = 0
    board = Dashboard(ui_data.from_traces(trace))
    fig, _ = board.timeline_view(ui_data.WHOLE_RUN)
    assert fig.layout.meta == {"step": ui_data.WHOLE_RUN}  # what the page posts back
    client = build_app(board).server.test_client()
    answer = client.post(clicks.MOMENT_ROUTE, json={
        "step": ui_data.WHOLE_RUN, "click": {"points": [{"pointIndex": 2}]}})
    assert answer.status_code == 200
    caption, rows = board.moment_table(ui_data.WHOLE_RUN, {"points": [{"pointIndex": 2}]})
    assert answer.get_json()["rows"] == rows and caption.startswith("At the selected moment")
    # a step number is refused: this trace is shown as the whole run only
    assert client.post(clicks.MOMENT_ROUTE, json={
        "step": 2, "click": {"points": [{"pointIndex": 2}]}}).status_code == 400
