"""Live bytes, peaks, lifetimes and the summary on a trace small enough to add up by hand."""
from __future__ import annotations

import numpy as np
import pytest

from memadvisor.trace import COLUMN_NAMES, Trace, TraceMeta, events_table, read_trace, write_trace
from memadvisor.trace import analysis
from memadvisor.trace.summary import summarize, summary_text

#: (action, storage_id, size, category, step, phase, module)
#: step 0 and step 1 are complete (2 optimizer steps); step 2 is a partial forward
ROWS = [
    ("alloc", 0, 100, "parameter", 0, "other", "fc"),          # live 100
    ("alloc", 1, 40, "input", 0, "other", ""),                 # 140
    ("alloc", 2, 60, "activation", 0, "forward", "blocks.0"),  # 200
    ("alloc", 3, 30, "temporary", 0, "forward", "blocks.0"),   # 230
    ("free", 3, 30, "temporary", 0, "forward", "blocks.0"),    # 200
    ("alloc", 4, 100, "gradient", 0, "backward", "fc"),        # 300
    ("free", 2, 60, "activation", 0, "backward", "blocks.0"),  # 240
    ("alloc", 5, 200, "optimizer_state", 0, "optimizer", "fc"),  # 440  <- peak of step 0
    ("free", 1, 40, "input", 1, "other", ""),                  # 400
    ("free", 4, 100, "gradient", 1, "other", "fc"),            # 300
    ("alloc", 6, 40, "input", 1, "other", ""),                 # 340
    ("alloc", 7, 80, "activation", 1, "forward", "blocks.0"),  # 420
    ("alloc", 8, 50, "temporary", 1, "forward", "blocks.1"),   # 470
    ("free", 8, 50, "temporary", 1, "forward", "blocks.1"),    # 420
    ("alloc", 9, 100, "gradient", 1, "backward", "fc"),        # 520  <- peak of step 1
    ("free", 7, 80, "activation", 1, "backward", "blocks.0"),  # 440
    ("alloc", 10, 20, "temporary", 1, "optimizer", ""),        # 460
    ("free", 10, 20, "temporary", 1, "optimizer", ""),         # 440
    ("alloc", 11, 1000, "activation", 2, "forward", "blocks.1"),  # 1440  <- partial step
]
LIVE = [100, 140, 200, 230, 200, 300, 240, 440, 400, 300, 340, 420, 470, 420, 520, 440, 460,
        440, 1440]


def build_events():
    n = len(ROWS)
    actions, sids, sizes, categories, steps, phases, modules = zip(*ROWS)
    return events_table({
        "seq": np.arange(n), "time_ns": np.arange(n) * 1000, "action": list(actions),
        "storage_id": list(sids), "size_bytes": list(sizes), "device": ["cpu"] * n,
        "dtype": ["float32"] * n, "shape": ["10"] * n, "category": list(categories),
        "op": ["aten::mm"] * n, "module": list(modules), "phase": list(phases),
        "step": list(steps), "source_file": ["/u/train.py"] * n,
        # one source line per storage, so sites do not merge
        "source_line": [10 + sid for sid in sids], "source_function": ["main"] * n,
    })


@pytest.fixture
def trace(tmp_path) -> Trace:
    meta = TraceMeta(steps_completed=2, steps=[
        {"index": 0, "start_ns": 0, "end_ns": 7500, "duration_s": 7.5e-6, "peak_bytes": 440},
        {"index": 1, "start_ns": 7500, "end_ns": 17500, "duration_s": 1e-5, "peak_bytes": 520},
    ], parameter_bytes=100)
    path = tmp_path / "hand.trace"
    write_trace(path, build_events(), meta)
    return read_trace(path)


def test_live_bytes(trace):
    assert analysis.live_bytes(trace.events).tolist() == LIVE


def test_step_slices(trace):
    assert analysis.step_slice(trace.events, 0) == slice(0, 8)
    assert analysis.step_slice(trace.events, 1) == slice(8, 18)
    assert analysis.step_slice(trace.events, 2) == slice(18, 19)
    assert analysis.step_slice(trace.events, None) == slice(0, 19)
    assert analysis.analysed_step(trace) == 1


def test_peaks(trace):
    live = analysis.live_bytes(trace.events)
    assert analysis.peak_in(live, slice(0, 8)) == (7, 440)
    assert analysis.peak_in(live, slice(8, 18)) == (14, 520)
    assert analysis.peak_in(live, slice(5, 5)) == (-1, 0)
    assert [(s["index"], s["peak_bytes"], s["peak_seq"])
            for s in analysis.step_peaks(trace.events, live)] == \
        [(0, 440, 7), (1, 520, 14), (2, 1440, 18)]


def test_lifetimes_and_what_is_alive(trace):
    lives = analysis.lifetimes(trace.events).set_index("storage_id")
    assert lives.loc[3, ["alloc_pos", "free_pos"]].tolist() == [3, 4]
    assert lives.loc[0, "free_pos"] == len(ROWS)  # never freed
    assert lives.loc[11, ["alloc_pos", "free_pos"]].tolist() == [18, 19]
    alive = analysis.alive_at(analysis.lifetimes(trace.events), 14)
    assert sorted(alive["storage_id"]) == [0, 5, 6, 7, 9]
    assert analysis.by_category(alive) == {
        "parameter": 100, "gradient": 100, "optimizer_state": 200, "activation": 80,
        "input": 40}


def test_category_series(trace):
    assert analysis.category_series(trace.events, "gradient").tolist() == \
        [0, 0, 0, 0, 0, 100, 100, 100, 100, 0, 0, 0, 0, 0, 100, 100, 100, 100, 100]


def test_summary_figures_add_up(trace):
    summary = summarize(trace)
    assert summary["analysed_step"] == 1
    assert summary["peak_bytes"] == 520
    assert summary["peak"]["seq"] == 14
    assert summary["peak"]["phase"] == "backward"
    assert summary["by_category"] == {
        "parameter": 100, "gradient": 100, "optimizer_state": 200, "activation": 80,
        "input": 40}
    assert sum(summary["by_category"].values()) == summary["peak_bytes"]
    assert summary["gradient_bytes"] == 100
    assert summary["optimizer_state_bytes"] == 200
    assert summary["parameter_bytes"] == 100
    assert [(s["index"], s["peak_bytes"], s["duration_s"]) for s in summary["steps"]] == \
        [(0, 440, 7.5e-6), (1, 520, 1e-5), (2, 1440, None)]
    sites = summary["top_sites"]
    assert sum(site["bytes"] for site in sites) == 520
    assert sites[0]["category"] == "optimizer_state" and sites[0]["bytes"] == 200
    assert sites[0]["source_line"] == 15
    assert len(summarize(trace, top=2)["top_sites"]) == 2
    assert summary["top_activation_modules"] == [{"module": "blocks.0", "bytes": 80}]


def test_summary_without_a_complete_step_covers_the_whole_run(trace):
    trace.meta.steps_completed = 0
    summary = summarize(trace)
    assert summary["analysed_step"] is None
    assert summary["peak_bytes"] == 1440
    assert sum(summary["by_category"].values()) == 1440


def test_summary_of_an_empty_trace(tmp_path):
    path = tmp_path / "empty.trace"
    write_trace(path, events_table({name: [] for name in COLUMN_NAMES}), TraceMeta())
    summary = summarize(read_trace(path))
    assert summary["peak_bytes"] == 0
    assert summary["by_category"] == {}
    assert summary["steps"] == []
    assert "peak" in summary_text(summary)


def test_summary_text_names_the_peak_and_the_categories(trace):
    text = summary_text(summarize(trace))
    assert "peak: 520 B in step 1" in text
    assert "during backward" in text
    for category in ("optimizer_state", "parameter", "gradient", "activation", "input"):
        assert category in text
    # categories largest first
    assert text.index("optimizer_state") < text.index("activation")
