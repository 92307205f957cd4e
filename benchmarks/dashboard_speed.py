"""How the dashboard feels on a large trace, measured in a real browser (issue 16).

    python benchmarks/dashboard_speed.py [--events 1000000] [--edits 20] [--gpus 8]
                                         [--shape transformer|categories] [--check]

A synthetic trace, written first and not timed, is served by ``memadvisor ui`` in its own
process on a loopback port, as a user starts it.  ``--shape transformer`` (the default) is
``advise_speed``'s transformer-shaped step (24 blocks, batch 64: about 2,000 plans on 8
GPUs, the plan search of a real model); ``categories`` is ``report.synthetic``'s trace with
every category (9 plans: the page, not the search, is what costs).  The system Chromium
(Playwright, offline: any request off the loopback is refused) then measures:

- start-up: from the command's start until the server answers its page;
- page usable: from opening the page until the timeline is drawn and the plan table holds
  the first row of the ranking for ``--budget`` (the server already up);
- click: once the page has also drawn its first plan's prediction (its own loading done),
  five clicks at different places on the timeline (median and worst), each pointed at as a
  user does (the pointer moved onto the chart until plotly shows its labels) and timed by
  the page's clock from the button going up (the mouseup event's time stamp) to the first
  frame in which the caption and every row the grid draws are what the server sent for the
  clicked point (checked afterwards against the server asked again for that point).
  Beside it, the same clicks timed from Python (before Playwright's ``mouse.click``, until
  its poll sees them: that adds Playwright's move, press and release round trips and the
  poll's way back); and five more clicks elsewhere with the page's head start switched
  off ("asked at the click": the page asks for the point under a resting pointer, and at
  the press; here the request leaves at the click);
- re-rank: from typing a budget never asked for before (Enter) until the plan table shows
  its ranking and the headline the new budget, for ``--edits`` budgets in a shuffled order
  (median and worst);
- server memory: the server's RSS, and the PSS of the server and every process under it
  (a worker forked from it shares its pages: PSS counts them once), before the first edit
  and after the last.

Targets (issue 16, at 1M events): page usable <= 3 s; re-rank <= 2 s; click <= 0.1 s, the
worst of five, with and without the head start; RSS (and PSS) after the edits at most 10%
above its start.  ``--check`` exits 1 when one
is missed.  The load average is printed beside the figures: the machine may be shared.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

CHROMIUM = os.environ.get("MEMADVISOR_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TARGETS_S = {"page usable": 3.0, "re-rank (worst)": 2.0, "click (worst)": 0.1,
             "click, asked at the click (worst)": 0.1}
RSS_GROWTH_LIMIT = 0.10
GIB = 1024**3
PLAN_CELL = "#plan-table .ag-center-cols-container .ag-cell[col-id=plan]"
MOMENT_CELL = "#moment-table .ag-center-cols-container .ag-cell"
#: where the clicks land, as a fraction of the timeline's width
CLICKS_AT = (0.3, 0.55, 0.15, 0.8, 0.42)
COLD_CLICKS_AT = (0.62, 0.22, 0.7, 0.35, 0.9)
MOMENT_TIMEOUT_MS = int(os.environ.get("MOMENT_TIMEOUT_MS", 60_000))
#: presses are this far apart at least: closer, plotly may take the second for a double
#: click (a click train is 300 ms from its first press, ``doubleClickDelay``) and reset the
#: axes, a redraw of the whole timeline (0.1-0.2 s), not a click.  The benchmark used to
#: press again 0.15-0.3 s after a click's table was drawn: plotly counted 3 double clicks
#: in 5 clicks; 0.4 s apart it still did in one run of three, 0.6 s apart in none of two
DOUBLE_CLICK_S = 0.6
_LAST_CLICK = [0.0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _field_bytes(path: Path, name: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    return 0


def tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [pid]
    if children.exists():
        for child in children.read_text().split():
            found += tree(int(child))
    return found


def memory_bytes(pid: int) -> tuple[int, int, dict[int, int]]:
    """The server's own RSS, the PSS of it and every process under it (the worker and
    its helpers share pages with the server they were forked from: PSS counts a shared page
    once, split between them), and each of those processes' PSS by pid."""
    rss = _field_bytes(Path(f"/proc/{pid}/status"), "VmRSS")
    each = {}
    for member in tree(pid):
        try:
            each[member] = _field_bytes(Path(f"/proc/{member}/smaps_rollup"), "Pss")
        except (FileNotFoundError, ProcessLookupError):
            pass
    return rss, sum(each.values()), each


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def budgets_for(shape: str, peak_bytes: int, edits: int) -> tuple[int, list[int]]:
    """The budget the server starts with and one new budget per edit, in a shuffled order
    (each edit asks for a ranking the server has not made)."""
    if shape == "transformer":  # per GPU of 8, as advise_speed's 24GiB: 12-50 GiB
        first, values = 25 * GIB, [(12 + 2 * i) * GIB for i in range(20)]
    else:  # every plan's peak is near the measured one: 1.05-2.95 times it
        first, values = int(peak_bytes * 2), [int(peak_bytes * (1.05 + 0.1 * i))
                                              for i in range(20)]
    # a stride coprime with the count visits every value once, far apart in a row
    order = [values[(7 * i) % len(values)] for i in range(1, len(values) + 1)]
    while len(order) < edits:  # more edits than values: halfway between, still new
        order += [v + GIB // 2 for v in order[:edits - len(order)]]
    return first, order[:edits]


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


def point_at(page, fraction: float) -> tuple[float, float]:
    """Hover ``fraction`` across the timeline until Plotly shows its label (its click event
    carries the hovered points, as tests/ui's browser test does); returns the spot."""
    graph = page.locator("#timeline .nsewdrag").first
    graph.scroll_into_view_if_needed()
    box = graph.bounding_box()
    x, y = box["x"] + box["width"] * fraction, box["y"] + box["height"] * 0.5
    page.mouse.move(x - 5, y)
    page.mouse.move(x, y, steps=3)
    # one label per category (hovermode x), or the unified box of dashboards before it
    page.wait_for_selector("#timeline .hoverlayer .hovertext, #timeline .hoverlayer .legend",
                           timeout=10_000)
    return x, y


#: records every moment the server sends, keyed by the point asked for: ``ui.clicks``'
#: route (fetched by the page when a click or a resting pointer asks for it) or, from
#: dashboards before it, the Dash callback answering the timeline's ``clickData``; the point
#: of each click as plotly reports it to its listeners, and when the button went up; counts
#: the answers that re-send the timeline's figure
WATCH_MOMENTS = """() => {
  if (window.__watching) return;
  window.__watching = true;
  window.__answers = {};
  window.__clicked = null;
  window.__timelineSends = 0;
  const gd = document.querySelector('#timeline .js-plotly-plot');
  gd.on('plotly_click', event => {
    const point = event.points[0];
    // the figure names its step (ui.clicks); one from before does not: 'dash'
    const step = (gd.layout.meta || {}).step;
    window.__clicked = (step === undefined ? 'dash' : step) + ':' + (
      point.pointIndex !== undefined ? point.pointIndex : point.pointNumber);
  });
  document.addEventListener('mouseup', event => { window.__upAt = event.timeStamp; }, true);
  const keep = (key, caption, rows, route) => {
    window.__answers[key] = {caption: caption, route: route,
      rows: rows.map((r, i) => r.row_id === undefined ? String(i) : r.row_id)};
  };
  const fetched = window.fetch;
  window.fetch = async (...args) => {
    const answer = await fetched(...args);
    if (String(args[0]).includes('_memadvisor/moment')) {  // a moment's answer
      const asked = JSON.parse(args[1].body);
      answer.clone().json().then(body => {
        if (body.rows) keep(asked.step + ':' + asked.click.points[0].pointIndex,
                            body.caption, body.rows, true);
      }).catch(() => {});
    } else if (String(args[0]).includes('_dash-update-component')) {
      const asked = JSON.parse(args[1].body);
      answer.clone().json().then(body => {
        const response = body.response || {};
        if (response.timeline && response.timeline.figure
            && response.timeline.figure.data) window.__timelineSends += 1;
        const table = response['moment-table'];
        const click = (asked.inputs || []).find(i => i.property === 'clickData');
        if (table && table.rowData && click && click.value)
          keep('dash:' + click.value.points[0].pointIndex,
               response['moment-caption'].children, table.rowData, false);
      }).catch(() => {});
    }
    return answer;
  };
}"""
#: true once the caption and every row the grid draws are those the server sent for the
#: point the last click was on
MOMENT_SHOWN = """() => {
  const sent = window.__clicked && window.__answers[window.__clicked];
  if (!sent) return false;
  if (document.querySelector('#moment-caption').innerText !== sent.caption) return false;
  const rows = document.querySelectorAll('#moment-table .ag-center-cols-container .ag-row');
  if (!rows.length) return sent.rows.length === 0;
  return Array.from(rows).every(
    r => sent.rows[Number(r.getAttribute('row-index'))] === r.getAttribute('row-id'));
}"""
#: checks ``MOMENT_SHOWN`` at every frame from now on, and notes the first frame it holds in
START_WATCH = """() => {
  window.__clicked = null; window.__upAt = null; window.__shownAt = null;
  const shown = %s;
  const frame = () => { if (shown()) window.__shownAt = performance.now();
                        else requestAnimationFrame(frame); };
  requestAnimationFrame(frame);
}""" % MOMENT_SHOWN


def click_once(page, fraction: float, url: str) -> tuple[float, float]:
    """A click on the timeline, timed until the moment's caption and every row the grid
    draws are what the server sent for the clicked point (checked afterwards against the
    server asked again, by this process, for that point): seconds from the button going up
    to the first frame that draws them (the page's clock), and from before Playwright's
    ``mouse.click`` to its seeing them (which adds Playwright's own round trips: the move,
    the press and the release each wait for the page, then the poll's answer comes back)."""
    import json

    page.evaluate(WATCH_MOMENTS)
    # plotly counts a press within 300 ms of the last one as a double click (wherever it
    # lands), which resets the axes: a redraw of the whole timeline, not a click
    since_s = time.perf_counter() - _LAST_CLICK[0]
    if since_s < DOUBLE_CLICK_S:
        time.sleep(DOUBLE_CLICK_S - since_s)
    x, y = point_at(page, fraction)
    page.evaluate(START_WATCH)
    clicked = _LAST_CLICK[0] = time.perf_counter()
    page.mouse.click(x, y)
    page.wait_for_function("() => window.__shownAt !== null", timeout=MOMENT_TIMEOUT_MS,
                           polling="raf")
    outer_s = time.perf_counter() - clicked
    key, shown, up_ms, shown_ms = page.evaluate(
        "() => [window.__clicked, window.__answers[window.__clicked], window.__upAt,"
        " window.__shownAt]")
    if shown["route"]:
        step, index = (int(v) for v in key.split(":"))
        asked = json.dumps({"step": step, "click": {"points": [{"pointIndex": index}]}})
        with urllib.request.urlopen(urllib.request.Request(
                url + "_memadvisor/moment", asked.encode(),
                {"Content-Type": "application/json"})) as reply:
            again = json.loads(reply.read())
        if again["caption"] != shown["caption"] or [
                r["row_id"] for r in again["rows"]] != shown["rows"]:
            raise SystemExit(f"the table shown for point {key} is not the server's answer")
    return (shown_ms - up_ms) / 1e3, outer_s


def figure_sends(page) -> int:
    """How many answers since ``WATCH_MOMENTS`` carried the timeline's figure data."""
    return page.evaluate("() => window.__timelineSends || 0")


def measure(trace: Path, shape: str, peak_bytes: int, gpus: int, edits: int) -> dict:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    from memadvisor.units import format_bytes

    first, budgets = budgets_for(shape, peak_bytes, edits)
    proc, url, startup_s = start_server(trace, free_port(), first, gpus)
    result = {"start-up": startup_s, "load at start": load_average()}
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
                " return g && g.data && g.data.length > 0; }", timeout=300_000,
                polling="raf")
            result["timeline drawn"] = time.perf_counter() - opened
            page.wait_for_selector(PLAN_CELL, timeout=300_000)
            result["page usable"] = time.perf_counter() - opened
            # the page then draws, unasked, the first plan's predicted timeline (a plotly
            # chart as large as the timeline): the clicks are timed once it has, not against
            # the page's own loading
            try:
                page.wait_for_selector("#plan-timeline .main-svg", timeout=60_000)
                result["plan detail drawn"] = time.perf_counter() - opened
            except PlaywrightTimeout:  # no plan selected (none fits): nothing to wait for
                result["plan detail drawn"] = float("nan")
            page.evaluate(WATCH_MOMENTS)  # from here, count the figures sent: a click sends none
            clicks = [click_once(page, fraction, url) for fraction in CLICKS_AT]
            result["click (median)"] = statistics.median(c[0] for c in clicks)
            result["click (worst)"] = max(c[0] for c in clicks)
            result["click from Python (worst)"] = max(c[1] for c in clicks)
            result["clicks"] = clicks
            # the same without the page asking for the point under a resting pointer: the
            # request leaves at the click (what a click the pointer did not rest before
            # costs), elsewhere on the chart (no answer kept from the clicks above)
            cold = []
            if page.evaluate("() => window.memadvisorClicks !== undefined"):
                page.evaluate("() => { const c = window.memadvisorClicks;"
                              " c.prefetch = false; c.answers.clear(); }")
                cold = [click_once(page, fraction, url) for fraction in COLD_CLICKS_AT]
                page.evaluate("() => { window.memadvisorClicks.prefetch = true; }")
            result["click, asked at the click (median)"] = statistics.median(
                c[0] for c in cold) if cold else float("nan")
            result["click, asked at the click (worst)"] = max(
                c[0] for c in cold) if cold else float("nan")
            result["cold clicks"] = cold
            result["timeline sent again by clicks"] = figure_sends(page)

            memory_start = memory_bytes(proc.pid)
            times = []
            for budget in budgets:
                before_headline = page.locator("#headline").inner_text()
                box = page.locator("#budget")
                box.fill(str(budget))
                typed = time.perf_counter()
                box.press("Enter")
                # the ranking of this budget, not the "ranking ... in the background" note
                page.wait_for_function(
                    "([budget, headline, cell]) => {"
                    " const m = document.querySelector('#plan-message').innerText;"
                    " const h = document.querySelector('#headline').innerText;"
                    " const done = m.includes(budget + ' (usable')"
                    "   || (m.startsWith('no plans') && m.includes(budget));"
                    " return done && h !== headline &&"
                    "   (m.startsWith('no plans') || document.querySelector(cell) !== null); }",
                    arg=[format_bytes(budget), before_headline, PLAN_CELL], timeout=300_000,
                    polling="raf")
                times.append(time.perf_counter() - typed)
            result["re-rank (median)"] = statistics.median(times) if times else float("nan")
            result["re-rank (worst)"] = max(times) if times else float("nan")
            result["re-rank times"] = times
            result["budgets"] = budgets
            time.sleep(1.0)  # let the server finish what the last edit started
            result["memory start"] = memory_start
            result["memory after edits"] = memory_bytes(proc.pid)
            result["load at end"] = load_average()
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    result["js errors"] = errors
    result["blocked requests"] = blocked
    return result


def make_trace(shape: str, folder: Path, events: int) -> Path:
    if shape == "transformer":
        from advise_speed import synthetic_trace
        return Path(synthetic_trace(str(folder / "big.trace"), events))
    from memadvisor.report.synthetic import make_trace as categories_trace
    return categories_trace(folder / "big.trace", events, all_categories=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--edits", type=int, default=20)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--shape", choices=("transformer", "categories"),
                        default="transformer")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    from memadvisor.trace.io import read_trace
    from memadvisor.trace.summary import summarize
    with tempfile.TemporaryDirectory() as folder:
        trace = make_trace(args.shape, Path(folder), args.events)
        peak = summarize(read_trace(trace))["peak_bytes"]
        result = measure(trace, args.shape, peak, args.gpus, args.edits)
    print(f"dashboard on a {args.events:,}-event synthetic trace ({args.shape}), "
          f"{args.gpus} GPUs, {args.edits} budget edits; {os.cpu_count()} CPUs, load average "
          f"{result['load at start']} at the start, {result['load at end']} at the end")
    missed = []
    for name in ("start-up", "timeline drawn", "page usable", "plan detail drawn",
                 "click (median)",
                 "click (worst)", "click from Python (worst)",
                 "click, asked at the click (median)", "click, asked at the click (worst)",
                 "re-rank (median)", "re-rank (worst)"):
        target = TARGETS_S.get(name)
        if result[name] != result[name]:  # NaN: a dashboard without that path
            print(f"{name:<34}      n/a")
            continue
        verdict = "" if target is None else (
            f"  (target <= {target:g} s: {'met' if result[name] <= target else 'NOT met'})")
        if target is not None and result[name] > target:
            missed.append(name)
        print(f"{name:<34}{result[name]:>9.3f} s{verdict}")
    for name, runs in (("clicks", result["clicks"]), ("cold clicks", result["cold clicks"])):
        print(f"{name} (page / from Python):", " ".join(
            f"{a * 1e3:.0f}/{b * 1e3:.0f}" for a, b in runs), "ms")
    print("re-rank per edit:   ", " ".join(f"{t:.2f}" for t in result["re-rank times"]))
    sends = result["timeline sent again by clicks"]
    print(f"timeline figure sent again by the clicks: {sends} times (target 0)")
    if sends:
        missed.append("a click sends the timeline again")
    for index, what in enumerate(("server RSS", "server and worker PSS")):
        before, after = result["memory start"][index], result["memory after edits"][index]
        growth = after / max(before, 1) - 1
        # less memory after than before (a job was running at the start) is not a miss
        print(f"{what} {before / 2**20:.0f} MiB before the edits, {after / 2**20:.0f} MiB "
              f"after ({growth:+.1%}; target: at most {RSS_GROWTH_LIMIT:.0%} more: "
              f"{'met' if growth <= RSS_GROWTH_LIMIT else 'NOT met'})")
        if growth > RSS_GROWTH_LIMIT:
            missed.append(what)
    each = [result["memory start"][2], result["memory after edits"][2]]
    print("PSS by process (MiB, before -> after; the server first):", ", ".join(
        f"{pid}: {each[0].get(pid, 0) / 2**20:.0f} -> {each[1].get(pid, 0) / 2**20:.0f}"
        for pid in dict.fromkeys([*each[0], *each[1]])))
    if result["js errors"] or result["blocked requests"]:
        print(f"JS errors: {result['js errors']}; blocked: {result['blocked requests']}")
        missed.append("errors")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
