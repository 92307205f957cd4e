"""Gradient accumulation: the step's forward+backward repeated ``accum`` times on micro-batches.

The *segment* runs from the step's first forward event to its last backward event; what
comes before (loading the batch) and after (clipping, the optimizer) happens once.  The
segment is laid out ``accum`` times in a row on a new event axis:

* storages living inside the segment are copied into every micro-step;
* storages made in the segment that outlive it (the gradients, the loss and the outputs
  the script keeps) exist from the first micro-step on.  Gradients stay alive across
  micro-steps; in later micro-steps the gradient a backward op makes is added into
  ``.grad`` and freed at once (``AccumulateGrad``), so it becomes a short temporary;
  the other outliving storages of micro-step k are released when micro-step k+1 makes
  their replacement (the script's variable is reassigned);
* storages that end inside the segment but began before it (the previous step's
  gradients released by ``zero_grad``) end in the first micro-step.

Batch-dependent sizes are scaled to the micro-batch separately (``batch.scale_batch``).
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from .replay import (CATEGORY_CODE, FREE_FIRST, PHASE_CODE, Timeline, merge_order,
                     replay_events)

_GRADIENT = CATEGORY_CODE[schema.GRADIENT]
_TEMPORARY = CATEGORY_CODE[schema.TEMPORARY]
JUST_AFTER = 1e-6  #: a free right after the allocation that replaces it, before anything else


def segment(timeline: Timeline) -> tuple[int, int] | None:
    """[first forward event, last backward event] of the step, or None."""
    phases = timeline.event_phase
    forward = np.flatnonzero(phases == PHASE_CODE[schema.FORWARD])
    backward = np.flatnonzero(phases == PHASE_CODE[schema.BACKWARD])
    if not len(forward) or not len(backward):
        return None
    return int(forward[0]), int(backward[-1])


def _masks(timeline: Timeline, start: float, end: float):
    alloc, free = timeline.alloc_key, timeline.free_key
    alloc_inside = (alloc >= start) & (alloc < end)
    free_inside = (free >= start) & (free < end)
    local = alloc_inside & free_inside
    outliving = alloc_inside & ~free_inside
    released = ~alloc_inside & (alloc < start) & free_inside  # e.g. zero_grad's frees
    return local, outliving, released


def segment_keys(timeline: Timeline) -> tuple[float, float] | None:
    """[start, end) of the micro-step segment on the key axis: from just before the first
    forward event (what techniques add there belongs to the micro-step) to the event after
    the last backward one."""
    bounds = segment(timeline)
    if bounds is None:
        return None
    return bounds[0] - 0.5, bounds[1] + 1.0


def accumulated_peak(timeline: Timeline, accum: int, categories: bool = True):
    """Peak of ``accum`` micro-steps without laying them out: the first micro-step is the
    recorded segment; every later one is the same segment with the released storages
    gone, the outliving ones (gradients, kept outputs) present from its start, and each
    outliving allocation a brief second instance (``AccumulateGrad`` adds it into .grad;
    a reassigned output frees its predecessor).  After the last micro-step memory is what
    it is after the first.  Returns a ``replay.Peak`` (``by_category`` empty unless
    ``categories``)."""
    return first_and_accumulated_peaks(timeline, accum, categories)[1]


def first_and_accumulated_peaks(timeline: Timeline, accum: int, categories: bool = True,
                                first_categories: bool = False):
    """(the timeline's own peak, ``accumulated_peak``), from one pass over its events: the
    first is the recorded micro-step's (``timeline.peak()``'s figure; ``by_category``
    only with ``first_categories``)."""
    from .replay import Peak

    order = timeline.order()
    rows = len(timeline)
    signed = np.concatenate([-timeline.size, timeline.size])[order]
    curve = np.cumsum(signed)
    at = int(np.argmax(curve)) if len(curve) else -1
    best = (int(round(float(curve[at]))) if at >= 0 else 0, at, 0.0, None)
    first = _first_peak(timeline, order, best, first_categories)
    keys = segment_keys(timeline) if accum > 1 else None
    if keys is not None:
        start, end = keys
        local, outliving, released = _masks(timeline, start, end)
        w0, w1 = (int(i) for i in timeline.sorted_position([start - 1e-6, end - 1e-6]))
        if w1 > w0:
            window = order[w0:w1]
            is_alloc = window >= rows
            row = np.where(is_alloc, window - rows, window)
            deltas = np.where(~is_alloc & released[row], 0.0, signed[w0:w1])
            spikes = np.where(is_alloc & outliving[row], timeline.size[row], 0.0)
            before = float(curve[w0 - 1]) if w0 > 0 else 0.0
            entering = before - float(timeline.size[released].sum()) + float(
                timeline.size[outliving].sum())
            middle = entering + np.cumsum(deltas) - (np.cumsum(spikes) - spikes)
            m = int(np.argmax(middle))
            if round(float(middle[m])) > best[0]:
                best = (int(round(float(middle[m]))), w0 + m, float(spikes[m]),
                        (released, outliving, row[m]))
    value, position, spike, middle_info = best
    if position < 0:
        return first, Peak(0, -1.0, {})
    key = float(timeline.event_keys(order[position:position + 1])[0])
    if not categories:
        return first, Peak(value, key, {})
    alive = timeline.alive_rows(0, upto_sorted=position)
    if middle_info is not None:
        released, outliving, spike_row = middle_info
        alive = (alive & ~released) | outliving
    by_category = timeline.bytes_by_category(alive)
    if spike:
        category = schema.CATEGORIES[int(timeline.category[middle_info[2]])]
        by_category[category] = by_category.get(category, 0) + int(round(spike))
    return first, Peak(value, key, by_category)


def _first_peak(timeline: Timeline, order: np.ndarray, best: tuple, categories: bool):
    """The recorded micro-step's peak as a ``replay.Peak`` from ``best`` (its value and
    sorted position)."""
    from .replay import Peak

    value, position = best[0], best[1]
    if position < 0:
        return Peak(0, -1.0, {})
    key = float(timeline.event_keys(order[position:position + 1])[0])
    by_category = (timeline.bytes_by_category(timeline.alive_rows(0, upto_sorted=position))
                   if categories else {})
    return Peak(value, key, by_category)


def apply_accumulation(timeline: Timeline, accum: int) -> Timeline:
    """The micro-steps laid out explicitly (at most three: the first, one standing for
    every middle one, the last), for the allocator model and as the oracle of
    ``accumulated_peak``."""
    if accum <= 1:
        return timeline
    keys = segment_keys(timeline)
    if keys is None:
        return timeline
    start, end = keys
    accum = min(accum, 3)
    length = float(end - start)
    shift_after = (accum - 1) * length

    def moved(key: np.ndarray, copy: int) -> np.ndarray:
        """Key in micro-step ``copy`` for keys inside the segment, shifted keys after it."""
        inside = (key >= start) & (key < end)
        return np.where(inside, key + copy * length,
                        np.where(key >= end, key + shift_after, key))

    alloc, free = timeline.alloc_key, timeline.free_key
    local, outliving, _ = _masks(timeline, start, end)

    base_alloc = moved(alloc, 0)
    base_free = moved(free, 0)
    # outliving non-gradients of micro-step 0 die when micro-step 1 remakes them
    keeps_grad = outliving & (timeline.category == _GRADIENT)
    replaced = outliving & ~keeps_grad
    base_free = np.where(replaced, alloc + length + JUST_AFTER, base_free)
    out = timeline.retimed(base_alloc, base_free)

    names = ("size", "category", "dtype", "module", "phase", "op", "scales_with_batch",
             "shape")
    additions = {name: [] for name in names + ("alloc_key", "free_key")}
    for copy in range(1, accum):
        last = copy == accum - 1
        for mask, kind in ((local, "local"), (keeps_grad, "grad"), (replaced, "replaced")):
            if not mask.any():
                continue
            for name in names:
                additions[name].append(getattr(timeline, name)[mask])
            new_alloc = alloc[mask] + copy * length
            if kind == "local":
                new_free = free[mask] + copy * length
            elif kind == "grad":
                new_free = new_alloc + JUST_AFTER
                additions["category"][-1] = np.full(int(mask.sum()), _TEMPORARY, np.int8)
            else:
                new_free = free[mask] + shift_after if last else new_alloc + length + JUST_AFTER
            additions["alloc_key"].append(new_alloc)
            additions["free_key"].append(new_free)
    if additions["size"]:
        out = out.appended({name: np.concatenate(parts) for name, parts in additions.items()})
    out.n_events = timeline.n_events + int(shift_after)
    return out


def accumulated_events(timeline: Timeline, accum: int) -> tuple[np.ndarray, np.ndarray]:
    """``replay.replay_events(apply_accumulation(timeline, accum))`` -- the allocation
    stream of the micro-steps laid out, for the allocator model -- from the laid-out
    sizes and keys only (its other columns are not made).  The order is the one the
    laid-out timeline's ``order()`` merges from ``timeline``'s (computed first, as in
    ``simulate``)."""
    keys = segment_keys(timeline) if accum > 1 else None
    if keys is None:
        return replay_events(timeline)
    parent = timeline.order()
    start, end = keys
    copies = min(accum, 3)
    length = float(end - start)
    shift_after = (copies - 1) * length
    alloc, free = timeline.alloc_key, timeline.free_key
    local, outliving, _ = _masks(timeline, start, end)

    def moved(key: np.ndarray) -> np.ndarray:  # apply_accumulation's, micro-step 0
        inside = (key >= start) & (key < end)
        return np.where(inside, key + 0 * length,
                        np.where(key >= end, key + shift_after, key))

    base_alloc, base_free = moved(alloc), moved(free)
    keeps_grad = outliving & (timeline.category == _GRADIENT)
    replaced = outliving & ~keeps_grad
    base_free = np.where(replaced, alloc + length + JUST_AFTER, base_free)
    sizes, allocs, frees = [timeline.size], [base_alloc], [base_free]
    for copy in range(1, copies):  # the rows apply_accumulation appends, in its order
        last = copy == copies - 1
        for mask, kind in ((local, "local"), (keeps_grad, "grad"), (replaced, "replaced")):
            if not mask.any():
                continue
            new_alloc = alloc[mask] + copy * length
            if kind == "local":
                new_free = free[mask] + copy * length
            elif kind == "grad":
                new_free = new_alloc + JUST_AFTER
            else:
                new_free = free[mask] + shift_after if last else new_alloc + length + JUST_AFTER
            sizes.append(timeline.size[mask])
            allocs.append(new_alloc)
            frees.append(new_free)
    size = np.concatenate(sizes)
    rows = len(size)
    sort_keys = np.concatenate(frees + allocs)
    sort_keys[:rows] -= FREE_FIRST
    changed = (base_alloc != alloc) | (base_free != free)
    order = merge_order(sort_keys, rows, parent, len(timeline), changed)
    is_alloc = order >= rows
    row = np.where(is_alloc, order - rows, order)
    sizes = size[row]
    keep = sizes > 0
    return np.where(is_alloc, sizes, -sizes)[keep], row[keep]
