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
import pandas as pd

from ..trace import schema
from .hardware import device_rules
from .kernel_blocks import (data_sized_kernel_blocks, dims_of, matmul_scratch,
                            probed_conv_blocks, saved_inplace_copies)
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline, DTYPE_BYTES

_FORWARD = PHASE_CODE[schema.FORWARD]
_BACKWARD = PHASE_CODE[schema.BACKWARD]
PASS_THROUGH = frozenset({
    "aten::gelu", "aten::relu", "aten::silu", "aten::tanh", "aten::sigmoid", "aten::hardtanh",
    "aten::leaky_relu", "aten::elu", "aten::mish", "aten::native_dropout", "aten::bernoulli",
    "aten::dropout", "aten::clone", "aten::_unsafe_view", "aten::view", "aten::transpose",
    "aten::contiguous", "aten::split_with_sizes", "aten::_softmax",
    "aten::max_pool2d_with_indices", "aten::avg_pool2d", "aten::adaptive_avg_pool2d",
    "aten::mean", "aten::flatten", "aten::reshape", "aten::permute", "aten::copy_",
    "aten::_reshape_alias", "aten::expand", "aten::max_pool2d",
    # batch norm is on neither autocast list: it runs in its input's dtype
    "aten::native_batch_norm", "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_functional", "aten::cudnn_batch_norm",
    "aten::batch_norm",
    # on neither of the CPU's lists (CUDA runs them in fp32: its fp32 list is read first),
    # so on the CPU a GroupNorm after a 16-bit convolution, a LayerNorm fed 16-bit, a
    # masked_fill fills in its input's dtype (softmax: above)
    "aten::native_group_norm", "aten::native_layer_norm",
    "aten::masked_fill"})
#: ops whose backward needs none of their inputs: reading a tensor, they do not save it
_SAVE_NOTHING = frozenset({"aten::add", "aten::sub", "aten::cat", "aten::stack",
                           "aten::clone", "aten::contiguous", "aten::_to_copy"})
_NORMS = frozenset({"aten::native_group_norm", "aten::native_layer_norm",
                    "aten::native_batch_norm", "aten::_native_batch_norm_legit",
                    "aten::_native_batch_norm_legit_functional", "aten::cudnn_batch_norm"})
LOW_DTYPES = {"amp-bf16": "bfloat16", "bf16": "bfloat16", "amp-fp16": "float16"}
#: autocast's "promote" ops: the widest input dtype
_PROMOTE = frozenset({"aten::cat", "aten::stack", "aten::index_copy"})


def _backward_of(op: str, fp32_ops: frozenset) -> bool:
    base = op.replace("_backward_data", "").replace("_backward", "")
    return base in fp32_ops or base + "_forward" in fp32_ops


def apply_precision(timeline: Timeline, precision: str, device_type: str,
                    module_parameter_bytes: dict[str, int] | None = None,
                    regions: list[str] | tuple = (), probes: dict | None = None,
                    batch: dict | None = None,
                    module_types: dict[str, str] | None = None) -> Timeline:
    """``regions``: the checkpointed modules (already applied to ``timeline``);
    ``probes``: the trace's ``meta.probes`` (16-bit kernel blocks measured by the profiler);
    ``batch``: its ``meta.batch`` (the root forward's inputs); ``module_types``: module
    path -> class name (``meta.modules``)."""
    if precision == "fp32":
        return timeline
    low = LOW_DTYPES[precision]
    if precision == "bf16":
        out = _pure_bf16(timeline, device_type)
        out = _cast_inputs(out, batch or {}, module_parameter_bytes or {}, low)
    else:
        out = _autocast(timeline, low, device_type, module_parameter_bytes or {}, regions,
                        module_types)
        out = _cast_inputs(out, batch or {}, module_parameter_bytes or {}, low,
                           device_rules(device_type)["autocast_lower"], len(timeline),
                           regions)
    out = matmul_scratch(out, len(timeline), low, device_type, probes or {},
                         timeline.alloc_key)
    out = probed_conv_blocks(out, low, device_type, probes or {}, timeline.alloc_key)
    return _fp32_outputs(out, len(timeline))


def _fp32_outputs(out: Timeline, original_rows: int) -> Timeline:
    """``apply`` runs the root forward under autocast and hands its floating outputs back in
    fp32: each 16-bit output the script keeps past the backward (logits; rows made in
    forward, not saved for backward) is copied to fp32 as the forward ends, and the 16-bit
    original is freed."""
    forward = np.flatnonzero(out.event_phase == _FORWARD)
    backward = np.flatnonzero(out.event_phase == _BACKWARD)
    if not len(forward) or not len(backward):
        return out
    forward_end, backward_end = float(forward[-1]), float(backward[-1])
    rows = np.arange(original_rows)
    kept = rows[(out.phase[rows] == _FORWARD) & (out.alloc_key[rows] >= 0)
                & (out.free_key[rows] > backward_end)
                & out.category_mask(schema.TEMPORARY, schema.OTHER)[rows]
                & out.dtype_in(("bfloat16", "float16"))[rows]]
    if not len(kept):
        return out
    fp32 = out.dtypes.index("float32") if "float32" in out.dtypes else None
    if fp32 is None:
        out = out.with_dtype(np.zeros(0, int), "float32")
        fp32 = out.dtypes.index("float32")
    original_free = out.free_key[kept].copy()
    free_key = out.free_key.copy()
    free_key[kept] = forward_end + 0.6
    out = out.retimed(out.alloc_key, free_key)
    return out.appended({
        "size": out.size[kept] * 2.0, "alloc_key": np.full(len(kept), forward_end + 0.55),
        "free_key": original_free, "category": out.category[kept],
        "dtype": np.full(len(kept), fp32, np.int16), "module": np.zeros(len(kept), np.int32),
        "phase": np.full(len(kept), _FORWARD, np.int8),
        "scales_with_batch": out.scales_with_batch[kept], "shape": out.shape[kept]})


def _resize_to(timeline: Timeline, rows: np.ndarray, dtype_name: str) -> Timeline:
    """Rows (bool mask) whose dtype is fp32 take ``dtype_name``, resized by the item size."""
    fp32 = rows & timeline.dtype_in(("float32",))
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
    # the script's data (made between steps, fed as is) stays fp32: only the model is cast
    data = (timeline.phase == PHASE_CODE[schema.OTHER_PHASE]) & timeline.category_mask(
        schema.INPUT, schema.OTHER, schema.TEMPORARY, schema.ACTIVATION)
    sdpa = _sdpa_math_rows(timeline, device_type)
    lowered = ~keep_fp32 & ~scalar & ~data & ~sdpa
    out = _resize_to(timeline, lowered, "bfloat16")
    copies = saved_inplace_copies(timeline, np.flatnonzero(lowered & timeline.dtype_in(
        ("float32",))))
    out = out.resized(np.where(copies, out.size / 2, out.size))
    # the script's own autocast (bf16) copied its fp32 weights; of bf16 parameters it makes
    # no copy (autocast's cast of a tensor already in the target dtype returns it)
    own_copies = timeline.category_mask(schema.AUTOCAST_WEIGHT) & timeline.dtype_in(
        ("bfloat16",))
    if own_copies.any():
        out = out.resized(np.where(own_copies, 0.0, out.size))
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


_FLOATING = ("float32", "float64", "float16", "bfloat16")
_SAFE_SOFTMAX = "aten::_safe_softmax"


def _sdpa_math_rows(timeline: Timeline, device_type: str) -> np.ndarray:
    """Rows of scaled-dot-product attention's math path, which on CPU computes 16-bit
    inputs in fp32 (it upcasts q, k and v and casts the result back): they keep their fp32
    size in a 16-bit plan.  The path shows in an fp32 trace as ``_safe_softmax`` over
    (B, H, T, S) scores in the attention's module (flash attention, used without dropout,
    records its own op instead); its tensors are that module's own rows shaped (B, H, ...)
    or (B*H, ...) (the batched matmuls), in forward and backward."""
    out = np.zeros(len(timeline), bool)
    if not device_rules(device_type).get("sdpa_math_upcast") or \
            _SAFE_SOFTMAX not in timeline.ops:
        return out
    softmax = np.flatnonzero(timeline.op_in((_SAFE_SOFTMAX,))
                             & (timeline.phase == _FORWARD)
                             & ~timeline.dtype_in((schema.RAW_BYTES_DTYPE,)))
    floating = timeline.dtype_in(("float32",))
    for module in np.unique(timeline.module[softmax]):
        dims = dims_of(timeline.shape[softmax[timeline.module[softmax] == module][0]])
        if len(dims) != 4:
            continue
        batch, heads = dims[0], dims[1]
        rows = np.flatnonzero((timeline.module == module) & floating
                              & np.isin(timeline.phase, (_FORWARD, _BACKWARD)))
        for row in rows:
            shape = dims_of(timeline.shape[row])
            out[row] = (len(shape) == 4 and shape[:2] == [batch, heads]) or (
                len(shape) == 3 and shape[0] == batch * heads)
    return out


def _first_owner(timeline: Timeline, module_parameter_bytes: dict[str, int]) -> int | None:
    """The first module with parameters to run in forward: the one the script's data meets."""
    forward = np.flatnonzero(timeline.event_phase == _FORWARD)
    return next((int(m) for m in timeline.event_module[forward]
                 if module_parameter_bytes.get(timeline.modules[int(m)], 0)), None)


def _cast_inputs(out: Timeline, batch: dict, module_parameter_bytes: dict[str, int],
                 low: str, lower_ops: frozenset | None = None,
                 original_rows: int | None = None, regions=()) -> Timeline:
    """The 16-bit copy of each floating model input (``meta.batch``), saved by the first
    module with parameters (a Linear or convolution keeps its input for the weight
    gradient) until that module's backward ends.  Pure bf16 (``lower_ops`` None): ``apply``
    casts the root forward's inputs as it begins.  Autocast: the first module's op casts
    its fp32 input when the op is on the target's low-precision list."""
    sizes, shapes = [], []
    for shape, dtype in zip(batch.get("shapes") or (), batch.get("dtypes") or ()):
        if str(dtype) in _FLOATING and shape:
            sizes.append(float(np.prod([int(d) for d in shape])) * DTYPE_BYTES[low])
            shapes.append(",".join(str(int(d)) for d in shape))
    forward = np.flatnonzero(out.event_phase == _FORWARD)
    if not sizes or not len(forward):
        return out
    first = _first_owner(out, module_parameter_bytes)
    if first is None:
        return out
    start = float(forward[0]) - 0.25
    if lower_ops is not None:
        # the module's own tensors (not a checkpoint's RNG state kept at its region's
        # start, nor a kernel's raw block)
        own = np.flatnonzero((out.module == first) & (out.phase == _FORWARD)
                             & (out.alloc_key >= 0) & ~out.category_mask(schema.OTHER)
                             & ~out.dtype_in((schema.RAW_BYTES_DTYPE,)))
        own = own[own < (original_rows or len(out))]  # the recorded ops, not added copies
        if not len(own):
            return out
        row = own[np.argmin(out.alloc_key[own])]
        if out.ops[out.op[row]] not in lower_ops:
            return out
        start = float(out.alloc_key[row]) - 0.25
    used = np.flatnonzero((out.event_phase == _BACKWARD) & (out.event_module == first))
    free = float(used[-1]) + 0.5 if len(used) else float(forward[-1])
    spans = [(start, free)]
    if lower_ops is not None and len(used) and _inside(out.modules[first], regions):
        # checkpointed: nothing saves the forward's copy (gone after its op); the
        # recompute (the module's first backward rows) casts the input again, and that
        # copy is saved for the module's backward
        again = out.alloc_key[(out.module == first) & (out.phase == _BACKWARD)
                              & (out.alloc_key >= 0)]  # the recompute's rows come first
        spans = [(start, start + 0.5), (float(again.min()) - 0.25, free)]
    sizes, shapes = sizes * len(spans), shapes * len(spans)
    starts = [a for a, _ in spans for _ in range(len(sizes) // len(spans))]
    frees = [b for _, b in spans for _ in range(len(sizes) // len(spans))]
    count = len(sizes)
    if low not in out.dtypes:
        out = out.with_dtype(np.zeros(0, int), low)
    return out.appended({
        "size": np.asarray(sizes), "alloc_key": np.asarray(starts, float),
        "free_key": np.asarray(frees, float),
        "category": np.full(count, CATEGORY_CODE[schema.ACTIVATION], np.int8),
        "dtype": np.full(count, out.dtypes.index(low), np.int16),
        "module": np.full(count, first, np.int32),
        "phase": np.full(count, _FORWARD, np.int8),
        "scales_with_batch": np.ones(count, bool), "shape": np.array(shapes, dtype=object)})


def _inside(path: str, regions) -> bool:
    """``path`` is one of ``regions`` or inside one ('' holds everything).  By the path's
    prefixes, not by region: a model of hundreds of checkpointed blocks asks it per module."""
    regions = regions if isinstance(regions, (set, frozenset)) else frozenset(regions)
    if not regions:
        return False
    if "" in regions or path in regions:
        return True
    parts = path.split(".")
    return any(".".join(parts[:i]) in regions for i in range(1, len(parts)))


def _autocast(timeline: Timeline, low: str, device_type: str,
              module_parameter_bytes: dict[str, int], regions=(),
              module_types: dict[str, str] | None = None) -> Timeline:
    module_types = module_types or {}
    regions = frozenset(regions)
    rules = device_rules(device_type)
    lower_ops, fp32_ops = rules["autocast_lower"], rules["autocast_fp32"]
    forward = np.flatnonzero((timeline.phase == _FORWARD) & (timeline.alloc_key >= 0))
    forward = forward[np.argsort(timeline.alloc_key[forward], kind="stable")]
    is_low = np.zeros(len(timeline), bool)
    floating = timeline.dtype_in(("float32", "float16", "bfloat16"))
    forward = forward[floating[forward]]
    kind_of_op = np.array([2 if op in lower_ops else 1 if op in fp32_ops else
                           3 if op in PASS_THROUGH else 0 for op in timeline.ops] or [0], np.int8)
    # attention's math path computes in fp32 whatever its inputs (no autocast casts there)
    # and hands its result back in its inputs' (16-bit) dtype: kind 4.  A Dropout module's
    # mask and product follow its input: kind 3.  autocast's promote ops (cat, stack) take
    # the widest input: fp32 where the module holds parameters of its own (a class token
    # joined to 16-bit patches), else the input's dtype: kind 5.
    sdpa = _sdpa_math_rows(timeline, device_type)
    dropout = np.array([str(module_types.get(name, "")).startswith("Dropout")
                        for name in timeline.modules] or [False])
    owns = np.array([bool(module_parameter_bytes.get(name, 0)) for name in timeline.modules]
                    or [False])
    promote = np.array([name in _PROMOTE for name in timeline.ops] or [False])
    module, op = timeline.module[forward], timeline.op[forward]
    kinds = np.select([sdpa[forward], dropout[module], promote[op]], [4, 3, 5],
                      kind_of_op[op]).astype(np.int8)
    low_rows = _low_rows_by_flow(timeline, forward, kinds, _low_rows(kinds, owns[module]))
    by_flow = _input_cast_rows_by_flow(timeline, forward, kinds, low_rows) \
        if timeline.reads is not None else None
    casts, fp32_casts, readers = by_flow if by_flow is not None else (
        _input_cast_rows(timeline, forward, kinds, low_rows), [], None)
    is_low[forward] = low_rows
    # backward tensors shaped like a 16-bit forward tensor of the same module
    backward = np.flatnonzero((timeline.phase == _BACKWARD)
                              & timeline.category_mask(schema.TEMPORARY, schema.ACTIVATION))
    if len(backward) and is_low.any():
        low_now = np.flatnonzero(is_low)
        both = np.concatenate([low_now, backward])
        shape_code, _ = pd.factorize(timeline.shape[both])
        keys = timeline.module[both].astype(np.int64) * (int(shape_code.max()) + 1) + shape_code
        is_low[backward[np.isin(keys[len(low_now):], keys[:len(low_now)])]] = True
        is_low |= _sibling_gradients(timeline, is_low, backward)
    is_low &= ~sdpa
    out = _resize_to(timeline, is_low, low)
    if is_low.any():
        raw_low = data_sized_kernel_blocks(timeline, np.flatnonzero(is_low))
        out = out.resized(np.where(raw_low, out.size * DTYPE_BYTES[low] / 4, out.size))
    out = _input_casts(out, timeline, casts, low, readers)
    out = _input_casts(out, timeline, fp32_casts, "float32", readers)

    # autocast weight copies of modules that ran a low-precision op
    modules = np.asarray(timeline.modules, dtype=object)
    ran_low = set(timeline.module[is_low & (timeline.phase == _FORWARD)
                                  & timeline.op_in(lower_ops)].tolist())
    cast_bytes = _weights_cast_by_flow(timeline, forward[kinds == 2])
    rows: dict[str, list] = {k: [] for k in ("size", "alloc_key", "free_key", "module",
                                              "category", "phase")}
    itemsize_ratio = DTYPE_BYTES[low] / 4
    # the first module with parameters reads the script's data, which needs no gradient:
    # its op saves the input for the weight gradient but not the cast weight, so the copy
    # dies with autocast's cache (the forward's end; a recompute's own end)
    forward_events = np.flatnonzero(timeline.event_phase == _FORWARD)
    forward_end = float(forward_events[-1]) + 0.5 if len(forward_events) else 0.0
    first_owner = _first_owner(timeline, module_parameter_bytes)
    grads = np.flatnonzero(timeline.category_mask(schema.GRADIENT) & (timeline.alloc_key >= 0)
                           & (timeline.phase == _BACKWARD) & np.isin(timeline.module, list(ran_low)))
    cast_key = _gradient_casts(timeline, grads)
    # rows of the step only: a gradient alive from the previous step is filed under
    # backward at key -1, and would start the copy before the step
    in_step = (timeline.alloc_key >= 0) & np.isin(timeline.module, list(ran_low))
    fwd_first, fwd_last, _ = _module_key_range(timeline, in_step & (timeline.phase == _FORWARD))
    bwd_first, bwd_last, bwd_count = _module_key_range(
        timeline, in_step & (timeline.phase == _BACKWARD))
    for code in sorted(ran_low):
        path = str(modules[code])
        owned = module_parameter_bytes.get(path, 0) if cast_bytes is None \
            else cast_bytes.get(code, 0)
        if owned <= 0:
            continue
        saved = code != first_owner
        has_bwd = bool(bwd_count[code])
        start = float(fwd_first[code]) - 0.5
        # a saved copy goes with its op's backward node, before that node's weight gradient
        # is cast into the fp32 .grad (the module's first gradient row)
        grads_made = cast_key[timeline.module[grads] == code]
        done = (float(grads_made.min()) - 0.05 if len(grads_made)
                else float(bwd_last[code]) + 0.5 if has_bwd else None)
        end = done if saved and done is not None else max(forward_end,
                                                          float(fwd_last[code]) + 0.5)
        spans = [(start, end)]
        if _inside(path, regions) and has_bwd:
            # checkpointed: nothing saves the copy, autocast's cache dies with the forward;
            # the recompute (the module's first backward rows) casts the weights again
            again = float(bwd_first[code]) - 1e-5
            # the first module's recompute copy lives in autocast's cache until the
            # recompute is done, i.e. through the region's backward (measured:
            # cnn_classifier's first convolution, amp-bf16 with checkpoint=auto)
            spans = [(start, float(fwd_last[code]) + 0.5),
                     (again, end if saved else float(bwd_last[code]) + 0.5)]
        for first, last in spans:
            rows["size"].append(owned * itemsize_ratio)
            rows["alloc_key"].append(first)
            rows["free_key"].append(last)
            rows["module"].append(code)
            rows["category"].append(CATEGORY_CODE[schema.AUTOCAST_WEIGHT])
            rows["phase"].append(_FORWARD)
    if low not in out.dtypes:
        out = out.with_dtype(np.zeros(0, int), low)
    low_code = out.dtypes.index(low)
    if rows["size"]:
        rows["dtype"] = [low_code] * len(rows["size"])
        out = out.appended({k: np.asarray(v) for k, v in rows.items()})
    # the 16-bit gradient of each weight copy, made by its matmul where the fp32 trace
    # made the .grad, and cast into the fp32 .grad once the node is done (_gradient_casts)
    if len(grads):
        alloc_key = out.alloc_key.copy()
        alloc_key[grads] = cast_key
        out = out.retimed(alloc_key, out.free_key)
        out = out.appended({
            "size": timeline.size[grads] * itemsize_ratio,
            "alloc_key": timeline.alloc_key[grads] - 0.25,
            "free_key": cast_key + 0.005,
            "module": timeline.module[grads], "phase": np.full(len(grads), _BACKWARD, np.int8),
            "dtype": np.full(len(grads), low_code, np.int16),
            "shape": timeline.shape[grads]})
    return out


def _weights_cast_by_flow(timeline: Timeline, low_ops: np.ndarray) -> dict[int, float] | None:
    """Per module code: the fp32 bytes of the parameters its low-precision ops read, each
    parameter counted once, for the first module that reads it -- autocast caches one
    16-bit copy per weight for the forward.  Not the module's own parameters: an
    ``nn.MultiheadAttention`` casts its ``out_proj``'s weight too (the child's forward
    never runs), a module reading a tied weight casts it once.  None without data flow."""
    reads = timeline.reads
    if reads is None or not len(low_ops) or not reads.counts()[low_ops].any():
        return None
    weights = timeline.category_mask(schema.PARAMETER) & timeline.dtype_in(("float32",))
    order = low_ops[np.argsort(timeline.alloc_key[low_ops], kind="stable")]
    seen: set[int] = set()
    out: dict[int, float] = {}
    for row in order.tolist():
        for source in reads.of(row).tolist():
            if weights[source] and source not in seen:
                seen.add(source)
                code = int(timeline.module[row])
                out[code] = out.get(code, 0.0) + float(timeline.size[source])
    return out


def _low_rows(kinds: np.ndarray, owns: np.ndarray) -> np.ndarray:
    """Which forward rows (in allocation order) autocast makes 16-bit, by kind: 2 (a
    low-precision op) yes; 0, 1 (kept, fp32 list), 4 (attention's math path) no; 3 (passes
    its input on) and 5 (promote, in a module without parameters of its own) as the row
    before, where a kind-4 row counts as 16-bit; 5 in a module with parameters no."""
    if not len(kinds):
        return np.zeros(0, bool)
    follows = (kinds == 3) | ((kinds == 5) & ~owns)
    hands_on = (kinds == 2) | (kinds == 4)  # what a row that decides tells the next one
    deciding = np.where(follows, -1, np.arange(len(kinds)))
    last = np.maximum.accumulate(deciding)
    before = np.concatenate([[-1], last[:-1]])  # the last deciding row before each row
    inherited = np.where(before >= 0, hands_on[np.maximum(before, 0)], False)
    return np.where(follows, inherited, kinds == 2)


def _low_rows_by_flow(timeline: Timeline, forward: np.ndarray, kinds: np.ndarray,
                      guessed: np.ndarray) -> np.ndarray:
    """``_low_rows`` where the trace records which storages each op read: an op on
    neither autocast list runs in the dtype type promotion gives its floating inputs, as
    autocast leaves it -- a residual add or a ``cat`` of two 16-bit tensors is 16-bit, a
    product with an fp32 parameter (a LayerScale, an RMSNorm's weight) fp32, 0-d tensors
    not counted where a tensor with dimensions is; an op that passes its data on (kind 3:
    activations, dropout, norms outside the lists) takes the dtype of the first floating
    input that is not a parameter or buffer; an op reading no floating tensor (factories,
    an integer mask's ``float()``) keeps its recorded dtype.  Rows whose op's reads were
    not recorded keep the guess (``guessed``: the rule without data flow)."""
    reads = timeline.reads
    if reads is None or not len(forward):
        return guessed
    floating = timeline.dtype_in(("float32", "float16", "bfloat16"))
    scalar = np.asarray(timeline.shape == "", bool)
    weights = timeline.category_mask(schema.PARAMETER, schema.BUFFER)
    norm = timeline.op_in(_NORMS)
    # what a reader of each row sees: 16-bit or not.  Rows outside the step's forward (the
    # script's data, parameters) read as recorded (fp32)
    seen_low = np.zeros(len(timeline), bool)
    counts = reads.counts()
    out = guessed.copy()
    attention = np.array(["attention" in op for op in timeline.ops] or [False])
    op_start = None  # (op, reads, dims) of the first output of the op running
    for index, (row, kind) in enumerate(zip(forward.tolist(), kinds.tolist())):
        group = (int(timeline.op[row]), tuple(reads.of(row).tolist()))
        dims = len(str(timeline.shape[row]).split(",")) if timeline.shape[row] != "" else 0
        if op_start is None or op_start[:2] != group:
            op_start = (*group, dims)
        if kind == 2 and attention[timeline.op[row]] and counts[row] and dims < op_start[2]:
            # an attention kernel's per-row statistics (logsumexp) are fp32 whatever its
            # inputs: fewer dimensions than its output
            out[index] = False
            continue
        if kind == 2 or kind == 4:  # a low-precision op; attention's math path hands back 16-bit
            seen_low[row] = True
            continue
        if kind == 1:
            continue
        if not counts[row]:
            seen_low[row] = out[index]
            continue
        read = reads.of(row)
        read = read[floating[read]]
        if kind == 3:
            read = read[~weights[read]][:1]
            if len(read) and norm[row] and timeline.shape[row] != timeline.shape[read[0]]:
                # a norm's statistics (mean, rstd) are kept in fp32 whatever its input
                out[index] = seen_low[row] = False
                continue
        elif len(read) and not scalar[read].all():
            read = read[~scalar[read]]
        decided = bool(len(read)) and bool(seen_low[read].all())
        out[index] = seen_low[row] = decided
    return out


def _input_cast_rows_by_flow(timeline: Timeline, forward: np.ndarray, kinds: np.ndarray,
                             low_rows: np.ndarray):
    """``_input_cast_rows`` from the recorded data flow: each low-precision op casts every
    fp32 tensor it reads (autocast caches the casts of weights only, so an fp32 input read
    by three Linears -- attention's query, key and value -- is cast three times), and each
    fp32-list op every 16-bit tensor it reads, to fp32 (a GroupNorm after a 16-bit
    convolution on CUDA saves that fp32 copy).  Weights (autocast's weight copies), the
    script's data (``_cast_inputs``) and 0-d tensors are not counted here.

    Returns (casts to 16 bits, casts to fp32, rows read by more than one op) -- a cast's
    source read by another op too stays alive as recorded -- or None where the step's
    low-precision ops have no recorded reads."""
    reads = timeline.reads
    ops = np.flatnonzero((kinds == 2) | (kinds == 1))
    if not len(ops) or not reads.counts()[forward[np.flatnonzero(kinds == 2)]].any():
        return None
    position = np.full(len(timeline), -1, np.int64)
    position[forward] = np.arange(len(forward))
    floating = timeline.dtype_in(("float32",))
    candidate = floating & ~timeline.category_mask(schema.PARAMETER, schema.BUFFER) \
        & (np.asarray(timeline.shape != "", bool)) & (position >= 0)
    to_low, to_fp32, previous = [], [], (None, None)
    # per row: the key of the last forward op reading it, and whether an op that may save
    # it (not a casting consumer, not an add or a cat) reads it
    last_read = np.full(len(timeline), -1.0)
    kept = np.zeros(len(timeline), bool)
    passes_on = timeline.op_in(_SAVE_NOTHING)
    for index, row in enumerate(forward.tolist()):
        read = reads.of(row)
        key = (int(timeline.op[row]), tuple(read.tolist()))
        if key == previous[0] and previous[1] == index - 1:
            previous = (key, index)  # another output of the same op
            continue
        previous = (key, index)
        sources = list(dict.fromkeys(read.tolist()))
        last_read[sources] = timeline.alloc_key[row]
        for source in sources:
            if not candidate[source]:
                continue
            source_low = bool(low_rows[position[source]])
            if kinds[index] == 2 and not source_low:
                to_low.append((source, row))
            elif kinds[index] == 1 and source_low:
                to_fp32.append((source, row))
            elif not passes_on[row]:
                kept[source] = True
    return to_low, to_fp32, (last_read, kept)


def _input_cast_rows(timeline: Timeline, forward: np.ndarray, kinds: np.ndarray,
                     low_rows: np.ndarray) -> list[tuple[int, int]]:
    """(fp32 input row, low-precision op row) per low-precision op fed by an fp32 tensor:
    the tensor the op most likely read is the latest row since the previous low-precision
    op (that op's own row included) with as many positions (all dims but the last) as the
    op's output and a real feature dimension (not a norm's per-position statistics)."""
    ops = np.flatnonzero(kinds == 2)
    if not len(ops):
        return []
    positions, last_dims = _row_positions(timeline, forward)
    codes = np.unique(positions, return_inverse=True)[1].reshape(-1).astype(np.int64)
    count = len(forward)
    candidates = np.flatnonzero(last_dims > 1)
    by_position = np.sort(codes[candidates] * count + candidates)
    # the latest candidate before each op with the op's positions
    found = np.searchsorted(by_position, codes[ops] * count + ops) - 1
    value = by_position[np.maximum(found, 0)] if len(by_position) else np.zeros(len(ops),
                                                                                np.int64)
    latest = value % count
    since = np.concatenate([[0], ops[:-1]])  # the previous low-precision op, or the start
    hit = (found >= 0) & (value // count == codes[ops]) & (latest >= since)
    hit &= ~low_rows[latest]
    return list(zip(forward[latest[hit]].tolist(), forward[ops[hit]].tolist()))


def _module_key_range(timeline: Timeline, mask: np.ndarray):
    """Per module code: the smallest and largest ``alloc_key`` of the rows in ``mask``,
    and how many there are."""
    count = len(timeline.modules) + 1
    rows = np.flatnonzero(mask)
    module, keys = timeline.module[rows], timeline.alloc_key[rows]
    first, last = np.full(count, np.inf), np.full(count, -np.inf)
    np.minimum.at(first, module, keys)
    np.maximum.at(last, module, keys)
    return first, last, np.bincount(module, minlength=count)


def _gradient_casts(timeline: Timeline, grads: np.ndarray) -> np.ndarray:
    """When autocast's 16-bit weight gradients (``grads``: the fp32 trace's .grad rows)
    become fp32 .grad: AccumulateGrad casts them after their backward node is done, i.e.
    after the frees that follow the node's outputs in the fp32 trace (its incoming
    gradient, the activations it saved, the weight copy) and before the next node
    allocates.  The node's own weight and bias gradients keep their order.  In an fp32
    trace the matmul makes the .grad itself: taken at that key, a 16-bit plan's peak
    would hold the .grad beside the saved activations it outlives only in fp32."""
    if not len(grads):
        return np.zeros(0)
    recorded = np.flatnonzero(timeline.alloc_key >= 0)
    keys = timeline.alloc_key[recorded]
    order = np.argsort(keys, kind="stable")
    keys, recorded = keys[order], recorded[order]
    gradient = timeline.category_mask(schema.GRADIENT)
    out = np.empty(len(grads))
    for i, row in enumerate(grads.tolist()):
        key = float(timeline.alloc_key[row])
        out[i] = key + 0.5
        # the first later row that is not one of the node's own gradients (a few rows on)
        start = int(np.searchsorted(keys, key, side="right"))
        while start < len(keys):
            later = recorded[start:start + 64]
            following = np.flatnonzero(~(gradient[later] & (timeline.module[later]
                                                            == timeline.module[row])))
            if len(following):
                out[i] = float(keys[start + following[0]]) - 0.2
                break
            start += 64
    # several gradients cast at one point: in their recorded order
    for point in np.unique(out):
        at = np.flatnonzero(out == point)
        at = at[np.argsort(timeline.alloc_key[grads[at]], kind="stable")]
        out[at] = point + 0.01 * np.arange(len(at))
    return out


def _sibling_gradients(timeline: Timeline, is_low: np.ndarray,
                       backward: np.ndarray) -> np.ndarray:
    """A backward tensor not shaped like anything its own module made in forward is the
    gradient of the module's input, made by a sibling (same parent path): the input of a
    convolution after a pooling layer, the input an in-place ``ReLU`` modified.  It is
    16-bit where the siblings' forward tensors of that shape are all 16-bit (a residual
    stream of the same shape in fp32 leaves it undecided: kept)."""
    out = np.zeros(len(timeline), bool)
    forward = np.flatnonzero((timeline.phase == _FORWARD) & (timeline.alloc_key >= 0)
                             & timeline.dtype_in(("float32", "float16", "bfloat16")))
    # (module, shape) and (parent module, shape) as integers: shapes by code (None: 0)
    shape_codes = pd.factorize(timeline.shape[np.concatenate([forward, backward])])[0] + 1
    shapes = int(shape_codes.max()) + 1 if len(shape_codes) else 1
    forward_shape, backward_shape = shape_codes[:len(forward)], shape_codes[len(forward):]
    module = timeline.module.astype(np.int64)
    own = module[forward] * shapes + forward_shape
    orphan = ~np.isin(module[backward] * shapes + backward_shape, own)
    orphans, orphan_shape = backward[orphan], backward_shape[orphan]
    if not len(orphans):
        return out
    parent = pd.factorize(np.array([name.rpartition(".")[0] for name in timeline.modules]
                                   + [""], dtype=object))[0].astype(np.int64)
    keys, group = np.unique(parent[module[forward]] * shapes + forward_shape,
                            return_inverse=True)
    # a (parent, shape) is 16-bit when every forward tensor of its siblings is
    all_low = np.bincount(group, weights=is_low[forward]) == np.bincount(group)
    wanted = parent[module[orphans]] * shapes + orphan_shape
    at = np.minimum(np.searchsorted(keys, wanted), max(len(keys) - 1, 0))
    known = (keys[at] == wanted) if len(keys) else np.zeros(len(orphans), bool)
    out[orphans[known]] = all_low[at[known]]
    if known.all():
        return out
    first_made = np.full(len(timeline.modules) + 1, np.inf)
    np.minimum.at(first_made, module[forward], timeline.alloc_key[forward])
    # no sibling made that shape: the module's input came from further away (a pooling
    # layer after a nested conv block): the tensor of that shape made last before the
    # module's first forward tensor, whoever made it
    rows = orphans[~known]
    out[rows] = _last_made_low(timeline, forward, forward_shape, is_low,
                               orphan_shape[~known], first_made[module[rows]])
    return out


def _last_made_low(timeline: Timeline, forward: np.ndarray, forward_shape: np.ndarray,
                   is_low: np.ndarray, shapes: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per query (a shape code and a key): whether the forward tensor of that shape made
    last before the key is 16-bit (False where there is none).  By shape group, one
    binary search per query."""
    order = np.lexsort((timeline.alloc_key[forward], forward_shape))
    rows, groups = forward[order], forward_shape[order]
    keys = timeline.alloc_key[rows]
    out = np.zeros(len(shapes), bool)
    for code in np.unique(shapes):
        lo, hi = np.searchsorted(groups, code, "left"), np.searchsorted(groups, code, "right")
        asked = np.flatnonzero(shapes == code)
        before = np.searchsorted(keys[lo:hi], starts[asked], "left") - 1
        found = (before >= 0) & np.isfinite(starts[asked])
        out[asked[found]] = is_low[rows[lo + before[found]]]
    return out


def _positions(shape: str) -> tuple[int, int]:
    dims = [int(d) for d in shape.split(",")] if shape else []
    if not dims:
        return 0, 0
    positions = 1
    for d in dims[:-1]:
        positions *= d
    return positions, dims[-1]


def _row_positions(timeline: Timeline, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, last dimension) of each row's shape, parsed once per distinct shape."""
    inverse, shapes = pd.factorize(timeline.shape[rows])
    parsed = [_positions(str(shape)) for shape in shapes]
    counts = np.array([p[0] for p in parsed] or [0], np.int64)
    lasts = np.array([p[1] for p in parsed] or [0], np.int64)
    return counts[inverse], lasts[inverse]


def _input_casts(out: Timeline, timeline: Timeline, casts: list[tuple[int, int]],
                 low: str, readers=None) -> Timeline:
    """A low-precision op fed by an fp32 tensor saves the 16-bit copy autocast makes of it
    (``low`` the copy's dtype: an fp32-list op fed a 16-bit tensor saves an fp32 copy):
    the copy takes the input's saved lifetime and the input, which only its casts saved,
    dies after the op.  With data flow (``readers``: each row's last forward reader and
    whether a reader that may save it read it) it dies after its last reader, and stays
    as recorded where such a reader read it; without, after the op that cast it (the
    input was allocated by another module just before)."""
    activation = CATEGORY_CODE[schema.ACTIVATION]
    if not casts:
        return out
    inputs = np.array([c[0] for c in casts])
    consumers = np.array([c[1] for c in casts])
    saved = timeline.category[inputs] == activation
    ratio = DTYPE_BYTES[low] / 4
    free_key = out.free_key.copy()
    op_keys = timeline.alloc_key[consumers]
    if readers is None:
        free_key[inputs[saved]] = op_keys[saved] + 0.5
    else:
        last_read, kept = readers
        freed = saved & ~kept[inputs]
        free_key[inputs[freed]] = np.minimum(free_key[inputs[freed]],
                                             last_read[inputs[freed]] + 0.5)
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
