"""Optimizer swap: the optimizer state (and step temporaries) of another optimizer.

The recorded optimizer's state rows and its step temporaries are dropped and replaced by
the new optimizer's, computed per parameter storage of the trace (tied weights count once):

=============  ================================================  ========================
optimizer      state per parameter                               step temporaries
=============  ================================================  ========================
sgd            none                                              none (in-place update)
sgd-momentum   one buffer, parameter-sized                       none (in-place update)
adafactor      row + column factors for >= 2-D, full for 1-D    one parameter-sized
adam8bit       2 bytes/element + absmax per 2048-element block   one parameter-sized fp32
               (32-bit Adam states below 4096 elements)          dequantised copy
=============  ================================================  ========================

State exists for the whole step (it is made at the first step and kept), so new rows span
the analysed step.  Temporaries of the step are modelled as the largest one alive at once.
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline, DTYPE_BYTES

_STATE = CATEGORY_CODE[schema.OPTIMIZER_STATE]
_TEMPORARY = CATEGORY_CODE[schema.TEMPORARY]
_OPTIMIZER = PHASE_CODE[schema.OPTIMIZER]
#: the op name of the temporaries a foreach Adam step makes on a CUDA target
#: (``simulator._device_optimizer_rules``; sharded with the state)
FOREACH_OP = "aten::_foreach_sqrt"
ADAM8BIT_MIN_ELEMENTS = 4096  #: bitsandbytes keeps 32-bit state for smaller tensors
ADAM8BIT_BLOCK = 2048

DESCRIPTIONS = {
    "sgd": "SGD without momentum: no optimizer state",
    "sgd-momentum": "SGD with momentum: one buffer per parameter",
    "adafactor": "Adafactor: factored second moment (row and column statistics)",
    "adam8bit": "8-bit Adam (bitsandbytes): two 1-byte states per parameter",
}


def _numel(shape: str) -> int:
    out = 1
    for dim in shape.split(",") if shape else ():
        out *= int(dim)
    return out


def state_bytes(shape: str, itemsize: int, optimizer: str) -> float:
    """Bytes of optimizer state for one parameter of ``shape``."""
    numel = _numel(shape)
    dims = [int(d) for d in shape.split(",")] if shape else []
    if optimizer == "sgd":
        return 0.0
    if optimizer == "sgd-momentum":
        return float(numel * itemsize)
    if optimizer == "adafactor":
        if len(dims) >= 2:
            rows = numel // dims[-1]
            cols = numel // dims[-2]
            return float((rows + cols) * itemsize)
        return float(numel * itemsize)
    if optimizer == "adam8bit":
        if numel < ADAM8BIT_MIN_ELEMENTS:
            return float(2 * numel * 4)
        blocks = -(-numel // ADAM8BIT_BLOCK)
        return float(2 * numel + 2 * blocks * 4)
    raise ValueError(optimizer)


def temporary_bytes(shape: str, itemsize: int, optimizer: str) -> float:
    if optimizer in ("sgd", "sgd-momentum"):
        return 0.0
    if optimizer == "adam8bit":
        return float(_numel(shape) * 4)
    return float(_numel(shape) * itemsize)


def apply_optimizer_swap(timeline: Timeline, optimizer: str) -> Timeline:
    if optimizer == "keep":
        return timeline
    n = timeline.n_events
    optimizer_events = np.flatnonzero(timeline.event_phase == _OPTIMIZER)
    step_start = float(optimizer_events[0]) if len(optimizer_events) else float(n) - 0.5
    in_step = (timeline.phase == _OPTIMIZER) & (timeline.category == _TEMPORARY)
    drop = (timeline.category == _STATE) | in_step
    out = timeline.dropped(~drop)

    params = np.flatnonzero(timeline.category_mask(schema.PARAMETER) & (timeline.size > 0))
    dtype_names = timeline.dtype_names()
    sizes, temps = [], []
    shapeless = timeline.op_in(("UntypedStorage.resize_",)) | timeline.dtype_in(("bytes",))
    for row in params:
        itemsize = DTYPE_BYTES.get(str(dtype_names[row]), 4)
        shape = str(timeline.shape[row])
        if shapeless[row]:  # a byte count, not a tensor shape: one flat tensor
            shape = str(int(timeline.size[row]) // itemsize)
        sizes.append(state_bytes(shape, itemsize, optimizer))
        temps.append(temporary_bytes(shape, itemsize, optimizer))
    sizes = np.asarray(sizes, float)
    keep = sizes > 0
    if keep.any():
        count = int(keep.sum())
        out = out.appended({
            "size": sizes[keep], "alloc_key": np.full(count, -1.0),
            "free_key": np.full(count, float(n)),
            "category": np.full(count, _STATE, np.int8),
            "dtype": timeline.dtype[params][keep], "module": timeline.module[params][keep],
            "phase": np.full(count, _OPTIMIZER, np.int8),
            "shape": timeline.shape[params][keep]})
    largest_temp = max(temps, default=0.0)
    if largest_temp > 0:
        out = out.appended({
            "size": np.array([largest_temp]), "alloc_key": np.array([step_start + 0.5]),
            "free_key": np.array([step_start + 0.75]),
            "category": np.array([_TEMPORARY], np.int8),
            "phase": np.array([_OPTIMIZER], np.int8)})
    return out
