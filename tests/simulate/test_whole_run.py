"""Reserved memory per step for CUDA traces no allocator reported on (fake execution, the
dispatch engine): the allocator model over the whole run, from a fresh process."""
from __future__ import annotations

import json
import subprocess
import sys

from memadvisor.report.synthetic import make_trace
from memadvisor.simulate.recorded_state import model_whole_run
from memadvisor.trace import read_trace
from memadvisor.trace.summary import summarize


def test_whole_run_per_step_peaks(tmp_path):
    trace = read_trace(make_trace(tmp_path / "t.trace", 4_000))
    run = model_whole_run(trace)
    summary = summarize(trace)
    assert set(run.steps) == {s["index"] for s in summary["steps"]}
    for step in summary["steps"]:
        allocated, reserved = run.steps[step["index"]]
        # blocks are the requests rounded up: never below the tensor-level peak
        assert step["peak_bytes"] <= allocated <= reserved
    # reserved memory is never given back: later steps keep what earlier ones cached
    reserved = [run.steps[i][1] for i in sorted(run.steps)]
    assert reserved == sorted(reserved)
    assert run.peak_reserved_bytes == reserved[-1]


def test_summary_models_reserved_for_a_cuda_trace(tmp_path):
    path = make_trace(tmp_path / "t.trace", 4_000)  # device cuda:0, no allocator record
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "summary", str(path),
                           "--json"], capture_output=True, text=True, check=True)
    data = json.loads(done.stdout)
    assert data["reserved_source"] == "modelled"
    assert data["reserved_bytes"] >= data["peak_bytes"] and data["segments"] > 0
    assert all(s["modelled_reserved_bytes"] >= s["peak_bytes"] for s in data["steps"])
    text = subprocess.run([sys.executable, "-m", "memadvisor.cli", "summary", str(path)],
                          capture_output=True, text=True, check=True).stdout
    assert "reserved per step:" in text and "the allocator model" in text
