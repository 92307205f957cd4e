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
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_GRADIENT = CATEGORY_CODE[schema.GRADIENT]
_TEMPORARY = CATEGORY_CODE[schema.TEMPORARY]


def segment(timeline: Timeline) -> tuple[int, int] | None:
    """[first forward event, last backward event] of the step, or None."""
    phases = timeline.event_phase
    forward = np.flatnonzero(phases == PHASE_CODE[schema.FORWARD])
    backward = np.flatnonzero(phases == PHASE_CODE[schema.BACKWARD])
    if not len(forward) or not len(backward):
        return None
    return int(forward[0]), int(backward[-1])


def apply_accumulation(timeline: Timeline, accum: int) -> Timeline:
    if accum <= 1:
        return timeline
    bounds = segment(timeline)
    if bounds is None:
        return timeline
    start, end = bounds
    length = float(end - start + 1)
    shift_after = (accum - 1) * length

    def moved(key: np.ndarray, copy: int) -> np.ndarray:
        """Key in micro-step ``copy`` for keys inside the segment, shifted keys after it."""
        inside = (key >= start) & (key < end + 1)
        return np.where(inside, key + copy * length,
                        np.where(key >= end + 1, key + shift_after, key))

    alloc, free = timeline.alloc_key, timeline.free_key
    alloc_inside = (alloc >= start) & (alloc < end + 1)
    free_inside = (free >= start) & (free < end + 1)
    local = alloc_inside & free_inside
    outliving = alloc_inside & ~free_inside

    base_alloc = moved(alloc, 0)
    base_free = moved(free, 0)
    # outliving non-gradients of micro-step 0 die when micro-step 1 remakes them
    keeps_grad = outliving & (timeline.category == _GRADIENT)
    replaced = outliving & ~keeps_grad
    base_free = np.where(replaced, alloc + length + 0.5, base_free)
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
                new_free = new_alloc + 0.25
                additions["category"][-1] = np.full(int(mask.sum()), _TEMPORARY, np.int8)
            else:
                new_free = free[mask] + shift_after if last else new_alloc + length + 0.5
            additions["alloc_key"].append(new_alloc)
            additions["free_key"].append(new_free)
    if additions["size"]:
        out = out.appended({name: np.concatenate(parts) for name, parts in additions.items()})
    out.n_events = timeline.n_events + int(shift_after)
    return out
