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
from .allocator import replay as allocator_replay
from .allocator_config import AllocatorConfig
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


#: at most this many steps get their own reserved figure (one compiled replay each)
MODELLED_STEPS = 16


def model_whole_run(trace: Trace, config=None, capacity_bytes: int = 0,
                    only_steps=None) -> ModelledRun:
    """Every request of ``trace`` in order through the allocator model, from nothing cached
    (a fresh process: a profile of the whole run, warm-up steps included, as fake execution
    records it), with each step's peaks -- what ``max_memory_allocated``/
    ``max_memory_reserved`` would say after a ``reset_peak_memory_stats`` at its start.

    Reserved memory never shrinks (segments are kept), so a step's peak reserved is the
    model's reserved at the step's end: one compiled replay of the run up to there, for the
    first steps and the last (``MODELLED_STEPS`` in all; ``only_steps``: just those step
    indices, e.g. the analysed one, one replay each).  A step's allocated peak is its
    live bytes with every request rounded to the allocator's 512-byte granule (a whole
    free block taken unsplit is not counted)."""
    events = trace.events
    device = str(trace.meta.device)
    if device.startswith("cuda") and (events["device"] != device).any():
        # only the device's own rows go through its allocator (a model built on the CPU
        # before .cuda() is in the trace too)
        events = events[(events["device"] == device).to_numpy()]
    is_alloc = (events["action"] == schema.ALLOC).to_numpy()
    requested = events["size_bytes"].to_numpy().astype(np.int64)
    config = config or AllocatorConfig()
    rounded = np.array([config.round_size(int(r)) for r in requested], dtype=np.int64) \
        if not config.default_rules else np.where(
            requested < 512, 512, -(-requested // 512) * 512)
    live = np.cumsum(np.where(is_alloc, rounded, -rounded))
    signed = np.where(is_alloc, requested, -requested).astype(np.float64)
    rows = events["storage_id"].to_numpy()
    steps_column = events["step"].to_numpy()
    unique = np.unique(steps_column)
    stops = np.searchsorted(steps_column, unique, "right")
    starts = np.searchsorted(steps_column, unique, "left")
    if only_steps is not None:
        wanted = set(only_steps)
        chosen = {i for i, step in enumerate(unique.tolist()) if step in wanted}
    else:
        chosen = set(range(min(len(unique), MODELLED_STEPS - 1))) | {len(unique) - 1}
    steps = {}
    for index in sorted(chosen):
        if index < 0:
            continue
        stop = int(stops[index])
        reserved = allocator_replay(signed[:stop], rows[:stop], capacity_bytes,
                                    config=config).peak_reserved_bytes
        window = live[int(starts[index]):stop]
        steps[int(unique[index])] = (int(window.max()) if len(window) else 0, reserved)
    whole = allocator_replay(signed, rows, capacity_bytes, config=config)
    return ModelledRun(whole.peak_allocated_bytes, whole.peak_reserved_bytes, whole.segments,
                       steps)
