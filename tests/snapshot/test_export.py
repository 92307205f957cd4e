"""Traces written as snapshots that torch's own memory_viz reads, and back."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from memadvisor.snapshot import load_snapshot
from memadvisor.snapshot.exporter import export_snapshot
from memadvisor.snapshot.importer import import_snapshot
from memadvisor.trace import read_trace
from memadvisor.trace.summary import summarize

CPU_TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "gpt_lm_whole_model_checkpoint.trace"


def _memory_viz_reads(path):
    """torch's own reader functions accept the file (segsum asserts its tiling adds up)."""
    _memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    data = load_snapshot(path)
    assert "Summary of segments" in _memory_viz.segsum(data)
    assert len(_memory_viz.trace_plot(data)) > 1000
    assert len(_memory_viz.segment_plot(data)) > 1000
    assert path.read_bytes()[:2] == b"\x80\x04"  # protocol 4: memory_viz reads <= 4
    return data


def _consistent(data):
    """Every event lands in a segment that exists then, and live blocks never overlap;
    at the end the live blocks are the segments' active blocks."""
    start_segments = {s["address"]: s["total_size"] for s in data["segments"]}
    events = data["device_traces"][0]
    for e in reversed(events):  # undo segment events to get the starting set
        if e["action"] == "segment_alloc":
            start_segments.pop(e["addr"], None)
        elif e["action"] == "segment_free":
            start_segments[e["addr"]] = e["size"]
    segments = dict(start_segments)
    live = {}
    for e in events:
        if e["action"] == "segment_alloc":
            segments[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            del segments[e["addr"]]
        elif e["action"] == "alloc":
            assert any(a <= e["addr"] < a + n for a, n in segments.items()), e
            assert e["addr"] not in live
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    ranges = sorted(live.items())
    for (a, n), (b, _) in zip(ranges, ranges[1:]):
        assert a + n <= b, "overlapping live blocks"
    active = {b["address"] for s in data["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    assert set(live) <= active


def test_round_trip_of_a_real_snapshot_is_exact(imported, tmp_path):
    for name, (_, trace_path) in imported.items():
        first = read_trace(trace_path)
        out = tmp_path / f"{name}.pickle"
        export_snapshot(first, out)
        data = _memory_viz_reads(out)
        _consistent(data)
        again = tmp_path / f"{name}.again.trace"
        import_snapshot(out, again)
        second = read_trace(again)
        for column in first.events.columns:
            assert list(first.events[column].astype(str)) == list(
                second.events[column].astype(str)), (name, column)
        a, b = summarize(first), summarize(second)
        for key in ("peak_bytes", "reserved_bytes", "segments", "by_category"):
            assert a[key] == b[key], (name, key)


def test_cpu_trace_is_laid_out_by_the_allocator_model(tmp_path):
    """A trace with no addresses (a CPU run) gets the caching allocator's layout."""
    trace = read_trace(CPU_TRACE)
    out = tmp_path / "cpu.pickle"
    result = export_snapshot(trace, out)
    data = _memory_viz_reads(out)
    _consistent(data)
    assert result["segments"] > 1
    # re-imported: every block, the requested bytes and the categories kept; the peak is
    # the block sizes' (>= the CPU peak of the same requests)
    back = tmp_path / "cpu.trace"
    import_snapshot(out, back)
    again = read_trace(back)
    assert len(again.events) == len(trace.events)
    for column in ("action", "size_bytes", "category", "phase", "op", "module", "dtype", "step"):
        assert list(again.events[column].astype(str)) == list(trace.events[column].astype(str))
    cpu_peak = int(np.cumsum(np.where(trace.events["action"] == "alloc",
                                      trace.events["size_bytes"],
                                      -trace.events["size_bytes"])).max())
    assert summarize(again)["reserved_bytes"] >= max(
        again.meta.allocator["peak_allocated_bytes"], cpu_peak)
