"""Data parallelism and ZeRO/FSDP sharding over ``world`` ranks, as the apply runtime does it.

Per rank, with ``G`` = ranks sharing one copy of the sharded state (``world``, or the
hybrid group size):

* ``ddp``: everything replicated; DDP's gradient buckets (``gradient_as_bucket_view``
  off) hold a second copy of all gradients for the whole run;
* ``zero1`` (DDP + ZeroRedundancyOptimizer): optimizer state of the parameters this rank
  owns (a greedy largest-first assignment, so the biggest rank share, not total/G), plus
  DDP's buckets;
* ``zero2`` (FSDP2, no reshard after forward): parameter, gradient and optimizer-state
  shards (1/G of each tensor, padded to G); each unit's parameters are all-gathered at its
  first forward allocation and stay whole until its backward ends; its gradients exist
  unsharded during its backward until the reduce-scatter;
* ``zero3`` (FSDP2, reshard after forward): as zero2, but a unit's gathered parameters
  are freed after its forward and gathered again for its backward; the next unit's
  gather is prefetched while a unit computes.

Units are the model's repeated blocks (``plan.repeated_blocks``) plus the root holding
the remaining parameters.  Communication buffers of NCCL/gloo are outside the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan import Plan
from ..trace import schema
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
    forward: tuple[float, float]
    backward: tuple[float, float]


def greedy_max_share(sizes: np.ndarray, ranks: int) -> float:
    """Largest per-rank total when tensors go largest-first to the least-loaded rank
    (ZeroRedundancyOptimizer's partitioning)."""
    loads = np.zeros(ranks)
    for size in np.sort(sizes)[::-1]:
        loads[np.argmin(loads)] += size
    return float(loads.max()) if ranks else 0.0


_SPANS: dict = {}  #: (id of the step's event arrays, blocks) -> spans (they never change)


def _units(timeline: Timeline, blocks: list[str], block_bytes: dict[str, float]) -> list[Unit]:
    key = (id(timeline.event_module), timeline.n_events, tuple(blocks))
    spans = _SPANS.get(key)
    if spans is None:
        spans = _spans(timeline, blocks)
        if len(_SPANS) > 16:
            _SPANS.clear()
        _SPANS[key] = spans
    return [Unit(path, block_bytes.get(path, 0.0), fwd, bwd) for path, fwd, bwd in spans]


def _spans(timeline: Timeline, blocks: list[str]) -> list[tuple]:
    modules = timeline.modules
    allocs = timeline.event_is_alloc
    # each event's module -> the block containing it (-1: none)
    block_of_module = np.full(len(modules), -1)
    for index, path in enumerate(blocks):
        for code, name in enumerate(modules):
            if name == path or name.startswith(path + "."):
                block_of_module[code] = index
    event_block = np.where(allocs, block_of_module[timeline.event_module], -1)
    spans = []
    for index, path in enumerate(blocks):
        hit = event_block == index
        fwd = np.flatnonzero(hit & (timeline.event_phase == _FORWARD))
        bwd = np.flatnonzero(hit & (timeline.event_phase == _BACKWARD))
        if len(fwd) and len(bwd):
            spans.append((path, (float(fwd[0]), float(fwd[-1])), (float(bwd[0]), float(bwd[-1]))))
    return spans


def _phase_span(timeline: Timeline, phase: int) -> tuple[float, float]:
    events = np.flatnonzero(timeline.event_phase == phase)
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
    if plan.shard == "zero1":
        total = float(size[state].sum())
        share = zero1_share(timeline, group)
        size[state] = size[state] * share
        notes["optimizer_share"] = share
        notes["optimizer_state_bytes"] = (total, total * share)
    else:
        grad = timeline.category == _GRAD
        size[param | grad | state] = np.ceil(size[param | grad | state] / group)
    return size, notes


def zero1_share(timeline: Timeline, group: int) -> float:
    """Fraction of the optimizer state the most loaded rank owns (state per parameter is
    proportional to the parameter's size)."""
    params = timeline.size[timeline.category == _PARAM]
    return greedy_max_share(params, group) / max(float(params.sum()), 1.0)


def gradient_bytes(timeline: Timeline) -> float:
    """Bytes of one set of gradients: those this step's backward makes (the previous step's,
    alive until ``zero_grad``, are the same tensors once more), else any gradient rows."""
    grad = timeline.category == _GRAD
    made = grad & (timeline.phase == _BACKWARD) & (timeline.alloc_key >= 0)
    return float(timeline.size[made].sum() or timeline.size[grad & (timeline.alloc_key < 0)].sum()
                 or timeline.size[grad].sum())


def shard_additions(timeline: Timeline, shard: str, blocks: list[str],
                    block_parameter_fraction: dict[str, float],
                    copies: dict | None = None) -> tuple[dict, dict]:
    """Rows a data-parallel mode adds (DDP buckets; FSDP's gathered parameters, unsharded
    gradients and collective buffers).  They depend on the shard mode only, not on the
    number of ranks: sizes are unsharded bytes, keys come from the step's unit spans.
    ``copies``: the target's ``collective_copies`` device rule."""
    notes: dict = {}
    param = timeline.category == _PARAM
    grad = timeline.category == _GRAD
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
        forward, backward = _phase_span(timeline, _FORWARD), _phase_span(timeline, _BACKWARD)
        units = _units(timeline, blocks, {b: f * param_total
                                          for b, f in block_parameter_fraction.items()})
        root_bytes = param_total - sum(u.parameter_bytes for u in units)
        # the root unit's parameters stay gathered through forward and backward
        add(root_bytes, forward[0] - 0.5, backward[1] + 0.5, _PARAM)
        grad_fraction = grad_bytes_total / max(param_total, 1.0)
        previous_forward_start = forward[0] - 0.5
        for index, unit in enumerate(units):
            nbytes = unit.parameter_bytes
            start = min(previous_forward_start, unit.forward[0] - 0.5)
            if shard == "zero2":
                add(nbytes, start, unit.backward[1] + 0.5, _PARAM)
            else:
                add(nbytes, start, unit.forward[1] + 0.5, _PARAM)
                # backward gather prefetched one unit ahead (units run in reverse)
                later = units[index + 1].backward[0] - 0.5 if index + 1 < len(units) \
                    else unit.backward[0] - 0.5
                add(nbytes, min(later, unit.backward[0] - 0.5), unit.backward[1] + 0.5,
                    _PARAM, _BACKWARD)
            add(nbytes * grad_fraction, unit.backward[0] - 0.25, unit.backward[1] + 0.75,
                _GRAD, _BACKWARD)
            previous_forward_start = unit.forward[0] - 0.5
        _collective_buffers(add, shard, units, root_bytes, grad_fraction, forward, backward,
                            copies or {})
        notes["units"] = [u.path for u in units] + ["(root)"]
    rows = {"size": np.asarray(additions["size"], float),
            "alloc_key": np.asarray(additions["alloc_key"], float),
            "free_key": np.asarray(additions["free_key"], float),
            "category": np.asarray(additions["category"], np.int8),
            "phase": np.asarray(additions["phase"], np.int8)}
    return rows, notes


def _collective_buffers(add, shard: str, units: list[Unit], root_bytes: float,
                        grad_fraction: float, forward: tuple, backward: tuple,
                        copies: dict) -> None:
    """FSDP2's flat communication buffers, as seen in its traces: each all-gather writes a
    unit-sized output buffer (copied out into the parameters, freed when the next gather
    comes), each reduce-scatter reads a unit-sized input buffer (the gradients copied in,
    freed at the next reduce-scatter); a backend that copies (gloo) adds short-lived raw
    blocks of the same size."""
    gathers = [(root_bytes, forward[0] - 0.5)] + [
        (u.parameter_bytes, u.forward[0] - 0.5) for u in units]
    if shard == "zero3":
        gathers += [(u.parameter_bytes, u.backward[0] - 0.5) for u in reversed(units)]
    for index, (nbytes, key) in enumerate(gathers):
        following = gathers[index + 1][1] if index + 1 < len(gathers) else forward[1]
        add(nbytes, key + 0.05, max(following, key) + 0.3, _OTHER)
        for copy in range(int(copies.get("all_gather", 0))):
            add(nbytes, key + 0.06, key + 0.07, _OTHER)
    scatters = [(u.parameter_bytes * grad_fraction, u.backward[1] + 0.6)
                for u in reversed(units)] + [(root_bytes * grad_fraction, backward[1] + 0.6)]
    for index, (nbytes, key) in enumerate(scatters):
        following = scatters[index + 1][1] if index + 1 < len(scatters) else backward[1] + 0.6
        add(nbytes, key, max(following, key) + 0.05, _OTHER, _BACKWARD)
        for copy in range(int(copies.get("reduce_scatter", 0))):
            add(nbytes, key + 0.01, key + 0.02, _OTHER, _BACKWARD)


def communication_bytes(plan: Plan, parameter_bytes: float, gradient_bytes: float) -> float:
    """Bytes each rank sends per optimizer step (ring algorithms, (G-1)/G factors)."""
    if plan.shard == "none" or plan.world <= 1:
        return 0.0
    group = plan.shard_group_size
    world = plan.world
    ring = lambda n: (n - 1) / n if n > 1 else 0.0
    if plan.shard in ("ddp", "zero1"):
        volume = 2 * gradient_bytes * ring(world)  # all-reduce
        if plan.shard == "zero1":
            volume += parameter_bytes * ring(world)  # broadcast of updated shards
        return volume
    gathers = 1 if plan.shard == "zero2" else 2
    volume = gathers * parameter_bytes * ring(group) + gradient_bytes * ring(group)
    if plan.hybrid:
        replicas = world // group
        volume += 2 * (gradient_bytes / group) * ring(replicas)  # all-reduce across groups
    return volume
