"""Activation checkpointing (non-reentrant ``torch.utils.checkpoint``) as a stream transform.

For each checkpointed region (a module path and its submodules; '' is the whole model):

* calls: a step with several backward passes calls the region once per pass (a GAN's
  discriminator), and a forward may call it many times (a decoder in a loop over time,
  ``_repeated_calls``): each call is checkpointed on its own, as apply's wrapped forward
  does, and transformed with its own backward;
* forward: activations a call saves for its own backward (allocated in the call, still
  alive when the region's backward starts) are no longer kept: where the trace records
  data flow (format 3), each dies once the last op of the call that reads it has run
  (``_ForwardReaders``; one nothing reads, e.g. a normalisation's saved statistics or a
  dropout mask, when the op that made it returns), else when the call ends.  One that
  an op after the call reads (its output) keeps its lifetime where an op outside the
  checkpointed calls saves it, else dies after its last reader; the call's arguments
  (rows made before it that its ops read) live until its backward is done: checkpoint
  keeps them to recompute from (so the next checkpointed block holds a block's output);
* backward: the call's forward is replayed (activations and temporaries, in their order)
  up to the last saved tensor (non-reentrant checkpoint stops recomputing early there):
  the region's last call just before the region's first backward allocation, an earlier
  one just before its backward first reads one of its saved tensors; recomputed
  activations then die at their original backward frees, recomputed temporaries as they
  did in forward;
* on a CPU model, ``preserve_rng_state`` keeps a copy of the CPU generator state
  (``CPU_RNG_STATE_BYTES``) from the call's forward until its backward is done, and the
  recompute (under ``fork_rng``) holds one more while it runs.

Regions are located from alloc events only: a free row carries its storage's allocation
module, not the module running when it is freed.  Modules the script checkpoints itself
(``own_checkpoints.script_checkpointed``) are not regions: apply leaves them as the script
runs them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace import schema
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

CPU_RNG_STATE_BYTES = 5056  #: torch.get_rng_state() of the default CPU generator (mt19937)

_FORWARD = PHASE_CODE[schema.FORWARD]
_BACKWARD = PHASE_CODE[schema.BACKWARD]


@dataclass(frozen=True)
class RegionEffect:
    path: str
    freed_bytes: int  #: activations no longer kept between forward and backward
    recompute_positions: tuple[int, int]  #: forward event span replayed in backward


class _Index:
    """Lookups every region of one ``apply_checkpoint`` shares, built once (linear in the
    events and rows), so that each region then costs what its own events and rows do: a
    model of 700 checkpointed blocks no longer scans the whole step 700 times (advise on a
    1M-event trace spent 22 s there)."""

    def __init__(self, timeline: Timeline):
        names = np.asarray(timeline.modules, dtype=object).astype(str)
        self.module_order = np.argsort(names, kind="stable")
        self.sorted_names = names[self.module_order]
        alloc_events = np.flatnonzero(timeline.event_is_alloc)
        by_module = np.argsort(timeline.event_module[alloc_events], kind="stable")
        self.alloc_events = alloc_events[by_module]  # grouped by module, in event order
        self.module_starts = np.searchsorted(timeline.event_module[self.alloc_events],
                                             np.arange(len(names) + 1))
        self.backward_so_far = np.cumsum(timeline.event_phase == _BACKWARD)
        self.outside_backward = np.flatnonzero(timeline.event_phase != _BACKWARD)
        self.rows_by_alloc = np.argsort(timeline.alloc_key, kind="stable")
        self.sorted_alloc_keys = timeline.alloc_key[self.rows_by_alloc]
        self.readers = _ForwardReaders.of(timeline)
        self.backward_reads = _backward_reads(timeline)
        #: per module: inside a checkpointed region (set by ``apply_checkpoint``)
        self.checkpointed: np.ndarray | None = None
        #: (rows, key): a call's arguments, held until its backward is done
        self.holds: list[tuple[np.ndarray, float]] = []

    def backward_reads_of(self, rows: np.ndarray, member: np.ndarray, after: float
                          ) -> np.ndarray:
        """Keys of the backward events after ``after`` whose op, one of the region's
        (``member``), reads one of ``rows`` (unpacks a saved tensor); empty where the
        trace records no such read."""
        if self.backward_reads is None:
            return np.zeros(0)
        source, key, module = self.backward_reads
        lo = np.searchsorted(source, rows, "left")
        hi = np.searchsorted(source, rows, "right")
        reader = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())]
                                + [np.zeros(0, np.int64)])
        return key[reader][member[module[reader]] & (key[reader] > after)]

    def saved_by_others(self, rows: np.ndarray, modules: np.ndarray) -> np.ndarray:
        """Per row: whether a backward op of a module outside ``modules`` (a bool mask)
        reads it, i.e. an op there saved it; False where the trace has no data flow."""
        out = np.zeros(len(rows), bool)
        if self.backward_reads is None:
            return out
        source, _, module = self.backward_reads
        lo = np.searchsorted(source, rows, "left")
        hi = np.searchsorted(source, rows, "right")
        for i, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
            out[i] = bool((~modules[module[a:b]]).any())
        return out

    def member_modules(self, region: str) -> np.ndarray:
        """Bool per module code: the region's module and its submodules."""
        member = np.zeros(len(self.sorted_names), bool)
        if region == "":
            member[:] = True
            return member
        names = self.sorted_names
        exact = slice(np.searchsorted(names, region, "left"),
                      np.searchsorted(names, region, "right"))
        # its submodules ``region.*`` sort together, from ``region.`` to before ``region/``
        below = slice(np.searchsorted(names, region + ".", "left"),
                      np.searchsorted(names, region + "/", "left"))
        member[self.module_order[exact]] = True
        member[self.module_order[below]] = True
        return member

    def alloc_events_of(self, member: np.ndarray) -> np.ndarray:
        parts = [self.alloc_events[self.module_starts[code]:self.module_starts[code + 1]]
                 for code in np.flatnonzero(member)]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def pass_end(self, backward_start: int, n_events: int) -> int:
        """The first event at or after ``backward_start`` outside backward."""
        at = np.searchsorted(self.outside_backward, backward_start)
        return int(self.outside_backward[at]) if at < len(self.outside_backward) else n_events

    def rows_made_between(self, start: float, end: float) -> np.ndarray:
        """Rows allocated at keys ``start``..``end``, in row order."""
        lo = np.searchsorted(self.sorted_alloc_keys, start, "left")
        hi = np.searchsorted(self.sorted_alloc_keys, end, "right")
        return np.sort(self.rows_by_alloc[lo:hi])


class _ForwardReaders:
    """Who reads each row in forward (the trace's data flow), and where each op ends.

    Under checkpointing a region's forward saves nothing, so a tensor made there lives as
    long as the Python code holds it: until the last op that reads it has returned (a
    ``Sequential`` rebinds its ``input``; ``f(g(x))`` drops ``g``'s result after ``f``).
    A local variable that holds a tensor past its last read is the exception it misses;
    the bound is the region's end, where it dies without data flow."""

    def __init__(self, source: np.ndarray, reader_key: np.ndarray, op_end: tuple,
                 reader_module: np.ndarray | None = None):
        self.source, self.reader_key, self.op_end = source, reader_key, op_end
        self.reader_module = reader_module

    @classmethod
    def of(cls, timeline: Timeline) -> "_ForwardReaders | None":
        found = _reads_in_phase(timeline, _FORWARD)
        if found is None:
            return None
        source, reader_key, reader_module = found
        return cls(source, reader_key, _op_ends(timeline), reader_module)

    def read_outside(self, rows: np.ndarray, member: np.ndarray, after: float) -> bool:
        """Whether an op of a module outside ``member`` reads one of ``rows`` after the
        key ``after``."""
        lo = np.searchsorted(self.source, rows, "left")
        hi = np.searchsorted(self.source, rows, "right")
        for a, b in zip(lo.tolist(), hi.tolist()):
            if ((self.reader_key[a:b] > after) & ~member[self.reader_module[a:b]]).any():
                return True
        return False

    def death(self, rows: np.ndarray, made: np.ndarray, start: float, end: float,
              checkpointed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per row: the key where it dies in a forward that saves nothing (its last reader
        in ``start..end`` ended; nothing read it: its own op ended), and whether an op
        after ``end`` reads it (then it is not the region's to free) -- an op of another
        checkpointed call (``checkpointed``: per module) does not count: that call keeps
        it as its argument until its backward, not longer (``_hold_arguments``)."""
        lo = np.searchsorted(self.source, rows, "left")
        hi = np.searchsorted(self.source, rows, "right")
        last = made.astype(float).copy()
        read_after = np.zeros(len(rows), bool)
        for i, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
            keys = self.reader_key[a:b]
            if len(keys):
                later = keys > end
                if checkpointed is not None and self.reader_module is not None:
                    later &= ~checkpointed[self.reader_module[a:b]]
                read_after[i] = bool(later.any())
                inside = keys[(keys >= start) & (keys <= end)]
                if len(inside):
                    last[i] = max(last[i], float(inside.max()))
        at = np.clip(np.searchsorted(self.op_end[0], last, "left"), 0,
                     max(len(self.op_end[0]) - 1, 0))
        died = np.where(self.op_end[0][at] == last, self.op_end[1][at], last + 0.5)
        return np.minimum(died, end + 0.5), read_after


def _backward_reads(timeline: Timeline) -> tuple[np.ndarray, ...] | None:
    """(rows read in backward, sorted; the alloc key and the module of the op reading
    each)."""
    return _reads_in_phase(timeline, _BACKWARD)


def _reads_in_phase(timeline: Timeline, phase: int) -> tuple[np.ndarray, ...] | None:
    """(rows read by ops of ``phase``, sorted; the alloc key and the module of the op
    reading each); None without data flow."""
    reads = timeline.reads
    if reads is None or not len(reads.rows):
        return None
    reader = np.repeat(np.arange(len(reads.counts())), reads.counts())
    here = timeline.phase[reader] == phase
    source, reader = reads.rows[here], reader[here]
    order = np.argsort(source, kind="stable")
    return source[order], timeline.alloc_key[reader[order]], timeline.module[reader[order]]


def _op_ends(timeline: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """(alloc key of each op output row, key just before the next op's first output): an
    op's inputs outlive the scratch it allocates after its output, so a tensor its last
    reader read dies when the next op starts, not at the reader's output."""
    reads = timeline.reads
    counts = reads.counts()
    outputs = np.flatnonzero(counts > 0)
    outputs = outputs[np.argsort(timeline.alloc_key[outputs], kind="stable")]
    keys = timeline.alloc_key[outputs]
    # the outputs of one op share its op code and the list of rows it read
    same = np.zeros(len(outputs), bool)
    if len(outputs) > 1:
        ops = timeline.op[outputs]
        first = reads.offsets[outputs]
        same[1:] = (ops[1:] == ops[:-1]) & (counts[outputs][1:] == counts[outputs][:-1])
        for i in np.flatnonzero(same):  # few: compare the read lists themselves
            same[i] = np.array_equal(reads.rows[first[i]:first[i] + counts[outputs[i]]],
                                     reads.rows[first[i - 1]:first[i - 1]
                                                + counts[outputs[i - 1]]])
    starts = np.flatnonzero(~same)  # index of each op's first output
    op_of = np.cumsum(~same) - 1
    next_start = np.append(keys[starts[1:]], float(timeline.n_events))
    ends = next_start[op_of] - 0.5
    return keys, np.maximum(ends, keys + 0.25)


_ROW_FIELDS = ("size", "alloc_key", "free_key", "category", "dtype", "module", "phase", "op",
               "scales_with_batch", "shape")


def apply_checkpoint(timeline: Timeline, regions: list[str], device_type: str = "cpu"
                     ) -> tuple[Timeline, list[RegionEffect]]:
    """Each region in turn; the lifetimes they shorten are gathered in one array and the
    recomputed rows appended once at the end (no copy of the step per region).  Regions
    see each other's shortened lifetimes, as when applied one after another; the rows one
    adds (in backward) never fall in another's forward."""
    if not regions:
        return timeline, []
    index = _Index(timeline)
    free_key = timeline.free_key.copy()
    added: list[dict] = []
    float32 = (timeline.dtypes.index("float32") if "float32" in timeline.dtypes
               else len(timeline.dtypes))
    effects = []
    index.checkpointed = np.zeros(len(timeline.modules), bool)
    for region in regions:
        index.checkpointed |= index.member_modules(region)
    for region in regions:
        effect = _checkpoint_region(timeline, index, free_key, added, region, device_type,
                                    float32)
        if effect is not None:
            effects.append(effect)
    for rows, until in index.holds:  # after every region shortened what it saves
        free_key[rows] = np.maximum(free_key[rows], until)
    if not added:
        return timeline, effects
    out = timeline.retimed(timeline.alloc_key, free_key)
    if float32 == len(timeline.dtypes) and any(
            (rows["dtype"] == float32).any() for rows in added):
        out = out.with_dtype(np.zeros(0, int), "float32")
    return out.appended({name: np.concatenate([rows[name] for rows in added])
                         for name in _ROW_FIELDS}), effects


def _checkpoint_region(timeline: Timeline, index: _Index, free_key: np.ndarray,
                       added: list, region: str, device_type: str, float32: int):
    member = index.member_modules(region)
    allocs = index.alloc_events_of(member)
    forward_allocs = allocs[timeline.event_phase[allocs] == _FORWARD]
    backward_allocs = allocs[timeline.event_phase[allocs] == _BACKWARD]
    if not len(forward_allocs) or not len(backward_allocs):
        return None
    freed, spans = 0, []
    for in_pass in _calls(index, forward_allocs):
        after = backward_allocs[backward_allocs > in_pass[-1]]
        if not len(after):
            continue
        backward_start = int(after[0])
        pass_end = index.pass_end(backward_start, timeline.n_events)
        in_backward = after[after < pass_end]
        calls = _repeated_calls(timeline, index, member, in_pass)
        # backward runs the calls last first; each call is recomputed when its first
        # saved tensor is unpacked, and lets go of its generator state once its backward
        # is done: when the call before it is recomputed
        todo, later_frees, later_reads = [], None, None
        for call in reversed(calls):
            start, end = int(call[0]), int(call[-1])
            saved = _saved_rows(timeline, index, free_key, member, start, end, backward_start)
            if not len(saved):
                continue
            reads = index.backward_reads_of(saved, member, backward_start - 1)
            reads = reads[reads < pass_end]
            if todo and later_reads is not None:
                # a tensor handed to the later call (its argument) is read by that call's
                # backward too, which is over before this call's begins
                reads = reads[reads > later_reads]
            if not todo:  # the last call: before the region's first backward allocation
                recompute_at = backward_start
            elif len(reads):  # an earlier one: where its backward reads its first one
                recompute_at = int(reads.min())
            else:  # no data flow: from when the later call's saved tensors are released
                recompute_at = _recompute_at(free_key[saved], later_frees, in_backward,
                                             backward_start)
            later_frees = free_key[saved].copy()
            later_reads = float(reads.max()) if len(reads) else None
            todo.append((start, end, saved, recompute_at))
        for i, (start, end, saved, recompute_at) in enumerate(todo):
            state_until = (todo[i + 1][3] - 0.5 if i + 1 < len(todo)
                           else float(in_backward[-1]) + 0.5)
            saved_bytes, last_saved = _checkpoint_call(
                timeline, index, free_key, added, member, start, end, saved, recompute_at,
                state_until, device_type, float32)
            if saved_bytes:
                freed += saved_bytes
                spans.append((start, last_saved))
    if not spans:
        return None
    spans.sort()
    return RegionEffect(region, freed, (spans[0][0], spans[-1][1]))


def _calls(index: _Index, forward_allocs: np.ndarray) -> list[np.ndarray]:
    """The region's forward allocations split where a backward pass runs between them: a
    step with several backward passes (a GAN's discriminator on real, then on generated
    data, then for the generator's loss) calls the region once per pass, and each call's
    recompute runs in the backward that uses its saved tensors, not in the step's first."""
    passes = index.backward_so_far[forward_allocs]
    return np.split(forward_allocs, np.flatnonzero(np.diff(passes)) + 1)


#: runs of allocations by one module whose recurrence starts another call of a region
CALL_SIGNATURE = 4


def _repeated_calls(timeline: Timeline, index: _Index, member: np.ndarray,
                    allocs: np.ndarray) -> list[np.ndarray]:
    """One pass's forward allocations of a region, split into its calls when the forward
    calls it several times (a decoder in a Python loop over time, a weight-shared block):
    non-reentrant checkpoint wraps each call on its own, recomputes it when that call's
    backward starts and lets it go when it is done, so one call's activations come back at
    a time, not all of them.  The allocations are read as runs by one module (its ops may
    allocate more or less from call to call: an embedding copies a strided index); a call
    starts where the first ``CALL_SIGNATURE`` runs of the first one recur.  The split
    stands only where every call runs the same modules in the same order and a call
    before the last hands the code outside the region a tensor (its output, which the
    data flow records where an op reads it) -- a loop inside the region over one submodule
    hands nothing out before its last iteration.  Anything else is one call."""
    if index.readers is None:
        return [allocs]
    modules = timeline.event_module[allocs]
    run_starts = np.flatnonzero(np.append(True, modules[1:] != modules[:-1]))
    runs = modules[run_starts]
    if len(runs) < 2 * CALL_SIGNATURE:
        return [allocs]
    windows = np.lib.stride_tricks.sliding_window_view(runs, CALL_SIGNATURE)
    starts = np.flatnonzero((windows == runs[:CALL_SIGNATURE]).all(axis=1))
    if len(starts) < 2:
        return [allocs]
    per_call = np.split(runs, starts[1:])
    if any(len(c) != len(per_call[0]) or (c != per_call[0]).any() for c in per_call):
        return [allocs]
    calls = np.split(allocs, run_starts[starts[1:]])
    if not any(index.readers.read_outside(timeline.event_row[call], member, float(call[-1]))
               for call in calls[:-1]):
        return [allocs]
    return calls


def _saved_rows(timeline: Timeline, index: _Index, free_key: np.ndarray, member: np.ndarray,
                start: int, end: int, backward_start: int) -> np.ndarray:
    """The activations one call (forward allocations ``start``..``end``) saves for its
    backward: still alive when the region's backward starts."""
    rows = index.rows_made_between(start, end)
    rows = rows[member[timeline.module[rows]]]
    is_saved = ((timeline.category[rows] == CATEGORY_CODE[schema.ACTIVATION])
                & (free_key[rows] >= backward_start))
    return rows[is_saved]


def _recompute_at(frees: np.ndarray, later_frees: np.ndarray | None,
                  in_backward: np.ndarray, backward_start: int) -> int:
    """The event before which one call is recomputed: the region's first backward
    allocation after the later call's saved tensors are released (those released before
    this call's first one: by that call's own backward); for the last call, the region's
    first backward allocation."""
    if later_frees is None:
        return backward_start
    first_own = float(frees.min())
    done = later_frees[later_frees < first_own]
    if not len(done):
        return backward_start
    at = in_backward[(in_backward > done.max()) & (in_backward < first_own)]
    return int(at[0]) if len(at) else backward_start


_ARGUMENT_CATEGORIES = np.array([CATEGORY_CODE[c] for c in (
    schema.ACTIVATION, schema.TEMPORARY, schema.INPUT)])


def _hold_arguments(timeline: Timeline, index: _Index, rows: np.ndarray, start: int,
                    until: float) -> None:
    """Non-reentrant checkpoint keeps the call's tensor arguments (its recompute reruns
    the call on them) until the call's backward is done: a block's input that nothing in
    the block saves -- a residual block that starts with an out-of-place ReLU -- lives
    on to the block's backward instead of dying when the next op has read it.  The
    arguments are read from the data flow: rows made before the call that its ops read.
    Applied once every region is done (``index.holds``), so that a call whose output is
    the next checkpointed call's argument frees it as its own and the next one holds it."""
    reads = timeline.reads
    if reads is None or not len(rows):
        return
    first, last = reads.offsets[rows], reads.offsets[rows + 1]
    if not (last > first).any():
        return
    read = np.unique(np.concatenate([reads.rows[a:b] for a, b in zip(first, last) if b > a]))
    read = read[(timeline.alloc_key[read] < start)
                & np.isin(timeline.category[read], _ARGUMENT_CATEGORIES)]
    index.holds.append((read, until))


def _checkpoint_call(timeline: Timeline, index: _Index, free_key: np.ndarray, added: list,
                     member: np.ndarray, start: int, end: int, saved: np.ndarray,
                     backward_start: int, state_until: float, device_type: str,
                     float32: int):
    """One call of the region (forward allocations ``start``..``end``) that saves
    ``saved``, recomputed just before the event ``backward_start``; the RNG state it keeps
    is freed at ``state_until``.  Shortens lifetimes in ``free_key``, adds the recomputed
    rows to ``added``; returns the bytes no longer kept and the last saved row's key."""
    rows = index.rows_made_between(start, end)
    rows = rows[member[timeline.module[rows]]]
    is_saved = np.isin(rows, saved)
    last_saved = float(timeline.alloc_key[saved].max())

    # recompute: rows of the region made up to the last saved one, replayed before backward
    keep = (timeline.alloc_key[rows] <= last_saved) & (timeline.size[rows] > 0)
    replay, replay_saved = rows[keep], is_saved[keep]
    span = last_saved - start + 2.0

    def squeeze(key):
        return backward_start - 1.0 + (key - start + 1.0) / (span + 1.0)

    recompute_end = squeeze(last_saved + 0.5)
    new_alloc = squeeze(timeline.alloc_key[replay])
    freed_in_span = free_key[replay] <= last_saved
    new_free = np.where(replay_saved, free_key[replay],
                        np.where(freed_in_span, squeeze(free_key[replay]), recompute_end))
    # freed when the region's forward is done with them (data flow), or when it ends, and
    # in any case before its recompute begins (a region whose forward ends right before
    # backward, e.g. the whole model: its originals and their recomputed copies never
    # coexist); a tensor an op after the region reads is held there, not by the region
    _hold_arguments(timeline, index, rows, start, float(free_key[saved].max()))
    dies_at = np.full(len(saved), end + 0.5)
    kept = np.zeros(len(saved), bool)
    if index.readers is not None:
        dies_at, kept = index.readers.death(saved, timeline.alloc_key[saved], start, end,
                                            index.checkpointed)
        # one that ops after the call read but none of them saves (a last block's output
        # read by a mean): the call's own op saved it, and it dies after its last reader
        loose = np.flatnonzero(kept)
        loose = loose[~index.saved_by_others(saved[loose], member | index.checkpointed)]
        if len(loose) and index.backward_reads is not None:
            dies_at[loose], _ = index.readers.death(
                saved[loose], timeline.alloc_key[saved[loose]], start, float(timeline.n_events))
            kept[loose] = False
    free_key[saved] = np.where(kept, free_key[saved],
                               np.minimum(dies_at, squeeze(start - 0.75)))
    copies = {name: getattr(timeline, name)[replay] for name in _ROW_FIELDS}
    copies["alloc_key"], copies["free_key"] = new_alloc, new_free
    # recomputed tensors are made in backward; temporaries stay temporaries
    copies["phase"] = np.full(len(replay), _BACKWARD, np.int8)
    added.append(copies)
    if device_type == "cpu":
        # the generator state saved in forward lives until the call's backward is done
        # (checkpoint's frame lets go of it then); the recompute runs under fork_rng, which
        # holds the current state meanwhile
        added.append({
            "size": np.full(2, CPU_RNG_STATE_BYTES, float),
            "alloc_key": np.array([start - 0.5, squeeze(start - 0.5)]),
            "free_key": np.array([state_until, recompute_end]),
            "category": np.full(2, CATEGORY_CODE[schema.OTHER], np.int8),
            "dtype": np.full(2, float32, np.int16), "module": np.zeros(2, np.int32),
            "phase": np.array([_FORWARD, _BACKWARD], np.int8), "op": np.zeros(2, np.int32),
            "scales_with_batch": np.zeros(2, bool), "shape": np.full(2, "", dtype=object)})
    return int(timeline.size[saved[~kept]].sum()), int(last_saved)


