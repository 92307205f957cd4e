"""Offload to host memory (GPU plans only), as the apply runtime realises it.

* ``optimizer`` (no FSDP; ZeRO-Offload's layout): optimizer state and the step's
  temporaries live on the host; the GPU keeps parameters and gradients.  The host holds
  fp32 master parameters, their gradients and the state;
* ``optimizer+params`` (FSDP2 ``CPUOffloadPolicy``): parameter, gradient and optimizer
  state *shards* live on the host; the GPU keeps only what is gathered for compute and the
  unsharded gradients until their reduce-scatter (see sharding);
* ``activations`` (``apply.precision.offload_saved_tensors``, save_on_cpu keeping layouts):
  every tensor autograd saves is copied to the host when saved and back when backward
  needs it; on the GPU it lives from its allocation to the end of the op that made it, and
  again from when the backward op that uses it starts until it is released.

Returns the device timeline and the host bytes (reported beside the device peak).
"""
from __future__ import annotations

import numpy as np

from ..plan import FSDP_SHARDS, Plan
from ..trace import schema
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_PARAM = CATEGORY_CODE[schema.PARAMETER]
_GRAD = CATEGORY_CODE[schema.GRADIENT]
_STATE = CATEGORY_CODE[schema.OPTIMIZER_STATE]
_ACTIVATION = CATEGORY_CODE[schema.ACTIVATION]
_TEMPORARY = CATEGORY_CODE[schema.TEMPORARY]
_OPTIMIZER = PHASE_CODE[schema.OPTIMIZER]
_BACKWARD = PHASE_CODE[schema.BACKWARD]


def apply_offload(timeline: Timeline, plan: Plan) -> tuple[Timeline, dict]:
    if not plan.offload:
        return timeline, {}
    size, host = offload_sizes(timeline, plan)
    out = timeline.resized(size)
    if "activations" in plan.offload:
        out, host["activations_peak"] = offload_activations(out)
    return out, host


def offload_sizes(timeline: Timeline, plan: Plan) -> tuple[np.ndarray, dict]:
    """Device sizes of the rows once optimizer state (and with ``params`` the persistent
    parameter and gradient shards) live on the host; the host bytes beside them."""
    host: dict[str, float] = {}
    size = timeline.size.copy()
    if "optimizer" in plan.offload:
        state = timeline.category == _STATE
        host["optimizer_state"] = float(size[state].sum())
        size[state | optimizer_step_temporaries(timeline)] = 0.0
        if "params" in plan.offload:
            # the shards (persistent rows) move; gathered copies and unsharded grads stay
            moved = persistent_rows(timeline) & np.isin(timeline.category, (_PARAM, _GRAD))
            host["parameter_and_gradient_shards"] = float(size[moved].sum())
            size[moved] = 0.0
        else:
            param = timeline.category == _PARAM
            host["master_parameters_and_gradients"] = 2.0 * float(
                timeline.size[param].sum() * (4.0 / max(_itemsize(timeline, param), 1)))
    return size, host


def optimizer_step_temporaries(timeline: Timeline) -> np.ndarray:
    return (timeline.phase == _OPTIMIZER) & (timeline.category == _TEMPORARY)


def persistent_rows(timeline: Timeline) -> np.ndarray:
    """Rows alive across the whole analysed step (model state, mostly)."""
    return (timeline.alloc_key < 0) & (timeline.free_key >= timeline.n_events)


def offload_activations(out: Timeline) -> tuple[Timeline, float]:
    """``save_on_cpu``: each saved activation leaves the device after the op that made it
    and comes back for its backward use.  Returns the timeline and the host peak.

    The copy backward gets is made when the backward op that uses it starts, before that
    op allocates its outputs, and lives until the op is done with it (the row's free in
    the trace): it comes back just before the last allocation ahead of that free.  Placed
    at the free alone, it missed the op's outputs and its incoming gradient: on a real H100
    a GPT's log-softmax output came back beside both (1.5 GiB each; -20% at the peak, now
    0.0%).  What a trace cannot say: an op that drops its copy before its last allocation
    (Linear's weight gradient before the bias's reduction: ViT +3%), and a storage saved by
    two ops (an in-place ReLU's output, the next conv's input), which comes back once per
    op while the trace shows only its last use (the conv's copy is missed: CNN -19%)."""
    saved = _saved(out)
    host_bytes = float(out.size[saved].sum())
    free_key = out.free_key.copy()
    original_free = free_key[saved].copy()
    free_key[saved] = out.alloc_key[saved] + 0.5
    retimed = out.retimed(out.alloc_key, free_key)
    rows = np.flatnonzero(saved)
    out_rows = {name: getattr(out, name)[rows] for name in (
        "size", "category", "dtype", "module", "op", "scales_with_batch", "shape")}
    out_rows["alloc_key"] = _unpacked_from(out, out.alloc_key[rows], original_free)
    out_rows["free_key"] = original_free
    out_rows["phase"] = np.full(len(rows), _BACKWARD, np.int8)
    return retimed.appended(out_rows), host_bytes


def _unpacked_from(out: Timeline, alloc_key: np.ndarray, free_key: np.ndarray) -> np.ndarray:
    """Where the device copy of a saved row freed at ``free_key`` comes back: half a key
    before the last allocation event of the backward phase ahead of the free (the outputs
    of the op that uses it); just before the free where there is none after the row's own
    allocation."""
    before = np.ceil(free_key).astype(np.int64) - 1  # the last event strictly ahead
    before = np.clip(before, 0, max(out.n_events - 1, 0))
    if not out.n_events:
        return free_key - 0.5
    positions = np.arange(out.n_events)
    last_alloc = np.maximum.accumulate(np.where(out.event_is_alloc, positions, -1))[before]
    usable = (last_alloc >= 0) & (last_alloc > alloc_key) & (last_alloc < free_key)
    usable &= out.event_phase[np.maximum(last_alloc, 0)] == _BACKWARD
    return np.where(usable, last_alloc - 0.5, free_key - 0.5)


def _itemsize(timeline: Timeline, mask: np.ndarray) -> float:
    from .replay import DTYPE_BYTES
    names = timeline.dtype_names()[mask]
    if not len(names):
        return 4.0
    return float(np.mean([DTYPE_BYTES.get(str(n), 4) for n in names]))


def host_link_bytes(plan: Plan, parameter_bytes: float, gradient_bytes: float,
                    offloaded_activation_bytes: float) -> float:
    """Bytes crossing one rank's host link per optimizer step (both directions together).
    ``offloaded_activation_bytes``: what ``save_on_cpu`` moves in one micro-step
    (``saved_activation_bytes``): each saved tensor goes to the host and comes back."""
    total = 0.0
    # under FSDP each rank keeps (and moves) only its shard of the model state
    shard = plan.shard_group_size if plan.shard in FSDP_SHARDS else 1
    if "optimizer" in plan.offload:
        total += (gradient_bytes + parameter_bytes) / shard  # gradients down, parameters up
    if "params" in plan.offload:
        total += parameter_bytes / shard  # shards up to be gathered
    if "activations" in plan.offload:
        total += 2.0 * offloaded_activation_bytes * plan.accum
    return total


def saved_activation_bytes(timeline: Timeline) -> tuple[float, float]:
    """Bytes ``save_on_cpu`` moves in one micro-step of ``timeline`` (the rows
    ``offload_activations`` sends to the host), as (batch-independent, batch-scaled): the
    second part scales with the micro-batch like ``batch.scale_batch`` scales the rows."""
    saved = _saved(timeline)
    scaled = timeline.scales_with_batch
    return (float(timeline.size[saved & ~scaled].sum()),
            float(timeline.size[saved & scaled].sum()))


def _saved(out: Timeline) -> np.ndarray:
    return (out.category == _ACTIVATION) & (out.alloc_key >= 0) \
        & (out.free_key < out.n_events) & (out.size > 0)
