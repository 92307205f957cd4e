"""Decimating a step's timeline: peaks survive, the stack adds up."""
from __future__ import annotations

import numpy as np
import pytest

from memadvisor.report.timeline import extreme_positions, phase_bands, step_timeline
from memadvisor.trace import analysis
from memadvisor.trace.io import read_trace
from memadvisor.trace.summary import summarize


def test_each_bucket_keeps_its_min_and_max():
    rng = np.random.default_rng(0)
    values = np.cumsum(rng.integers(-100, 101, size=100_003))
    buckets = 500
    kept = extreme_positions(values, buckets)
    assert len(kept) <= 2 * buckets + 2
    assert kept[0] == 0 and kept[-1] == len(values) - 1
    width = -(-len(values) // buckets)
    kept_set = set(kept.tolist())
    for start in range(0, len(values), width):
        chunk = values[start:start + width]
        # some position of this bucket holding its max (and its min) was kept
        assert any(start + i in kept_set for i in np.flatnonzero(chunk == chunk.max()))
        assert any(start + i in kept_set for i in np.flatnonzero(chunk == chunk.min()))


def test_short_series_are_not_decimated():
    values = np.arange(50)
    assert extreme_positions(values, 100).tolist() == list(range(50))


def test_kept_positions_are_included():
    values = np.zeros(10_000)
    kept = extreme_positions(values, 10, keep=(1234, 5678))
    assert {1234, 5678} <= set(kept.tolist())


@pytest.mark.parametrize("buckets", [20, 1000])
def test_timeline_stack_adds_up_and_keeps_the_peak(traces, buckets):
    trace = read_trace(traces["base"])
    summary = summarize(trace)
    timeline = step_timeline(trace, max_buckets=buckets)
    assert timeline.step == summary["analysed_step"] == 2
    assert timeline.peak_bytes == summary["peak_bytes"]
    # the drawn total reaches the peak exactly, and the stack sums to it at every point
    assert int(timeline.total_bytes.max()) == summary["peak_bytes"]
    stacked = sum(timeline.by_category.values())
    assert np.array_equal(stacked, timeline.total_bytes)
    assert timeline.points <= 2 * buckets + 2 + 1 + len(timeline.by_category)
    if buckets == 20:
        assert timeline.points < timeline.events_in_step / 10


def test_timeline_categories_are_those_alive_in_the_step(traces):
    trace = read_trace(traces["base"])
    timeline = step_timeline(trace)
    # parameters were made before the step and have no event in it, yet are drawn
    assert list(timeline.by_category) == ["parameter", "gradient", "optimizer_state",
                                          "activation", "temporary", "input"]
    events = trace.events
    window = analysis.step_slice(events, 2)
    for category, values in timeline.by_category.items():
        full = analysis.category_series(events, category)[window]
        assert values.max() == full.max(), category  # each category's own peak is kept


def test_phase_bands_follow_the_step(traces):
    timeline = step_timeline(read_trace(traces["base"]))
    assert [b.phase for b in timeline.phases] == ["forward", "backward", "optimizer"]
    starts = [b.start_ms for b in timeline.phases]
    assert starts == sorted(starts)
    assert timeline.phases[0].end_ms == timeline.phases[1].start_ms
    # the synthetic peak is the first backward temporary, right after the forward ends
    assert timeline.phases[1].start_ms <= timeline.peak_ms <= timeline.phases[1].end_ms


def test_interleaved_phases_merge_into_one_band_each():
    phases = np.array(["forward", "other"] * 100 + ["backward"] * 10, dtype=object)
    bands = phase_bands(phases, np.arange(len(phases), dtype=float))
    assert [(b.phase, b.start_ms, b.end_ms) for b in bands] == \
        [("forward", 0.0, 199.0), ("backward", 200.0, 209.0)]
