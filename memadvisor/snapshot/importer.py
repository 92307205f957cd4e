"""A CUDA memory snapshot as a memadvisor trace (``memadvisor import-snapshot``).

One alloc row and one free row per block lifetime (``layout.replay_layout``): the requested
bytes in ``size_bytes``, the allocator's block in ``block_bytes`` (what every reader counts,
as ``max_memory_allocated`` does), stream and address.  Blocks alive when recording began
come first, in address order, at time 0.  The snapshot is one recorded window, taken as
one step (index 0).  Categories are inferred from where a block was made and freed:

- made in forward, freed in backward: ``activation``; made and freed in one phase:
  ``temporary``;
- made in backward and alive at the dump: ``gradient``; made in the optimizer and alive
  at the dump: ``optimizer_state``;
- alive before recording: ``optimizer_state`` where the dump's frames say an optimizer
  step made it or this step's optimizer frees it (an optimizer that replaces its state
  each step, ``m = beta * m + ...``, frees the previous step's), ``parameter``
  where it is never freed and a gradient of its exact size is made (matched one to one),
  else ``other``; cuBLAS workspaces and anything else: ``other``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..trace import schema
from ..trace.io import events_table, write_trace
from . import frames as frame_rules
from .layout import Layout, Lifetime, replay_layout
from .safe_pickle import SnapshotError, load_snapshot

#: the default cuBLAS workspace (CublasHandlePool.cpp) on compute capability >= 9 and below
_WORKSPACE_BYTES_BY_ARCH = {32 << 20: "compute capability >= 9 (Hopper or newer)",
                            8_519_680: "compute capability < 9 (Ampere or older)"}


def pick_device(snapshot: dict, device: int | None) -> int:
    traces = snapshot.get("device_traces") or []
    if device is None:
        if not traces:
            return 0
        return max(range(len(traces)), key=lambda d: len(traces[d]))
    if device < 0 or (traces and device >= len(traces)):
        raise SnapshotError(f"device {device}: the snapshot has traces for devices "
                            f"0-{max(len(traces) - 1, 0)}")
    return device


def import_snapshot(path: str | Path, output: str | Path, device: int | None = None) -> dict:
    """Read ``path``, write the trace to ``output``; return the figures the CLI prints."""
    snapshot = load_snapshot(path)
    device = pick_device(snapshot, device)
    events = (snapshot.get("device_traces") or [[]])[device] if snapshot.get(
        "device_traces") else []
    if not events and not snapshot["segments"]:
        raise SnapshotError(f"{path}: the snapshot is empty (was _record_memory_history on?)")
    layout = replay_layout(snapshot, device)
    columns, seq_after_event = _columns(snapshot, events, layout, device)
    meta = _meta(path, snapshot, events, layout, device, seq_after_event, columns)
    write_trace(output, events_table(columns), meta)
    return {"trace": str(output), "blocks": len(layout.lifetimes), "events": len(columns["seq"]),
            "peak_allocated_bytes": layout.peak_allocated_bytes,
            "peak_reserved_bytes": layout.peak_reserved_bytes,
            "segments": layout.segments_at_end,
            "block_mismatches": layout.block_mismatches, "blocks_checked": layout.blocks_checked}


def _columns(snapshot, events, layout: Layout, device: int):
    windows = frame_rules.optimizer_windows(snapshot, device)
    t0_us = events[0].get("time_us", 0) if events else 0
    rows = []  # (order key, tie, is_free, lifetime index)
    for index, life in enumerate(layout.lifetimes):
        rows.append((life.alloc_event, life.address if life.alloc_event < 0 else 0, 0, index))
        if life.free_event >= 0:
            rows.append((life.free_event, 0, 1, index))
    rows.sort()
    n = len(rows)
    cols = {name: [] for name in schema.COLUMN_NAMES}
    phases = {}
    for index, life in enumerate(layout.lifetimes):
        alloc = events[life.alloc_event] if life.alloc_event >= 0 else None
        phases[index] = (
            # a block alive before recording may still carry the frames of its making
            frame_rules.phase_of(life.frames, alloc.get("time_us") if alloc else None, windows),
            frame_rules.phase_of(events[life.free_event].get("frames") or [],
                                 events[life.free_event].get("time_us"), windows)
            if life.free_event >= 0 else None)
    categories = _categories(layout, phases)
    tags = {}  # what memadvisor wrote into a snapshot it exported: taken as said
    for index, life in enumerate(layout.lifetimes):
        free_tag = frame_rules.read_tag(events[life.free_event].get("frames") or []) \
            if life.free_event >= 0 else {}
        tag = frame_rules.read_tag(life.frames)
        if not tag and life.alloc_event < 0 and free_tag:
            # alive before recording: only its free carries the tag; its alloc row is
            # at the start of recording, whatever phase the free saw
            tag = {k: v for k, v in free_tag.items() if k not in ("phase", "step")}
        if tag or free_tag:
            tags[index] = (tag, free_tag)
    for seq, (key, _, is_free, index) in enumerate(rows):
        life = layout.lifetimes[index]
        event = events[key] if key >= 0 else None
        time_us = event.get("time_us", t0_us) if event else t0_us
        file, line, function = frame_rules.user_frame(life.frames)
        cols["seq"].append(seq)
        cols["time_ns"].append(max(int(time_us - t0_us), 0) * 1000)
        cols["action"].append(schema.FREE if is_free else schema.ALLOC)
        cols["storage_id"].append(index)
        cols["size_bytes"].append(life.requested_bytes)
        cols["device"].append(f"cuda:{device}")
        tag, free_tag = tags.get(index, ({}, {}))
        # a snapshot names no dtype or shape: raw bytes, unless memadvisor wrote it
        cols["dtype"].append(str(tag.get("dtype", schema.RAW_BYTES_DTYPE)))
        cols["shape"].append(str(tag.get("shape", life.requested_bytes)))
        cols["category"].append(str(tag.get("category", categories[index])))
        cols["op"].append(str(tag.get("op", frame_rules.op_of(life.frames))))
        cols["module"].append(str(tag.get("module", "")))
        phase = (free_tag if is_free else tag).get(
            "phase", phases[index][1] if is_free else phases[index][0])
        cols["phase"].append(str(phase))
        cols["step"].append(int((free_tag if is_free else tag).get("step", 0)))
        cols["source_file"].append(file)
        cols["source_line"].append(line)
        cols["source_function"].append(function)
        cols["block_bytes"].append(life.block_bytes)
        cols["stream"].append(life.stream)
        cols["address"].append(life.address)
    for name, kind in (("seq", np.int64), ("time_ns", np.int64), ("storage_id", np.int64),
                       ("size_bytes", np.int64), ("step", np.int32), ("source_line", np.int32),
                       ("block_bytes", np.int64), ("stream", np.int64), ("address", np.int64)):
        cols[name] = np.asarray(cols[name], dtype=kind)
    keys = np.array([r[0] for r in rows], dtype=np.int64) if n else np.zeros(0, np.int64)
    # trace position after which a snapshot event happened: rows with an earlier key
    seq_after_event = lambda event_index: int(np.searchsorted(keys, event_index, "right")) - 1
    return cols, seq_after_event


def _categories(layout: Layout, phases: dict) -> dict[int, str]:
    """Each lifetime's category; parameters are matched to gradients by size, since a
    block alive before recording and never freed with a gradient of its exact size is, in
    a training step, almost always the parameter (made before recording, no frames)."""
    categories = {i: _category(life, *phases[i]) for i, life in enumerate(layout.lifetimes)}
    gradient_sizes: dict[int, int] = {}
    for i, life in enumerate(layout.lifetimes):
        if categories[i] == schema.GRADIENT:
            gradient_sizes[life.requested_bytes] = gradient_sizes.get(life.requested_bytes, 0) + 1
    for i, life in enumerate(layout.lifetimes):
        if (life.alloc_event < 0 and life.free_event < 0 and categories[i] == schema.OTHER
                and gradient_sizes.get(life.requested_bytes, 0) > 0
                and not frame_rules.is_cublas_workspace(life.frames)):
            gradient_sizes[life.requested_bytes] -= 1
            categories[i] = schema.PARAMETER
    return categories


def _category(life: Lifetime, alloc_phase: str, free_phase: str | None) -> str:
    if frame_rules.is_cublas_workspace(life.frames):
        return schema.OTHER
    if life.alloc_event < 0:
        # made in an earlier step's optimizer, or replaced by this one: optimizer state
        return schema.OPTIMIZER_STATE if schema.OPTIMIZER in (alloc_phase, free_phase) \
            else schema.OTHER
    if free_phase is None:  # alive at the dump
        return {schema.BACKWARD: schema.GRADIENT,
                schema.OPTIMIZER: schema.OPTIMIZER_STATE}.get(alloc_phase, schema.OTHER)
    if alloc_phase == schema.FORWARD and free_phase == schema.BACKWARD:
        return schema.ACTIVATION
    if alloc_phase == schema.OTHER_PHASE and free_phase == schema.OTHER_PHASE:
        return schema.OTHER
    return schema.TEMPORARY


def _meta(path, snapshot, events, layout: Layout, device, seq_after_event, columns):
    t0_us = events[0].get("time_us", 0) if events else 0
    end_ns = int(columns["time_ns"][-1]) if len(columns["time_ns"]) else 0
    workspaces = sorted({life.block_bytes for life in layout.lifetimes
                         if frame_rules.is_cublas_workspace(life.frames)})
    hint = next((_WORKSPACE_BYTES_BY_ARCH[b] for b in workspaces
                 if b in _WORKSPACE_BYTES_BY_ARCH), "")
    step = schema.StepInfo(index=0, start_ns=0, end_ns=end_ns, duration_s=end_ns / 1e9,
                           peak_bytes=layout.peak_allocated_bytes,
                           cuda_max_allocated_bytes=layout.peak_allocated_bytes,
                           cuda_max_reserved_bytes=layout.peak_reserved_bytes)
    allocator = {
        "source": "snapshot",
        "settings": snapshot.get("allocator_settings") or {},
        "initial_segments": layout.initial_segments,
        "initial_reserved_bytes": layout.initial_reserved_bytes,
        # the trace's first rows, in address order: blocks alive when recording began
        "initial_blocks": sum(1 for life in layout.lifetimes if life.alloc_event < 0),
        # per segment event: [trace seq after which it happened (-1: before the first
        # row), action, address, bytes, stream, reserved bytes after, segments after]
        "segment_events": [[seq_after_event(i), *rest] for i, *rest in layout.segment_events],
        "peak_allocated_bytes": layout.peak_allocated_bytes,
        "peak_reserved_bytes": layout.peak_reserved_bytes,
        "segments": layout.segments_at_end,
        "blocks_checked_against_dump": layout.blocks_checked,
        "block_mismatches": layout.block_mismatches,
        "unplaced_events": layout.unplaced_events,
        # the allocator ran out of memory: [trace seq after which, requested bytes, the
        # device's free bytes then (0: not recorded)]
        "oom_events": [[seq_after_event(i), size, free] for i, size, free in layout.oom_events],
        "cublas_workspace_bytes": workspaces,
        "gpu_hint": hint,
        "start_time_us": t0_us,
    }
    parameter_bytes = int(sum(b for b, c, a in zip(
        columns["size_bytes"], columns["category"], columns["action"])
        if c == schema.PARAMETER and a == schema.ALLOC))
    return schema.TraceMeta(
        script=str(path), argv=[], device=f"cuda:{device}", parameter_bytes=parameter_bytes,
        device_name=f"CUDA device {device}" + (f", {hint}" if hint else ""),
        status="completed", steps_requested=1, steps_completed=1, step_detection="snapshot",
        steps=[vars(step)], allocator=allocator,
        extra={"imported_from": "torch.cuda.memory snapshot", "snapshot_events": len(events)})
