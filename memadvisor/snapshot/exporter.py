"""Any memadvisor trace as a CUDA memory snapshot (``memadvisor export-snapshot``).

The file is what ``torch.cuda.memory._dump_snapshot`` writes (pickle protocol 4, which
pytorch.org/memory_viz reads): ``device_traces`` with ``alloc``/``free_requested``/
``free_completed``/``segment_alloc``/``segment_free`` events, ``segments`` as the
allocator holds them at the end, each tiled exactly by its blocks, and the allocator
settings.

- An imported snapshot goes back with its recorded addresses, segments and segment
  events: import -> export -> import gives the same blocks and peaks.
- Any other trace (CPU, predicted, fake) is laid out by the allocator model
  (``simulate.allocator``): its segments and block placement are what the caching
  allocator would do with these requests on a GPU, at addresses made up for the file.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from ..output_files import write_output
from ..simulate.allocator import CachingAllocator, round_size
from ..trace import schema
from ..trace.io import Trace
from . import frames as frame_rules

PICKLE_PROTOCOL = 4  #: memory_viz reads protocol <= 4
_MADE_UP_BASE_ADDRESS = 0x7F00_0000_0000
_SEGMENT_ALIGN = 2 << 20


def export_snapshot(trace: Trace, output: str | Path) -> dict:
    snapshot = build_snapshot(trace)
    output = Path(output)

    def dump(where):
        with open(where, "wb") as handle:
            pickle.dump(snapshot, handle, protocol=PICKLE_PROTOCOL)
    write_output(output, dump)
    events = snapshot["device_traces"][0]
    return {"snapshot": str(output), "events": len(events),
            "segments": len(snapshot["segments"]),
            "reserved_bytes": sum(s["total_size"] for s in snapshot["segments"])}


def build_snapshot(trace: Trace) -> dict:
    allocator = trace.meta.allocator or {}
    if allocator.get("source") == "snapshot" and (trace.events["address"] != 0).any():
        placed = _recorded_layout(trace)
    else:
        placed = _modelled_layout(trace)
    return _snapshot_from(trace, *placed)


def _recorded_layout(trace: Trace):
    """(per-row address, per-row block bytes, initial rows, initial segments, segment
    events) as recorded."""
    meta = trace.meta.allocator
    events = trace.events
    return (events["address"].to_numpy(), events["block_bytes"].to_numpy(),
            int(meta.get("initial_blocks", 0)),
            [dict(s) for s in meta.get("initial_segments", [])],
            [tuple(e) for e in meta.get("segment_events", [])],
            meta.get("settings") or {})


class _PlacingAllocator(CachingAllocator):
    """The model, remembering when it made each segment."""

    def __init__(self):
        super().__init__()
        self.made: list[int] = []

    def _new_segment(self, nbytes, small):
        super()._new_segment(nbytes, small)
        self.made.append(self.next_segment - 1)


def _modelled_layout(trace: Trace):
    events = trace.events
    actions = (events["action"] == schema.ALLOC).to_numpy()
    sids = events["storage_id"].to_numpy()
    sizes = events["size_bytes"].to_numpy()
    model = _PlacingAllocator()
    live, bases, next_base = {}, {}, _MADE_UP_BASE_ADDRESS
    addresses = np.zeros(len(events), dtype=np.int64)
    blocks = np.zeros(len(events), dtype=np.int64)
    segment_events = []
    for row in range(len(events)):
        if actions[row]:
            before = len(model.made)
            block = model.malloc(int(sizes[row]))
            for segment in model.made[before:]:
                nbytes = model.segment_sizes[segment][0]
                bases[segment] = next_base
                next_base += -(-nbytes // _SEGMENT_ALIGN) * _SEGMENT_ALIGN + _SEGMENT_ALIGN
                segment_events.append((row - 1, "segment_alloc", bases[segment], nbytes, 0,
                                       model.reserved, len(model.segment_sizes)))
            live[sids[row]] = block
            addresses[row] = bases[block.segment] + block.offset
            blocks[row] = block.size
        else:
            block = live.pop(sids[row], None)
            if block is not None:
                addresses[row] = bases[block.segment] + block.offset
                blocks[row] = block.size
                model.free(block)
    return addresses, blocks, 0, [], segment_events, {}


def _frames(events, row: int, phase_row: int) -> list[dict]:
    """The row's user frame, under a tag frame with what the trace knew of the block
    (``phase`` from ``phase_row``: the free's phase on a free event)."""
    tag = frame_rules.tag_frame({
        "category": str(events["category"].iat[row]), "phase": str(events["phase"].iat[phase_row]),
        "op": str(events["op"].iat[row]), "module": str(events["module"].iat[row]),
        "step": int(events["step"].iat[phase_row]), "dtype": str(events["dtype"].iat[row]),
        "shape": str(events["shape"].iat[row])})
    file = str(events["source_file"].iat[row])
    user = [{"filename": file, "line": int(events["source_line"].iat[row]),
             "name": str(events["source_function"].iat[row])}] if file else []
    return [tag] + user


def _snapshot_from(trace, addresses, blocks, initial_rows, initial_segments, segment_events,
                   settings) -> dict:
    events = trace.events
    actions = (events["action"] == schema.ALLOC).to_numpy()
    sizes = events["size_bytes"].to_numpy()
    streams = events["stream"].to_numpy()
    times_us = events["time_ns"].to_numpy() // 1000 + int(
        (trace.meta.allocator or {}).get("start_time_us", 0))
    sids = events["storage_id"].to_numpy()

    segments = {s["address"]: (s["total_size"], s["stream"], s["small"])
                for s in initial_segments}
    pending = sorted(segment_events, key=lambda e: e[0])
    out, cursor = [], 0
    live: dict[int, tuple] = {}  # address -> (requested, block, stream, frames)
    alloc_row = {}

    def segment_events_until(seq):
        nonlocal cursor
        while cursor < len(pending) and pending[cursor][0] <= seq:
            _, action, address, nbytes, stream, *_ = pending[cursor]
            if action in ("segment_alloc", "segment_map"):
                segments[address] = (nbytes, stream, nbytes == 2 << 20)
            else:
                segments.pop(address, None)
            out.append({"action": action, "addr": int(address), "size": int(nbytes),
                        "stream": int(stream), "time_us": int(times_us[max(seq, 0)])
                        if len(times_us) else 0, "frames": []})
            cursor += 1

    segment_events_until(initial_rows - 1)
    for row in range(len(events)):
        if actions[row]:
            frames = _frames(events, row, row)
            alloc_row[sids[row]] = row
            live[int(addresses[row])] = (int(sizes[row]), int(blocks[row]) or
                                         round_size(int(sizes[row])), int(streams[row]), frames)
            if row >= initial_rows:
                out.append({"action": "alloc", "addr": int(addresses[row]),
                            "size": int(sizes[row]), "stream": int(streams[row]),
                            "time_us": int(times_us[row]), "frames": frames})
        else:
            live.pop(int(addresses[row]), None)
            first = alloc_row.get(sids[row], row)
            for action in ("free_requested", "free_completed"):
                out.append({"action": action, "addr": int(addresses[row]),
                            "size": int(sizes[row]), "stream": int(streams[row]),
                            "time_us": int(times_us[row]),
                            "frames": _frames(events, first, row)})
        segment_events_until(row)
    segment_events_until(len(events))
    return {"segments": _final_segments(segments, live),
            "device_traces": [out],
            "allocator_settings": dict(settings) or {"PYTORCH_CUDA_ALLOC_CONF": "",
                                                     "expandable_segments": False},
            "external_annotations": []}


def _final_segments(segments: dict, live: dict) -> list[dict]:
    """The allocator's state at the end: every segment tiled by its blocks, free gaps
    as ``inactive`` blocks (memory_viz's ``segsum`` checks the tiling adds up)."""
    starts = sorted(live)
    out = []
    for address in sorted(segments):
        nbytes, stream, small = segments[address]
        lo = int(np.searchsorted(starts, address, "left"))
        hi = int(np.searchsorted(starts, address + nbytes, "left"))
        blocks, offset = [], address
        for start in starts[lo:hi]:
            requested, block, block_stream, frames = live[start]
            if start > offset:
                blocks.append({"address": offset, "size": start - offset,
                               "requested_size": 0, "state": "inactive", "frames": []})
            size = min(block, address + nbytes - start)
            blocks.append({"address": start, "size": size, "requested_size": requested,
                           "state": "active_allocated", "frames": frames})
            offset = start + size
        if offset < address + nbytes:
            blocks.append({"address": offset, "size": address + nbytes - offset,
                           "requested_size": 0, "state": "inactive", "frames": []})
        active = [b for b in blocks if b["state"] == "active_allocated"]
        out.append({"device": 0, "address": address, "total_size": nbytes,
                    "allocated_size": sum(b["size"] for b in active),
                    "active_size": sum(b["size"] for b in active),
                    "requested_size": sum(b["requested_size"] for b in active),
                    "stream": stream, "segment_type": "small" if small else "large",
                    "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                    "blocks": blocks})
    return out
