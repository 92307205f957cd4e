"""Facts a profiler must match, read from the real CUDA snapshots in /work/shared/gpu-truth.

    python benchmarks/gpu_truth/snapshot_facts.py [SNAPSHOT.pickle ...] [--top 10] [--json FILE]

A snapshot is a pickle written by ``torch.cuda.memory._dump_snapshot``.  A pickle can run
code, so it is read with an unpickler whose ``find_class`` refuses every global: a snapshot
holds only dicts, lists, tuples, str, int, float, bool and None, which need none.

For each snapshot this prints:

* ``alloc_count``: the trace's ``alloc`` events.
* ``live_bytes_at_start``: bytes allocated before recording began, in two parts: blocks the
  trace frees without having allocated them, and blocks still alive in ``segments`` at the
  dump that no ``alloc`` event in the trace made.
* ``peak_allocated_bytes``: the highest allocated total over the trace, starting from
  ``live_bytes_at_start``, each block counted at the size the caching allocator rounds a
  request to (below 512 B: 512 B; else up to a multiple of 512 B); a block stops counting at
  its ``free_requested`` event (the allocator's ``allocated_bytes`` statistic drops there).
* the cuBLAS workspace blocks (8,519,680 B below compute capability 9, 33,554,432 B from
  Hopper on), in the trace and alive at the dump, and the frames that made them.
* the largest allocations in the trace with their Python frames.
* the allocations inside each ``Optimizer.step`` annotation, grouped by Python line.
"""
from __future__ import annotations

import argparse
import collections
import json
import pickle
import re
import sys
from pathlib import Path

GPU_TRUTH_DIR = Path("/work/shared/gpu-truth")
CUBLAS_WORKSPACE_SIZES_BYTES = (8_519_680, 33_554_432)
ALIVE_BLOCK_STATES = ("active_allocated", "active_pending_free")


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"snapshot refers to {module}.{name}: refused (plain data only)")


def load_snapshot(path: Path) -> dict:
    with open(path, "rb") as handle:
        return _PlainDataUnpickler(handle).load()


def allocator_rounded_bytes(requested_bytes: int) -> int:
    if requested_bytes < 512:
        return 512
    return (requested_bytes + 511) // 512 * 512


def _trace(snapshot: dict) -> list[dict]:
    # one device in all five files; the events of every device are concatenated otherwise
    return [event for device_events in snapshot["device_traces"] for event in device_events]


def python_frames(event_or_block: dict, skip_torch: bool = True) -> list[str]:
    """The Python frames, innermost first, as ``file.py:line function``; torch's own and
    site-packages frames are left out unless ``skip_torch`` is False."""
    out = []
    for frame in event_or_block.get("frames", []):
        filename = frame["filename"]
        if not filename.endswith(".py"):
            continue
        if skip_torch and "site-packages" in filename:
            continue
        out.append(f"{Path(filename).name}:{frame['line']} {frame['name']}")
    return out


def is_cublas_workspace(event_or_block: dict) -> bool:
    # an activation can have the same size (W at context 1024 has hundreds of 32 MiB blocks):
    # only a block whose frames pass through cuBLAS's handle or workspace getter counts
    return any("Blas" in frame["name"] and ("Handle" in frame["name"] or "Workspace" in frame["name"])
               for frame in event_or_block.get("frames", []))


def frames_summary(event: dict, depth: int = 3) -> str:
    """The Python frames, or for autograd's backward thread (which has none) the backward
    node that allocated."""
    frames = python_frames(event)[:depth]
    if frames:
        return " <- ".join(frames)
    for frame in event.get("frames", []):
        match = re.search(r"autograd::generated::(\w+)::apply", frame["name"])
        if match:
            return f"(backward thread) {match.group(1)}"
        # autograd's own steps outside a node: AccumulateGrad's clone of a gradient whose
        # strides differ from the parameter's, a gradient summed down to an input's shape
        match = re.search(r"torch::autograd::(?:utils::)?(clone_obey_contract|InputMetadata::reduce_grad"
                          r"|AccumulateGrad\w*)", frame["name"])
        if match:
            return f"(backward thread) {match.group(1)}"
    return "(no Python frame)"


def workspace_origin(event_or_block: dict) -> str:
    """Which cuBLAS handle asked for a workspace block: the forward (Python) thread or
    autograd's backward thread, and through which getter."""
    names = [frame["name"] for frame in event_or_block.get("frames", [])]
    getter = next((n for n in names if "Blas" in n and ("Handle" in n or "Workspace" in n)), "?")
    thread = "autograd backward thread" if any("Engine::thread_main" in n for n in names) else "Python thread"
    return f"{getter.split('(')[0]} on the {thread}"


def live_bytes_at_start(snapshot: dict) -> dict:
    """Blocks allocated before recording: freed in the trace without an alloc, or alive at
    the dump without an alloc."""
    live_from_trace: dict[int, int] = {}
    freed_unallocated_bytes = 0
    freed_unallocated_count = 0
    for event in _trace(snapshot):
        if event["action"] == "alloc":
            live_from_trace[event["addr"]] = event["size"]
        elif event["action"] == "free_requested":
            if event["addr"] in live_from_trace:
                del live_from_trace[event["addr"]]
            else:
                freed_unallocated_bytes += allocator_rounded_bytes(event["size"])
                freed_unallocated_count += 1
    alive_unallocated_bytes = 0
    alive_unallocated_count = 0
    alive_block_bytes = 0
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] not in ALIVE_BLOCK_STATES:
                continue
            alive_block_bytes += block["size"]
            if block["address"] not in live_from_trace:
                alive_unallocated_bytes += allocator_rounded_bytes(block["requested_size"])
                alive_unallocated_count += 1
    return {
        "freed_without_alloc_bytes": freed_unallocated_bytes,
        "freed_without_alloc_count": freed_unallocated_count,
        "alive_at_dump_without_alloc_bytes": alive_unallocated_bytes,
        "alive_at_dump_without_alloc_count": alive_unallocated_count,
        "total_bytes": freed_unallocated_bytes + alive_unallocated_bytes,
        # the allocator's own block sizes at the dump (a block can exceed its rounded request
        # when the remainder was too small to split off)
        "alive_at_dump_block_bytes": alive_block_bytes,
        "alive_at_dump_allocated_in_trace_count": len(live_from_trace),
    }


def peak_allocated(snapshot: dict, start_bytes: int) -> dict:
    allocated_bytes = start_bytes
    peak_bytes = start_bytes
    peak_event_index = -1
    sizes_by_address: dict[int, int] = {}
    for index, event in enumerate(_trace(snapshot)):
        if event["action"] == "alloc":
            sizes_by_address[event["addr"]] = allocator_rounded_bytes(event["size"])
            allocated_bytes += sizes_by_address[event["addr"]]
            if allocated_bytes > peak_bytes:
                peak_bytes, peak_event_index = allocated_bytes, index
        elif event["action"] == "free_requested":
            allocated_bytes -= sizes_by_address.pop(event["addr"], allocator_rounded_bytes(event["size"]))
    return {"peak_allocated_bytes": peak_bytes, "peak_event_index": peak_event_index,
            "allocated_bytes_at_dump": allocated_bytes}


def cublas_workspaces(snapshot: dict) -> dict:
    in_trace = [
        {"size_bytes": e["size"], "origin": workspace_origin(e), "python_frames": python_frames(e)[:3]}
        for e in _trace(snapshot)
        if e["action"] == "alloc" and e["size"] in CUBLAS_WORKSPACE_SIZES_BYTES and is_cublas_workspace(e)
    ]
    alive_at_dump = [
        {"size_bytes": b["size"], "origin": workspace_origin(b) if b.get("frames") else "before recording"}
        for segment in snapshot["segments"] for b in segment["blocks"]
        if b["state"] in ALIVE_BLOCK_STATES and b["requested_size"] in CUBLAS_WORKSPACE_SIZES_BYTES
        and (is_cublas_workspace(b) or not b.get("frames"))
    ]
    return {"in_trace": in_trace, "alive_at_dump": alive_at_dump}


def largest_allocations(snapshot: dict, top: int) -> list[dict]:
    allocs = [e for e in _trace(snapshot) if e["action"] == "alloc"]
    allocs.sort(key=lambda e: -e["size"])
    return [{"size_bytes": e["size"], "frames": frames_summary(e)} for e in allocs[:top]]


def optimizer_step_allocations(snapshot: dict) -> dict:
    """Allocations between each Optimizer.step START and END annotation, by innermost
    Python line: how many, and how many distinct sizes."""
    annotations = snapshot.get("external_annotations") or []
    windows = []
    start_us = None
    for note in annotations:
        if not note["name"].startswith("Optimizer.step"):
            continue
        if note["stage"] == "START":
            start_us = note["time_us"]
        elif start_us is not None:
            windows.append((start_us, note["time_us"]))
            start_us = None
    by_line: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    frees_in_step = 0
    for event in _trace(snapshot):
        if not any(lo <= event["time_us"] <= hi for lo, hi in windows):
            continue
        if event["action"] == "free_requested":
            frees_in_step += 1
        if event["action"] != "alloc":
            continue
        frames = python_frames(event)
        by_line[frames[0] if frames else "?"][event["size"]] += 1
    return {
        "windows": len(windows),
        "frees_in_step": frees_in_step,
        "by_line": {line: {"alloc_count": sum(c.values()), "distinct_sizes": len(c)}
                    for line, c in sorted(by_line.items())},
    }


def snapshot_facts(path: Path, top: int = 10) -> dict:
    snapshot = load_snapshot(path)
    trace = _trace(snapshot)
    start = live_bytes_at_start(snapshot)
    return {
        "file": path.name,
        "alloc_count": sum(1 for e in trace if e["action"] == "alloc"),
        "event_counts": dict(collections.Counter(e["action"] for e in trace)),
        "segment_count": len(snapshot["segments"]),
        "reserved_bytes_at_dump": sum(s["total_size"] for s in snapshot["segments"]),
        "live_bytes_at_start": start,
        **peak_allocated(snapshot, start["total_bytes"]),
        "cublas_workspaces": cublas_workspaces(snapshot),
        "largest_allocations": largest_allocations(snapshot, top),
        "optimizer_step": optimizer_step_allocations(snapshot),
    }


def format_facts(facts: dict) -> str:
    mib = 1 << 20
    start = facts["live_bytes_at_start"]
    lines = [
        f"## {facts['file']}",
        f"alloc events: {facts['alloc_count']}   all events: {facts['event_counts']}",
        f"segments at dump: {facts['segment_count']}, reserved {facts['reserved_bytes_at_dump']:,} B "
        f"({facts['reserved_bytes_at_dump'] / mib:,.0f} MiB)",
        f"live at start: {start['total_bytes']:,} B ({start['total_bytes'] / mib:,.1f} MiB) = "
        f"{start['freed_without_alloc_bytes']:,} B freed without alloc ({start['freed_without_alloc_count']} blocks)"
        f" + {start['alive_at_dump_without_alloc_bytes']:,} B alive at dump without alloc "
        f"({start['alive_at_dump_without_alloc_count']} blocks)",
        f"peak allocated: {facts['peak_allocated_bytes']:,} B ({facts['peak_allocated_bytes'] / mib:,.1f} MiB)"
        f" at event {facts['peak_event_index']}; allocated at dump {facts['allocated_bytes_at_dump']:,} B",
        "cuBLAS workspaces allocated in the trace:",
    ]
    for ws in facts["cublas_workspaces"]["in_trace"]:
        lines.append(f"  {ws['size_bytes']:,} B  {ws['origin']}  {' <- '.join(ws['python_frames']) or '-'}")
    alive = collections.Counter((w["size_bytes"], w["origin"]) for w in facts["cublas_workspaces"]["alive_at_dump"])
    for (size, origin), count in alive.items():
        lines.append(f"  alive at dump: {count} x {size:,} B ({origin})")
    lines.append("largest allocations:")
    for item in facts["largest_allocations"]:
        lines.append(f"  {item['size_bytes']:>13,} B  {item['frames']}")
    step = facts["optimizer_step"]
    if step["windows"]:
        lines.append(f"inside Optimizer.step ({step['windows']} call(s), {step['frees_in_step']} frees):")
        for line, c in step["by_line"].items():
            lines.append(f"  {line}: {c['alloc_count']} allocs, {c['distinct_sizes']} distinct sizes")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="*", type=Path,
                        help=f"snapshot pickles (default: every *.pickle in {GPU_TRUTH_DIR})")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest allocations to list")
    parser.add_argument("--json", type=Path, help="also write the facts to this JSON file")
    args = parser.parse_args(argv)
    paths = args.snapshots or sorted(GPU_TRUTH_DIR.glob("*.pickle"))
    all_facts = [snapshot_facts(path, args.top) for path in paths]
    print("\n\n".join(format_facts(f) for f in all_facts))
    if args.json:
        args.json.write_text(json.dumps(all_facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
