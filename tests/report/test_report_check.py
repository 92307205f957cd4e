"""`memadvisor check`: exit 0 fits, 1 over budget or regressed, 2 bad input; one line each."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from memadvisor.cli import main
from memadvisor.report.gate import Increase, regression_check
from memadvisor.trace.io import read_trace
from memadvisor.trace.summary import summarize
from memadvisor.units import format_bytes

MIB = 1024**2


def run(capsys, *argv):
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture(scope="module")
def peaks(traces):
    return {name: summarize(read_trace(path))["peak_bytes"] for name, path in traces.items()}


def test_within_budget_exits_0(capsys, traces, peaks):
    code, out, err = run(capsys, traces["base"], "--budget", str(peaks["base"]))
    assert code == 0, err
    assert out.strip() == (f"memadvisor check: ok   budget: peak {format_bytes(peaks['base'])} "
                           f"(step 2) fits the {format_bytes(peaks['base'])} budget, 0 B to "
                           f"spare (100.0% used)")


def test_one_byte_over_budget_exits_1(capsys, traces, peaks):
    code, out, err = run(capsys, traces["base"], "--budget", str(peaks["base"] - 1))
    assert code == 1
    assert err.strip().endswith("is over the " + format_bytes(peaks["base"] - 1) +
                                " budget by 1 B")
    assert len(err.strip().splitlines()) == 1


def test_regression_against_baseline_exits_1(capsys, traces, peaks):
    growth = (peaks["regressed"] - peaks["base"]) / peaks["base"]
    assert 0.05 < growth < 0.5  # activations x1.3 move the peak by this much
    code, out, err = run(capsys, traces["regressed"], "--budget", "1GiB",
                         "--baseline", traces["base"], "--max-increase", "5%")
    assert code == 1
    assert "ok   budget" in out
    assert f"FAIL regression: peak {format_bytes(peaks['regressed'])} vs baseline " \
           f"{format_bytes(peaks['base'])} (+{format_bytes(peaks['regressed'] - peaks['base'])}" \
           f", {100 * growth:+.1f}%), more than the allowed +5%" in err


def test_growth_within_allowance_exits_0(capsys, traces, peaks):
    allowed = f"{100 * (peaks['regressed'] - peaks['base']) / peaks['base'] + 1:.1f}%"
    code, _, err = run(capsys, traces["regressed"], "--baseline", traces["base"],
                       "--max-increase", allowed)
    assert code == 0, err
    # an absolute allowance: exactly the growth passes, one byte less fails
    growth = peaks["regressed"] - peaks["base"]
    assert run(capsys, traces["regressed"], "--baseline", traces["base"],
               "--max-increase", str(growth))[0] == 0
    assert run(capsys, traces["regressed"], "--baseline", traces["base"],
               "--max-increase", str(growth - 1))[0] == 1
    # shrinking never fails, even with no growth allowed
    assert run(capsys, traces["base"], "--baseline", traces["regressed"],
               "--max-increase", "0")[0] == 0


@pytest.mark.parametrize("argv, message", [
    (["{missing}", "--budget", "1GiB"], "no such trace file"),
    (["{garbage}", "--budget", "1GiB"], "not a readable trace file"),
    (["{base}", "--budget", "16 parsecs"], "not a size: '16 parsecs'"),
    (["{base}", "--budget", "0"], "size must be positive"),
    (["{base}", "--baseline", "{base}", "--max-increase", "lots"],
     "--max-increase: not a percentage or size"),
    (["{base}", "--baseline", "{missing}"], "no such trace file"),
    (["{base}"], "nothing to check"),
])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, traces, argv, message):
    garbage = tmp_path / "garbage.trace"
    garbage.write_bytes(b"this is not parquet at all")
    paths = {"missing": str(tmp_path / "nope.trace"), "garbage": str(garbage),
             "base": traces["base"]}
    code, out, err = run(capsys, *[a.format(**paths) for a in argv])
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("memadvisor: error: ") and message in err


def test_junit_has_one_testcase_per_check(capsys, tmp_path, traces, peaks):
    junit = tmp_path / "out" / "check.xml"
    code, _, _ = run(capsys, traces["regressed"], "--budget", str(peaks["regressed"]),
                     "--baseline", traces["base"], "--junit", str(junit))
    assert code == 1
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("2", "1", "0")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert set(cases) == {"budget", "regression"}
    assert cases["budget"].find("failure") is None
    failure = cases["regression"].find("failure")
    assert "more than the allowed +5%" in failure.get("message")


def test_junit_records_bad_input_as_an_error(capsys, tmp_path, traces):
    junit = tmp_path / "check.xml"
    code, _, _ = run(capsys, str(tmp_path / "nope.trace"), "--budget", "1GiB",
                     "--junit", str(junit))
    assert code == 2
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("errors") == "1"
    assert "no such trace file" in suite.find("testcase/error").get("message")


def test_increase_forms():
    assert Increase.parse("5%").allowed_bytes(1000) == 50
    assert Increase.parse("+2.5 %").allowed_bytes(1000) == 25
    assert Increase.parse("100MiB").allowed_bytes(1) == 100 * MIB
    assert Increase.parse("0").allowed_bytes(10**9) == 0
    assert Increase.parse("0%").allowed_bytes(10**9) == 0
    result = regression_check({"peak_bytes": 1050}, {"peak_bytes": 1000}, Increase(ratio=0.05))
    assert result.passed and result.limit_bytes == 1050
    result = regression_check({"peak_bytes": 1051}, {"peak_bytes": 1000}, Increase(ratio=0.05))
    assert not result.passed


def test_a_run_without_a_complete_step_is_bad_input(capsys, tmp_path):
    from memadvisor.report.synthetic import make_trace

    path = make_trace(tmp_path / "zero.trace", 100, steps=0)
    code, out, err = run(capsys, str(path), "--budget", "1GiB")
    assert code == 2  # passing it would let a run that crashed at once through the gate
    assert "completed no training step" in err


def test_a_run_that_failed_later_is_judged_on_its_last_complete_step(capsys, tmp_path, traces,
                                                                     peaks):
    from memadvisor.trace.io import write_trace

    trace = read_trace(traces["base"])
    trace.meta.status, trace.meta.error = "error", "CUDA out of memory"
    path = write_trace(tmp_path / "failed.trace", trace.events, trace.meta)
    code, out, _ = run(capsys, str(path), "--budget", str(peaks["base"]))
    assert code == 0
    assert out.strip().endswith("(the run ended with status error)")
