"""What ``memadvisor apply``'s loop rewrite changes for every plan, before any technique.

The rewrite runs the statements from the forward through ``loss.backward()`` once per
micro-batch and moves a ``zero_grad()`` found among them in front of that loop
(docs/APPLY.md).  A script that clears gradients between its forward and its backward
(``loss = model(x); opt.zero_grad(); loss.backward()``) keeps the previous step's
gradients alive through its forward; rewritten, they are gone before the forward starts.
So every plan other than the script as is (``Plan()``) is predicted from the trace with
those frees moved to just before the step's first forward event.
"""
from __future__ import annotations

from ..plan import Plan
from ..trace import schema
from .accumulation import segment_keys
from .replay import CATEGORY_CODE, Timeline

_GRADIENT = CATEGORY_CODE[schema.GRADIENT]


def rewrites_loop(plan: Plan) -> bool:
    """Whether ``apply`` rewrites the loop for ``plan`` (every plan but the script as is)."""
    return plan != Plan()


def hoisted_zero_grad(timeline: Timeline) -> tuple[Timeline, int]:
    """``timeline`` with gradients that a ``zero_grad`` between forward and backward freed
    (made before the forward, freed inside the forward+backward segment) freed just before
    the first forward event instead; and how many moved."""
    keys = segment_keys(timeline)
    if keys is None:
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
