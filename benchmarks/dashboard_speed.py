"""How the dashboard feels on a large trace, measured in a real browser (issue 16).

    python benchmarks/dashboard_speed.py [--events 1000000] [--edits 20] [--gpus 4]

A synthetic trace (``memadvisor.report.synthetic``, all nine categories, not timed) is served
by ``memadvisor ui`` in its own process on a loopback port, as a user starts it; the system
Chromium (Playwright, offline: any request off the loopback is refused) then measures:

- start-up: from the command's start until the server answers its page;
- page usable: from opening the page until the timeline is drawn and the plan table holds
  its first row (the server already up);
- re-rank: from typing a new budget (Enter) until the plan table shows the new ranking and
  the headline the new budget, for ``--edits`` budgets alternating between 1.5 and 2 times
  the peak (the rankings differ; the median and the worst are printed);
- click: from a click on the timeline until the table of what is alive there is filled;
- server memory: the server process's RSS before the first edit and after the last.

Targets (issue 16, at 1M events): page usable <= 3 s; re-rank <= 2 s; click <= 0.1 s;
RSS after the edits within 10% of its start.  ``--check`` exits 1 when one is missed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHROMIUM = os.environ.get("MEMADVISOR_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TARGETS_S = {"page usable": 3.0, "re-rank (worst)": 2.0, "click": 0.1}
RSS_GROWTH_LIMIT = 0.10
PLAN_CELL = "#plan-table .ag-center-cols-container .ag-cell[col-id=plan]"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start_server(trace: Path, port: int, budget: int, gpus: int):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memadvisor.cli", "ui", str(trace), "--port", str(port),
         "--no-browser", "--budget", str(budget), "--gpus", str(gpus)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"memadvisor ui exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                answer.read()
            return proc, url, time.perf_counter() - started
        except OSError:
            time.sleep(0.05)


def plan_rows(page) -> str:
    return page.evaluate(
        "() => Array.from(document.querySelectorAll('#plan-table .ag-center-cols-container "
        ".ag-row')).map(r => r.innerText).join('|')")


def click_timeline(page) -> None:
    """Click 30% across the timeline as a user does: hover until Plotly shows its label
    (its click event carries the hovered points), then click (as tests/ui's browser test)."""
    graph = page.locator("#timeline .nsewdrag").first
    graph.scroll_into_view_if_needed()
    box = graph.bounding_box()
    x, y = box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.5
    page.mouse.move(x - 5, y)
    page.mouse.move(x, y, steps=3)
    page.wait_for_selector("#timeline .hoverlayer .legend", timeout=10_000)
    page.mouse.click(x, y)
    page.wait_for_function("() => document.querySelector('#moment-caption')"
                           ".innerText.startsWith('At the selected moment')", timeout=60_000)


def measure(trace: Path, peak_bytes: int, gpus: int, edits: int) -> dict:
    from playwright.sync_api import sync_playwright

    # two budgets whose rankings differ on the synthetic trace (at 1.5x fewer plans fit)
    budgets = [int(peak_bytes * 2.0), int(peak_bytes * 1.5)]
    proc, url, startup_s = start_server(trace, free_port(), budgets[0], gpus)
    result = {"start-up": startup_s}
    blocked: list[str] = []
    errors: list[str] = []
    executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    try:
        with sync_playwright() as p:
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
            opened = time.perf_counter()
            page.goto(url)
            page.wait_for_function(
                "() => { const g = document.querySelector('#timeline .js-plotly-plot');"
                " return g && g.data && g.data.length > 0; }", timeout=300_000)
            result["timeline drawn"] = time.perf_counter() - opened
            page.wait_for_selector(PLAN_CELL, timeout=300_000)
            result["page usable"] = time.perf_counter() - opened

            clicked = time.perf_counter()
            click_timeline(page)
            page.wait_for_selector("#moment-table .ag-center-cols-container .ag-cell",
                                   timeout=60_000)
            result["click"] = time.perf_counter() - clicked

            rss_start = rss_bytes(proc.pid)
            times = []
            for index in range(edits):
                budget = budgets[(index + 1) % 2]
                before_rows = plan_rows(page)
                before_headline = page.locator("#headline").inner_text()
                box = page.locator("#budget")
                box.fill(str(budget))
                typed = time.perf_counter()
                box.press("Enter")
                page.wait_for_function(
                    "([rows, headline]) => {"
                    " const now = Array.from(document.querySelectorAll("
                    "   '#plan-table .ag-center-cols-container .ag-row'))"
                    "   .map(r => r.innerText).join('|');"
                    " const h = document.querySelector('#headline').innerText;"
                    " return now.length > 0 && now !== rows && h !== headline; }",
                    arg=[before_rows, before_headline], timeout=300_000)
                times.append(time.perf_counter() - typed)
            result["re-rank (median)"] = statistics.median(times) if times else float("nan")
            result["re-rank (worst)"] = max(times) if times else float("nan")
            result["rss start"] = rss_start
            result["rss after edits"] = rss_bytes(proc.pid)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    result["js errors"] = errors
    result["blocked requests"] = blocked
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--edits", type=int, default=20)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    from memadvisor.report.synthetic import make_trace
    from memadvisor.trace.io import read_trace
    from memadvisor.trace.summary import summarize
    with tempfile.TemporaryDirectory() as folder:
        trace = make_trace(Path(folder) / "big.trace", args.events, all_categories=True)
        peak = summarize(read_trace(trace))["peak_bytes"]
        result = measure(trace, peak, args.gpus, args.edits)
    print(f"dashboard on a {args.events:,}-event synthetic trace, {args.edits} budget edits")
    missed = []
    for name in ("start-up", "timeline drawn", "page usable", "click", "re-rank (median)",
                 "re-rank (worst)"):
        target = TARGETS_S.get(name)
        verdict = "" if target is None else (
            f"  (target <= {target:g} s: {'met' if result[name] <= target else 'NOT met'})")
        if target is not None and result[name] > target:
            missed.append(name)
        print(f"{name:<20}{result[name]:>9.3f} s{verdict}")
    growth = result["rss after edits"] / max(result["rss start"], 1) - 1
    print(f"server RSS {result['rss start'] / 2**20:.0f} MiB before the edits, "
          f"{result['rss after edits'] / 2**20:.0f} MiB after ({growth:+.1%}; target within "
          f"{RSS_GROWTH_LIMIT:.0%}: {'met' if abs(growth) <= RSS_GROWTH_LIMIT else 'NOT met'})")
    if abs(growth) > RSS_GROWTH_LIMIT:
        missed.append("server RSS")
    if result["js errors"] or result["blocked requests"]:
        print(f"JS errors: {result['js errors']}; blocked: {result['blocked requests']}")
        missed.append("errors")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
