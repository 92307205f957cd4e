"""The dashboard in a real browser: served on a free port, loaded offline, no JS error, the
timeline drawn, the plan table filled, a click on the chart answered.

System Chromium driven by Playwright (recipe: /work/shared/recipes/browser-tests.md);
skipped where either is missing, deselected with ``-m "not browser"``."""
from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import pytest

from memadvisor.ui import data as ui_data
from memadvisor.ui.app import build_app
from memadvisor.ui.server import bind, url_of
from memadvisor.ui.views import Dashboard

from browser_support import ARGS, CHROMIUM, MARKS, SCREENSHOTS  # noqa: E402

pytestmark = MARKS
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed")


def test_dashboard_in_the_browser(ui_model_trace, synthetic_traces):
    board = Dashboard(ui_data.load(ui_model_trace, synthetic_traces["base"]), num_gpus=4,
                      baseline_name="base.trace")
    budget = str(int(board.data.summary["peak_bytes"] * 0.9))
    server = bind("127.0.0.1", 0, build_app(board, budget).server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = url_of(server)
    blocked, errors = [], []
    executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=executable, headless=True, args=ARGS)
            context = browser.new_context(viewport={"width": 1280, "height": 1000})

            def guard(route):
                if route.request.url.startswith(url):
                    return route.continue_()
                blocked.append(route.request.url)
                return route.abort()

            context.route("**/*", guard)
            page = context.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            page.wait_for_function(
                "() => { const g = document.querySelector('#timeline .js-plotly-plot');"
                " return g && g.data && g.data.length > 0; }", timeout=15_000)
            drawn = page.evaluate(
                "document.querySelector('#timeline .js-plotly-plot').data.map(t => t.name)")
            assert drawn == list(board.data.timeline(2).by_category)
            cell = "#plan-table .ag-center-cols-container .ag-cell[col-id=plan]"
            page.wait_for_selector(cell, timeout=15_000)
            first_plan = page.locator(cell).first
            expected = board.plans_view(budget, 4)[0][0]["plan"]
            assert first_plan.inner_text().strip() == expected
            page.wait_for_selector("#plan-timeline .main-svg", timeout=15_000)
            assert page.locator("#moment-caption").inner_text().startswith("At the peak:")
            assert page.locator("#comparison .main-svg").count() > 0
            # the advice panel fills in from the worker: the rows advice_view gives
            titles = "#advice-table .ag-center-cols-container .ag-cell[col-id=title]"
            page.wait_for_selector(titles, timeout=15_000)
            advice_rows = board.advice_view()[0]
            assert page.locator(titles).count() == len(advice_rows)
            assert page.locator(titles).first.inner_text().strip() == advice_rows[0]["title"]
            # a click on the timeline answers with the storages alive at that moment
            clicked = click_timeline(page)
            sizes = page.locator("#moment-table .ag-center-cols-container "
                                 ".ag-cell[col-id=bytes]")
            assert sizes.count() > 0
            # byte counts stay numbers in the grid, shown in binary units
            assert re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", sizes.first.inner_text().strip())
            # the caption and the grid are the server's answer for the point clicked (the
            # page asks ui.clicks' route, not a Dash callback) ...
            click = {"points": [{"pointIndex": clicked}]}
            caption, rows = board.moment_table(2, click)
            assert page.locator("#moment-caption").inner_text() == caption
            drawn = page.evaluate(
                "Array.from(document.querySelectorAll('#moment-table "
                ".ag-center-cols-container .ag-row')).map(r => [Number(r.getAttribute("
                "'row-index')), r.getAttribute('row-id')])")
            assert drawn and all(rows[i]["row_id"] == row_id for i, row_id in drawn)
            # ... and the chart beside it follows (asked once the table is drawn)
            page.wait_for_function(
                "() => { const g = document.querySelector('#moment-breakdown .js-plotly-plot');"
                " return g && g.layout.title.text.includes('selected moment'); }",
                timeout=10_000)
            SCREENSHOTS.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / "dashboard.png"), full_page=True)
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    assert errors == [] and blocked == []


def click_timeline(page) -> int:
    """Click inside the timeline the way a user does: point at it until Plotly shows its
    hover label (its click event carries the hovered points), click, and wait for the
    dashboard's answer. The spot is 30% across, wherever the events fall: the x axis is
    time, and a click between two distant events must still pick the nearest one.

    Returns the index of the point the click event carried (as the page recorded it): once
    the answer is drawn the page may reflow under the resting pointer and plotly hover
    another point, so the hover data read afterwards is not the point clicked."""
    graph = page.locator("#timeline .nsewdrag").first
    graph.scroll_into_view_if_needed()
    box = graph.bounding_box()
    x, y = box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.5
    page.mouse.move(x - 5, y)
    page.mouse.move(x, y, steps=3)
    page.wait_for_selector("#timeline .hoverlayer .hovertext", timeout=10_000)
    page.mouse.click(x, y)
    page.wait_for_function("() => document.querySelector('#moment-caption')"
                           ".innerText.startsWith('At the selected moment')", timeout=10_000)
    return page.evaluate("window.memadvisorClicks.lastClick.points[0].pointIndex")
