"""What the advice beyond plans adds to `advise`, on the traces of advise_speed.py.

    python benchmarks/advice_speed.py [--events 1000000] [--gpu h100-80gb] [--trace-dir DIR]

Writes advise_speed.py's synthetic transformer-shaped trace (reused from --trace-dir) with
a data-flow column added -- each op reads the storage made just before it, so the in-place
pass has every op to look at -- then, in this process: reads it, ``prepare``s it as
``advise`` does, and times each advice provider (wall and CPU seconds, best of three) and
``advise``'s plan search itself for comparison.  The load average is printed: on a shared
machine wall seconds move with it, CPU seconds much less.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def trace_with_flow(folder: str, events: int) -> str:
    from advise_speed import synthetic_trace
    from memadvisor.trace.io import read_trace, write_trace
    plain = os.path.join(folder, f"advise_speed_{events}.trace")
    flow = os.path.join(folder, f"advice_speed_flow_{events}.trace")
    if os.path.exists(flow):
        return flow
    if not os.path.exists(plain):
        synthetic_trace(plain + ".tmp", events)
        os.replace(plain + ".tmp", plain)
    trace = read_trace(plain)
    frame = trace.events
    allocs = np.flatnonzero((frame["action"] == "alloc").to_numpy())
    ids = frame["storage_id"].to_numpy()
    read = np.concatenate([[ids[allocs[0]]], ids[allocs[:-1]]])
    counts = np.zeros(len(frame), np.int32)
    counts[allocs] = 1
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    frame["input_ids"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(read, pa.int64()))
    write_trace(flow + ".tmp", frame, trace.meta)
    os.replace(flow + ".tmp", flow)
    return flow


def timed(function, repeats: int = 3) -> tuple[float, float, object]:
    best_wall = best_cpu = float("inf")
    result = None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = function()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--trace-dir", help="Keep the synthetic traces here and reuse them.")
    args = parser.parse_args(argv)
    from memadvisor.advice import PROVIDERS, collect
    from memadvisor.simulate import advise, hardware, prepare
    from memadvisor.trace.io import read_trace
    from memadvisor.units import parse_bytes
    with tempfile.TemporaryDirectory() as scratch:
        path = trace_with_flow(args.trace_dir or scratch, args.events)
        load_before = os.getloadavg()[0]
        trace = read_trace(path)
        base = prepare(trace)
        hw = hardware(args.gpu)
        rows = []
        total_cpu = 0.0
        for provider in PROVIDERS:
            wall, cpu, found = timed(lambda: collect(trace, base, hw, providers=[provider]))
            total_cpu += cpu
            rows.append((provider.__name__, wall, cpu, len(found)))
        wall, cpu, _ = timed(lambda: advise(base, hw, parse_bytes(args.budget), args.gpus), 1)
        print(f"{len(trace.events):,} events, target {args.gpu}; load average "
              f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}\n")
        print("| pass | wall s | CPU s | items |\n|---|---:|---:|---:|")
        for name, w, c, n in rows:
            print(f"| {name} | {w:.3f} | {c:.3f} | {n} |")
        print(f"| all advice | | {total_cpu:.3f} | |")
        print(f"| advise's plan search (for scale) | {wall:.2f} | {cpu:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
