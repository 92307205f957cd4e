"""Activation checkpointing (non-reentrant ``torch.utils.checkpoint``) as a stream transform.

For each checkpointed region (a module path and its submodules; '' is the whole model):

* forward: activations the region saves for its own backward (allocated in the region's
  forward, still alive when the region's backward starts) are no longer kept: where the
  trace records data flow (format 3), each dies once the last op of the region's forward
  that reads it has run (``_ForwardReaders``; one nothing reads, e.g. a normalisation's
  saved statistics or a dropout mask, when the op that made it returns), else when the
  region's forward ends;  one that an op after the region reads (the region's output,
  saved downstream) keeps its lifetime.  A
  step with several backward passes calls the region once per pass (a GAN's
  discriminator): each call, with the backward that follows it, is transformed alone;
* backward: just before the region's first backward allocation its forward is replayed
  (activations and temporaries, in their order) up to the last saved tensor (non-reentrant
  checkpoint stops recomputing early there); recomputed activations then die at their
  original backward frees, recomputed temporaries as they did in forward;
* on a CPU model, ``preserve_rng_state`` keeps a copy of the CPU generator state
  (``CPU_RNG_STATE_BYTES``) from the region's forward until its backward is done, and the
  recompute (under ``fork_rng``) holds one more while it runs.

Regions are located from alloc events only: a free row carries its storage's allocation
module, not the module running when it is freed.
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

    def __init__(self, source: np.ndarray, reader_key: np.ndarray, op_end: tuple):
        self.source, self.reader_key, self.op_end = source, reader_key, op_end

    @classmethod
    def of(cls, timeline: Timeline) -> "_ForwardReaders | None":
        reads = timeline.reads
        if reads is None or not len(reads.rows):
            return None
        reader = np.repeat(np.arange(len(reads.counts())), reads.counts())
        forward = timeline.phase[reader] == _FORWARD
        source, reader = reads.rows[forward], reader[forward]
        order = np.argsort(source, kind="stable")
        return cls(source[order], timeline.alloc_key[reader[order]], _op_ends(timeline))

    def death(self, rows: np.ndarray, made: np.ndarray, start: float, end: float
              ) -> tuple[np.ndarray, np.ndarray]:
        """Per row: the key where it dies in a forward that saves nothing (its last reader
        in ``start..end`` ended; nothing read it: its own op ended), and whether an op
        after ``end`` reads it (then it is not the region's to free)."""
        lo = np.searchsorted(self.source, rows, "left")
        hi = np.searchsorted(self.source, rows, "right")
        last = made.astype(float).copy()
        read_after = np.zeros(len(rows), bool)
        for i, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
            keys = self.reader_key[a:b]
            if len(keys):
                read_after[i] = bool((keys > end).any())
                inside = keys[(keys >= start) & (keys <= end)]
                if len(inside):
                    last[i] = max(last[i], float(inside.max()))
        at = np.clip(np.searchsorted(self.op_end[0], last, "left"), 0,
                     max(len(self.op_end[0]) - 1, 0))
        died = np.where(self.op_end[0][at] == last, self.op_end[1][at], last + 0.5)
        return np.minimum(died, end + 0.5), read_after


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
    for region in regions:
        effect = _checkpoint_region(timeline, index, free_key, added, region, device_type,
                                    float32)
        if effect is not None:
            effects.append(effect)
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
    for calls in _calls(index, forward_allocs):
        start, end = int(calls[0]), int(calls[-1])
        after = backward_allocs[backward_allocs > end]
        if not len(after):
            continue
        saved_bytes, last_saved = _checkpoint_call(
            timeline, index, free_key, added, member, start, end, after, device_type,
            float32)
        if saved_bytes:
            freed += saved_bytes
            spans.append((start, last_saved))
    if not spans:
        return None
    return RegionEffect(region, freed, (spans[0][0], spans[-1][1]))


def _calls(index: _Index, forward_allocs: np.ndarray) -> list[np.ndarray]:
    """The region's forward allocations split where a backward pass runs between them: a
    step with several backward passes (a GAN's discriminator on real, then on generated
    data, then for the generator's loss) calls the region once per pass, and each call's
    recompute runs in the backward that uses its saved tensors, not in the step's first."""
    passes = index.backward_so_far[forward_allocs]
    return np.split(forward_allocs, np.flatnonzero(np.diff(passes)) + 1)


def _checkpoint_call(timeline: Timeline, index: _Index, free_key: np.ndarray, added: list,
                     member: np.ndarray, start: int, end: int, backward_after: np.ndarray,
                     device_type: str, float32: int):
    """One call of the region (forward allocations ``start``..``end``); its backward is the
    region's next backward allocations (``backward_after``, up to the end of that pass).
    Shortens lifetimes in ``free_key``, adds the recomputed rows to ``added``; returns the
    bytes no longer kept and the last saved row's key."""
    backward_start = int(backward_after[0])
    pass_end = index.pass_end(backward_start, timeline.n_events)
    backward_last = int(backward_after[backward_after < pass_end][-1])

    rows = index.rows_made_between(start, end)
    rows = rows[member[timeline.module[rows]]]
    is_saved = ((timeline.category[rows] == CATEGORY_CODE[schema.ACTIVATION])
                & (free_key[rows] >= backward_start))
    if not is_saved.any():
        return 0, start
    saved = rows[is_saved]
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
    dies_at = np.full(len(saved), end + 0.5)
    kept = np.zeros(len(saved), bool)
    if index.readers is not None:
        dies_at, kept = index.readers.death(saved, timeline.alloc_key[saved], start, end)
    free_key[saved] = np.where(kept, free_key[saved],
                               np.minimum(dies_at, squeeze(start - 0.75)))
    copies = {name: getattr(timeline, name)[replay] for name in _ROW_FIELDS}
    copies["alloc_key"], copies["free_key"] = new_alloc, new_free
    # recomputed tensors are made in backward; temporaries stay temporaries
    copies["phase"] = np.full(len(replay), _BACKWARD, np.int8)
    added.append(copies)
    if device_type == "cpu":
        # the generator state saved in forward lives until the region's backward is done
        # (checkpoint's frame lets go of it then); the recompute runs under fork_rng, which
        # holds the current state meanwhile
        added.append({
            "size": np.full(2, CPU_RNG_STATE_BYTES, float),
            "alloc_key": np.array([start - 0.5, squeeze(start - 0.5)]),
            "free_key": np.array([float(backward_last) + 0.5, recompute_end]),
            "category": np.full(2, CATEGORY_CODE[schema.OTHER], np.int8),
            "dtype": np.full(2, float32, np.int16), "module": np.zeros(2, np.int32),
            "phase": np.array([_FORWARD, _BACKWARD], np.int8), "op": np.zeros(2, np.int32),
            "scales_with_batch": np.zeros(2, bool), "shape": np.full(2, "", dtype=object)})
    return int(timeline.size[saved[~kept]].sum()), int(last_saved)
