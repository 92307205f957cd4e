"""What a client posts to the dashboard's callbacks is not trusted: a malformed or hostile
request is answered (a generic 4xx/5xx, or the page's own 'select a plan' text) and leaves
at most one line on the server's terminal, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from memadvisor.report.synthetic import make_trace

CHECKOUT = Path(__file__).resolve().parents[2]


def _callback(output: str, inputs: list, state: list | None = None) -> dict:
    component, prop = output.split(".")
    return {"output": output, "outputs": {"id": component, "property": prop},
            "inputs": inputs, "state": state or [], "changedPropIds": []}


def _value(component: str, prop: str, value) -> dict:
    return {"id": component, "property": prop, "value": value}


BODIES = [
    b"[]",                                     # not an object
    b'{"output": 3}',                          # dash's own fields of the wrong type
    json.dumps(_callback("nowhere.children", [])).encode(),  # no such callback
    # the plan detail with rows that are not rows and a selection that is not a list
    json.dumps(_callback("plan-detail.children",
                         [_value("plan-table", "selectedRows", {"plan": "x"})],
                         [_value("plan-table", "rowData", ["not a row", 7]),
                          _value("budget", "value", "1GiB")])).encode(),
    json.dumps(_callback("plan-detail.children",
                         [_value("plan-table", "selectedRows", [{"plan": ["/etc/passwd"]}])],
                         [_value("plan-table", "rowData", [{"plan": ["/etc/passwd"]}]),
                          _value("budget", "value", "1GiB")])).encode(),
    # the timeline with a step that is an object and a click that is not Plotly's
    json.dumps({"output": "..timeline.figure...timeline-caption.children..",
                "outputs": [{"id": "timeline", "property": "figure"},
                            {"id": "timeline-caption", "property": "children"}],
                "inputs": [_value("step", "value", {"a": []}), _value("budget", "value", None),
                           _value("timeline", "clickData", {"points": "x"})],
                "state": [], "changedPropIds": []}).encode(),
]


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    trace = make_trace(tmp_path_factory.mktemp("ui") / "t.trace", 300)
    proc = subprocess.Popen(
        [sys.executable, "-m", "memadvisor.cli", "ui", str(trace), "--port", "0",
         "--no-browser"], env={**os.environ, "PYTHONPATH": str(CHECKOUT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    announced = proc.stdout.readline()
    assert "dashboard at http://" in announced, proc.stderr.read()
    yield proc, announced.split(" at ")[1].split()[0]
    proc.terminate()
    proc.wait(timeout=30)


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url + "_dash-update-component", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_malformed_callbacks_leave_one_line_each_and_no_traceback(dashboard):
    proc, url = dashboard
    answers = [_post(url, body) for body in BODIES]
    # a good request still works afterwards
    good = _post(url, json.dumps(_callback("headline.children", [
        _value("budget", "value", "1TiB"), _value("gpus", "value", 1)])).encode())
    assert good[0] == 200 and b"fits" in good[1], good
    proc.terminate()
    proc.wait(timeout=30)
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr[:3000]
    failed = [a for a in answers if a[0] >= 500]
    lines = [line for line in stderr.splitlines() if "failed" in line]
    assert len(lines) == len(failed), (answers, stderr)
    assert all(line.startswith("memadvisor: dashboard: POST /_dash-update-component failed (")
               for line in lines), lines
    for status, body in answers:
        assert status == 200 or 400 <= status < 600, (status, body)
        assert b"passwd" not in body or status == 200 and b"root:" not in body
