"""The dashboard's callbacks called directly (no server, no browser), on a real trace of a
tiny model and on synthetic ones: what they show must be the numbers memadvisor's own
commands compute."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import plotly.utils
import pytest

from memadvisor.units import format_bytes

from memadvisor.errors import UserError
from memadvisor.plan import Plan
from memadvisor.report.synthetic import make_trace
from memadvisor.simulate import advise, hardware, prepare, simulate
from memadvisor.trace import analysis
from memadvisor.trace.io import read_trace
from memadvisor.trace.summary import summarize
from memadvisor.ui import data as ui_data
from memadvisor.ui.app import build_app
from memadvisor.ui.views import Dashboard, parse_budget

CONFTEST = Path(__file__).with_name("conftest.py")
KIB = 1024


@pytest.fixture(scope="module")
def board(ui_model_trace) -> Dashboard:
    return Dashboard(ui_data.load(ui_model_trace), num_gpus=1)


def layout_json(app) -> str:
    return json.dumps(app.layout, cls=plotly.utils.PlotlyJSONEncoder)


def _hidden_line() -> int:
    lines = CONFTEST.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(
        "# <- hidden activation") and "hidden =" in line)


def test_table_at_the_peak_sums_to_the_peak_and_names_the_line(board, ui_model_trace):
    summary = summarize(read_trace(ui_model_trace))
    caption, fig, rows = board.moment_view(board.default_step())
    assert board.default_step() == summary["analysed_step"] == 2
    assert caption.startswith("At the peak:")
    assert sum(r["bytes"] for r in rows) == summary["peak_bytes"] > 0
    sizes = [r["bytes"] for r in rows]
    assert sizes == sorted(sizes, reverse=True)
    # the category chart is the breakdown ``summary`` prints
    drawn = dict(zip(fig.data[0].y, fig.data[0].text))
    assert set(drawn) == set(summary["by_category"])
    # parameters of Linear(32, 64): weight 32*64 and bias 64 float32
    weights = [r for r in rows if r["category"] == "parameter" and r["shape"] == "[64,32]"]
    assert weights and weights[0]["bytes"] == 64 * 32 * 4 and weights[0]["dtype"] == "float32"
    # the activation made by the ReLU: its source line is the test's own training loop
    hidden = [r for r in rows if r["category"] == "activation" and r["op"] == "aten::relu"]
    assert hidden and hidden[0]["source"].endswith(f"conftest.py:{_hidden_line()}")
    assert hidden[0]["bytes"] == 16 * 64 * 4 and hidden[0]["shape"] == "[16,64]"


def test_a_click_shows_the_storages_alive_at_that_event(board):
    step = board.default_step()
    timeline = board.data.timeline(step)
    window = board.data.step_window(step)
    index = 3
    click = {"points": [{"curveNumber": 1, "pointNumber": index, "pointIndex": index,
                         "x": float(timeline.time_ms[index])}]}
    caption, _, rows = board.moment_view(step, click)
    position = window.start + int(timeline.positions[index])
    assert caption.startswith("At the selected moment:")
    assert sum(r["bytes"] for r in rows) == int(board.data.live[position])
    assert f"event {int(board.data.trace.events['seq'].iat[position])}" in caption
    # a stale click (index beyond this figure) falls back to the nearest time
    stale = {"points": [{"pointIndex": 10**6, "x": float(timeline.time_ms[index])}]}
    assert board.moment_view(step, stale)[2] == rows
    # a click between two events far apart in time still reaches the nearest one
    plain, _ = board.timeline_view(step)
    assert plain.layout.hoverdistance == -1
    # hovering picks the event by time alone (a click high above the curves stays at its
    # time), one label per category
    assert plain.layout.hovermode == "x"


def test_a_click_updates_the_tables_only(board):
    """The figure is never sent again for a click: a click is answered outside Dash's
    callbacks (``ui.clicks``' route, tested in test_ui_clicks), so no callback listens to
    the timeline's clickData; the step's own moment still comes from a callback."""
    app = build_app(board, "8KiB")
    on_click = [output for output, spec in app.callback_map.items()
                if any(i["id"] == "timeline" and i["property"] == "clickData"
                       for i in spec["inputs"])]
    assert on_click == []
    on_step = [output for output, spec in app.callback_map.items()
               if any(i["id"] == "step" for i in spec["inputs"])]
    assert any("moment-table.rowData" in o for o in on_step)
    assert not [o for o in on_step if "moment" in o and "timeline.figure" in o]


def test_selecting_a_step_changes_the_figure_and_the_moment(board):
    options = ui_data.step_options(board.data)
    assert [o["value"] for o in options] == [0, 1, 2, 3][:len(options)]
    assert "analysed" in options[2]["label"]
    last, _ = board.timeline_view(2)
    first, caption = board.timeline_view(0)
    assert "step 0" in first.layout.title.text and "step 2" in last.layout.title.text
    assert [t.name for t in first.data] != [t.name for t in last.data] or any(
        not np.array_equal(a.y, b.y) for a, b in zip(first.data, last.data))
    # a new step's moment is that step's own peak
    peak_0 = analysis.peak_in(board.data.live, board.data.step_window(0))[1]
    rows_0 = board.moment_view(0)[2]
    assert sum(r["bytes"] for r in rows_0) == peak_0
    assert board.moment_view(0)[0] != board.moment_view(2)[0]  # another event
    assert caption.startswith(f"{board.data.timeline(0).events_in_step:,} events in the step")


def test_top_sites_follow_the_selected_step(board):
    caption_2, rows_2, _ = board.sites_view(2)
    caption_0, rows_0, modules_0 = board.sites_view(0)
    assert "step 2, the analysed step" in caption_2 and "step 0:" in caption_0
    # the sites of step 0 are those alive at step 0's own peak: they sum to at most it
    peak_0 = analysis.peak_in(board.data.live, board.data.step_window(0))[1]
    assert format_bytes(peak_0) in caption_0
    assert 0 < sum(r["bytes"] for r in rows_0) <= peak_0
    assert rows_2 == board.sites_view(2)[1]  # cached, same answer
    assert all(r["code"] is not None for r in rows_0)
    assert len(modules_0.data) == 1


def test_budget_line_follows_the_budget_input(board):
    with_budget, _ = board.timeline_view(2, "8KiB")
    without, _ = board.timeline_view(2, "not a size")
    dashed = [s for s in with_budget.layout.shapes if s.line.dash == "dash"]
    assert len(dashed) == 1 and dashed[0].y0 == pytest.approx(8.0)  # drawn in KiB
    assert not [s for s in without.layout.shapes if s.line.dash == "dash"]


def test_plan_table_is_ranked_and_matches_the_simulator(board, ui_model_trace):
    peak = board.data.summary["peak_bytes"]
    budget = int(peak * 0.9)
    rows, message, selected, pending = board.plans_view(f"{budget}", 4)
    assert rows and selected == [0] and "plans evaluated" in message and not pending
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, key=lambda f: f != "yes")  # fitting plans first
    fitting = [r for r in rows if r["fits"] == "yes"]
    # ranked as advise ranks by default: GPU-time per step (step time x the plan's GPUs)
    costs = [round(r["step_time_factor"] * Plan.parse(r["plan"]).world, 3) for r in fitting]
    assert costs == sorted(costs)
    assert all(r["peak_bytes"] <= budget for r in fitting)
    # the same ranking as `memadvisor advise`, and each row what `simulate` predicts
    trace = read_trace(ui_model_trace)
    # the worker's baseline: the loop as apply rewrites it (where the zero_grad stays put,
    # a zero2/zero3 prediction differs from prepare's by the gradients it keeps)
    from memadvisor.verify import baseline_as_applied
    base, hw = baseline_as_applied(trace), hardware(None, trace.meta.device)
    result = advise(base, hw, budget, 4)
    assert [r["plan"] for r in fitting] == [p.plan.to_compact() or "none" for p in result.ranked]
    for row in (rows[0], rows[-1]):
        prediction = simulate(base, Plan.parse(row["plan"]), hw)
        assert row["peak_bytes"] == prediction.peak_bytes
        assert row["step_time_factor"] == pytest.approx(prediction.step_time_factor, abs=1e-4)


def test_selecting_a_plan_draws_its_prediction_and_explains_it(board):
    peak = board.data.summary["peak_bytes"]
    rows, _, selected, _ = board.plans_view(str(int(peak * 0.9)), 4)
    fig, lines = board.plan_view(selected, rows, str(int(peak * 0.9)))
    assert len(fig.data) == 2 and rows[0]["plan"] in fig.layout.annotations[1].text
    assert max(fig.data[1].y) < max(fig.data[0].y)  # the plan fits, the measured step not
    assert lines[0].startswith(rows[0]["plan"])
    assert any(line.startswith("at the peak: ") for line in lines)
    assert any(line.startswith("changes: ") for line in lines)
    other, other_lines = board.plan_view([len(rows) - 1], rows)
    assert other_lines[0].startswith(rows[-1]["plan"]) and other_lines != lines
    assert board.plan_view([], rows)[0] is None


def test_editing_budget_and_gpus_reranks(board):
    peak = board.data.summary["peak_bytes"]
    roomy = board.plans_view(str(peak * 4), 1)[0]
    tight = board.plans_view(str(int(peak * 0.9)), 4)[0]
    assert roomy[0]["plan"] == "none"  # fits as is: the unchanged script is fastest
    assert [r["plan"] for r in roomy] != [r["plan"] for r in tight]
    assert board.headline_text(str(peak * 4), 1).endswith("to spare")
    assert "does not fit" in board.headline_text(str(int(peak * 0.9)), 4)
    assert board.plans_view("", 1)[1] == "enter a budget per GPU to rank plans"
    rows, message, selected, pending = board.plans_view("24 potatoes", 1)
    assert (rows, selected, pending) == ([], [], False) and message.startswith("not a size")
    assert board.plans_view("1GiB", 0)[1] == "GPUs must be at least 1, got 0"
    # nothing fits one byte: the panel says why instead of failing
    rows, message, _, _ = board.plans_view("1", 1)
    assert rows == [] and message.startswith("no plans: no plan fits")


def test_parse_budget():
    assert parse_budget(" ") is None and parse_budget("2KiB") == 2 * KIB
    with pytest.raises(UserError):
        parse_budget("-3GB")


def test_app_layout_holds_every_panel(board, synthetic_traces):
    app = build_app(board, "8KiB")
    text = layout_json(app)
    for component in ("timeline", "moment-table", "sites-table", "modules", "plan-table",
                      "plan-detail", "step", "budget", "gpus"):
        assert f'"id": "{component}"' in text
    assert "comparison-section" not in text
    outputs = " ".join(app.callback_map)
    for output in ("timeline.figure", "moment-table.rowData", "plan-table.rowData",
                   "plan-detail.children", "headline.children"):
        assert output in outputs


def test_baseline_comparison(synthetic_traces):
    data = ui_data.load(synthetic_traces["bigger"], synthetic_traces["base"])
    board = Dashboard(data, baseline_name="base.trace")
    assert data.comparison["peak_change_bytes"] > 0
    text = layout_json(build_app(board))
    assert '"id": "comparison-section"' in text and "base.trace" in text
    assert '"id": "compare-modules"' in text
    # the hostile module name reaches the page only as text in a table cell
    assert "<script>alert(1)</script>" in text


def test_large_traces_send_decimated_data(tmp_path):
    path = make_trace(tmp_path / "large.trace", 120_000, all_categories=True)
    board = Dashboard(ui_data.load(str(path)))
    fig, caption = board.timeline_view(board.default_step())
    timeline = board.data.timeline(board.default_step())
    assert timeline.events_in_step > 20_000
    assert all(len(t.x) <= 2 * 800 + 2 + 10 for t in fig.data)
    assert len(fig.to_json()) < 400_000
    caption, _, rows = board.moment_view(board.default_step())
    assert len(rows) <= ui_data.MAX_MOMENT_ROWS
    assert sum(r["bytes"] for r in rows) <= timeline.peak_bytes


def test_trace_without_a_complete_step(tmp_path, ui_model_trace):
    trace = read_trace(ui_model_trace)
    trace.meta.steps_completed = 0
    board = Dashboard(ui_data.from_traces(trace))
    assert ui_data.step_options(board.data) == [
        {"label": "whole run (no complete step)", "value": ui_data.WHOLE_RUN}]
    fig, _ = board.timeline_view(ui_data.WHOLE_RUN)
    assert "the whole run" in fig.layout.title.text
    rows, message, _, _ = board.plans_view("1GiB", 1)
    assert rows == [] and "completed no training step" in message


def test_plan_detail_never_opens_a_path_the_page_names(board, tmp_path):
    """Rows come back from the browser: a plan that is a file path is refused as a spec,
    and the file's contents never reach the answer (they used to, in the error text)."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"precision": "TOP-SECRET-VALUE"}')
    fig, lines = board.plan_view([0], [{"plan": str(secret)}])
    assert fig is None and not any("TOP-SECRET-VALUE" in line for line in lines)
    assert any("plan item" in line for line in lines)
    for rows in ([{"plan": 42}], ["not a row"], None, [{}]):
        assert board.plan_view([0], rows)[0] is None
    assert board.plan_view(["0"], [{"plan": "none"}])[0] is None
