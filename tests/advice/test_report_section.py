"""The HTML report's advice section: the advice on the trace's own device, escaped."""
from memadvisor.report.build import build_report
from memadvisor.report.html import render_html
from memadvisor.trace.io import read_trace

from .test_inplace import EVENTS
from .traces import write_events


def test_the_report_shows_suggested_and_refused_advice(tmp_path):
    trace = read_trace(write_events(tmp_path / "t.trace", EVENTS))
    data = build_report(trace)
    statuses = {(a["status"], a["location"]) for a in data.advice}
    assert ("suggested", "/work/model.py:11") in statuses
    assert ("refused", "/work/model.py:12") in statuses
    page = render_html(data, plotly_js="")
    section = page[page.index('<section id="advice">'):]
    section = section[:section.index("</section>")]
    assert "model.py:11" in section and "1.86 KiB" in section  # the relu's 1900 B
    assert "refused" in section and "saved it for backward" in section
    # after the plans, before the comparison and the steps
    assert page.index('id="plans"') < page.index('id="advice"') < page.index('id="steps"')


def test_a_trace_with_no_complete_step_says_why_there_is_no_advice(tmp_path):
    path = write_events(tmp_path / "t.trace", EVENTS, steps=0)
    data = build_report(read_trace(path))
    assert data.advice == [] and "advice unavailable" in data.advice_note
    assert "advice unavailable" in render_html(data, plotly_js="")
