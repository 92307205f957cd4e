"""The allocator model replayed over a recorded CUDA stream, from its recorded start.

An imported snapshot (``memadvisor import-snapshot``) holds what a real GPU's caching
allocator did: the segments and live blocks when recording began (``meta.allocator``'s
``initial_segments`` and the trace's first rows, at their addresses) and every request
after.  Replaying only the requests through ``allocator.CachingAllocator`` -- which
chooses its own blocks, splits, merges and new segments -- and comparing its reserved
bytes and segment count with the recorded ones is the test of the model against real
GPUs (docs/GPU_TRUTH.md).  Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace import schema
from ..trace.io import Trace
from .allocator import CachingAllocator, round_size
from .allocator_config import config_from_snapshot


@dataclass
class RecordedReplay:
    recorded_peak_reserved_bytes: int
    modelled_peak_reserved_bytes: int
    recorded_segments: int
    modelled_segments: int
    recorded_peak_allocated_bytes: int
    modelled_peak_allocated_bytes: int
    requests: int

    @property
    def reserved_error(self) -> float:
        return self.modelled_peak_reserved_bytes / max(self.recorded_peak_reserved_bytes, 1) - 1

    @property
    def segments_error(self) -> float:
        return self.modelled_segments / max(self.recorded_segments, 1) - 1


def replay_recorded(trace: Trace, cold_start: bool = False) -> RecordedReplay:
    """Model the recorded stream of an imported snapshot from its recorded starting state.

    ``cold_start``: forget the recorded starting state -- no segments, the blocks alive
    when recording began requested first in address order, as the simulator starts a
    plan's step -- which shows what the warm-up history the model does not see is worth."""
    allocator_meta = trace.meta.allocator or {}
    if allocator_meta.get("source") != "snapshot":
        raise ValueError(f"{trace.path}: not an imported CUDA snapshot")
    model = CachingAllocator(config=config_from_snapshot(allocator_meta.get("settings")))
    # segments in address order: the real allocator breaks best-fit ties by address
    segment_of = []  # (base address, size, id)
    for segment in [] if cold_start else sorted(allocator_meta["initial_segments"],
                                                key=lambda s: s["address"]):
        segment_id = model.add_segment(segment["total_size"], bool(segment["small"]),
                                       int(segment.get("stream", 0)))
        segment_of.append((segment["address"], segment["total_size"], segment_id))
    bases = np.array([base for base, _, _ in segment_of], dtype=np.int64)

    events = trace.events
    actions = (events["action"] == schema.ALLOC).to_numpy()
    sids = events["storage_id"].to_numpy()
    requested = events["size_bytes"].to_numpy()
    blocks = events["block_bytes"].to_numpy()
    addresses = events["address"].to_numpy()
    streams = events["stream"].to_numpy()
    initial = int(allocator_meta["initial_blocks"])
    live, requests = {}, 0
    for row in range(len(events)):
        if row < initial and cold_start:
            live[sids[row]] = model.malloc(int(requested[row]), int(streams[row]))
        elif row < initial:
            index = int(np.searchsorted(bases, addresses[row], "right")) - 1
            base, size, segment_id = segment_of[index]
            live[sids[row]] = model.place(segment_id, int(addresses[row] - base), int(blocks[row]))
        elif actions[row]:
            requests += 1
            # each stream's pool caches its own blocks (FSDP's and DDP's side streams)
            live[sids[row]] = model.malloc(int(requested[row]), int(streams[row]))
        else:
            block = live.pop(sids[row], None)
            if block is not None:
                model.free(block)
    recorded_blocks = np.where(blocks > 0, blocks, [round_size(int(r)) for r in requested]) \
        if len(blocks) else blocks
    signed = np.where(actions, recorded_blocks, -recorded_blocks)
    return RecordedReplay(
        recorded_peak_reserved_bytes=int(allocator_meta["peak_reserved_bytes"]),
        modelled_peak_reserved_bytes=model.peak_reserved,
        recorded_segments=int(allocator_meta["segments"]),
        modelled_segments=len(model.segment_sizes),
        recorded_peak_allocated_bytes=int(np.cumsum(signed).max()) if len(signed) else 0,
        modelled_peak_allocated_bytes=model.peak_allocated,
        requests=requests)


@dataclass
class ModelledRun:
    """A whole trace's requests through the allocator model from a fresh process."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    segments: int
    #: per step index: (peak allocated, peak reserved) while that step's events ran
    steps: dict


def model_whole_run(trace: Trace, config=None, capacity_bytes: int = 0) -> ModelledRun:
    """Replay every request of ``trace`` in order, from nothing cached (a fresh process:
    a profile of the whole run, warm-up steps included, as fake execution records it), and
    keep each step's peaks -- what ``max_memory_allocated``/``max_memory_reserved`` would
    say after a ``reset_peak_memory_stats`` at the step's start (reserved never shrinks,
    so a step's peak reserved includes what earlier steps left cached)."""
    model = CachingAllocator(capacity_bytes, config)
    events = trace.events
    actions = (events["action"] == schema.ALLOC).to_numpy()
    sids = events["storage_id"].to_numpy()
    requested = events["size_bytes"].to_numpy()
    step_of = events["step"].to_numpy()
    streams = events["stream"].to_numpy()
    live, steps = {}, {}
    current, step_allocated, step_reserved = None, 0, 0
    for row in range(len(events)):
        if step_of[row] != current:
            if current is not None:
                steps[int(current)] = (step_allocated, step_reserved)
            current = step_of[row]
            step_allocated, step_reserved = model.allocated, model.reserved
        if actions[row]:
            live[sids[row]] = model.malloc(int(requested[row]), int(streams[row]))
        else:
            block = live.pop(sids[row], None)
            if block is not None:
                model.free(block)
        step_allocated = max(step_allocated, model.allocated)
        step_reserved = max(step_reserved, model.reserved)
    if current is not None:
        steps[int(current)] = (step_allocated, step_reserved)
    return ModelledRun(model.peak_allocated, model.peak_reserved, len(model.segment_sizes),
                       steps)
