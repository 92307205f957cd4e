"""Out-of-memory post-mortem: where a step runs out of a device's memory, and what was there.

Two ways to know: the trace records it (an imported snapshot's ``oom`` event: the real
allocator failed a request), or the allocator model finds it (the trace's requests replayed
through ``allocator.CachingAllocator`` limited to the device's bytes: the first request no
cached block holds and no new segment fits, even after every free cached segment is given
back, as on a failed cudaMalloc).  Either way the answer is the failing request (bytes, op,
source line), what was live then (by category and by source line), reserved memory and how
much of it was cached but free (fragmentation), and the best plan ``advise`` finds that fits
the device.  Pure: no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import UserError
from ..trace import analysis, schema
from ..trace.io import Trace
from ..trace.summary import _top_sites
from .allocator import CachingAllocator, replay

TOP_SITES = 5


@dataclass
class OutOfMemory:
    capacity_bytes: int
    #: 'recorded' (the snapshot's allocator failed) or 'modelled' (the allocator model did)
    source: str
    position: int  #: trace row of the failing request (recorded: the row before it)
    requested_bytes: int
    op: str
    module: str
    phase: str
    step: int
    source_file: str
    source_line: int
    allocated_bytes: int  #: live block bytes when it failed
    reserved_bytes: int  #: segments then
    by_category: dict = field(default_factory=dict)
    top_sites: list = field(default_factory=list)
    fitting_plan: str | None = None  #: the best plan that fits the device (advise)
    fitting_plan_peak_bytes: int | None = None
    fitting_plan_reserved_bytes: int | None = None
    no_plan_reason: str = ""

    @property
    def reserved_free_bytes(self) -> int:
        """Reserved but not allocated: cached blocks the request could not use."""
        return max(self.reserved_bytes - self.allocated_bytes, 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "reserved_free_bytes": self.reserved_free_bytes}


def post_mortem(trace: Trace, capacity_bytes: int, *, hw=None,
                suggest_plan: bool = True) -> OutOfMemory | None:
    """The first out-of-memory of ``trace`` on a device of ``capacity_bytes`` (None: it
    fits).  ``hw``: the target whose plans are searched for one that fits."""
    if capacity_bytes <= 0:
        raise UserError("the device memory must be positive")
    found = _recorded(trace, capacity_bytes) or _modelled(trace, capacity_bytes)
    if found is None:
        return None
    _describe(trace, found)
    if suggest_plan:
        _fitting_plan(trace, found, hw)
    return found


def _recorded(trace: Trace, capacity_bytes: int) -> OutOfMemory | None:
    allocator = trace.meta.allocator or {}
    events = allocator.get("oom_events") or []
    if not events:
        return None
    position, requested, _ = events[0]
    reserved = allocator.get("initial_reserved_bytes", 0)
    for seq_after, _action, _address, _size, _stream, reserved_after, _ in \
            allocator.get("segment_events", []):
        if seq_after > position:
            break
        reserved = reserved_after
    live = analysis.live_bytes(trace.events)
    allocated = int(live[position]) if 0 <= position < len(live) else 0
    return OutOfMemory(capacity_bytes, "recorded", max(int(position), 0), int(requested), "",
                       "", "", 0, "", 0, allocated, int(reserved))


def _modelled(trace: Trace, capacity_bytes: int) -> OutOfMemory | None:
    events = trace.events
    if not (events["stream"] != 0).any():
        # the compiled replay says quickly whether it fits at all; only a run that does not
        # is walked request by request to find where
        signed = analysis.signed_sizes(events.assign(block_bytes=0)).astype(np.float64)
        if not replay(signed, events["storage_id"].to_numpy(), capacity_bytes).out_of_memory:
            return None
    actions = (events["action"] == schema.ALLOC).to_numpy()
    sids = events["storage_id"].to_numpy()
    sizes = events["size_bytes"].to_numpy()
    streams = events["stream"].to_numpy()
    model = CachingAllocator(capacity_bytes)
    live = {}
    for row in range(len(events)):
        if actions[row]:
            live[sids[row]] = model.malloc(int(sizes[row]), int(streams[row]))
            if model.out_of_memory:
                # the model made the segment anyway; the device would not have
                block = live.pop(sids[row])
                nbytes = model.segment_sizes[block.segment][0]
                return OutOfMemory(capacity_bytes, "modelled", row, int(sizes[row]), "", "",
                                   "", 0, "", 0, model.allocated - block.size,
                                   model.reserved - nbytes)
        else:
            block = live.pop(sids[row], None)
            if block is not None:
                model.free(block)
    return None


def _describe(trace: Trace, found: OutOfMemory) -> None:
    events = trace.events
    row = events.iloc[found.position] if len(events) else None
    if row is not None and found.source == "modelled":
        found.op, found.module, found.phase = str(row["op"]), str(row["module"]), str(row["phase"])
        found.step, found.source_file = int(row["step"]), str(row["source_file"])
        found.source_line = int(row["source_line"])
    lives = analysis.lifetimes(events)
    # alive just before the failing request (a modelled failure's own row is excluded)
    moment = found.position - 1 if found.source == "modelled" else found.position
    alive = analysis.alive_at(lives, moment)
    found.by_category = analysis.by_category(alive)
    found.top_sites = _top_sites(alive, TOP_SITES)


def _fitting_plan(trace: Trace, found: OutOfMemory, hw) -> None:
    from .hardware import hardware
    from .search import advise
    from .simulator import prepare
    try:
        base = prepare(trace)
        target = hw or hardware(None, trace.meta.device)
        result = advise(base, target, found.capacity_bytes, 1, top=1)
    except (UserError, ValueError, KeyError) as exc:
        found.no_plan_reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return
    if not result.ranked:
        found.no_plan_reason = "no single-GPU plan fits"
        return
    best = result.ranked[0]
    found.fitting_plan = best.plan.to_compact()
    found.fitting_plan_peak_bytes = int(best.peak_bytes)
    found.fitting_plan_reserved_bytes = None if best.reserved_bytes is None else int(
        best.reserved_bytes)


def post_mortem_text(found: OutOfMemory) -> str:
    from ..units import format_bytes as fb
    how = ("the recorded allocator failed" if found.source == "recorded"
           else "the allocator model fails")
    where = f"{found.source_file}:{found.source_line}" if found.source_file else "(no user frame)"
    lines = [f"OUT OF MEMORY on a {fb(found.capacity_bytes)} device ({how}): a request of "
             f"{fb(found.requested_bytes)}" + (f" by {found.op}" if found.op else "")
             + (f" in {found.phase}" if found.phase else "") + f" at {where}",
             f"  allocated {fb(found.allocated_bytes)}, reserved {fb(found.reserved_bytes)}, "
             f"of which {fb(found.reserved_free_bytes)} cached but free (fragmentation)"]
    lines.append("  live then, by category: " + ", ".join(
        f"{c} {fb(b)}" for c, b in sorted(found.by_category.items(), key=lambda kv: -kv[1])))
    for site in found.top_sites:
        at = f"{site['source_file']}:{site['source_line']}" if site["source_file"] \
            else "(no user frame)"
        lines.append(f"    {fb(site['bytes']):>12}  {site['category']:<15} {at}")
    if found.fitting_plan:
        reserved = "" if found.fitting_plan_reserved_bytes is None else \
            f", reserved {fb(found.fitting_plan_reserved_bytes)}"
        lines.append(f"  would have fitted: --plan {found.fitting_plan} (peak "
                     f"{fb(found.fitting_plan_peak_bytes)}{reserved})")
    elif found.no_plan_reason:
        lines.append(f"  no plan found that fits: {found.no_plan_reason}")
    return "\n".join(lines)
