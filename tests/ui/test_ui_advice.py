"""The dashboard's "Advice beyond plans" panel, called directly (no server, no browser):
its rows are ``advice.collect``'s items for the trace and the dashboard's target, in the
same order, with the figures and locations ``memadvisor advise`` prints."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import plotly.utils
import pytest

from memadvisor.advice import collect
from memadvisor.advice.output import HEADINGS
from memadvisor.trace.io import read_trace
from memadvisor.ui import data as ui_data
from memadvisor.ui.app import ADVICE_COLUMNS, build_app
from memadvisor.ui.views import Dashboard
from memadvisor.verify import baseline_as_applied

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.fixture(scope="module")
def board(ui_model_trace):
    board = Dashboard(ui_data.load(ui_model_trace), num_gpus=1)
    yield board
    board.advisor.close()


def _hidden_line() -> int:
    lines = CONFTEST.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(
        "# <- hidden activation") and "hidden =" in line)


def test_panel_rows_are_advice_collect_for_the_trace(board, ui_model_trace):
    trace = read_trace(ui_model_trace)
    expected = collect(trace, baseline_as_applied(trace), board.advisor.hardware)
    rows, message, pending = board.advice_view(wait_s=None)
    assert not pending
    assert len(rows) == len(expected) >= 2
    for row, item in zip(rows, expected):
        assert (row["status"], row["title"], row["reason"]) == (item.status, item.title,
                                                                item.reason)
        assert row["ms_per_step"] == (None if item.seconds is None
                                      else round(item.seconds * 1e3, 3))
        if item.status == "suggested" and item.kind != "data_loading":
            assert row["bytes_saved"] == item.bytes_saved  # "saves 0 B" is said too
        else:
            assert row["bytes_saved"] in (None, item.bytes_saved)
        cwd = trace.meta.cwd
        assert row["source"] == (os.path.relpath(item.location, cwd)
                                 if item.location.startswith(cwd + os.sep) else item.location)
    # the ReLU of the training loop: suggested in place, at the loop's line, relative to
    # the folder the trace was recorded in
    relu = [r for r in rows if r["kind"] == "inplace" and "relu" in r["title"]]
    assert relu and relu[0]["status"] == "suggested" and relu[0]["group"] == "suggested"
    assert relu[0]["source"] == (f"{os.path.relpath(CONFTEST, trace.meta.cwd)}:"
                                 f"{_hidden_line()}")
    assert relu[0]["bytes_saved"] == 0 and "not at the peak" in relu[0]["reason"]
    # statuses in advise's order, each headed as advise heads it
    order = ["suggested", "refused", "info", "missing"]
    assert [order.index(r["status"]) for r in rows] == sorted(
        order.index(r["status"]) for r in rows)
    # (a script iterating no DataLoader has nothing 'not known': the trace records that)
    groups = {r["status"]: r["group"] for r in rows}
    assert groups == {status: HEADINGS[status] for status in groups} and len(groups) >= 2
    assert message.startswith("1 suggested, ") and all(
        f"{sum(r['status'] == s for r in rows)} {HEADINGS[s]}" in message for s in groups)
    # the grid knows a row by a string id, and shows only fields the rows have
    assert len({r["row_id"] for r in rows}) == len(rows)
    assert {field for field, _ in ADVICE_COLUMNS} <= set(rows[0])


def test_advice_is_made_once_by_the_worker(board):
    first = board.advisor.advice_in_background()
    assert board.advisor.advice_in_background() is first and first.done()


def test_the_panel_waits_for_the_worker_not_the_page(ui_model_trace):
    board = Dashboard(ui_data.load(ui_model_trace), rank_now=False)
    try:
        # a job that holds the worker: the advice asked for behind it is not made yet
        gate = board.advisor.worker.submit(time.sleep, 1.0)
        rows, message, pending = board.advice_view(wait_s=0.01)
        assert pending and rows == [] and "in the background" in message
        gate.result()
        rows, _, pending = board.advice_view(wait_s=None)
        assert rows and not pending
    finally:
        board.advisor.close()


def test_a_trace_without_a_complete_step_says_why(ui_model_trace):
    trace = read_trace(ui_model_trace)
    trace.meta.steps_completed = 0
    board = Dashboard(ui_data.from_traces(trace))
    try:
        rows, message, pending = board.advice_view(wait_s=None)
        assert rows == [] and not pending
        assert message.startswith("advice unavailable: ") and "no training step" in message
    finally:
        board.advisor.close()


def test_the_page_has_the_panel_filled_by_a_callback(board):
    app = build_app(board, "8KiB")
    text = json.dumps(app.layout, cls=plotly.utils.PlotlyJSONEncoder)
    assert '"id": "advice"' in text and '"id": "advice-table"' in text
    assert "Advice beyond plans" in text
    # served empty: the rows come from the worker, never built into the first page
    grid = app.layout.children[[getattr(c, "id", None) for c in app.layout.children]
                               .index("advice")]
    assert '"rowData": []' in json.dumps(grid, cls=plotly.utils.PlotlyJSONEncoder)
    advice = [spec for output, spec in app.callback_map.items()
              if "advice-table.rowData" in output]
    assert len(advice) == 1
    assert [i["id"] for i in advice[0]["inputs"]] == ["advice-poll"]
