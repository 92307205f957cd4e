"""Out-of-memory post-mortems: on a real GPU snapshot replayed on smaller devices, and on a
snapshot whose allocator itself ran out."""
from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys

from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.oom import post_mortem
from memadvisor.trace import read_trace

from ..snapshot.conftest import W_SNAPSHOTS, imported  # noqa: F401  (session fixture)

GiB = 2**30


def test_modelled_post_mortem_on_a_smaller_device(imported):  # noqa: F811
    _, trace_path = imported["W_medium_1024_training"]  # 24,012 MiB reserved on the real GPU
    trace = read_trace(trace_path)
    assert post_mortem(trace, 40 * GiB, suggest_plan=False) is None  # fits an A100-40GB
    found = post_mortem(trace, 20 * GiB, hw=hardware("a100-40gb"))
    assert found.source == "modelled"
    assert found.reserved_bytes + found.requested_bytes > 20 * GiB >= found.reserved_bytes
    assert found.allocated_bytes <= found.reserved_bytes
    assert found.reserved_free_bytes == found.reserved_bytes - found.allocated_bytes
    # what was live adds up to the allocated bytes (the trace's block sizes; the model may
    # have left a different block or two unsplit)
    assert abs(sum(found.by_category.values()) / found.allocated_bytes - 1) < 0.001
    assert found.by_category["activation"] > 10 * GiB  # mid-forward at ctx 1024
    assert found.phase == "forward" and found.source_file.endswith(".py")
    assert found.top_sites and found.top_sites[0]["bytes"] > GiB
    assert found.fitting_plan and found.fitting_plan_peak_bytes < 20 * GiB


def test_recorded_oom_event_is_the_post_mortem(tmp_path):
    """A snapshot whose allocator failed a request: the event says where, the trace keeps
    everything before it, and summary reports it without being asked."""
    snapshot = pickle.loads(gzip.decompress(W_SNAPSHOTS[0].read_bytes()))
    events = snapshot["device_traces"][0]
    at = len(events) // 2
    events.insert(at, {"action": "oom", "addr": 0, "size": 3 * GiB, "stream": 0,
                       "time_us": events[at]["time_us"], "device_free": 100 << 20,
                       "frames": []})
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))
    out = tmp_path / "oom.trace"
    subprocess.run([sys.executable, "-m", "memadvisor.cli", "import-snapshot", str(path),
                    "-o", str(out)], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "summary", str(out),
                           "--json"], capture_output=True, text=True, check=True)
    oom = json.loads(done.stdout)["out_of_memory"]
    assert oom["source"] == "recorded" and oom["requested_bytes"] == 3 * GiB
    # the device held what the allocator reserved then plus what the driver said was free
    assert oom["capacity_bytes"] == json.loads(done.stdout)["reserved_bytes"] + (100 << 20)
    assert 0 < oom["allocated_bytes"] <= oom["reserved_bytes"]
    text = subprocess.run([sys.executable, "-m", "memadvisor.cli", "summary", str(out)],
                          capture_output=True, text=True, check=True).stdout
    assert "OUT OF MEMORY" in text and "the recorded allocator failed" in text
