"""What ``memadvisor apply``'s loop rewrite changes for every plan, before any technique.

The rewrite runs the statements from the forward through ``loss.backward()`` once per
micro-batch and moves a ``zero_grad()`` found among them in front of that loop
(docs/APPLY.md).  A script that clears gradients between its forward and its backward
(``loss = model(x); opt.zero_grad(); loss.backward()``) keeps the previous step's
gradients alive through its forward; rewritten, they are gone before the forward starts.
So every plan other than the script as is (``Plan()``) is predicted from the trace with
those frees moved to just before the step's first forward event.

Only where the rewrite has that one loop to move it in front of: a step that runs several
backward passes (a GAN's discriminator and generator updates, two losses each with its own
``.backward()``) has no single forward..backward region, so ``apply`` leaves its
``zero_grad`` calls where they are (docs/APPLY.md), and so does the prediction.
"""
from __future__ import annotations

import numpy as np

from ..plan import Plan
from ..trace import schema
from .accumulation import segment_keys
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_GRADIENT = CATEGORY_CODE[schema.GRADIENT]
_BACKWARD = PHASE_CODE[schema.BACKWARD]
_TRAINING_PHASES = [PHASE_CODE[schema.FORWARD], _BACKWARD, PHASE_CODE[schema.OPTIMIZER]]


def rewrites_loop(plan: Plan) -> bool:
    """Whether ``apply`` rewrites the loop for ``plan`` (every plan but the script as is)."""
    return plan != Plan()


def hoisted_zero_grad(timeline: Timeline) -> tuple[Timeline, int]:
    """``timeline`` with gradients that a ``zero_grad`` between forward and backward freed
    (made before the forward, freed inside the forward+backward segment) freed just before
    the first forward event instead; and how many moved."""
    keys = segment_keys(timeline)
    if keys is None or backward_passes(timeline) > 1:
        return timeline, 0
    start, end = keys
    free = timeline.free_key
    inside = (free >= start) & (free < end)
    # nothing else frees a gradient made before the step inside its forward+backward (the
    # profiler books such a zero_grad to the forward phase, which lasts until backward)
    cleared = (timeline.category == _GRADIENT) & (timeline.alloc_key < start) & inside
    if not cleared.any():
        return timeline, 0
    free_key = free.copy()
    free_key[cleared] = start - 0.25
    return timeline.retimed(timeline.alloc_key, free_key), int(cleared.sum())


def backward_passes(timeline: Timeline) -> int:
    """How many separate backward passes the step runs: runs of backward events, with the
    events between phases (logging, data) not breaking a run."""
    phases = timeline.event_phase[np.isin(timeline.event_phase, _TRAINING_PHASES)]
    backward = phases == _BACKWARD
    return int(backward[:1].sum() + (backward[1:] & ~backward[:-1]).sum())
