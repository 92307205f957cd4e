"""Pure queries over a trace's events: live bytes, peaks, what is alive at a moment.

Readers (summary, report, compare, check, the dashboard, the simulator) build on these, so
a peak means the same thing everywhere.  No torch here.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import schema
from .io import Trace


def counted_bytes(events: pd.DataFrame) -> np.ndarray:
    """Bytes each row counts toward live memory: the allocator's block where one said
    (a CUDA trace: what ``max_memory_allocated`` counts), else the storage's bytes.  In a
    trace with GPU rows, host rows count nothing: a GPU's peak is its own memory, and a
    DataLoader's batches, pinned buffers or offloaded activations are not in it."""
    sizes = events["size_bytes"].to_numpy(dtype=np.int64)
    if "block_bytes" in events:
        blocks = events["block_bytes"].to_numpy(dtype=np.int64)
        sizes = np.where(blocks > 0, blocks, sizes)
    on_gpu = _gpu_rows(events)
    return sizes if on_gpu is None else np.where(on_gpu, sizes, 0)


def _gpu_rows(events: pd.DataFrame) -> np.ndarray | None:
    """Which rows are on a GPU; None when none is (a CPU trace counts every row)."""
    if "device" not in events or not len(events):
        return None
    devices = events["device"]
    if isinstance(devices.dtype, pd.CategoricalDtype):
        # per category, then by code: no string work per row (traces have millions)
        gpu = np.array([str(name).startswith("cuda") for name in devices.cat.categories])
        if not gpu.any():
            return None
        codes = devices.cat.codes.to_numpy()
        return np.where(codes >= 0, gpu[np.maximum(codes, 0)], False)
    names = pd.unique(devices)
    if not any(str(name).startswith("cuda") for name in names):
        return None
    return devices.astype(str).str.startswith("cuda").to_numpy()


def signed_sizes(events: pd.DataFrame) -> np.ndarray:
    sizes = counted_bytes(events)
    is_alloc = (events["action"] == schema.ALLOC).to_numpy()
    return np.where(is_alloc, sizes, -sizes)


def live_bytes(events: pd.DataFrame) -> np.ndarray:
    """Live bytes just after each event (the GPUs' own in a GPU trace, see
    :func:`counted_bytes`)."""
    return np.cumsum(signed_sizes(events)) if len(events) else np.zeros(0, dtype=np.int64)


def analysed_step(trace: Trace) -> int | None:
    """The steady-state step: the last complete one (None when no step completed)."""
    done = trace.meta.steps_completed
    return done - 1 if done > 0 else None


def step_slice(events: pd.DataFrame, step: int | None) -> slice:
    """Positions of a step's events (events are ordered, steps never decrease)."""
    if step is None:
        return slice(0, len(events))
    steps = events["step"].to_numpy()
    return slice(int(np.searchsorted(steps, step, "left")),
                 int(np.searchsorted(steps, step, "right")))


def peak_in(live: np.ndarray, window: slice) -> tuple[int, int]:
    """(position, bytes) of the highest live point in ``window`` (first one on ties)."""
    part = live[window]
    if not len(part):
        return -1, 0
    offset = int(np.argmax(part))
    return window.start + offset, int(part[offset])


def lifetimes(events: pd.DataFrame) -> pd.DataFrame:
    """One row per storage: its alloc row's columns plus ``alloc_pos`` and ``free_pos``.

    ``free_pos`` is len(events) for storages still alive at the end of the trace.
    """
    actions = events["action"].to_numpy()
    positions = np.arange(len(events))
    alloc_mask = actions == schema.ALLOC
    allocs = events[alloc_mask].copy()
    allocs["alloc_pos"] = positions[alloc_mask]
    free_mask = ~alloc_mask
    free_pos = pd.Series(positions[free_mask], index=events["storage_id"].to_numpy()[free_mask])
    free_pos = free_pos[~free_pos.index.duplicated(keep="first")]
    allocs["free_pos"] = allocs["storage_id"].map(free_pos).fillna(len(events)).astype(np.int64)
    return allocs


def alive_at(lives: pd.DataFrame, position: int) -> pd.DataFrame:
    """Storages alive just after the event at ``position``."""
    mask = (lives["alloc_pos"].to_numpy() <= position) & (lives["free_pos"].to_numpy() > position)
    return lives[mask]


def category_series(events: pd.DataFrame, category: str) -> np.ndarray:
    """Live bytes of one category after each event."""
    mask = (events["category"] == category).to_numpy()
    return np.cumsum(np.where(mask, signed_sizes(events), 0))


def bytes_by(frame: pd.DataFrame, keys, aggregations=("sum",)) -> pd.DataFrame:
    """Counted bytes (``counted_bytes``) grouped by ``keys``: one column per aggregation."""
    counted = pd.Series(counted_bytes(frame), index=frame.index, name="bytes")
    groups = counted.groupby([frame[k] for k in ([keys] if isinstance(keys, str) else keys)],
                             observed=True)
    return groups.agg(list(aggregations))


def by_category(alive: pd.DataFrame) -> dict[str, int]:
    sums = bytes_by(alive, "category")["sum"]
    return {c: int(sums.get(c, 0)) for c in schema.CATEGORIES if int(sums.get(c, 0))}


def step_peaks(events: pd.DataFrame, live: np.ndarray) -> list[dict]:
    """Peak live bytes of every step present in the events (one pass: the step column is
    read once, each step's window found by binary search)."""
    out = []
    if not len(events):
        return out
    steps = events["step"].to_numpy()
    unique = np.unique(steps)
    starts = np.searchsorted(steps, unique, "left")
    stops = np.searchsorted(steps, unique, "right")
    for step, start, stop in zip(unique.tolist(), starts.tolist(), stops.tolist()):
        position, peak = peak_in(live, slice(start, stop))
        out.append({"index": int(step), "peak_bytes": peak, "peak_seq": int(position)})
    return out
