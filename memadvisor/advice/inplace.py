"""In-place opportunities: an out-of-place op whose input dies once the op has read it.

Read from the analysed step's timeline (``simulate.replay``) and its data flow (the trace's
``input_ids``).  A forward op with an in-place form (an activation, ``x + y``, a scaling)
whose output has its input's size and dtype, and that is the last op to read that input,
could write into the input instead of a new storage.  The trace says whether that is safe
for autograd from the input's lifetime alone:

- it dies right after the op (before the next op that reads anything allocates): nothing
  saved it for backward, nothing reads it later -- the change is **suggested**;
- it dies later in the forward: the script holds it while other ops run, and one of them
  may read it unseen (an in-place op allocates nothing, so the trace records no read) --
  **refused**;
- it lives into the backward: an op saved it (autograd would raise "modified by an
  inplace operation", or the in-place form keeps a copy: ``silu_``, ``gelu_``), or the
  script holds it -- **refused**;
- it is a parameter (a leaf that requires grad, or a view of one: they share its storage)
  or a buffer, or it outlives the step (the batch the loop holds) -- **refused**.

What it saves: in place, the input's storage is the output's, so for as long as both
were alive (from the op until the first of them dies) one storage's bytes are gone.  The
peak goes down only if every moment at the peak lies in such a window; ``bytes_saved`` is
that drop, found on the step's live curve (prefix and suffix maxima: vectorised, no
Python loop per event).  Several changes can be needed together (two out-of-place ops in
a row both at the peak): the summary advice gives the drop of all suggested at once.
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from ..units import format_bytes
from . import MISSING, REFUSED, SUGGESTED, Advice

KIND = "inplace"

#: op -> how to write it in place; ops with a ``torch.nn.functional`` ``inplace=`` flag name
#: it (and their module's), the rest the Tensor method or the augmented assignment
INPLACE_FORMS = {
    "aten::relu": "F.relu(x, inplace=True), nn.ReLU(inplace=True) or x.relu_()",
    "aten::hardtanh": "F.hardtanh(x, inplace=True) or nn.ReLU6(inplace=True)",
    "aten::leaky_relu": "F.leaky_relu(x, inplace=True) or nn.LeakyReLU(inplace=True)",
    "aten::elu": "F.elu(x, inplace=True) or nn.ELU(inplace=True)",
    "aten::celu": "F.celu(x, inplace=True)",
    "aten::selu": "F.selu(x, inplace=True)",
    "aten::silu": "F.silu(x, inplace=True) or nn.SiLU(inplace=True)",
    "aten::mish": "F.mish(x, inplace=True) or nn.Mish(inplace=True)",
    "aten::hardswish": "F.hardswish(x, inplace=True) or nn.Hardswish(inplace=True)",
    "aten::hardsigmoid": "F.hardsigmoid(x, inplace=True)",
    "aten::gelu": "torch.ops.aten.gelu_(x) (F.gelu has no inplace flag)",
    "aten::sigmoid": "x.sigmoid_()",
    "aten::tanh": "x.tanh_()",
    "aten::add": "x += y (x.add_(y))",
    "aten::sub": "x -= y (x.sub_(y))",
    "aten::mul": "x *= y (x.mul_(y); a dropout: F.dropout(x, p, inplace=True))",
    "aten::div": "x /= y (x.div_(y))",
    "aten::clamp": "x.clamp_(...)",
    "aten::clamp_min": "x.clamp_min_(...)",
    "aten::clamp_max": "x.clamp_max_(...)",
    "aten::neg": "x.neg_()",
    "aten::exp": "x.exp_()",
    "aten::masked_fill": "x.masked_fill_(mask, value)",
}
#: binary ops that may write into either operand (``y + x`` with ``x`` dying: ``x += y``)
COMMUTATIVE = frozenset({"aten::add", "aten::mul"})

#: why a change is refused, by code
REASONS = {
    "parameter": "its input is a parameter -- a leaf that requires grad, or a view of one "
                 "(same storage): autograd refuses in-place ops on it",
    "buffer": "its input is a module buffer: in place, the op would change the module's "
              "state",
    "backward": "its input stays alive into the backward: an op saved it for backward "
                "(in place, autograd raises 'modified by an inplace operation', or the "
                "in-place form keeps a copy) or the script holds it",
    "later": "its input stays alive while later ops run (the script holds it, or an op "
             "the trace cannot see reads it: an in-place op allocates nothing): in place, "
             "its values would change under them",
    "held": "its input outlives the step (the batch the loop holds, a value the script "
            "keeps): in place, the script's own tensor would change",
}


def inplace_advice(context) -> list[Advice]:
    timeline = context.base.timeline
    reads = timeline.reads
    if reads is None or not len(reads.rows):  # a trace of format < 3: no data flow
        return [Advice(kind=KIND, status=MISSING, title="in-place ops not examined",
                       reason="the trace records no data flow (the input_ids column, trace "
                              "format 3): which op read which storage is unknown; profile "
                              "again with this memadvisor")]
    pairs = _pairs(timeline)
    if not len(pairs["output"]):
        return []
    pairs["reason"] = _refusals(timeline, pairs["output"], pairs["input"])
    windows = _windows(timeline, pairs)
    pairs.update(windows)
    return _grouped(context, timeline, pairs)


def _pairs(timeline) -> dict[str, np.ndarray]:
    """(output row, input row) of every forward op with an in-place form whose output could
    take its input's storage (same bytes and dtype) and that is the input's last reader."""
    reads = timeline.reads
    counts = reads.counts()
    owner = np.repeat(np.arange(len(timeline)), counts)
    read = reads.rows
    operand = np.arange(len(read)) - reads.offsets[owner]
    ops = timeline.ops
    known = np.asarray([o in INPLACE_FORMS for o in ops], bool)
    commutative = np.asarray([o in COMMUTATIVE for o in ops], bool)
    key = timeline.alloc_key
    # the last forward op to read each storage (backward ops read what was saved: the
    # input's lifetime says that, and refuses it)
    forward = timeline.phase[owner] == _FORWARD
    last_reader = np.full(len(timeline), -np.inf)
    np.maximum.at(last_reader, read[forward], key[owner[forward]])
    op = timeline.op[owner]
    ok = (known[op] & ((operand == 0) | (commutative[op] & (operand == 1)))
          & forward & (key[owner] >= 0) & (read != owner)
          & (timeline.size[read] == timeline.size[owner]) & (timeline.size[owner] > 0)
          & (timeline.dtype[read] == timeline.dtype[owner])
          & (last_reader[read] == key[owner]))
    entries = np.flatnonzero(ok)
    # one input per op: the first operand that qualifies
    _, first = np.unique(owner[entries], return_index=True)
    entries = entries[first]
    return {"output": owner[entries], "input": read[entries]}


_FORWARD = schema.PHASES.index(schema.FORWARD)
_BACKWARD = schema.PHASES.index(schema.BACKWARD)


def _refusals(timeline, outputs: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """Per pair, '' (suggested) or a ``REASONS`` key."""
    category = timeline.category[inputs]
    codes = {name: schema.CATEGORIES.index(name) for name in schema.CATEGORIES}
    free = timeline.free_key[inputs]
    n_events = timeline.n_events
    free_at = np.clip(free, 0, max(n_events - 1, 0)).astype(np.int64)
    first_backward = np.flatnonzero(timeline.event_phase == _BACKWARD)
    backward_starts = first_backward[0] if len(first_backward) else n_events
    reason = np.full(len(inputs), "", dtype=object)
    in_forward = (free < n_events) & (free_at < backward_starts) \
        & (timeline.event_phase[free_at] == _FORWARD)
    # dies right after: before the next op that read anything allocates (an op that
    # allocates nothing -- an in-place op -- reads unseen: only this close is it safe)
    ops_made = np.sort(timeline.alloc_key[(timeline.reads.counts() > 0)
                                          & (timeline.alloc_key >= 0)])
    after = np.searchsorted(ops_made, timeline.alloc_key[outputs], side="right")
    next_op = np.where(after < len(ops_made), ops_made[np.minimum(after, len(ops_made) - 1)],
                       np.inf)
    reason[in_forward & (free > next_op)] = "later"
    reason[~in_forward] = "backward"
    reason[(free >= n_events) | (timeline.alloc_key[inputs] < 0)] = "held"
    reason[category == codes[schema.BUFFER]] = "buffer"
    reason[category == codes[schema.PARAMETER]] = "parameter"
    return reason


def _windows(timeline, pairs) -> dict[str, np.ndarray]:
    """Where on the step's live curve each suggested pair holds two storages that could
    be one ([start, stop) of sorted events), and the peak drop of each alone."""
    live, order = timeline.live_curve()
    rows = len(timeline)
    position = np.empty(len(order), np.int64)
    position[order] = np.arange(len(order))
    output, source = pairs["output"], pairs["input"]
    start = position[rows + output]  # the output's alloc
    stop = np.minimum(position[source], position[output])  # the first of the two frees
    stop = np.maximum(stop, start)
    size = timeline.size[output]
    peak = float(live.max()) if len(live) else 0.0
    prefix = np.maximum.accumulate(live) if len(live) else live
    suffix = np.maximum.accumulate(live[::-1])[::-1] if len(live) else live
    before = np.where(start > 0, prefix[np.maximum(start - 1, 0)], -np.inf)
    after = np.where(stop < len(live), suffix[np.minimum(stop, len(live) - 1)], -np.inf)
    outside = np.maximum(before, after)
    alone = np.clip(peak - np.maximum(outside, peak - size), 0, None)
    alone[pairs["reason"] != ""] = 0
    return {"start": start, "stop": stop, "alone": alone, "live": live, "peak": peak}


def _drop(live: np.ndarray, peak: float, start, stop, size) -> float:
    """The peak's drop when ``size`` bytes go from every window at once."""
    delta = np.zeros(len(live) + 1)
    np.add.at(delta, start, -size)
    np.add.at(delta, stop, size)
    return float(peak - (live + np.cumsum(delta)[:-1]).max())


def _grouped(context, timeline, pairs) -> list[Advice]:
    """One advice per source line, op and verdict (a block repeated 24 times is one
    change), and one for all suggested changes together."""
    events = context.trace.events
    at = context.step_start + timeline.alloc_key[pairs["output"]].astype(np.int64)
    files = events["source_file"].to_numpy()[at].astype(str)
    lines = events["source_line"].to_numpy()[at]
    functions = events["source_function"].to_numpy()[at].astype(str)
    ops = np.asarray(timeline.ops, dtype=object)[timeline.op[pairs["output"]]]
    modules = np.asarray(timeline.modules, dtype=object)[timeline.module[pairs["output"]]]
    size = timeline.size[pairs["output"]]
    live, peak = pairs["live"], pairs["peak"]
    peak_rows = np.flatnonzero(live == peak)
    first_peak = int(peak_rows[0]) if len(peak_rows) else -1
    keys = np.char.add(np.char.add(files.astype(str), "\0"),
                       np.char.add(lines.astype(str), np.char.add("\0", ops.astype(str))))
    keys = np.char.add(keys, np.char.add("\0", pairs["reason"].astype(str)))
    unique, group = np.unique(keys, return_inverse=True)
    found = []
    for index in range(len(unique)):
        members = np.flatnonzero(group == index)
        first = members[0]
        reason = pairs["reason"][first]
        where = f"{files[first]}:{lines[first]}" if files[first] else ""
        op = ops[first]
        per_op = int(size[members].max())
        windows = (pairs["start"][members], pairs["stop"][members])
        covers_peak = bool(((windows[0] <= first_peak) & (windows[1] > first_peak)).any())
        saved = 0
        if not reason and covers_peak:
            saved = max(int(round(_drop(live, peak, *windows, size[members]))), 0)
        details = {"op": str(op), "module": str(modules[first]), "function": str(functions[first]),
                   "occurrences": int(len(members)), "bytes_per_op": per_op,
                   "inplace_form": INPLACE_FORMS[op],
                   "bytes_saved_alone": int(pairs["alone"][members].max())}
        if reason:
            found.append(Advice(kind=KIND, status=REFUSED, location=where, details=details,
                                title=f"{op} cannot run in place",
                                reason=REASONS[reason]))
            continue
        transient = int(size[members][pairs["stop"][members] > pairs["start"][members]].sum())
        details["transient_bytes"] = transient
        found.append(Advice(
            kind=KIND, status=SUGGESTED, location=where, bytes_saved=saved, details=details,
            title=f"run {op} in place: {INPLACE_FORMS[op]}",
            reason=(f"its input ({format_bytes(per_op)}"
                    f"{f' x {len(members)}' if len(members) > 1 else ''}) dies right after "
                    f"it and nothing saved it for backward; "
                    + (f"the peak drops {format_bytes(saved)}" if saved else
                       f"it frees {format_bytes(per_op)} for a moment, not at the peak"))))
    suggested = pairs["reason"] == ""
    if suggested.sum() > 1 and len(live):
        together = max(int(round(_drop(live, peak, pairs["start"][suggested],
                                       pairs["stop"][suggested], size[suggested]))), 0)
        lines_count = len({a.location for a in found if a.status == SUGGESTED})
        if together > max((a.bytes_saved for a in found), default=0):
            found.append(Advice(
                kind=KIND, status=SUGGESTED, bytes_saved=together,
                title=f"all {lines_count} in-place changes suggested here, together",
                reason=f"the peak drops {format_bytes(together)} only with all of them: "
                       "alone each leaves another moment at the peak",
                details={"occurrences": int(suggested.sum())}))
    return found
