"""Precision plans as stream transforms: amp-bf16 / amp-fp16 (autocast) and pure bf16.

Autocast (``amp-*``), on the *target* device's op lists (``hardware.DEVICE_RULES``):

* forward outputs of low-precision ops (matmuls, convolutions, attention) become 16-bit;
  outputs of fp32-list ops (losses, log-softmax; norms and softmax on CUDA) stay fp32;
  elementwise ops that only pass data on (activations functions, dropout, copies) take
  the dtype of the output made just before them; everything else (residual adds that
  meet an fp32 stream, norms on CPU fed by fp32) keeps its recorded dtype;
* backward temporaries shaped like a 16-bit forward tensor of the same module are 16-bit;
* the autocast weight cache: each module running a low-precision op gets a 16-bit copy
  of its own parameters from its first forward allocation until its last backward one
  (matmuls save the cast weight for backward), and each parameter gradient first exists
  as a 16-bit gradient of that copy (a short temporary) before the fp32 ``.grad``;
* parameters, gradients and optimizer state stay fp32 (the master weights);
* amp-fp16 adds the gradient scaler: one fp32 scale and one found-inf flag, and the
  unscale step's per-device found-inf tensor (a few bytes).

Pure ``bf16``: every fp32 storage becomes bf16 except fp32-list ops and their backward,
and 0-d optimizer scalars (Adam's ``step``); the first fp32-list op gets its input cast
to fp32 (a temporary) and its backward the gradient cast back (a 16-bit temporary).

Limits: without data flow in the trace the pass-through rule is a heuristic (exact for
Linear/Conv -> activation chains; an op fed by two tensors of different dtypes is taken
as fp32).  Measured against hand-written loops in tests/simulate.
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from .hardware import device_rules
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline, DTYPE_BYTES

_FORWARD = PHASE_CODE[schema.FORWARD]
_BACKWARD = PHASE_CODE[schema.BACKWARD]
PASS_THROUGH = frozenset({
    "aten::gelu", "aten::relu", "aten::silu", "aten::tanh", "aten::sigmoid", "aten::hardtanh",
    "aten::leaky_relu", "aten::elu", "aten::mish", "aten::native_dropout", "aten::bernoulli",
    "aten::dropout", "aten::clone", "aten::_unsafe_view", "aten::view", "aten::transpose",
    "aten::contiguous", "aten::cat", "aten::split_with_sizes", "aten::_softmax",
    "aten::max_pool2d_with_indices", "aten::avg_pool2d", "aten::adaptive_avg_pool2d",
    "aten::mean", "aten::flatten", "aten::reshape", "aten::permute", "aten::copy_",
    "aten::_reshape_alias", "aten::expand", "aten::max_pool2d"})
LOW_DTYPES = {"amp-bf16": "bfloat16", "bf16": "bfloat16", "amp-fp16": "float16"}


def _backward_of(op: str, fp32_ops: frozenset) -> bool:
    base = op.replace("_backward_data", "").replace("_backward", "")
    return base in fp32_ops or base + "_forward" in fp32_ops


def apply_precision(timeline: Timeline, precision: str, device_type: str,
                    module_parameter_bytes: dict[str, int] | None = None) -> Timeline:
    if precision == "fp32":
        return timeline
    low = LOW_DTYPES[precision]
    if precision == "bf16":
        return _pure_bf16(timeline, device_type)
    return _autocast(timeline, low, device_type, module_parameter_bytes or {})


def _resize_to(timeline: Timeline, rows: np.ndarray, dtype_name: str) -> Timeline:
    """Rows (bool mask) whose dtype is fp32 take ``dtype_name``, resized by the item size."""
    names = timeline.dtype_names()
    fp32 = rows & (names == "float32")
    ratio = DTYPE_BYTES[dtype_name] / 4
    size = np.where(fp32, timeline.size * ratio, timeline.size)
    return timeline.resized(size).with_dtype(np.flatnonzero(fp32), dtype_name)


def _ops(timeline: Timeline) -> np.ndarray:
    return np.asarray(timeline.ops, dtype=object)[timeline.op]


def _pure_bf16(timeline: Timeline, device_type: str) -> Timeline:
    rules = device_rules(device_type)
    fp32_ops = rules["autocast_fp32"]
    ops = _ops(timeline)
    keep_fp32 = np.array([op in fp32_ops or _backward_of(op, fp32_ops) for op in ops], bool)
    scalar = timeline.shape.astype(str) == ""
    out = _resize_to(timeline, ~keep_fp32 & ~scalar, "bfloat16")
    island = np.flatnonzero(keep_fp32 & (timeline.phase == _FORWARD) & (timeline.size > 4))
    if len(island):
        first = island[np.argmin(timeline.alloc_key[island])]
        key = timeline.alloc_key[first]
        size = timeline.size[first]
        backward = np.flatnonzero(keep_fp32 & (timeline.phase == _BACKWARD)
                                  & (timeline.size > 4))
        grad_key = (timeline.free_key[backward].max() if len(backward)
                    else timeline.free_key[first])
        out = out.appended({
            "size": np.array([size, size / 2]),
            "alloc_key": np.array([key - 0.5, grad_key - 0.5]),
            "free_key": np.array([key + 0.5, grad_key + 0.75]),
            "phase": np.array([_FORWARD, _BACKWARD], np.int8),
            "scales_with_batch": np.array([timeline.scales_with_batch[first]] * 2),
            "shape": np.array([timeline.shape[first]] * 2, dtype=object)})
    return out


def _autocast(timeline: Timeline, low: str, device_type: str,
              module_parameter_bytes: dict[str, int]) -> Timeline:
    rules = device_rules(device_type)
    lower_ops, fp32_ops = rules["autocast_lower"], rules["autocast_fp32"]
    ops = _ops(timeline)
    forward = np.flatnonzero((timeline.phase == _FORWARD) & (timeline.alloc_key >= 0))
    forward = forward[np.argsort(timeline.alloc_key[forward], kind="stable")]
    is_low = np.zeros(len(timeline), bool)
    floating = np.isin(timeline.dtype_names(), ("float32", "float16", "bfloat16"))
    previous_low = False
    casts: list[tuple[int, int]] = []  #: (fp32 input row, low-precision op row)
    recent: list[int] = []  #: floating rows made since the last low-precision op
    for row in forward:
        if not floating[row]:
            continue
        op = ops[row]
        if op in lower_ops:
            is_low[row] = True
            source = _input_of(timeline, row, recent)
            if source >= 0 and not is_low[source]:
                casts.append((source, row))
            recent = []
        elif op in fp32_ops:
            is_low[row] = False
        elif op in PASS_THROUGH:
            is_low[row] = previous_low
        previous_low = is_low[row]
        recent.append(row)
    # backward tensors shaped like a 16-bit forward tensor of the same module
    low_keys = {(int(m), str(s)) for m, s in zip(timeline.module[is_low], timeline.shape[is_low])}
    backward = np.flatnonzero((timeline.phase == _BACKWARD)
                              & timeline.category_mask(schema.TEMPORARY, schema.ACTIVATION))
    for row in backward:
        if (int(timeline.module[row]), str(timeline.shape[row])) in low_keys:
            is_low[row] = True
    out = _resize_to(timeline, is_low, low)
    out = _input_casts(out, timeline, casts, low)

    # autocast weight copies of modules that ran a low-precision op
    modules = np.asarray(timeline.modules, dtype=object)
    ran_low = set(timeline.module[is_low & (timeline.phase == _FORWARD)
                                  & np.isin(ops, list(lower_ops))].tolist())
    rows: dict[str, list] = {k: [] for k in ("size", "alloc_key", "free_key", "module",
                                              "category", "phase")}
    itemsize_ratio = DTYPE_BYTES[low] / 4
    for code in sorted(ran_low):
        path = str(modules[code])
        owned = module_parameter_bytes.get(path, 0)
        if owned <= 0:
            continue
        in_module = timeline.module == code
        fwd = timeline.alloc_key[in_module & (timeline.phase == _FORWARD)]
        bwd = timeline.alloc_key[in_module & (timeline.phase == _BACKWARD)]
        start = float(fwd.min()) - 0.5
        end = float(bwd.max()) + 0.5 if len(bwd) else float(fwd.max()) + 0.5
        rows["size"].append(owned * itemsize_ratio)
        rows["alloc_key"].append(start)
        rows["free_key"].append(end)
        rows["module"].append(code)
        rows["category"].append(CATEGORY_CODE[schema.AUTOCAST_WEIGHT])
        rows["phase"].append(_FORWARD)
    if low not in out.dtypes:
        out = out.with_dtype(np.zeros(0, int), low)
    low_code = out.dtypes.index(low)
    if rows["size"]:
        rows["dtype"] = [low_code] * len(rows["size"])
        out = out.appended({k: np.asarray(v) for k, v in rows.items()})
    # the 16-bit gradient of each weight copy, cast into the fp32 .grad right away
    grads = np.flatnonzero(timeline.category_mask(schema.GRADIENT)
                           & (timeline.phase == _BACKWARD) & np.isin(timeline.module, list(ran_low)))
    if len(grads):
        out = out.appended({
            "size": timeline.size[grads] * itemsize_ratio,
            "alloc_key": timeline.alloc_key[grads] - 0.25,
            "free_key": timeline.alloc_key[grads] + 0.25,
            "module": timeline.module[grads], "phase": np.full(len(grads), _BACKWARD, np.int8),
            "dtype": np.full(len(grads), low_code, np.int16),
            "shape": timeline.shape[grads]})
    return out


def _positions(shape: str) -> tuple[int, int]:
    dims = [int(d) for d in shape.split(",")] if shape else []
    if not dims:
        return 0, 0
    total = 1
    for d in dims:
        total *= d
    return total // dims[-1], dims[-1]


def _input_of(timeline: Timeline, row: int, recent: list[int]) -> int:
    """The fp32 tensor a low-precision op most likely read: the latest row made since the
    previous low-precision op with as many positions (all dims but the last) as the op's
    output and a real feature dimension (not a norm's per-position statistics)."""
    positions, _ = _positions(str(timeline.shape[row]))
    for candidate in reversed(recent):
        count, last = _positions(str(timeline.shape[candidate]))
        if count == positions and last > 1:
            return candidate
    return -1


def _input_casts(out: Timeline, timeline: Timeline, casts: list[tuple[int, int]],
                 low: str) -> Timeline:
    """A low-precision op fed by an fp32 tensor saves the 16-bit copy autocast makes of it:
    the copy takes the input's saved lifetime and the fp32 input dies after the op (when it
    was saved only by that op, i.e. allocated by another module just before)."""
    activation = CATEGORY_CODE[schema.ACTIVATION]
    if not casts:
        return out
    inputs = np.array([c[0] for c in casts])
    consumers = np.array([c[1] for c in casts])
    saved = timeline.category[inputs] == activation
    ratio = DTYPE_BYTES[low] / 4
    free_key = out.free_key.copy()
    op_keys = timeline.alloc_key[consumers]
    free_key[inputs[saved]] = op_keys[saved] + 0.5
    out = out.retimed(out.alloc_key, free_key)
    low_code = out.dtypes.index(low) if low in out.dtypes else None
    if low_code is None:
        out = out.with_dtype(np.zeros(0, int), low)
        low_code = out.dtypes.index(low)
    return out.appended({
        "size": timeline.size[inputs] * ratio,
        "dtype": np.full(len(casts), low_code, np.int16),
        "alloc_key": op_keys - 0.5,
        "free_key": np.where(saved, timeline.free_key[inputs], op_keys + 0.5),
        "category": np.where(saved, activation, CATEGORY_CODE[schema.TEMPORARY]).astype(np.int8),
        "module": timeline.module[consumers],
        "phase": np.full(len(casts), _FORWARD, np.int8),
        "scales_with_batch": timeline.scales_with_batch[inputs],
        "shape": timeline.shape[inputs]})


def scaler_bytes(precision: str) -> int:
    """GradScaler state on the device: scale and growth tracker (fp32, int32)."""
    return 8 if precision == "amp-fp16" else 0
