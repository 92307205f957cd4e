"""The event-stream model every technique transforms: storages with lifetimes, as numpy arrays.

A baseline trace is reduced to its *analysed step* (the last complete one, the steady state)
plus the storages alive across it.  Each storage becomes one row: size, category, dtype,
module, alloc phase, and its lifetime as two keys on the step's event axis (``alloc_key``,
``free_key``; event ``p`` of the step sits at key ``p``; storages alive before the step
start at key -1, storages alive after it end at ``n_events``).  Techniques return a new
``Timeline`` with rows resized (``size``), retimed (moved keys) or added (new rows at
fractional keys between events), so any combination composes and nothing is re-read.

Peak memory is then a sort of 2 x rows keys and a cumulative sum.  The sort depends only on
the keys, so a ``Timeline`` caches its order: plans that only resize rows (precision,
sharding, optimizer swap, batch size) reuse it and cost one gather and one cumsum.

At equal keys a free comes before an alloc: a storage freed "at" key k is gone before one
allocated at k exists, which is how the profiler records an op that frees its input.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ..trace import schema
from ..trace.analysis import analysed_step, step_slice
from ..trace.io import Trace, id_lists

CATEGORY_CODE = {name: code for code, name in enumerate(schema.CATEGORIES)}
PHASE_CODE = {name: code for code, name in enumerate(schema.PHASES)}
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8,
               "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
               "float8_e4m3fn": 1, "float8_e5m2": 1}
FLOATING = ("float32", "float64", "float16", "bfloat16")


@dataclass
class Timeline:
    """Storages of the analysed step (one row each) as parallel numpy arrays.

    ``size`` is float64 so that scaling by a micro-batch or a shard fraction stays exact
    enough; the final figures are rounded to whole bytes.
    """

    size: np.ndarray  #: bytes (float64)
    alloc_key: np.ndarray  #: float64 position on the step's event axis (-1: before the step)
    free_key: np.ndarray  #: float64 (n_events: still alive after the step)
    category: np.ndarray  #: int8 code into schema.CATEGORIES
    dtype: np.ndarray  #: int16 code into ``dtypes``
    module: np.ndarray  #: int32 code into ``modules``
    phase: np.ndarray  #: int8 code into schema.PHASES (phase at allocation)
    op: np.ndarray  #: int32 code into ``ops``
    scales_with_batch: np.ndarray  #: bool: size is proportional to the micro-batch
    shape: np.ndarray  #: object array of shape strings (for rules and explanations)
    dtypes: list[str]
    modules: list[str]
    ops: list[str]
    n_events: int
    #: per event position of the step: phase code and module code (for locating regions)
    event_phase: np.ndarray
    event_module: np.ndarray
    event_is_alloc: np.ndarray
    #: row of the storage each event belongs to (-1 for rows added by techniques)
    event_row: np.ndarray
    #: data flow: the rows each row's op read (``Reads``); None where the trace has none
    reads: "Reads | None" = field(default=None, repr=False, compare=False)
    _order: np.ndarray | None = field(default=None, repr=False, compare=False)
    #: (order of the parent timeline, its row count, rows whose keys changed or None):
    #: lets ``order`` merge the few changed and added rows into the parent's order
    _parent: tuple | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.size)

    # --- building new timelines -----------------------------------------------------------
    def resized(self, size: np.ndarray) -> "Timeline":
        """Same lifetimes, new sizes: keeps the cached event order."""
        out = replace(self, size=np.asarray(size, dtype=np.float64))
        out._order, out._parent = self._order, self._parent
        return out

    def retimed(self, alloc_key: np.ndarray, free_key: np.ndarray) -> "Timeline":
        changed = (alloc_key != self.alloc_key) | (free_key != self.free_key)
        out = replace(self, alloc_key=alloc_key, free_key=free_key, _order=None, _parent=None)
        out._parent = self._retime_lineage(changed)
        return out

    def _retime_lineage(self, changed: np.ndarray) -> tuple | None:
        if self._order is not None:
            return (self._order, len(self), changed)
        if self._parent is not None:
            order, rows, before = self._parent
            grown = changed.copy()
            grown[rows:] = False  # rows added since the parent are merged anyway
            if before is not None:
                grown[:rows] |= before
            return (order, rows, grown[:rows] if len(grown) > rows else grown)
        return None

    def with_dtype(self, rows: np.ndarray, dtype_name: str) -> "Timeline":
        dtypes = list(self.dtypes)
        if dtype_name not in dtypes:
            dtypes.append(dtype_name)
        code = dtypes.index(dtype_name)
        dtype = self.dtype.copy()
        dtype[rows] = code
        out = replace(self, dtype=dtype, dtypes=dtypes)
        out._order, out._parent = self._order, self._parent
        return out

    def with_op(self, op_name: str) -> "Timeline":
        """The same rows with ``op_name`` among the op names (for rows a technique adds)."""
        if op_name in self.ops:
            return self
        out = replace(self, ops=list(self.ops) + [op_name])
        out._order, out._parent = self._order, self._parent
        return out

    def appended(self, rows: dict) -> "Timeline":
        """Add storages; ``rows`` maps field -> array (missing fields get neutral values)."""
        count = len(rows["size"])
        if not count:
            return self
        base = self
        if "dtype" not in rows and "float32" not in self.dtypes:
            base = replace(self, dtypes=self.dtypes + ["float32"])
            base._order, base._parent = self._order, self._parent
        if base is not self:
            return base.appended(rows)
        defaults = {
            "category": np.full(count, CATEGORY_CODE[schema.TEMPORARY], np.int8),
            "dtype": np.full(count, self.dtypes.index("float32") if "float32" in self.dtypes
                             else 0, np.int16),
            "module": np.zeros(count, np.int32),
            "phase": np.zeros(count, np.int8), "op": np.zeros(count, np.int32),
            "scales_with_batch": np.zeros(count, bool),
            "shape": np.full(count, "", dtype=object),
        }
        merged = {}
        for name in ("size", "alloc_key", "free_key", "category", "dtype", "module", "phase",
                     "op", "scales_with_batch", "shape"):
            base = getattr(self, name)
            extra = np.asarray(rows.get(name, defaults.get(name)), dtype=base.dtype)
            merged[name] = np.concatenate([base, extra])
        reads = self.reads.extended(count) if self.reads is not None else None
        out = replace(self, **merged, reads=reads, _order=None, _parent=None)
        if self._order is not None:
            out._parent = (self._order, len(self), None)
        else:
            out._parent = self._parent
        return out

    def dropped(self, keep: np.ndarray) -> "Timeline":
        """Rows where ``keep`` is False become size 0 (kept so codes and orders stay valid)."""
        return self.resized(np.where(keep, self.size, 0.0))

    # --- evaluation --------------------------------------------------------------------------
    def sort_keys(self) -> np.ndarray:
        """Keys of the concatenated [frees, allocs] events; a free sorts just before an
        alloc at the same key (``FREE_FIRST``), so ties left are between events of one
        kind, whose order changes no peak."""
        return np.concatenate([self.free_key - FREE_FIRST, self.alloc_key])

    def event_keys(self, events: np.ndarray) -> np.ndarray:
        """``sort_keys()[events]`` without building every key."""
        rows = len(self)
        return np.where(events >= rows, self.alloc_key[np.maximum(events - rows, 0)],
                        self.free_key[np.minimum(events, rows - 1)] - FREE_FIRST)

    def sorted_position(self, keys, side: str = "left") -> np.ndarray:
        """``np.searchsorted(sort_keys()[order()], keys, side)``, by binary search."""
        return sorted_search(self, self.order(), keys, side)

    def order(self) -> np.ndarray:
        """Indices into the concatenated [frees, allocs] events, sorted by ``sort_keys``.

        Derived timelines merge their changed and added rows into the parent's order
        (a searchsorted and an insert, linear) instead of sorting everything again."""
        if self._order is None:
            keys = self.sort_keys()
            if self._parent is None:
                self._order = np.argsort(keys, kind="stable")
            else:
                self._order = merge_order(keys, len(self), *self._parent)
            self._parent = None
        return self._order

    def live_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(live bytes after each sorted event, sorted event index)."""
        order = self.order()
        deltas = np.concatenate([-self.size, self.size])[order]
        return np.cumsum(deltas), order

    def peak(self) -> "Peak":
        live, order = self.live_curve()
        if not len(live):
            return Peak(0, -1.0, {})
        at = int(np.argmax(live))
        rows = len(self)
        index = int(order[at])
        key = float(self.alloc_key[index - rows] if index >= rows else self.free_key[index])
        alive = self.alive_rows(key, include_allocs_at_key=True, upto_sorted=at)
        return Peak(int(round(float(live[at]))), key, self.bytes_by_category(alive))

    def alive_rows(self, key: float, include_allocs_at_key: bool = True,
                   upto_sorted: int | None = None) -> np.ndarray:
        """Boolean mask of rows alive just after the sorted event ``upto_sorted`` at ``key``."""
        if upto_sorted is not None:
            order = self.order()
            rows = len(self)
            seen = np.zeros(2 * rows, bool)
            seen[order[:upto_sorted + 1]] = True
            return seen[rows:] & ~seen[:rows]
        alloc_ok = self.alloc_key <= key if include_allocs_at_key else self.alloc_key < key
        return alloc_ok & (self.free_key > key)

    def bytes_by_category(self, mask: np.ndarray) -> dict[str, int]:
        sums = np.bincount(self.category[mask], weights=self.size[mask],
                           minlength=len(schema.CATEGORIES))
        return {name: int(round(sums[code])) for code, name in enumerate(schema.CATEGORIES)
                if round(sums[code])}

    def category_mask(self, *names: str) -> np.ndarray:
        codes = [CATEGORY_CODE[n] for n in names]
        return np.isin(self.category, codes)

    def dtype_names(self) -> np.ndarray:
        return np.asarray(self.dtypes, dtype=object)[self.dtype]

    def dtype_in(self, names) -> np.ndarray:
        """Rows whose dtype is one of ``names`` (by code: no string per row)."""
        return np.asarray([d in names for d in self.dtypes], bool)[self.dtype] \
            if self.dtypes else np.zeros(len(self), bool)

    def op_in(self, names) -> np.ndarray:
        return np.asarray([o in names for o in self.ops], bool)[self.op] \
            if self.ops else np.zeros(len(self), bool)

    def module_names(self) -> np.ndarray:
        return np.asarray(self.modules, dtype=object)[self.module]


@dataclass(frozen=True)
class Reads:
    """Which rows each row's op read (the trace's ``input_ids`` on the step's rows): row
    ``i`` read ``rows[offsets[i]:offsets[i + 1]]``.  Rows a technique adds read nothing
    recorded; storages read that are not rows of the step (made before it and gone) are
    left out."""

    offsets: np.ndarray  #: int64, len(timeline) + 1
    rows: np.ndarray  #: int64 row indices

    def of(self, row: int) -> np.ndarray:
        return self.rows[self.offsets[row]:self.offsets[row + 1]]

    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    def extended(self, added_rows: int) -> "Reads":
        return Reads(np.concatenate([self.offsets, np.full(added_rows, self.offsets[-1])]),
                     self.rows)


def _reads(events: pd.DataFrame, row_alloc: np.ndarray, ids: np.ndarray,
           row_of_id: np.ndarray) -> Reads | None:
    """The step's data flow from the events' ``input_ids`` (None where none recorded)."""
    if "input_ids" not in events:
        return None
    offsets, values = id_lists(events)
    if not len(values):
        return None
    starts, stops = offsets[row_alloc], offsets[row_alloc + 1]
    counts = stops - starts
    flat = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) \
        + np.arange(int(counts.sum()))
    sids = values[flat]
    at = np.clip(np.searchsorted(ids, sids), 0, max(len(ids) - 1, 0))
    found = (ids[at] == sids) if len(ids) else np.zeros(len(sids), bool)
    rows = np.where(found, row_of_id[at], -1)
    keep = rows >= 0
    owner = np.repeat(np.arange(len(row_alloc)), counts)[keep]
    new_offsets = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(row_alloc)))])
    return Reads(new_offsets.astype(np.int64), rows[keep].astype(np.int64))


FREE_FIRST = 1e-7  #: below the smallest key step techniques use (1 / events in a step)


def merge_order(keys: np.ndarray, rows: int, parent_order: np.ndarray, parent_rows: int,
                 changed: np.ndarray | None) -> np.ndarray:
    """The parent's order without the changed rows' events (``mapped``), with the changed
    and added rows' events (``new``: frees, then allocs, rows ascending) placed by key; at
    equal keys ``mapped`` first, then ``new`` in its own order.  That is a stable sort by
    key of ``[mapped, new]``: it is computed as one, in linear time where ``new`` is small
    (binary searches and one copy) or made of a few sorted runs (timsort)."""
    mapped = parent_order
    added = np.arange(parent_rows, rows)
    if changed is not None and changed.any():
        moved = changed[:parent_rows]
        mapped = mapped[~np.concatenate([moved, moved])[mapped]]
        added = np.concatenate([np.flatnonzero(moved), added])
    if rows != parent_rows:  # allocs are numbered after the rows: shift them by the added rows
        mapped = np.where(mapped < parent_rows, mapped, mapped + (rows - parent_rows))
    if not len(added):
        return mapped
    new = np.concatenate([added, added + rows])
    if len(new) <= FEW_NEW:
        new = new[np.argsort(keys[new], kind="stable")]
        return _inserted(mapped, sorted_search(keys, mapped, keys[new], "right"), new)
    new = new[np.argsort(keys[new], kind="stable")]
    merged = np.concatenate([mapped, new])  # two sorted runs: timsort merges them
    return merged[np.argsort(keys[merged], kind="stable")]


FEW_NEW = 4096  #: events placed one by one (binary search) rather than sorted in


def _inserted(items: np.ndarray, positions: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``np.insert(items, positions, new)`` for a few ``positions`` in ascending order: one
    copy of ``items`` in slices."""
    parts = []
    start = 0
    for position, value in zip(positions.tolist(), np.split(new, len(new))):
        parts += [items[start:position], value]
        start = position
    parts.append(items[start:])
    return np.concatenate(parts)


def sorted_search(keys, order: np.ndarray, queries, side: str = "left") -> np.ndarray:
    """``np.searchsorted(keys[order], queries, side)`` without gathering ``keys[order]``
    (for a few queries against a long axis): a binary search per query, all queries at
    once.  ``keys``: an array by event index, or a ``Timeline`` (its ``event_keys``)."""
    lookup = keys.event_keys if isinstance(keys, Timeline) else keys.__getitem__
    queries = np.asarray(queries, dtype=np.float64)
    low = np.zeros(len(queries), np.int64)
    high = np.full(len(queries), len(order), np.int64)
    while True:
        active = low < high
        if not active.any():
            return low
        middle = (low + high) // 2
        value = lookup(order[np.minimum(middle, len(order) - 1)])
        after = value <= queries if side == "right" else value < queries
        low = np.where(active & after, middle + 1, low)
        high = np.where(active & ~after, middle, high)


@dataclass(frozen=True)
class Peak:
    bytes: int
    key: float  #: where on the step's event axis the peak is
    by_category: dict[str, int]


# --- building the baseline timeline -----------------------------------------------------------
def _codes(column: pd.Series) -> tuple[np.ndarray, list[str]]:
    if isinstance(column.dtype, pd.CategoricalDtype):
        cats = [str(c) for c in column.cat.categories]
        codes = column.cat.codes.to_numpy()
        if (codes < 0).any():
            cats.append("")
            codes = np.where(codes < 0, len(cats) - 1, codes)
        return codes.astype(np.int32), cats
    codes, uniques = pd.factorize(column.astype(str))
    return codes.astype(np.int32), [str(u) for u in uniques]


def _per_id(row_flags: np.ndarray, inverse: np.ndarray, n_ids: int,
            alloc_at: np.ndarray) -> np.ndarray:
    """A per-row flag read at each storage id's alloc row (False where it has none)."""
    flags = np.zeros(n_ids, bool)
    has = alloc_at >= 0
    flags[has] = row_flags[alloc_at[has]]
    return flags


def build_timeline(trace: Trace, step: int | None = None) -> Timeline:
    """The analysed step (default: the last complete one) of ``trace`` as a Timeline."""
    events = trace.events
    if step is None:
        step = analysed_step(trace)
    window = step_slice(events, step)
    start, stop = window.start, window.stop
    n_events = stop - start

    is_alloc = (events["action"] == schema.ALLOC).to_numpy()
    storage_ids = events["storage_id"].to_numpy()
    positions = np.arange(len(events))
    ids, inverse = np.unique(storage_ids, return_inverse=True)
    alloc_at = np.full(len(ids), -1, np.int64)
    free_at = np.full(len(ids), len(events), np.int64)
    # the first alloc and the first free after it per storage id (ids are not reused)
    alloc_idx = positions[is_alloc]
    alloc_at[inverse[alloc_idx][::-1]] = alloc_idx[::-1]
    free_idx = positions[~is_alloc]
    free_at[inverse[free_idx][::-1]] = free_idx[::-1]
    has_alloc = alloc_at >= 0
    alive = has_alloc & (alloc_at < stop) & (free_at >= start)
    device = str(trace.meta.device)
    if device.startswith("cuda"):
        # a GPU's peak holds its own blocks only: host tensors (a DataLoader's batches,
        # pinned buffers, offloaded activations) live on the CPU
        on_device = (events["device"] == device).to_numpy()
        if on_device.any():  # (a trace naming no such rows is left whole)
            alive &= _per_id(on_device, inverse, len(ids), alloc_at)
    rows = np.flatnonzero(alive)
    row_alloc = alloc_at[rows]

    columns = {}
    for name in ("category", "dtype", "module", "phase", "op", "shape"):
        codes, names = _codes(events[name])
        columns[name] = (codes[row_alloc], names)
    category_map = np.array([CATEGORY_CODE.get(c, CATEGORY_CODE[schema.OTHER])
                             for c in columns["category"][1]], np.int8)
    phase_map = np.array([PHASE_CODE.get(p, PHASE_CODE[schema.OTHER_PHASE])
                          for p in columns["phase"][1]], np.int8)
    shape_names = np.asarray(columns["shape"][1], dtype=object)

    alloc_key = np.where(row_alloc < start, -1.0, (row_alloc - start).astype(np.float64))
    free_key = np.minimum(free_at[rows], stop).astype(np.float64) - start
    size = events["size_bytes"].to_numpy()[row_alloc].astype(np.float64)

    module_codes, module_names = _codes(events["module"])
    phase_codes, phase_names = _codes(events["phase"])
    event_phase = np.array([PHASE_CODE.get(p, 3) for p in phase_names], np.int8)[
        phase_codes[start:stop]]
    row_of_id = np.full(len(ids), -1, np.int64)
    row_of_id[rows] = np.arange(len(rows))
    timeline = Timeline(
        size=size, alloc_key=alloc_key, free_key=free_key,
        category=category_map[columns["category"][0]],
        dtype=columns["dtype"][0].astype(np.int16), dtypes=columns["dtype"][1],
        module=columns["module"][0], modules=columns["module"][1],
        phase=phase_map[columns["phase"][0]],
        op=columns["op"][0], ops=columns["op"][1],
        scales_with_batch=np.zeros(len(rows), bool),
        shape=shape_names[columns["shape"][0]],
        n_events=n_events,
        event_phase=event_phase,
        event_module=module_codes[start:stop],
        event_is_alloc=is_alloc[start:stop],
        event_row=row_of_id[inverse[start:stop]],
        reads=_reads(events, row_alloc, ids, row_of_id),
    )
    assert timeline.modules == module_names
    return timeline


def replay_events(timeline: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """(signed sizes in event order, row of each event): the allocation stream a plan makes,
    for the allocator model.  Rows alive before the step come first, in row order."""
    order = timeline.order()
    rows = len(timeline)
    is_alloc = order >= rows
    row = np.where(is_alloc, order - rows, order)
    sizes = timeline.size[row]
    keep = sizes > 0
    return np.where(is_alloc, sizes, -sizes)[keep], row[keep]
