"""Data parallelism and ZeRO/FSDP sharding over ``world`` ranks, as the apply runtime does it.

Per rank, with ``G`` = ranks sharing one copy of the sharded state (``world``, or the
hybrid group size):

* ``ddp``: everything replicated; DDP's gradient buckets (``gradient_as_bucket_view``
  off) hold a second copy of all gradients for the whole run;
* ``zero1`` (DDP + ZeroRedundancyOptimizer): optimizer state of the parameters this rank
  owns (a greedy largest-first assignment, so the biggest rank share, not total/G), plus
  DDP's buckets;
* ``zero2`` (FSDP2, no reshard after forward): parameter, gradient and optimizer-state
  shards (1/G of each tensor, padded to G); each unit's parameters are all-gathered in its
  pre-forward and stay whole until its post-backward; its gradients exist unsharded from
  the op that makes them until the reduce-scatter (``fsdp_layout``);
* ``zero3`` (FSDP2, reshard after forward): as zero2, but a unit's gathered parameters
  are freed after its forward and gathered again for its backward (the next unit's
  all-gather buffer prefetched one unit ahead).

Units are the model's repeated blocks (``plan.repeated_blocks``) plus the root holding
the remaining parameters.  FSDP2's flat all-gather / reduce-scatter buffers and gloo's
copies of them are modelled (``_fsdp_rows``); NCCL's internal buffers are outside it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..plan import Plan
from ..trace import schema
from .optimizer_swap import FOREACH_OP
from .module_paths import containing, last_containing
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_FORWARD = PHASE_CODE[schema.FORWARD]
_BACKWARD = PHASE_CODE[schema.BACKWARD]
_PARAM = CATEGORY_CODE[schema.PARAMETER]
_GRAD = CATEGORY_CODE[schema.GRADIENT]
_STATE = CATEGORY_CODE[schema.OPTIMIZER_STATE]
_OTHER = CATEGORY_CODE[schema.OTHER]


@dataclass(frozen=True)
class Unit:
    path: str
    parameter_bytes: float  #: unsharded bytes of the unit's own parameters (now)
    #: (first allocation, last event of the unit's work) in forward and in backward: the
    #: work ends with the frees after its last allocation, before the next allocation
    forward: tuple[float, float]
    backward: tuple[float, float]


def greedy_max_share(sizes: np.ndarray, ranks: int) -> float:
    """Largest per-rank total when tensors go largest-first to the least-loaded rank
    (ZeroRedundancyOptimizer's partitioning)."""
    loads = np.zeros(ranks)
    for size in np.sort(sizes)[::-1]:
        loads[np.argmin(loads)] += size
    return float(loads.max()) if ranks else 0.0


_SPANS: dict = {}  #: (id of the step's event arrays, blocks, window) -> spans (never change)

#: a window of the step's event axis: [first event, end)
Window = tuple[int, int]


def passes(timeline: Timeline) -> list[Window]:
    """The step's forward-and-backward passes: a script that accumulates gradients itself
    runs several per optimizer step, and FSDP2 gathers, reshards and reduce-scatters in
    each.  A pass starts at a forward event that follows a backward one (the first at the
    step's start) and ends where the next starts (the last at the step's end)."""
    phase = timeline.event_phase
    marked = np.flatnonzero((phase == _FORWARD) | (phase == _BACKWARD))
    kinds = phase[marked]
    starts = [0] + marked[1:][(kinds[1:] == _FORWARD) & (kinds[:-1] == _BACKWARD)].tolist()
    bounds = starts + [timeline.n_events]
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _units(timeline: Timeline, blocks: list[str], block_bytes: dict[str, float],
           window: Window | None = None) -> list[Unit]:
    key = (id(timeline.event_module), timeline.n_events, tuple(blocks), window)
    spans = _SPANS.get(key)
    if spans is None:
        spans = _spans(timeline, blocks, window)
        if len(_SPANS) > 16:
            _SPANS.clear()
        _SPANS[key] = spans
    return [Unit(path, block_bytes.get(path, 0.0), fwd, bwd) for path, fwd, bwd in spans]


def _spans(timeline: Timeline, blocks: list[str], window: Window | None = None) -> list[tuple]:
    modules = timeline.modules
    allocs = timeline.event_is_alloc.copy()
    if window is not None:
        allocs[:window[0]] = False
        allocs[window[1]:] = False
    # each event's module -> the block containing it (-1: none)
    block_of_module = last_containing(modules, blocks)
    event_block = np.where(allocs, block_of_module[timeline.event_module], -1)
    alloc_events = np.flatnonzero(allocs)
    phase_last = {phase: _phase_span(timeline, phase, window)[1]
                  for phase in (_FORWARD, _BACKWARD)}

    def end(last: int, phase: int) -> float:
        # the unit's work ends with the frees after its last allocation (its temporaries,
        # the saved tensors its backward used): the event before the next allocation
        following = np.searchsorted(alloc_events, last, side="right")
        after = alloc_events[following] if following < len(alloc_events) else timeline.n_events
        return float(max(last, min(after - 1, phase_last[phase])))

    # each block's first and last allocation per phase, all blocks at once
    hit = np.flatnonzero(event_block >= 0)
    ranges = {}
    for phase in (_FORWARD, _BACKWARD):
        events = hit[timeline.event_phase[hit] == phase]
        first = np.full(len(blocks), np.iinfo(np.int64).max, np.int64)
        last = np.full(len(blocks), -1, np.int64)
        np.minimum.at(first, event_block[events], events)
        np.maximum.at(last, event_block[events], events)
        ranges[phase] = (first, last)
    spans = []
    for index, path in enumerate(blocks):
        (fwd_first, fwd_last), (bwd_first, bwd_last) = (
            (r[0][index], r[1][index]) for r in (ranges[_FORWARD], ranges[_BACKWARD]))
        if fwd_last >= 0 and bwd_last >= 0:
            spans.append((path, (float(fwd_first), end(int(fwd_last), _FORWARD)),
                          (float(bwd_first), end(int(bwd_last), _BACKWARD))))
    return spans


def _phase_span(timeline: Timeline, phase: int,
                window: Window | None = None) -> tuple[float, float]:
    events = np.flatnonzero(timeline.event_phase == phase)
    if window is not None:
        events = events[(events >= window[0]) & (events < window[1])]
    if not len(events):
        return (0.0, 0.0)
    return float(events[0]), float(events[-1])


def apply_sharding(timeline: Timeline, plan: Plan, blocks: list[str],
                   block_parameter_fraction: dict[str, float],
                   copies: dict | None = None) -> tuple[Timeline, dict]:
    """``block_parameter_fraction``: each block's share of all parameter bytes."""
    if plan.shard == "none":
        return timeline, {}
    size, notes = shard_sizes(timeline, plan)
    rows, more = shard_additions(timeline, plan.shard, blocks, block_parameter_fraction, copies)
    notes.update(more)
    out = timeline.resized(size)
    if len(rows["size"]):
        out = out.appended(rows)
    return out, notes


def shard_sizes(timeline: Timeline, plan: Plan) -> tuple[np.ndarray, dict]:
    """Per-rank sizes of the existing rows: model state divided among the ``G`` ranks of a
    shard group (``ceil(bytes / G)`` per tensor, FSDP pads), or zero1's largest state share."""
    notes: dict = {}
    size = timeline.size.copy()
    if plan.shard in ("none", "ddp"):
        return size, notes
    group = plan.shard_group_size
    param = timeline.category == _PARAM
    state = timeline.category == _STATE
    # a foreach optimizer step's temporaries (one per parameter the rank steps)
    foreach = timeline.op_in({FOREACH_OP})
    if plan.shard == "zero1":
        total = float(size[state].sum())
        share = zero1_share(timeline, group)
        size[state | foreach] = size[state | foreach] * share
        notes["optimizer_share"] = share
        notes["optimizer_state_bytes"] = (total, total * share)
    else:
        grad = timeline.category == _GRAD
        sharded = param | grad | state | foreach
        size[sharded] = np.ceil(size[sharded] / group)
    return size, notes


def zero1_share(timeline: Timeline, group: int) -> float:
    """Fraction of the optimizer state the most loaded rank owns (state per parameter is
    proportional to the parameter's size)."""
    params = timeline.size[timeline.category == _PARAM]
    return greedy_max_share(params, group) / max(float(params.sum()), 1.0)


def gradient_bytes(timeline: Timeline) -> float:
    """Bytes of one set of gradients: those this step's backward makes (the previous step's,
    alive until ``zero_grad``, are the same tensors once more), else any gradient rows.
    A parameter has one gradient however often the step makes it again (an LBFGS closure
    evaluated four times, clearing gradients each time): at most as many gradients of a
    module and size count as that module has parameters of that size (sizes, not shapes:
    a bias's gradient is recorded as the (1, N) sum autograd made it from)."""
    grad = timeline.category == _GRAD
    made = grad & (timeline.phase == _BACKWARD) & (timeline.alloc_key >= 0)
    if not made.any():
        before = grad & (timeline.alloc_key < 0)
        made = before if before.any() else grad

    def by_module_and_size(mask):
        return Counter(zip(timeline.module[mask].tolist(), timeline.size[mask].tolist()))

    parameters = by_module_and_size(timeline.category == _PARAM)
    return float(sum(size * min(count, parameters.get((module, size), count))
                     for (module, size), count in by_module_and_size(made).items()))


def shard_additions(timeline: Timeline, shard: str, blocks: list[str],
                    block_parameter_fraction: dict[str, float],
                    copies: dict | None = None) -> tuple[dict, dict]:
    """Rows a data-parallel mode adds (DDP buckets; FSDP's gathered parameters, unsharded
    gradients and collective buffers).  They depend on the shard mode only, not on the
    number of ranks: sizes are unsharded bytes, keys come from the step's unit spans.
    ``copies``: the target's ``collective_copies`` device rule."""
    notes: dict = {}
    param = timeline.category == _PARAM
    grad_bytes_total = gradient_bytes(timeline)
    additions: dict[str, list] = {k: [] for k in ("size", "alloc_key", "free_key", "category",
                                                  "phase")}

    def add(nbytes, start, end, category=_OTHER, phase=_FORWARD):
        if nbytes > 0 and end > start:
            additions["size"].append(nbytes)
            additions["alloc_key"].append(start)
            additions["free_key"].append(end)
            additions["category"].append(category)
            additions["phase"].append(phase)

    if shard in ("ddp", "zero1"):
        add(grad_bytes_total, -1.0, float(timeline.n_events))
        notes["ddp_bucket_bytes"] = grad_bytes_total
    elif shard in ("zero2", "zero3"):
        param_total = float(timeline.size[param].sum())
        block_bytes = {b: f * param_total for b, f in block_parameter_fraction.items()}
        windows = passes(timeline)
        for window in windows:  # FSDP's hooks run in each forward and backward
            units = _units(timeline, blocks, block_bytes,
                           window if len(windows) > 1 else None)
            _fsdp_rows(add, timeline, shard, units, param_total, copies or {},
                       window if len(windows) > 1 else None)
        notes["units"] = [u.path for u in units] + ["(root)"]
    rows = {"size": np.asarray(additions["size"], float),
            "alloc_key": np.asarray(additions["alloc_key"], float),
            "free_key": np.asarray(additions["free_key"], float),
            "category": np.asarray(additions["category"], np.int8),
            "phase": np.asarray(additions["phase"], np.int8)}
    return rows, notes


# --- FSDP2 (zero2 / zero3) ---------------------------------------------------------------------
#: Offsets of FSDP2's hook work from a unit's span on the step's event axis.  Pre-forward
#: work sits in the half event before the unit's first forward allocation (the root's
#: before any unit's); the forward's end (root post-forward) half an event after its last
#: event; the root's pre-backward just before the backward's first event; a unit's
#: pre-backward just after the event before the unit's first backward allocation, below
#: the smallest key step of a checkpoint recompute, which is replayed there after the
#: parameters are gathered; post-backward work in the half event after the unit's last
#: backward allocation (the root's after every unit's).
_ROOT_PRE_FORWARD, _UNIT_PRE_FORWARD = -0.5, -0.4
_ROOT_PRE_BACKWARD, _PRE_BACKWARD, _EPS = -0.4, -1.0, 1e-6
_UNIT_POST_BACKWARD, _ROOT_POST_BACKWARD, _LAST_SCATTER_FREE = 0.5, 0.7, 0.9
#: post-backward order: reshard, free the previous reduce-scatter input, allocate this
#: one, free the unsharded gradients (copied in), allocate the sharded ones, backend copies
_RESHARD, _PREVIOUS_SCATTER, _SCATTER, _UNSHARDED_GRAD_FREE, _SHARDED_GRAD, _SCATTER_COPY = (
    0.01, 0.02, 0.03, 0.04, 0.05, 0.06)


def _post_backward_keys(timeline: Timeline, blocks: list[str],
                        window: Window | None = None) -> tuple[list[float], float]:
    """Post-backward key of each unit with spans (``_units`` order) and of the root."""
    spans = _units(timeline, blocks, {}, window)
    backward = _phase_span(timeline, _BACKWARD, window)
    return ([u.backward[1] + _UNIT_POST_BACKWARD for u in spans],
            backward[1] + _ROOT_POST_BACKWARD)


def fsdp_layout(timeline: Timeline, blocks: list[str]) -> Timeline:
    """The lifetimes FSDP2 gives gradients (zero2 and zero3 alike): each gradient made in
    the step's backward exists unsharded (a temporary of its full size, added here) from
    the op that makes it until its unit's reduce-scatter has copied it in, and sharded (the
    original row, which ``shard_sizes`` shrinks) from there on.  A unit is a block of
    ``blocks``; gradients of other modules belong to the root, reduced after every unit."""
    grad = np.flatnonzero((timeline.category == _GRAD) & (timeline.phase == _BACKWARD)
                          & (timeline.alloc_key >= 0) & (timeline.size > 0))
    if not len(grad) or not _phase_span(timeline, _BACKWARD)[1]:
        return timeline
    windows = passes(timeline)
    post = np.full(len(grad), np.nan)
    root = np.full(len(grad), np.nan)
    for window in windows:  # a gradient made in a pass is reduced at that pass's end
        here = (timeline.alloc_key[grad] >= window[0]) & (timeline.alloc_key[grad] < window[1])
        if len(windows) == 1:
            here[:] = True
        if not here.any():
            continue
        window_or_step = window if len(windows) > 1 else None
        unit_keys, root_key = _post_backward_keys(timeline, blocks, window_or_step)
        spans = [u.path for u in _units(timeline, blocks, {}, window_or_step)]
        unit_of_module = last_containing(timeline.modules, spans)
        keys = np.append(np.asarray(unit_keys, float), root_key)
        post[here] = keys[unit_of_module[timeline.module[grad[here]]]]  # -1 -> the root's
        root[here] = root_key
    ok = ~np.isnan(post)
    grad, post, root = grad[ok], post[ok], root[ok]
    # a gradient made after its unit's reduce-scatter (module attribution off): the root's
    post = np.where(post > timeline.alloc_key[grad], post, root)
    ok = post > timeline.alloc_key[grad]
    grad, post = grad[ok], post[ok]
    if not len(grad):
        return timeline
    alloc_key = timeline.alloc_key.copy()
    original = alloc_key[grad].copy()
    alloc_key[grad] = np.minimum(post + _SHARDED_GRAD, timeline.free_key[grad])
    out = timeline.retimed(alloc_key, timeline.free_key)
    return out.appended({
        "size": timeline.size[grad], "alloc_key": original,
        "free_key": np.minimum(post + _UNSHARDED_GRAD_FREE, timeline.free_key[grad]),
        "category": np.full(len(grad), CATEGORY_CODE[schema.TEMPORARY], np.int8),
        "dtype": timeline.dtype[grad], "module": timeline.module[grad],
        "phase": np.full(len(grad), _BACKWARD, np.int8), "op": timeline.op[grad],
        "shape": timeline.shape[grad]})


def _earliest_backward_rows(timeline: Timeline, paths: list[str],
                            window: Window | None = None) -> np.ndarray:
    """Earliest allocation key of a backward row (a recomputed one included) of each unit
    in ``paths`` and, last, of any module (inf where none), in ``window`` if given."""
    rows = (timeline.phase == _BACKWARD) & (timeline.alloc_key >= 0) & (timeline.size > 0)
    if window is not None:
        rows &= (timeline.alloc_key >= window[0]) & (timeline.alloc_key < window[1])
    keys = timeline.alloc_key
    out = np.full(len(paths) + 1, np.inf)
    if rows.any():
        out[-1] = float(keys[rows].min())
    # earliest per module, then per path over the modules it holds
    by_module = np.full(len(timeline.modules), np.inf)
    np.minimum.at(by_module, timeline.module[rows], keys[rows])
    codes, found = containing(timeline.modules, paths)
    np.minimum.at(out, found, by_module[codes])
    return out


def _fsdp_rows(add, timeline: Timeline, shard: str, units: list[Unit], param_total: float,
               copies: dict, window: Window | None = None) -> None:
    """FSDP2's gathered parameters and flat collective buffers, in the order its hooks run
    (as seen in traces of ``fully_shard`` on gloo; program order, so the same on NCCL):

    * pre-forward of each unit (the root first): the all-gather writes a flat buffer of
      the unit's (unsharded) bytes, copied out into the parameters; the previous unit's
      buffer is freed after that copy-out (the last one at the forward's end);
    * zero3 frees a unit's parameters after its forward (the root's at the forward's
      end) and gathers them again in backward: the root's pre-backward gathers the root
      and prefetches the last unit's buffer; each unit's pre-backward copies its buffer out
      into the parameters, frees it and prefetches the next unit's (reverse order);
      zero2 keeps the parameters from the forward gather;
    * post-backward of each unit (the root last): parameters freed, the previous
      reduce-scatter input freed, this one allocated (the unit's gradient bytes), the
      unsharded gradients copied in and freed and the sharded ones made (``fsdp_layout``);
    * a backend that copies (gloo, ``copies``) adds raw blocks of the buffer's size: one
      at a time per all-gather (made and freed inside the collective), one per
      reduce-scatter (its input cloned, all-reduced, the rank's chunk copied out);
    * where the backend's worker thread may hold what a collective used
      (``copies['held_until_next']``: gloo on a group ``apply`` did not make, since
      ``apply`` drains its own after each collective, apply/gloo_release.py), the
      reduce-scatter's clone and an all-gather's output buffer can outlive the
      collective until the worker thread runs again, at the latest when the rank's next
      collective blocks its main thread.  Modelled at that latest point: the clone lives
      until the next collective (the step's last one until the backward's end: not into
      the optimizer step); an all-gather buffer until FSDP frees it or the next
      collective, whichever is later.  Without it, each dies with its collective.
    """
    forward = _phase_span(timeline, _FORWARD, window)
    backward = _phase_span(timeline, _BACKWARD, window)
    root_bytes = param_total - sum(u.parameter_bytes for u in units)
    grad_fraction = gradient_bytes(timeline) / max(param_total, 1.0)
    gather_copies = min(int(copies.get("all_gather", 0)), 1)
    scatter_copies = min(int(copies.get("reduce_scatter", 0)), 1)
    held = bool(copies.get("held_until_next"))
    forward_end = forward[1] + 0.5
    #: (key where the collective blocks the main thread, after its own copy is made)
    collectives: list[float] = []
    #: buffers a gloo work holds: (bytes, alloc, FSDP's free, its collective, phase)
    buffers: list[tuple] = []
    # (bytes, pre-forward key, end of forward, first backward allocation, post-backward key)
    order = [(root_bytes, forward[0] + _ROOT_PRE_FORWARD, forward_end, backward[0],
              backward[1] + _ROOT_POST_BACKWARD)] + [
        (u.parameter_bytes, u.forward[0] + _UNIT_PRE_FORWARD, u.forward[1] + 0.5,
         u.backward[0], u.backward[1] + _UNIT_POST_BACKWARD) for u in units]

    # forward: buffer, backend copy, copy-out into the parameters, previous buffer freed
    previous = None
    for nbytes, pre, end, _, post in order:
        key = pre + 0.01
        if gather_copies:
            add(nbytes, key + 0.01, key + 0.02, _OTHER)
        collectives.append(key + 0.015)
        add(nbytes, key + 0.03, end if shard == "zero3" else post + _RESHARD, _PARAM)
        if previous is not None:
            buffers.append((previous[0], previous[1], key + 0.04, previous[2], _FORWARD))
        previous = (nbytes, key, key + 0.015)
    if previous is not None:
        buffers.append((previous[0], previous[1], forward_end + 0.02, previous[2], _FORWARD))
    if shard == "zero3":
        # backward: the root gathers itself and prefetches the last unit's buffer; each
        # unit (in reverse) copies its buffer out, frees it and prefetches the next one.
        # A unit recomputed by a checkpoint before its backward (a region holding several
        # units) is gathered by its pre-forward in the recompute, in forward order.
        sequence = [order[0]] + order[:0:-1]
        earliest = _earliest_backward_rows(timeline, [u.path for u in units], window)
        root_base = min(backward[0] + _ROOT_PRE_BACKWARD, earliest[-1] - 30 * _EPS)
        bases = [root_base] + [
            min(max(first + _PRE_BACKWARD, root_base) + 10 * _EPS, early - 20 * _EPS)
            for (_, _, _, first, _), early in zip(sequence[1:], earliest[-2::-1])]
        pending = None  #: (alloc key, collective key) of a prefetched buffer
        for index, (nbytes, _, _, _, post) in enumerate(sequence):
            base = bases[index]
            if pending is None:  # nothing prefetched it: it gathers its own
                if gather_copies:
                    add(nbytes, base + 2 * _EPS, base + 3 * _EPS, _OTHER, _BACKWARD)
                collectives.append(base + 2.5 * _EPS)
                pending = (base + _EPS, base + 2.5 * _EPS)
            add(nbytes, base + 3 * _EPS, post + _RESHARD, _PARAM, _BACKWARD)
            buffers.append((nbytes, pending[0], base + 4 * _EPS, pending[1], _BACKWARD))
            pending = None
            if index + 1 < len(sequence) and bases[index + 1] > base + 7 * _EPS:
                if gather_copies:
                    add(sequence[index + 1][0], base + 6 * _EPS, base + 7 * _EPS, _OTHER,
                        _BACKWARD)
                collectives.append(base + 6.5 * _EPS)
                pending = (base + 5 * _EPS, base + 6.5 * _EPS)
    # post-backward: reduce-scatter input buffers (units in reverse, the root last)
    scatters = [(u.parameter_bytes * grad_fraction, u.backward[1] + _UNIT_POST_BACKWARD)
                for u in reversed(units)] + [(root_bytes * grad_fraction,
                                              backward[1] + _ROOT_POST_BACKWARD)]
    scatters.sort(key=lambda s: s[1])
    clones = []
    for index, (nbytes, post) in enumerate(scatters):
        end = (scatters[index + 1][1] + _PREVIOUS_SCATTER if index + 1 < len(scatters)
               else backward[1] + _LAST_SCATTER_FREE)
        add(nbytes, post + _SCATTER, end, _OTHER, _BACKWARD)
        collectives.append(post + _SCATTER_COPY + 0.0025)
        if scatter_copies:
            clones.append((nbytes, post + _SCATTER_COPY, post + _SCATTER_COPY + 0.005,
                           post + _SCATTER_COPY + 0.0025))
    collectives.sort()
    collective_keys = np.asarray(collectives, float)  # searched once per buffer

    def next_collective(key: float) -> float | None:
        at = int(np.searchsorted(collective_keys, key, side="right"))
        return collectives[at] + 1e-4 if at < len(collectives) else None

    for nbytes, start, fsdp_free, collective, phase in buffers:
        later = next_collective(collective) if held else None
        add(nbytes, start, max(fsdp_free, later or fsdp_free), _OTHER, phase)
    for nbytes, start, end, collective in clones:
        if held:
            # the step's last one: until the backward's end (held into the optimizer step
            # and the next step it would outlive the micro-step, which the accumulation
            # layout and the bounds do not express; not modelled)
            later = next_collective(collective) or backward[1] + _LAST_SCATTER_FREE
            end = max(end, later)
        add(nbytes, start, end, _OTHER, _BACKWARD)


def communication_bytes(plan: Plan, parameter_bytes: float, gradient_bytes: float) -> float:
    """Bytes each rank sends per optimizer step (ring algorithms, (G-1)/G factors).  DDP and
    zero1 all-reduce once per step (``no_sync`` on the other micro-steps); FSDP2 gathers
    and reduce-scatters on every micro-step (the apply runtime does not turn gradient
    sync off between micro-steps: unsharded gradients would stay alive across them)."""
    if plan.shard == "none" or plan.world <= 1:
        return 0.0
    group = plan.shard_group_size
    # the ranks that hold copies of what this rank holds (tp and pp ranks hold other parts)
    replicas_all = plan.data_parallel_size
    ring = lambda n: (n - 1) / n if n > 1 else 0.0
    if plan.shard in ("ddp", "zero1"):
        volume = 2 * gradient_bytes * ring(replicas_all)  # all-reduce
        if plan.shard == "zero1":  # broadcast of updated shards within the shard group
            volume += parameter_bytes * ring(group)
        return volume
    gathers = 1 if plan.shard == "zero2" else 2
    volume = gathers * parameter_bytes * ring(group) + gradient_bytes * ring(group)
    if plan.hybrid:
        replicas = replicas_all // group
        volume += 2 * (gradient_bytes / group) * ring(replicas)  # all-reduce across groups
    # FSDP's hooks run per pipeline micro-batch too (apply/pipeline_data_parallel.py)
    return volume * plan.accum * plan.pipeline_microbatches
