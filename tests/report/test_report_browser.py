"""The HTML report in a real browser, offline: no JS error, charts drawn, plan table there.

System Chromium driven by Playwright (see docs/REPORTS.md); skipped where either is
missing.  Every request that is not for the report file itself is blocked and recorded,
so a report that needs the network fails here.  Screenshots go to ``reports/`` at the
repository root (CI uploads that folder).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from memadvisor.report import write_report
from memadvisor.report.build import build_report
from memadvisor.report.html import render_html, write_html
from memadvisor.trace.io import read_trace

from report_fakes import install_fake_simulator

from browser_support import ARGS, CHROMIUM, MARKS, SCREENSHOTS  # noqa: E402

pytestmark = MARKS
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed")


@pytest.fixture(scope="module")
def browser():
    executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=ARGS)
        yield browser
        browser.close()


def open_offline(browser, path: Path):
    """The report opened from disk with every other request blocked; returns the page and
    the lists of blocked requests, JS errors and dialogs (an ``alert`` is an injection)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    seen = {"blocked": [], "errors": [], "dialogs": []}
    own = path.resolve().as_uri()

    def guard(route):
        url = route.request.url
        if url == own or url.startswith("http://127.0.0.1"):
            return route.continue_()
        seen["blocked"].append(url)
        return route.abort()

    context.route("**/*", guard)
    page = context.new_page()
    page.on("pageerror", lambda exc: seen["errors"].append(str(exc)))
    page.on("dialog", lambda dialog: (seen["dialogs"].append(dialog.message), dialog.dismiss()))
    page.goto(own)
    page.wait_for_function("() => { const t = document.getElementById('fig-timeline');"
                           " return t && t.data && document.querySelector('#fig-timeline svg'); }",
                           timeout=15_000)
    return page, seen


def plot_names(page, div_id: str) -> list[str]:
    return page.evaluate(f"document.getElementById('{div_id}').data.map(t => t.name)")


def test_full_report_offline(browser, tmp_path, traces):
    with pytest.MonkeyPatch.context() as monkeypatch:
        install_fake_simulator(monkeypatch)
        data = build_report(read_trace(traces["regressed"]), budget_bytes=100 * 1024**2,
                            baseline=read_trace(traces["base"]))
    path = write_html(tmp_path / "memory.html", render_html(data))
    page, seen = open_offline(browser, path)
    try:
        assert seen == {"blocked": [], "errors": [], "dialogs": []}
        # one trace per category present in the step, in the same order
        assert plot_names(page, "fig-timeline") == list(data.timeline.by_category)
        assert len(plot_names(page, "fig-timeline")) == 6
        for div in ("fig-breakdown", "fig-modules", "fig-plan-timeline", "fig-comparison"):
            assert page.evaluate(f"document.querySelectorAll('#{div} .main-svg').length") > 0
        rows = page.locator("#plan-table tbody tr")
        assert rows.count() == 2
        assert "precision=amp-bf16" in page.locator("#plan-table tr.recommended").inner_text()
        # the hostile module is shown as text, not run as markup
        assert "<script>alert(1)</script>" in page.locator("#sites-table").inner_text()
        tick_texts = page.evaluate(
            "Array.from(document.querySelectorAll('#fig-modules .ytick text'))"
            ".map(t => t.textContent)")
        assert "<script>alert(1)</script>" in tick_texts
        SCREENSHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "report-synthetic.png"), full_page=True)
    finally:
        page.context.close()


def test_real_example_report_offline(browser, tmp_path, example_runs):
    run = example_runs.get("gpt_lm")
    path = write_report(str(run.trace_path), tmp_path / "gpt_lm.html",
                        budget_bytes=2 * 1024**2, num_gpus=4)
    page, seen = open_offline(browser, path)
    try:
        assert seen == {"blocked": [], "errors": [], "dialogs": []}
        categories = page.evaluate("document.getElementById('fig-timeline').data.length")
        assert categories == len(build_report(run.trace).timeline.by_category) >= 5
        assert page.locator("#headline").inner_text().startswith("Peak ")
        # the plan section: a table where the simulator is installed, else the notice
        assert page.locator("#plan-table").count() + page.locator("#plans-notice").count() == 1
        SCREENSHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "report-gpt_lm.png"), full_page=True)
    finally:
        page.context.close()
