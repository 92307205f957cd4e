"""The HTML report: self-contained, escaped, and showing the numbers summary computes."""
from __future__ import annotations

import base64
import gzip
import json
import re
import subprocess
import sys
import time

import pytest
from plotly.offline import get_plotlyjs

from memadvisor.report import write_report
from memadvisor.report.build import build_report
from memadvisor.report.html import render_html
from memadvisor.report.synthetic import HOSTILE_FILE, HOSTILE_MODULE, make_trace
from memadvisor.trace.io import read_trace
from memadvisor.trace.summary import summarize
from memadvisor.units import format_bytes

from report_fakes import install_fake_simulator

MIB = 1024**2
SIZE_LIMIT_BYTES = 2_500_000


def figures_of(page: str) -> dict:
    """The figures a report draws, with pooled arrays resolved (as its script does)."""
    payload = json.loads(re.search(r"var report=(\{.*?\});function resolve", page).group(1))

    def resolve(node):
        if isinstance(node, list):
            return [resolve(v) for v in node]
        if isinstance(node, dict):
            if "$pool" in node:
                return payload["pool"][node["$pool"]]
            return {k: resolve(v) for k, v in node.items()}
        return node

    return {k: resolve(v) for k, v in payload["figures"].items()}


@pytest.fixture(scope="module")
def page(traces):
    """A report with everything in it: budget, plans (from a stand-in simulator), baseline."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        install_fake_simulator(monkeypatch)
        return render_html(build_report(read_trace(traces["base"]), budget_bytes=100 * MIB,
                                        baseline=read_trace(traces["regressed"])))


def test_user_strings_appear_only_escaped(page):
    assert HOSTILE_MODULE not in page
    assert "<img src=x" not in page and HOSTILE_FILE not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the sites table's module cell
    assert "&lt;img src=x onerror=alert(2)&gt;.py" in page  # its source file
    # inside the figures' JSON no '<' is left raw: the module is there, escaped twice
    script = page[page.index("var report="):]
    assert "<" not in script[:script.index("</script>")]
    modules = figures_of(page)["fig-modules"]["data"][0]["y"]
    assert modules[0] == "&lt;script&gt;alert(1)&lt;/script&gt;"


def test_self_contained(page):
    plotly_js = get_plotlyjs()
    # plotly.js inlined once (gzipped, base64), not per figure, and unpacks to itself
    packed = re.findall(r'<script id="plotly-js-gzip" type="application/gzip;base64">'
                        r'([A-Za-z0-9+/=]+)</script>', page)
    assert len(packed) == 1
    assert gzip.decompress(base64.b64decode(packed[0])).decode() == plotly_js
    assert len(page) < len(plotly_js) / 2
    # nothing the browser would fetch: no src/href to anything, no remote fonts
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=", page)
    assert "@import" not in page and "fonts.googleapis" not in page
    assert "cdn.plot.ly" not in page.replace(plotly_js, "")


def test_headline_and_breakdown_are_summary_numbers(traces, page):
    summary = summarize(read_trace(traces["base"]))
    over = summary["peak_bytes"] - 100 * MIB
    assert over > 0
    headline = re.search(r'<div id="headline" class="headline over">(.*?)</div>', page).group(1)
    assert f"Peak {format_bytes(summary['peak_bytes'])} in step 2" in headline
    assert f"over by {format_bytes(over)}" in headline
    table = re.search(r'<table id="breakdown-table">(.*?)</table>', page).group(1)
    for category, size in summary["by_category"].items():
        assert f"<td class=\"\">{category}</td><td class=\"num\">{format_bytes(size)}</td>" \
            in table


def test_timeline_figure_has_one_trace_per_category(traces, page):
    timeline = figures_of(page)["fig-timeline"]
    names = [t["name"] for t in timeline["data"]]
    assert names == ["parameter", "gradient", "optimizer_state", "activation", "temporary",
                     "input"]
    assert all(t["stackgroup"] == "live" for t in timeline["data"])
    # peak marked, budget drawn, phases banded
    texts = [a["text"] for a in timeline["layout"]["annotations"]]
    peak = summarize(read_trace(traces["base"]))["peak_bytes"]
    assert any(f"peak {format_bytes(peak)}" in t for t in texts)
    assert "budget 100 MiB" in texts
    assert {"forward", "backward", "optimizer"} <= set(texts)


def test_sites_show_source_lines(tmp_path):
    source = tmp_path / "model.py"
    source.write_text("\n" * 39 + "x = big_tensor_here()\n")
    trace_path = make_trace(tmp_path / "t.trace", 3_000, hostile=False)
    trace = read_trace(trace_path)
    trace.meta.cwd = str(tmp_path)
    page = render_html(build_report(trace))
    sites = re.search(r'<table id="sites-table">(.*?)</table>', page).group(1)
    assert "<code>model.py:40</code>" in sites
    assert "<code>x = big_tensor_here()</code>" in sites


def test_without_simulator_the_plan_section_says_so(traces, no_simulator):
    page = render_html(build_report(read_trace(traces["base"]), budget_bytes=100 * MIB))
    assert ('id="plans-notice">plan predictions unavailable: simulator not installed in this '
            'version</p>') in page
    assert 'id="plan-table"' not in page


def test_plan_table_and_predicted_timeline(traces, fake_simulator):
    page = render_html(build_report(read_trace(traces["base"]), budget_bytes=100 * MIB,
                                    num_gpus=4))
    assert fake_simulator == [("advise", 100 * MIB, 4)]
    table = re.search(r'<table id="plan-table">(.*?)</table>', page).group(1)
    rows = re.findall(r"<tr( class=\"recommended\")?>(.*?)</tr>", table.split("</thead>")[1])
    assert len(rows) == 2
    assert rows[0][0] and "precision=amp-bf16" in rows[0][1]  # first plan that fits
    assert "&lt;b&gt;checkpoint=auto&lt;/b&gt;" in rows[1][1]
    assert "&lt;script&gt;alert(3)&lt;/script&gt;" in rows[1][1]
    assert "Recommended plan <code>precision=amp-bf16</code>" in page
    # the figures are the analytic model's, never executed by a report: said so
    assert "(fits, by the analytic model: not executed)" in page
    assert 'id="plans-basis">Analytic predictions: no plan was executed.' in page
    assert '<th class="">fits (analytic)</th>' in table and "analytic peak" in table
    predicted = figures_of(page)["fig-plan-timeline"]
    assert [t["name"] for t in predicted["data"]] == ["measured", "predicted"]


def test_plan_option_simulates_that_plan(traces, fake_simulator):
    data = build_report(read_trace(traces["base"]), plan_spec="precision=amp-bf16")
    assert fake_simulator == [("simulate", "precision=amp-bf16")]
    assert [p.plan for p in data.plans.predictions] == ["precision=amp-bf16"]
    assert data.headline.fits is None  # no budget: the headline does not judge


def test_baseline_comparison(traces):
    page = render_html(build_report(read_trace(traces["regressed"]),
                                    baseline=read_trace(traces["base"])))
    section = page[page.index('<section id="comparison">'):]
    base = summarize(read_trace(traces["base"]))["peak_bytes"]
    new = summarize(read_trace(traces["regressed"]))["peak_bytes"]
    assert f"peak {format_bytes(base)} → this trace {format_bytes(new)}" in section
    row = re.search(r"<tr><td class=\"\">activation</td>(.*?)</tr>", section).group(1)
    assert "+" in row
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in section  # hostile module changed too


def test_large_trace_report_is_fast_and_small(tmp_path):
    trace_path = make_trace(tmp_path / "big.trace", 100_000)
    started = time.perf_counter()
    out = write_report(str(trace_path), tmp_path / "r" / "memory.html", budget_bytes=MIB)
    elapsed = time.perf_counter() - started
    assert out.stat().st_size < SIZE_LIMIT_BYTES
    assert elapsed < 5
    timeline = figures_of(out.read_text())["fig-timeline"]
    assert len(timeline["data"]) == 6


def test_report_modules_import_neither_torch_nor_dash():
    code = ("import sys, memadvisor.report.build, memadvisor.report.html, "
            "memadvisor.report.gate, memadvisor.report.compare, memadvisor.ui.figures, "
            "memadvisor.commands.report, memadvisor.commands.check, "
            "memadvisor.commands.compare; "
            "bad = [m for m in ('torch', 'dash') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_report_says_where_a_run_runs_out_of_the_budget(tmp_path):
    """A budget under what the run needs: the report names the failing request and what
    was live (the allocator model's post-mortem); a budget it fits: no such section."""
    from memadvisor.report import write_report
    from memadvisor.report.synthetic import make_trace
    from memadvisor.trace import read_trace
    from memadvisor.trace.summary import summarize

    trace = make_trace(tmp_path / "t.trace", 2_000)
    peak = summarize(read_trace(trace))["peak_bytes"]
    over = write_report(trace, tmp_path / "over.html", budget_bytes=peak // 2).read_text()
    assert 'id="out-of-memory"' in over and "OUT OF MEMORY" in over
    fits = write_report(trace, tmp_path / "fits.html", budget_bytes=peak * 4).read_text()
    assert 'id="out-of-memory"' not in fits
