"""Peaks of many plans that share one lifetime layout, without replaying each of them.

``advise`` predicts thousands of plans; most differ from one another only in row *sizes*
(the micro-batch, ranks sharing the model state, what is offloaded), not in lifetimes.  A
``LayoutBounds`` is built once per lifetime layout (steps 1-3 of ``simulator`` plus
``offload=activations``) and answers the exact peak of any such plan in time that does not
grow with the trace:

* rows fall in groups (fixed, optimizer-step temporaries, optimizer state, persistent and
  other parameters and gradients; each split by ``scales_with_batch``); a plan turns every
  group's sizes by one rule (``x f``, ``ceil(/G)``, ``x share``, ``x 0``), so the live curve
  is a non-negative combination of per-group *columns*;
* the sorted event axis is cut into chunks (``CHUNK`` events, and cut at every position a
  data-parallel mode adds rows: those rows are constant inside a chunk); each column keeps
  its maximum and its value before each chunk;
* a plan's bound per chunk is the combination of its column maxima plus the added rows;
  the plan's own added events are evaluated exactly, then only the chunks whose bound beats
  the best value so far are replayed event by event (usually a handful).

The result is the same number ``accumulation.accumulated_peak`` gives for the plan's
timeline (the micro-step curve of ``accum > 1`` is bounded the same way), up to float
rounding; ``tests/simulate/test_bounds.py`` checks it against the exact path for every
candidate plan.  Layouts it cannot express (a batch-scaled model-state row, rows a mode
adds that outlive the micro-step) answer ``None`` and the caller replays exactly.
"""
from __future__ import annotations

import numpy as np

from ..plan import FSDP_SHARDS, Plan
from ..trace import schema
from .accumulation import _masks, segment_keys
from .offload import optimizer_step_temporaries, persistent_rows
from .optimizer_swap import FOREACH_OP
from .replay import CATEGORY_CODE, FREE_FIRST, Timeline, sorted_search
from .sharding import shard_additions, zero1_share

CHUNK = 128  #: events per chunk
REFINE_BATCH = 4  #: chunks replayed together
FIXED, OPTIMIZER_TEMP, STATE, PARAM_KEPT, PARAM_OTHER, GRAD_KEPT, GRAD_OTHER, FOREACH = range(8)
MODEL_STATE = (STATE, PARAM_KEPT, PARAM_OTHER, GRAD_KEPT, GRAD_OTHER)
GROUPS = 16  #: category group x scales-with-batch
SHARD_KINDS = ("ddp", "zero2", "zero3")  #: zero1 adds what ddp adds
OUTLIVING, RELEASED = 1, 2  #: event flags of the micro-step curve (``accumulated_peak``)


def row_groups(timeline: Timeline) -> np.ndarray:
    category = timeline.category
    group = np.full(len(timeline), FIXED, np.int8)
    group[optimizer_step_temporaries(timeline)] = OPTIMIZER_TEMP
    kept = persistent_rows(timeline)
    group[category == CATEGORY_CODE[schema.OPTIMIZER_STATE]] = STATE
    param = category == CATEGORY_CODE[schema.PARAMETER]
    grad = category == CATEGORY_CODE[schema.GRADIENT]
    group[param & kept], group[param & ~kept] = PARAM_KEPT, PARAM_OTHER
    group[grad & kept], group[grad & ~kept] = GRAD_KEPT, GRAD_OTHER
    group[timeline.op_in({FOREACH_OP})] = FOREACH
    return (group * 2 + timeline.scales_with_batch).astype(np.int8)


def group_rules(plan: Plan, batch_factor: float, share: float) -> list[tuple[float, int]]:
    """(multiplier, ranks G) per group: size -> multiplier x (ceil(size / G) if G > 1 else
    size), mirroring ``scale_batch``, ``sharding.shard_sizes`` and ``offload.offload_sizes``."""
    rules = []
    for code in range(GROUPS):
        kind, scaled = divmod(code, 2)
        multiplier, ranks = (batch_factor if scaled else 1.0), 1
        if kind in MODEL_STATE or kind == FOREACH:
            if plan.shard == "zero1" and kind in (STATE, FOREACH):
                multiplier *= share
            elif plan.shard in FSDP_SHARDS:
                ranks = plan.shard_group_size
        if "optimizer" in plan.offload:
            if kind in (STATE, OPTIMIZER_TEMP, FOREACH):
                multiplier = 0.0
            if "params" in plan.offload and kind in (PARAM_KEPT, GRAD_KEPT):
                multiplier = 0.0
        rules.append((multiplier, ranks))
    return rules


def _shrunk(size: np.ndarray, ranks: int) -> np.ndarray:
    return np.ceil(size / ranks) if ranks > 1 else size


class _Column:
    """One group's live bytes (one ``ranks`` rule) reduced to what the bounds need."""

    __slots__ = ("max", "before", "at", "mid_max", "mid_before", "mid_at")


class _Additions:
    """What one data-parallel mode adds, placed on this layout's event axis."""

    def __init__(self, layout: "LayoutBounds", rows: dict, keys_of: np.ndarray,
                 event_order: np.ndarray):
        sizes = rows["size"]
        keys = np.concatenate([rows["alloc_key"], rows["free_key"] - FREE_FIRST])
        signed = np.concatenate([sizes, -sizes])
        order = np.argsort(keys, kind="stable")  # as ``replay.merge_order`` inserts them
        self.keys = keys[order]
        self.positions = sorted_search(keys_of, event_order, self.keys, "right")
        self.running = np.cumsum(signed[order])  # added bytes alive after each added event
        self.slot = np.searchsorted(layout.slot_positions, self.positions)
        self.before = _running_before(self.positions, self.running, layout.starts)
        self.middle_ok = True
        if layout.window is not None and len(sizes):
            start, end = layout.segment
            alloc, free = rows["alloc_key"], rows["free_key"]
            alloc_inside = (alloc >= start) & (alloc < end)
            free_inside = (free >= start) & (free < end)
            outliving = alloc_inside & ~free_inside
            released = ~alloc_inside & (alloc < start) & free_inside
            self.middle_ok = not (outliving.any() or released.any())
            self.in_window = (self.keys >= start - 1e-6) & (self.keys < end - 1e-6)
            self.mid_before = _running_before(self.positions, self.running, layout.mid_starts)


def _running_before(positions: np.ndarray, running: np.ndarray, starts: np.ndarray):
    """Added bytes alive at the first event of each chunk (added events placed earlier)."""
    count = np.searchsorted(positions, starts, side="right")
    return np.where(count > 0, running[np.maximum(count - 1, 0)], 0.0) if len(running) \
        else np.zeros(len(starts))


class LayoutBounds:
    def __init__(self, timeline: Timeline, blocks: list[str], fractions: dict[str, float],
                 copies: dict | None = None, sharded: Timeline | None = None,
                 kinds: tuple[str, ...] = SHARD_KINDS, additions: dict | None = None):
        """``sharded``: the timeline the data-parallel rows are derived from where it is not
        ``timeline`` itself (``transform`` shards before it offloads activations);
        ``kinds``: the data-parallel modes this layout answers (others: None);
        ``additions``: ``shard_additions``'s rows per mode in ``kinds`` where the caller has
        them (layouts that differ only in activation offload share them).

        Per event (sorted) it keeps the size, sign, group and micro-step flags, and the same
        in group order (each group's events one contiguous run, ascending), so a column is
        built from views and ``_replay_chunks`` from gathers; nothing per row or per group
        and row."""
        self.timeline = timeline
        rows = len(timeline)
        order = timeline.order()
        is_alloc = order >= rows
        row = np.where(is_alloc, order - rows, order)
        keys_of = timeline.sort_keys()  # by event index; placed through ``order`` on demand
        self.sign = np.where(is_alloc, 1, -1).astype(np.int8)
        self.event_size = timeline.size[row]
        self.groups = row_groups(timeline)
        scaled_state = (self.groups % 2 == 1) & np.isin(self.groups // 2, MODEL_STATE)
        self.supported = not bool((scaled_state & (timeline.size > 0)).any())
        self.event_group = self.groups[row]
        # each group's events ascending (a stable sort by group, one pass per group)
        self.members = [np.flatnonzero(self.event_group == g) for g in range(GROUPS)]
        by_group = np.concatenate(self.members)
        self.group_start = np.cumsum([0] + [len(m) for m in self.members])
        self.grouped_size = self.event_size[by_group]
        self.grouped_sign = self.sign[by_group]
        self.blocks, self.fractions = blocks, fractions
        if additions is None:
            additions = {kind: shard_additions(sharded if sharded is not None else timeline,
                                               kind, blocks, fractions, copies)[0]
                         for kind in kinds}
        keys = np.concatenate([np.concatenate([r["alloc_key"], r["free_key"] - FREE_FIRST])
                               for r in additions.values()])
        self.slot_positions = np.unique(sorted_search(keys_of, order, keys, "right"))
        n = len(order)
        self.n = n
        self.segment = segment_keys(timeline)
        self.window = None
        cuts = [np.arange(0, n, CHUNK), self.slot_positions[self.slot_positions < n]]
        if self.segment is not None:
            start, end = self.segment
            w0, w1 = (int(i) for i in sorted_search(keys_of, order,
                                                     np.array([start - 1e-6, end - 1e-6])))
            if w1 > w0:
                self.window = (w0, w1)
                _, outliving, released = _masks(timeline, start, end)
                # by event index ([frees, allocs]), then placed: one gather, not four
                self.flags = np.concatenate([released * np.int8(RELEASED),
                                             outliving * np.int8(OUTLIVING)])[order]
                self.grouped_flags = self.flags[by_group]
                flagged = np.flatnonzero(self.grouped_flags)
                self.grouped_flagged = [flagged[(flagged >= self.group_start[g])
                                                & (flagged < self.group_start[g + 1])]
                                        - self.group_start[g] for g in range(GROUPS)]
                # the few rows that enter the micro-step otherwise, by group (row order)
                released_rows, outliving_rows = np.flatnonzero(released), np.flatnonzero(
                    outliving)
                self.group_released = [released_rows[self.groups[released_rows] == g]
                                       for g in range(GROUPS)]
                self.group_outliving = [outliving_rows[self.groups[outliving_rows] == g]
                                        for g in range(GROUPS)]
                cuts += [np.array([w0, w1])]
        del is_alloc, row, by_group
        starts = np.unique(np.concatenate(cuts))
        self.starts = starts[(starts >= 0) & (starts < n)] if n else np.zeros(0, np.int64)
        self.ends = np.append(self.starts[1:], n)
        # each chunk's first event within each group's run: a binary search per chunk and
        # group, the chunks in order (each search starts where the last one ended)
        self.heads = np.stack([np.searchsorted(members, self.starts) for members in
                               self.members], axis=1) if len(self.starts) else \
            np.zeros((0, GROUPS), np.int64)
        if self.window is not None:
            w0, w1 = self.window
            inside = (self.starts >= w0) & (self.starts < w1)
            self.mid_starts = self.starts[inside]
            self.mid_ends = self.ends[inside]
            self.mid_chunks = np.flatnonzero(inside)
        self.columns: dict[tuple[int, int], _Column] = {}
        self.additions = {"none": None}
        for kind, rows_added in additions.items():
            self.additions[kind] = _Additions(self, rows_added, keys_of, order) \
                if len(rows_added["size"]) else None
        if "ddp" in self.additions:
            self.additions["zero1"] = self.additions["ddp"]
        self.share: dict[int, float] = {}
        #: ``_best`` by its inputs: plans that scale every group alike (world x accum the
        #: same under ddp, say) have one peak, found once
        self.known: dict[tuple, float] = {}

    # --- columns ------------------------------------------------------------------------
    def _column(self, group: int, ranks: int) -> _Column:
        key = (group, ranks)
        column = self.columns.get(key)
        if column is not None:
            return column
        column = _Column()
        events = self.members[group]
        first, last = self.group_start[group], self.group_start[group + 1]
        size = _shrunk(self.grouped_size[first:last], ranks)
        sign = self.grouped_sign[first:last]
        cum = np.cumsum(sign * size)
        heads = self.heads[:, group]
        column.before, column.max = _chunk_stats(heads, len(events), cum, cum)
        column.at = _value_after(events, cum, self.slot_positions - 1)
        if self.window is not None:
            w0, w1 = self.window
            i0, i1 = (int(i) for i in np.searchsorted(events, [w0, w1]))
            before_window = float(cum[i0 - 1]) if i0 > 0 else 0.0
            released, outliving = self.group_released[group], self.group_outliving[group]
            sizes = self.timeline.size
            entering = (before_window - _shrunk(sizes[released], ranks).sum()
                        + _shrunk(sizes[outliving], ranks).sum())
            window_events = events[i0:i1]
            window_size = size[i0:i1]
            flagged = self.grouped_flagged[group]  # the few flagged events, in the window
            flagged = flagged[(flagged >= i0) & (flagged < i1)] - i0
            step = sign[i0:i1] * window_size
            step[flagged] = 0.0
            mid_cum = entering + np.cumsum(step)
            outliving = flagged[self.grouped_flags[first + i0 + flagged] & OUTLIVING != 0]
            peaks = mid_cum.copy()
            peaks[outliving] += window_size[outliving]
            column.mid_before, column.mid_max = _chunk_stats(
                heads[self.mid_chunks] - i0, i1 - i0, mid_cum, peaks, entering)
            slots = np.clip(self.slot_positions, w0, w1) - 1
            column.mid_at = np.where(self.slot_positions <= w0, entering,
                                     _value_after(window_events, mid_cum, slots, entering))
        self.columns[key] = column
        return column

    # --- evaluation ---------------------------------------------------------------------
    def peak_bytes(self, plan: Plan, batch_factor: float) -> int | None:
        """The plan's peak (``accumulated_peak(...).bytes``), or None when not expressible."""
        if not self.supported or not self.n or plan.shard not in self.additions:
            return None
        share = 1.0
        if plan.shard == "zero1":
            group = plan.shard_group_size
            if group not in self.share:
                self.share[group] = zero1_share(self.timeline, group)
            share = self.share[group]
        rules = group_rules(plan, batch_factor, share)
        used = [(g, m, r) for g, (m, r) in enumerate(rules) if m > 0 and len(self.members[g])]
        added = self.additions[plan.shard]
        columns = [(self._column(g, r), m) for g, m, r in used]
        multipliers = np.zeros(GROUPS)
        ranks = np.ones(GROUPS, np.int64)
        for g, (m, r) in enumerate(rules):
            multipliers[g], ranks[g] = m, r
        best = self._best(columns, added, multipliers, ranks, middle=False)
        if plan.accum > 1 and self.window is not None:
            if added is not None and not added.middle_ok:
                return None
            best = max(best, self._best(columns, added, multipliers, ranks, middle=True))
        return int(round(best))

    def _best(self, columns, added, multipliers, ranks, middle: bool) -> float:
        # ``columns`` follow from the multipliers and ranks: they need not be in the key
        key = (middle, id(added), multipliers.tobytes(), ranks.tobytes())
        best = self.known.get(key)
        if best is None:
            best = self.known[key] = self._best_of(columns, added, multipliers, ranks, middle)
        return best

    def _best_of(self, columns, added, multipliers, ranks, middle: bool) -> float:
        if middle:
            starts, ends = self.mid_starts, self.mid_ends
            bound = sum(m * c.mid_max for c, m in columns) if columns else np.zeros(len(starts))
            before = sum(m * c.mid_before for c, m in columns) if columns else np.zeros(len(starts))
            at = sum(m * c.mid_at for c, m in columns) if columns else np.zeros(
                len(self.slot_positions))
        else:
            starts, ends = self.starts, self.ends
            bound = sum(m * c.max for c, m in columns) if columns else np.zeros(len(starts))
            before = sum(m * c.before for c, m in columns) if columns else np.zeros(len(starts))
            at = sum(m * c.at for c, m in columns) if columns else np.zeros(
                len(self.slot_positions))
        best = -np.inf
        if added is not None:
            extra = added.mid_before if middle else added.before
            bound = bound + extra
            before = before + extra
            values = at[added.slot] + added.running
            if middle:
                values = values[added.in_window]
            if len(values):
                best = float(values.max())
        if not len(starts):
            return best
        bound = bound.copy()
        while True:
            candidates = np.flatnonzero(bound > best)
            if not len(candidates):
                return best
            if len(candidates) > REFINE_BATCH:  # the most promising first
                top = np.argpartition(-bound[candidates], REFINE_BATCH)[:REFINE_BATCH]
                candidates = candidates[top]
            best = max(best, self._replay_chunks(starts[candidates], ends[candidates],
                                                 before[candidates], multipliers, ranks,
                                                 middle))
            bound[candidates] = -np.inf

    def _replay_chunks(self, starts, ends, before, multipliers, ranks, middle: bool) -> float:
        lengths = ends - starts
        index = np.repeat(starts - np.cumsum(np.append(0, lengths[:-1])), lengths) + \
            np.arange(int(lengths.sum()))
        group = self.event_group[index]
        size = self.event_size[index]
        group_ranks = ranks[group]
        size = multipliers[group] * np.where(group_ranks > 1, np.ceil(size / group_ranks), size)
        step = self.sign[index] * size
        bump = 0.0
        if middle:
            flags = self.flags[index]
            bump = np.where(flags & OUTLIVING, size, 0.0)
            step = np.where(flags != 0, 0.0, step)
        cum = np.cumsum(step)
        offsets = np.repeat(np.append(0.0, cum[np.cumsum(lengths)[:-1] - 1]) - before, lengths)
        return float((cum - offsets + bump).max())


def _value_after(events: np.ndarray, cum: np.ndarray, positions: np.ndarray,
                 initial: float = 0.0) -> np.ndarray:
    """Column value after event ``positions`` (``initial`` before its first event)."""
    count = np.searchsorted(events, positions, side="right")
    if not len(cum):
        return np.full(len(positions), initial)
    return np.where(count > 0, cum[np.maximum(count - 1, 0)], initial)


def _chunk_stats(heads, count, cum, peaks, initial: float = 0.0):
    """(value before each chunk, an upper bound of the value after any event in it) of a
    column of ``count`` events; ``heads``: each chunk's first event among them (a chunk
    runs to the next one's, the last past every event)."""
    if not len(cum):
        before = np.full(len(heads), initial)
        return before, before.copy()
    before = np.where(heads > 0, cum[np.maximum(heads - 1, 0)], initial)
    top = before.copy()
    nonempty = np.diff(np.append(heads, count)) > 0
    top[nonempty] = np.maximum(top[nonempty], np.maximum.reduceat(peaks, heads[nonempty]))
    return before, top
