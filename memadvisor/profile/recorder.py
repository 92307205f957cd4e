"""The event log: storages coming to life and dying, and what each one turned out to be.

Storages, not tensors, are the unit: views and in-place results share their base's
storage, so they never add bytes.  A storage's *category* is only known over its life
(an op output becomes a gradient when autograd accumulates it, an activation when autograd
saves it), so categories are collected as marks and resolved when the trace is written:
the most specific mark wins (``CATEGORY_PRIORITY``).
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np
import pyarrow as pa

from ..trace import schema
from ..trace.io import events_table

# the most specific role first: a parameter saved for backward is still a parameter
CATEGORY_PRIORITY = {
    schema.PARAMETER: 0, schema.BUFFER: 1, schema.OPTIMIZER_STATE: 2, schema.GRADIENT: 3,
    # the batch is 'input' even where autograd saves it (embedding saves the token ids)
    schema.AUTOCAST_WEIGHT: 4, schema.INPUT: 5, schema.ACTIVATION: 6, schema.TEMPORARY: 7,
    schema.OTHER: 8,
}

# row layout (tuples are the cheapest thing to append per event)
_TIME, _ACTION, _SID, _SIZE, _DEVICE, _DTYPE, _SHAPE, _OP, _MODULE, _PHASE, _FILE, _LINE, \
    _FUNC = range(13)


class EventRecorder:
    """Owns the live-storage map and the rows; the dispatch mode and hooks feed it."""

    def __init__(self, clock=time.monotonic_ns):
        self._clock = clock
        self.start_ns = clock()
        self.rows: list[tuple] = []
        self._live: dict[int, tuple[int, int]] = {}  # storage _cdata -> (sid, alloc row)
        self._refs: dict[int, weakref.ref] = {}  # _cdata -> weakref whose callback logs the free
        self._marks: dict[int, str] = {}  # sid -> best category so far
        # sid -> module that owns the storage (a parameter's module, its gradient's and its
        # optimizer state's): more useful than the module running when it was allocated
        self._owners: dict[int, str] = {}
        self._next_sid = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        # set by the session: where we are in training, read at every event
        self.phase = schema.OTHER_PHASE
        self.module = ""
        self.enabled = True
        #: ``on_free(cdata) -> bool``: asked before a storage's free is logged; True means
        #: it was handled (fake execution merges autograd's accumulations: ``merge_into``)
        self.on_free = None
        self.pending_merge = None  #: owned by on_free's provider
        #: alloc row -> storage ids the op that made it read (the trace's ``input_ids``)
        self.row_inputs: dict[int, tuple[int, ...]] = {}

    # --- storages --------------------------------------------------------------------
    def lookup(self, storage) -> int | None:
        entry = self._live.get(storage._cdata)
        return None if entry is None else entry[0]

    def size_of(self, storage) -> int:
        entry = self._live.get(storage._cdata)
        return -1 if entry is None else self.rows[entry[1]][_SIZE]

    def created_phase(self, storage) -> str | None:
        entry = self._live.get(storage._cdata)
        return None if entry is None else self.rows[entry[1]][_PHASE]

    def alloc(self, storage, device: str, dtype: str, shape: str, op: str,
              source: tuple[str, int, str], size_bytes: int | None = None,
              inputs: tuple[int, ...] = ()) -> int:
        """Log a storage we have not seen; returns its sid.  ``size_bytes`` is the
        allocator's block size where the native hook saw it (else the storage's bytes);
        ``inputs``: the storage ids the op making it read."""
        cdata = storage._cdata
        size = storage.nbytes() if size_bytes is None else size_bytes
        if inputs:
            self.row_inputs[len(self.rows)] = inputs
        sid = self._log_alloc(cdata, size, device, dtype, shape, op, self.module,
                              source)
        # keyed by the storage's address, not the sid: a resize gives the storage a new sid
        self._refs[cdata] = weakref.ref(storage, lambda _ref, cdata=cdata: self._free(cdata))
        return sid

    def _log_alloc(self, cdata: int | None, size: int, device, dtype, shape, op, module,
                   source) -> int:
        sid = self._next_sid
        self._next_sid += 1
        if cdata is not None:
            self._live[cdata] = (sid, len(self.rows))
        self.rows.append((self._clock() - self.start_ns, schema.ALLOC, sid, size, device, dtype,
                          shape, op, module, self.phase, source[0], source[1], source[2]))
        self.live_bytes += size
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return sid

    def _free(self, cdata: int) -> None:
        self._refs.pop(cdata, None)
        if self.on_free is not None and self.enabled and self.on_free(cdata):
            return
        entry = self._live.pop(cdata, None)
        if entry is None or not self.enabled:
            return
        self._log_free(entry[1])

    def _log_free(self, alloc_row: int) -> None:
        a = self.rows[alloc_row]
        # a free row repeats its allocation's identity (op, module, source) so that any row
        # can be grouped on its own; phase and time are those of the free
        self.rows.append((self._clock() - self.start_ns, schema.FREE, a[_SID], a[_SIZE],
                          a[_DEVICE], a[_DTYPE], a[_SHAPE], a[_OP], a[_MODULE], self.phase,
                          a[_FILE], a[_LINE], a[_FUNC]))
        self.live_bytes -= a[_SIZE]

    def live_row(self, storage) -> int | None:
        """The alloc row of a live storage."""
        entry = self._live.get(storage._cdata)
        return None if entry is None else entry[1]

    def merge_into(self, result_cdata: int, dying_cdata: int, result_row: int) -> None:
        """The storage ``result_cdata`` (allocated at ``result_row``, the last row) takes
        over the block of ``dying_cdata``, which is being freed: what an in-place op would
        have done.  The result's alloc row is dropped; its marks move to the block."""
        dying = self._live.pop(dying_cdata)
        result_sid = self._live[result_cdata][0]
        row = self.rows.pop(result_row)
        self.row_inputs.pop(result_row, None)
        self._unlog_alloc(row)
        mark = self._marks.pop(result_sid, None)
        if mark is not None:
            self.mark_sid(dying[0], mark)
        owner = self._owners.pop(result_sid, None)
        if owner is not None:
            self._owners.setdefault(dying[0], owner)
        self._live[result_cdata] = dying

    def _unlog_alloc(self, row: tuple) -> None:
        self.live_bytes -= row[_SIZE]

    def internal_alloc(self, size: int, device: str, op: str, source) -> int:
        """A block a kernel allocated for itself (seen only by the native allocator hook):
        a raw byte buffer with no tensor.  Returns its alloc row for ``internal_free``."""
        row = len(self.rows)
        self._log_alloc(None, size, device, schema.RAW_BYTES_DTYPE, str(size), op, self.module,
                        source)
        return row

    def internal_free(self, alloc_row: int) -> None:
        if self.enabled:
            self._log_free(alloc_row)

    def kernel_scratch(self, sizes, device: str, op: str, source, category: str) -> None:
        """Blocks a GPU kernel takes for its own duration (workspaces, staging buffers),
        which fake tensors never make: logged after the op's outputs, all alive together,
        then freed -- the kernel's peak is its inputs, outputs and these."""
        rows = []
        for size in sizes:
            if size > 0:
                rows.append(self.internal_alloc(size, device, op, source))
                self.mark_sid(self.rows[rows[-1]][_SID], category)
        for row in rows:
            self.internal_free(row)

    def check_resize(self, storage, op: str, shape: str, source,
                     size_bytes: int | None = None, allow_shrink: bool = False) -> None:
        """An op grew (or shrank) an existing storage in place (``out=`` into an empty
        tensor, ``resize_``): log it as the old size freed and the new size allocated."""
        cdata = storage._cdata
        entry = self._live.get(cdata)
        if entry is None:
            return
        old = self.rows[entry[1]]
        size = storage.nbytes() if size_bytes is None else size_bytes
        if size == old[_SIZE] or (size < old[_SIZE] and not allow_shrink):
            return
        self._log_free(entry[1])
        new_sid = self._log_alloc(cdata, size, old[_DEVICE], old[_DTYPE], shape, op,
                                  self.module, source)
        mark = self._marks.get(old[_SID])
        if mark is not None:
            self._marks[new_sid] = mark

    # --- categories --------------------------------------------------------------------
    def mark(self, storage, category: str) -> None:
        entry = self._live.get(storage._cdata)
        if entry is not None:
            self.mark_sid(entry[0], category)

    def mark_sid(self, sid: int, category: str) -> None:
        old = self._marks.get(sid)
        if old is None or CATEGORY_PRIORITY[category] < CATEGORY_PRIORITY[old]:
            self._marks[sid] = category

    def set_owner(self, storage, module_path: str) -> None:
        entry = self._live.get(storage._cdata)
        if entry is not None:
            self._owners.setdefault(entry[0], module_path)

    def category_of(self, storage) -> str | None:
        entry = self._live.get(storage._cdata)
        return None if entry is None else self._marks.get(entry[0])

    # --- output ------------------------------------------------------------------------
    def now_seq(self) -> int:
        """The seq the next event will get (step boundaries are kept as seqs)."""
        return len(self.rows)

    def now_ns(self) -> int:
        return self._clock() - self.start_ns

    def stop(self) -> None:
        """No more events: frees after this (interpreter teardown) are not part of the run."""
        self.enabled = False

    def to_table(self, step_boundaries: list[int]) -> pa.Table:
        """Resolve steps and categories and build the events table."""
        rows = self.rows
        n = len(rows)
        columns: dict[str, Any] = {}
        if n:
            cols = list(zip(*rows))
        else:
            cols = [()] * 13
        columns["seq"] = np.arange(n, dtype=np.int64)
        columns["time_ns"] = np.asarray(cols[_TIME], dtype=np.int64)
        columns["action"] = cols[_ACTION]
        columns["storage_id"] = np.asarray(cols[_SID], dtype=np.int64)
        columns["size_bytes"] = np.asarray(cols[_SIZE], dtype=np.int64)
        columns["device"] = cols[_DEVICE]
        columns["dtype"] = cols[_DTYPE]
        columns["shape"] = cols[_SHAPE]
        marks = self._marks
        phases = cols[_PHASE]
        # an unmarked storage made while computing is a temporary; one made between steps
        # (logging, data not fed to a model) is 'other'.  Decided from the alloc row's phase.
        alloc_phase: dict[int, str] = {}
        freed_in_backward: set[int] = set()
        for sid, action, phase in zip(cols[_SID], cols[_ACTION], phases):
            if action == schema.ALLOC:
                alloc_phase[sid] = phase
            elif phase == schema.BACKWARD:
                freed_in_backward.add(sid)

        def resolve(sid: int) -> str:
            mark = marks.get(sid)
            if mark is not None:
                return mark
            created = alloc_phase.get(sid)
            if created == schema.FORWARD and sid in freed_in_backward:
                # held from forward into backward without passing through our pack hook:
                # what a non-reentrant checkpoint (or a custom autograd.Function) keeps
                return schema.ACTIVATION
            return schema.OTHER if created == schema.OTHER_PHASE else schema.TEMPORARY
        cache: dict[int, str] = {}
        categories = []
        for sid in cols[_SID]:
            category = cache.get(sid)
            if category is None:
                category = cache[sid] = resolve(sid)
            categories.append(category)
        columns["category"] = categories
        columns["op"] = cols[_OP]
        owners = self._owners
        columns["module"] = [owners.get(sid, module) for sid, module in zip(cols[_SID], cols[_MODULE])] \
            if owners else cols[_MODULE]
        columns["phase"] = phases
        boundaries = np.asarray(sorted(step_boundaries), dtype=np.int64)
        columns["step"] = np.searchsorted(boundaries, columns["seq"], side="right").astype(np.int32)
        columns["source_file"] = cols[_FILE]
        columns["source_line"] = np.asarray(cols[_LINE], dtype=np.int32)
        columns["source_function"] = cols[_FUNC]
        inputs = self.row_inputs
        columns["input_ids"] = [inputs.get(row, ()) for row in range(n)] if inputs else None
        return events_table(columns)
