"""Real GPU snapshots become traces whose figures are the allocator's own."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from memadvisor.simulate.allocator import round_size
from memadvisor.trace import read_trace, schema
from memadvisor.trace.summary import summarize


def _dump_active_bytes(snapshot):
    return sum(b["size"] for s in snapshot["segments"] for b in s["blocks"]
               if b["state"].startswith("active"))


def test_blocks_and_peaks_are_the_allocators(imported):
    for name, (snapshot, trace_path) in imported.items():
        trace = read_trace(trace_path)
        events = trace.events
        summary = summarize(trace)
        allocator = trace.meta.allocator
        # every block of the dump was reproduced by replaying the recorded addresses
        assert allocator["block_mismatches"] == 0 and allocator["blocks_checked_against_dump"] > 800, name
        assert allocator["unplaced_events"] == 0, name
        # live block bytes at the end are the dump's active blocks, to the byte
        live = np.where(events["action"] == "alloc", events["block_bytes"], -events["block_bytes"])
        assert int(live.sum()) == _dump_active_bytes(snapshot), name
        # peak allocated: the allocator's block sizes, as max_memory_allocated counts
        assert summary["peak_bytes"] == allocator["peak_allocated_bytes"] == int(
            np.cumsum(live).max()), name
        # an independent walk with only rounded requests can only be a little lower
        own = _rounded_walk(snapshot)
        assert own <= summary["peak_bytes"] <= own * 1.002, (name, own, summary["peak_bytes"])
        # reserved and segments are the dump's
        assert summary["reserved_bytes"] == sum(s["total_size"] for s in snapshot["segments"])
        assert summary["segments"] == len(snapshot["segments"])
        # every alloc event of the snapshot is one block lifetime
        allocs = sum(e["action"] == "alloc" for e in snapshot["device_traces"][0])
        assert (events["action"] == "alloc").sum() == allocs + allocator["initial_blocks"]


def _rounded_walk(snapshot) -> int:
    """Peak of live bytes with each block the request rounded to 512 B: blocks alive at
    the start are found from first frees and the dump (not from memadvisor's code)."""
    events = snapshot["device_traces"][0]
    seen, live = set(), {}
    for e in events:
        if e["action"] == "alloc":
            seen.add(e["addr"])
        elif e["action"] == "free_requested" and e["addr"] not in seen:
            seen.add(e["addr"])
            live[e["addr"]] = round_size(e["size"])
    for s in snapshot["segments"]:
        for b in s["blocks"]:
            if b["state"].startswith("active") and b["address"] not in seen:
                live[b["address"]] = b["size"]
    total = peak = sum(live.values())
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = round_size(e["size"])
            total += live[e["addr"]]
        elif e["action"] == "free_requested":
            total -= live.pop(e["addr"])
        peak = max(peak, total)
    return peak


def test_categories_from_frames_and_lifetimes(imported):
    for name, (_, trace_path) in imported.items():
        summary = summarize(read_trace(trace_path))
        by_category = summary["by_category"]
        # medium: ~423M fp32 parameters -> ~1.58 GiB each of parameters and gradients; the
        # optimizer's m and v twice that
        parameter_bytes = summary["parameter_bytes"]
        assert 1.5 * 2**30 < parameter_bytes < 1.7 * 2**30, (name, parameter_bytes)
        assert abs(summary["gradient_bytes"] - parameter_bytes) < 0.01 * parameter_bytes
        assert abs(summary["optimizer_state_bytes"] - 2 * parameter_bytes) < \
            0.01 * parameter_bytes, (name, summary["optimizer_state_bytes"])
        events = read_trace(trace_path).events
        activations = events[(events["category"] == schema.ACTIVATION)
                             & (events["action"] == "alloc")]
        assert len(activations) > 100 and set(activations["phase"]) == {"forward"}
        assert (events.loc[events["category"] == schema.GRADIENT, "phase"] != "forward").all()
        # the user's source lines survive (the model file and the optimizer's)
        files = set(events["source_file"])
        assert any(f.endswith("cs336_basics/model.py") for f in files)
        assert any(f.endswith("cs336_basics/optimizer.py") for f in files)


def test_cli_import_and_summary_json(tmp_path):
    from .conftest import W_SNAPSHOTS
    out = tmp_path / "w.trace"
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "import-snapshot",
                           str(W_SNAPSHOTS[0]), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "match the replay" in done.stderr
    summary = subprocess.run([sys.executable, "-m", "memadvisor.cli", "summary", str(out),
                              "--json"], capture_output=True, text=True, check=True)
    import json
    data = json.loads(summary.stdout)
    assert data["device"] == "cuda:0"
    assert data["reserved_bytes"] > data["peak_bytes"] > 0 and data["segments"] > 0
