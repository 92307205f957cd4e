"""`memadvisor compare`: per category and per module, at the peak and in total."""
from __future__ import annotations

import json

import pytest

from memadvisor.cli import main
from memadvisor.report.compare import compare_traces, step_profile
from memadvisor.report.synthetic import HOSTILE_MODULE, MIB
from memadvisor.trace.io import read_trace
from memadvisor.trace.summary import summarize


def rows_by_name(rows):
    return {r["name"]: r for r in rows}


def test_analysed_step_matches_summary(traces):
    trace = read_trace(traces["base"])
    summary = summarize(trace)
    profile = step_profile(trace)
    assert profile["step"] == summary["analysed_step"]
    assert profile["peak_bytes"] == summary["peak_bytes"]
    assert profile["at_peak_by_category"] == summary["by_category"]
    assert sum(profile["at_peak_by_module"].values()) == summary["peak_bytes"]


def test_activation_growth_is_attributed(traces):
    result = compare_traces(read_trace(traces["base"]), read_trace(traces["regressed"]))
    # 8 layers of 3 modules; the hostile one saves 1.5x; activations scaled by 1.3
    old, new = 2 * MIB, int(2 * MIB * 1.3)
    expected = 23 * (new - old) + (new * 3 // 2 - old * 3 // 2)
    categories = rows_by_name(result["by_category"])
    assert categories["activation"]["peak_change_bytes"] == expected
    assert categories["parameter"]["peak_change_bytes"] == 0
    assert result["peak_change_bytes"] == sum(r["peak_change_bytes"]
                                              for r in result["by_category"])
    modules = rows_by_name(result["by_module"])
    assert modules[HOSTILE_MODULE]["peak_change_bytes"] == new * 3 // 2 - old * 3 // 2
    assert result["by_module"][0]["name"] == HOSTILE_MODULE  # the largest change first


def test_steps_of_one_trace(traces):
    trace = read_trace(traces["base"])
    result = compare_traces(trace, trace, step_a=0, step_b=2)
    categories = rows_by_name(result["by_category"])
    # Adam's state is made in step 0 only, so step 0 peaks in its optimizer step (after the
    # activations are gone) and later steps peak at the end of the forward
    assert categories["optimizer_state"]["a_allocated_bytes"] == 24 * 2 * MIB
    assert categories["optimizer_state"]["b_allocated_bytes"] == 0
    assert result["a"]["peak"]["phase"] == "optimizer"
    assert result["b"]["peak"]["phase"] == "backward"
    assert categories["activation"]["a_peak_bytes"] == 0
    assert categories["activation"]["b_peak_bytes"] == 23 * 2 * MIB + 3 * MIB


def test_cli_json_and_text(capsys, traces):
    assert main(["compare", traces["base"], traces["regressed"], "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"a", "b", "peak_change_bytes", "peak_change_ratio",
                           "by_category", "by_module"}
    assert result["peak_change_bytes"] > 0
    assert main(["compare", traces["base"], "--step-a", "0", "--step-b", "2"]) == 0
    text = capsys.readouterr().out
    assert "step 0" in text and "step 2" in text and text.count("peak:") == 1


@pytest.mark.parametrize("argv", [["--step-a", "9"], ["{missing}"]])
def test_cli_bad_input_exits_2(capsys, tmp_path, traces, argv):
    argv = [a.format(missing=tmp_path / "nope.trace") for a in argv]
    assert main(["compare", traces["base"], *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
