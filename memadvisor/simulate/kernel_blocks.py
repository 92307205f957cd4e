"""Untyped blocks 16-bit kernels allocate for themselves (oneDNN's scratch and reorders on a
CPU target): what an fp32 trace cannot show of a bf16 plan besides its tensors.

* ``matmul_scratch``: one block per bf16 ``mm``/``addmm``, sized by the profiler's probe of
  the Linear (``meta.probes['linear']``) or, for traces without probes, by a formula fitted
  to one CPU's oneDNN blocking (``matmul_scratch_bytes``);
* ``probed_conv_blocks``: a convolution's blocks mapped onto its probe
  (``meta.probes['convolution']``);
* ``data_sized_kernel_blocks``: a backward block the size of a tensor that became 16-bit
  (batch norm's workspace) is 16-bit data too.

Device rules (``hardware.DEVICE_RULES``) say where each applies; the CUDA target has none.
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from .hardware import device_rules
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_FORWARD = PHASE_CODE[schema.FORWARD]
_BACKWARD = PHASE_CODE[schema.BACKWARD]


def dims_of(shape) -> list[int]:
    """A shape string's dimensions ([] for a scalar or a string that is no shape)."""
    try:
        return [int(d) for d in str(shape).split(",")] if shape else []
    except ValueError:
        return []


def matmul_scratch_bytes(rule: dict, rows: int, cols: int, inner: int,
                         weight_gradient: bool) -> tuple[float, float]:
    """(batch-independent, batch-proportional) bytes of the scratch block a 16-bit matmul
    making a ``rows x cols`` output over ``inner`` allocates (``rule``: the target's
    ``matmul_scratch`` device rule).  Forward and input-gradient matmuls: an fp32
    accumulator of ``rows`` x a column block, the packed right operand (``inner`` x a fixed
    width, 16-bit) and a constant; a weight gradient (left operand a transposed view):
    also a 16-bit copy of that operand, over at least ``min_inner`` rows."""
    if weight_gradient:
        block = min(cols, rule["weight_gradient_block"])
        padded = max(inner, rule["min_inner"])
        fixed = rows * block * 4 + rule["weight_gradient_overhead"]
        per_inner = (rows * 2 + rule["packed_bytes_per_inner"]) * padded
        # the inner dimension is the batch rows: it scales unless padded up
        return (fixed, per_inner) if inner > rule["min_inner"] else (fixed + per_inner, 0.0)
    block = next((b for b in rule["accumulator_blocks"] if cols % b == 0), cols)
    return (inner * rule["packed_bytes_per_inner"] + rule["overhead"], rows * block * 4.0)


def probed_matmul_parts(entry: dict, kind: str, low: str) -> tuple[float, float] | None:
    """(batch-independent, batch-proportional) bytes of a Linear's ``kind`` matmul
    ('forward', 'input_gradient', 'weight_gradient') from the profiler's probe at the
    recorded rows and at half of them (``meta.probes['linear']``); None where the probe
    does not say (no ``low`` run, or fp32 made blocks of its own the trace already holds)."""
    sizes, rows = entry.get(low, {}).get(kind), entry.get("rows") or []
    if not sizes or entry.get("float32_blocks", 1) != 0:
        return None
    if len(sizes) < 2 or len(rows) < 2 or rows[0] == rows[1]:
        return float(sizes[0]), 0.0
    proportional = max(0.0, (sizes[0] - sizes[1]) / (rows[0] - rows[1]) * rows[0])
    proportional = min(proportional, float(sizes[0]))
    return float(sizes[0]) - proportional, proportional


def matmul_scratch(out: Timeline, original_rows: int, low: str,
                    device_type: str, probes: dict,
                    recorded_alloc_key: np.ndarray | None = None) -> Timeline:
    """The scratch blocks 16-bit matmuls allocate on targets with a ``matmul_scratch``
    rule (oneDNN's bf16 matmul on CPU: none in an fp32 trace, MKL's fp32 gemm allocates
    none).  Each is a raw block made right after the matmul's output and freed at once.
    Its size is the profiler's probe of that Linear (``meta.probes['linear']``) where the
    trace has one, else the rule's formula (fitted to one CPU's oneDNN blocking): the
    inner dimension from the module's 2-D parameters (a Linear's weight), the rows of a
    weight gradient's inner dimension from the module's forward matmul.
    ``recorded_alloc_key``: the rows' keys before the plan moved any (autocast casts an
    fp32 .grad later than its 16-bit matmul ran)."""
    rule = device_rules(device_type).get("matmul_scratch")
    if not rule or low not in rule["dtypes"]:
        return out
    probed = {e["module"]: e for e in probes.get("linear", ()) if "skipped" not in e}
    rows = np.arange(original_rows)
    candidate = (out.op_in(rule["ops"])[rows] & (out.alloc_key[rows] >= 0)
                 & (out.size[rows] > 0) & np.isin(out.phase[rows], (_FORWARD, _BACKWARD)))
    is_low = out.dtype_in((low,))[rows]
    # under autocast a weight gradient is computed by a 16-bit matmul and only then cast
    # into the fp32 .grad: its row stays fp32, its matmul is a 16-bit one all the same
    low_modules = np.unique(out.module[rows[candidate & is_low
                                            & (out.phase[rows] == _FORWARD)]])
    fp32_gradient = (out.category_mask(schema.GRADIENT)[rows] & ~is_low
                     & np.isin(out.module[rows], low_modules))
    matmul = rows[candidate & (is_low | fp32_gradient)]
    matmul_key = out.alloc_key.copy()
    if recorded_alloc_key is not None:
        matmul_key[:len(recorded_alloc_key)] = recorded_alloc_key
    cast_later = np.zeros(len(out), bool)
    cast_later[rows[candidate & fp32_gradient]] = True
    if not len(matmul):
        return out
    weights: dict[int, list[tuple[int, int]]] = {}
    for row in np.flatnonzero(out.category_mask(schema.PARAMETER)):
        dims = dims_of(out.shape[row])
        if len(dims) == 2:
            weights.setdefault(int(out.module[row]), []).append((dims[0], dims[1]))
    forward_rows: dict[int, tuple[int, bool]] = {}  #: module -> (rows, scales with batch)
    for row in matmul[out.phase[matmul] == _FORWARD]:
        dims = dims_of(out.shape[row])
        if len(dims) == 2:
            forward_rows.setdefault(int(out.module[row]),
                                    (dims[0], bool(out.scales_with_batch[row])))
    gradient = CATEGORY_CODE[schema.GRADIENT]
    add: dict[str, list] = {k: [] for k in ("size", "alloc_key", "free_key", "module",
                                             "phase", "scales_with_batch")}
    for row in matmul:
        dims = dims_of(out.shape[row])
        module = int(out.module[row])
        if len(dims) != 2 or module not in weights:
            continue
        m, n = dims
        own = weights[module]
        if out.phase[row] == _BACKWARD and (out.category[row] == gradient or (
                (m, n) in own and not out.scales_with_batch[row])):
            if module not in forward_rows:
                continue
            inner, batch_rows = forward_rows[module]
            parts = _parts(probed, out.modules[module], "weight_gradient", low) or \
                matmul_scratch_bytes(rule, m, n, inner, True)
            # from just before the gradient: with accumulation a later micro-step's weight
            # gradient is a one-event instance added into .grad, the block meets it there.
            # Under autocast the block belongs to the 16-bit gradient (made at -0.25) and
            # is gone before that is cast into the fp32 .grad
            start = float(matmul_key[row]) - (0.24 if cast_later[row] else 0.3)
            end = float(matmul_key[row]) - 0.1 if cast_later[row] else None
        else:
            start = float(matmul_key[row]) + 0.3
            end = None
            batch_rows = bool(out.scales_with_batch[row])
            if out.phase[row] == _FORWARD:
                inner = next((k for o, k in own if o == n), None)
            else:  # the input's gradient: over the weight's output features
                inner = next((o for o, k in own if k == n), None)
            if inner is None:
                continue
            kind = "forward" if out.phase[row] == _FORWARD else "input_gradient"
            parts = _parts(probed, out.modules[module], kind, low) or \
                matmul_scratch_bytes(rule, m, n, inner, False)
        for nbytes, scaled in zip(parts, (False, True)):
            if nbytes > 0:
                add["size"].append(nbytes)
                add["alloc_key"].append(start)
                add["free_key"].append(float(matmul_key[row]) + 0.4 if end is None
                                       else end)
                add["module"].append(module)
                add["phase"].append(out.phase[row])
                add["scales_with_batch"].append(scaled and batch_rows)
    if not add["size"]:
        return out
    if schema.RAW_BYTES_DTYPE not in out.dtypes:
        out = out.with_dtype(np.zeros(0, int), schema.RAW_BYTES_DTYPE)
    count = len(add["size"])
    return out.appended({**{k: np.asarray(v) for k, v in add.items()},
                         "dtype": np.full(count, out.dtypes.index(schema.RAW_BYTES_DTYPE),
                                          np.int16),
                         "phase": np.asarray(add["phase"], np.int8),
                         "shape": np.array([str(int(x)) for x in add["size"]], dtype=object)})


def _parts(probed: dict, path: str, kind: str, low: str) -> tuple[float, float] | None:
    entry = probed.get(path)
    return probed_matmul_parts(entry, kind, low) if entry else None


def probed_conv_blocks(out: Timeline, low: str, device_type: str, probes: dict,
                       recorded_alloc_key: np.ndarray | None = None) -> Timeline:
    """A convolution's untyped kernel blocks (oneDNN's reorders and scratch, or ATen's
    im2col buffer where oneDNN has no 16-bit kernel for the ISA) as the profiler measured
    the same module in ``low`` on the machine that recorded the trace (``meta.probes``,
    profile/probes.py).

    Where the probe recorded each call's blocks with their lifetimes (``calls``), every
    call's recorded fp32 blocks are replaced by the 16-bit call's, each placed among the
    call's own tensors (output, gradients) as the probe saw it and split into a
    batch-independent and a batch-proportional part by the probe at half the batch
    (``_replace_conv_calls``): the kernel the ISA picks decides how many blocks there are
    and which live together, so nothing is assumed of the fp32 ones.  Older probes (block
    sizes only): the trace's blocks of each call are matched in order with the probe's
    fp32 blocks and each is scaled by the probe's ``low`` / fp32 ratio; blocks only the
    16-bit kernel makes are added after the call's last block.  A module without a probe
    keeps its recorded blocks.  ``recorded_alloc_key``: the keys of the rows the
    convolution made, before the plan moved any (autocast casts an fp32 .grad after its
    16-bit kernel ran); rows past them were added by the plan (casts, weight copies)."""
    if not device_rules(device_type).get("conv_probes"):
        return out
    entries = {e["module"]: e for e in probes.get("convolution", ())
               if low in e.get("raw_bytes", {}) and "float32" in e.get("raw_bytes", {})}
    if not entries:
        return out
    raw = out.dtype_in((schema.RAW_BYTES_DTYPE,))
    conv = [i for i, name in enumerate(out.ops) if "convolution" in name]
    by_direction = {"forward": [i for i in conv if "backward" not in out.ops[i]],
                    "backward": [i for i in conv if "backward" in out.ops[i]]}
    size = out.size.copy()
    extra: dict[str, list] = {k: [] for k in ("size", "alloc_key", "free_key", "module",
                                               "phase", "op", "scales_with_batch")}
    key = out.alloc_key.copy()
    if recorded_alloc_key is not None:
        key[:len(recorded_alloc_key)] = recorded_alloc_key
    recorded_rows = np.arange(len(out)) < len(key if recorded_alloc_key is None
                                               else recorded_alloc_key)
    for path, entry in entries.items():
        if path not in out.modules:
            continue
        code = out.modules.index(path)
        own = out.module == code
        scales = bool((own & np.isin(out.op, by_direction["forward"]) & ~raw
                       & out.scales_with_batch).any())
        for direction, codes in by_direction.items():
            if _replace_conv_calls(out, entry, direction, low,
                                   own & np.isin(out.op, codes) & recorded_rows,
                                   raw, scales, key, size, extra):
                continue
            blocks = entry["raw_bytes"]
            recorded, target = blocks["float32"][direction], blocks[low][direction]
            rows = np.flatnonzero(own & raw & np.isin(out.op, codes))
            count = len(recorded)
            if not count or len(rows) % count:
                continue
            rows = rows[np.argsort(out.alloc_key[rows], kind="stable")]
            matched = min(count, len(target))
            ratio = np.array([t / r if r else 1.0 for t, r in zip(target, recorded)]
                             + [0.0] * (count - matched))  # blocks bf16 does not make
            size[rows] *= np.tile(ratio, len(rows) // count)
            for call in rows.reshape(-1, count):
                last = call[-1]
                for k, nbytes in enumerate(target[matched:]):
                    extra["size"].append(float(nbytes))
                    extra["alloc_key"].append(out.alloc_key[last] + 0.1 * (k + 1))
                    extra["free_key"].append(out.alloc_key[last] + 0.1 * (k + 1) + 0.05)
                    extra["module"].append(out.module[last])
                    extra["phase"].append(out.phase[last])
                    extra["op"].append(out.op[last])
                    extra["scales_with_batch"].append(False)
    out = out.resized(size)
    if not extra["size"]:
        return out
    count = len(extra["size"])
    return out.appended({**{k: np.asarray(v) for k, v in extra.items()},
                         "dtype": np.full(count, out.dtypes.index(schema.RAW_BYTES_DTYPE),
                                          np.int16),
                         "phase": np.asarray(extra["phase"], np.int8),
                         "shape": np.array([str(int(x)) for x in extra["size"]],
                                           dtype=object)})


def conv_blocks_following_batch(timeline: Timeline, probes: dict) -> tuple[np.ndarray,
                                                                           np.ndarray]:
    """(rows, follows): the recorded fp32 convolution blocks whose module's probe ran at
    the recorded batch and at half of it (``calls['float32']``, ``calls['float32-half']``),
    and whether each follows the batch.  Blocks are matched in order within each call (the
    trace's calls must make the probe's blocks, sizes included); a block follows the batch
    when most of it does -- oneDNN's reorders of the data halve with the batch, those of
    the weights and its scratch do not, so on the probed machines each block is one or the
    other.  Calls that do not look like the probe's are left to the size rule."""
    rows_out: list[int] = []
    follows_out: list[bool] = []
    raw = timeline.dtype_in((schema.RAW_BYTES_DTYPE,))
    conv = [i for i, name in enumerate(timeline.ops) if "convolution" in name]
    by_direction = {"forward": [i for i in conv if "backward" not in timeline.ops[i]],
                    "backward": [i for i in conv if "backward" in timeline.ops[i]]}
    for entry in probes.get("convolution", ()):
        calls, batch = entry.get("calls") or {}, entry.get("batch") or {}
        path = entry.get("module")
        if ("float32" not in calls or "float32-half" not in calls or path
                not in timeline.modules or not batch.get("float32")):
            continue
        ratio = batch.get("float32-half", 0) / batch["float32"]
        own = timeline.module == timeline.modules.index(path)
        for direction, codes in by_direction.items():
            full, half = calls["float32"][direction], calls["float32-half"][direction]
            parts = _batch_parts(full, half, ratio)
            sizes = [float(b[0]) for b in full["raw"]]
            per_call = len(full["raw"]) + len(full["typed"])
            rows = np.flatnonzero(own & np.isin(timeline.op, codes)
                                  & (timeline.alloc_key >= 0))
            if not sizes or not len(rows) or len(rows) % per_call:
                continue
            rows = rows[np.argsort(timeline.alloc_key[rows], kind="stable")]
            for call in rows.reshape(-1, per_call):
                mine = call[raw[call]]
                if [float(x) for x in timeline.size[mine]] != sizes:
                    continue
                rows_out += mine.tolist()
                follows_out += [proportional > fixed for fixed, proportional in parts]
    return np.asarray(rows_out, np.int64), np.asarray(follows_out, bool)


def _batch_parts(full: dict, half: dict | None, ratio: float) -> list[tuple[float, float]]:
    """(batch-independent, batch-proportional) bytes of each block of a 16-bit call from
    the probe at the recorded batch and at ``ratio`` of it; all batch-independent where
    the smaller batch's kernel made other blocks (another algorithm: nothing to say)."""
    if not half or ratio >= 1 or [b[1:] for b in half["raw"]] != [b[1:] for b in full["raw"]]:
        return [(float(b[0]), 0.0) for b in full["raw"]]
    parts = []
    for (nbytes, *_), (smaller, *_) in zip(full["raw"], half["raw"]):
        proportional = min(max((nbytes - smaller) / (1 - ratio), 0.0), float(nbytes))
        parts.append((nbytes - proportional, proportional))
    return parts


def _replace_conv_calls(out: Timeline, entry: dict, direction: str, low: str,
                        rows_of_op: np.ndarray, raw: np.ndarray, scales: bool,
                        key: np.ndarray, size: np.ndarray, extra: dict) -> bool:
    """Each recorded call of a module's convolution in ``direction``: its fp32 blocks out
    (``size`` 0), the probe's ``low`` blocks in, their allocations and frees placed
    between the call's own tensors where the probe saw them (a block alive while the
    output is made meets it; one freed before does not).  False where the probe has no
    such record or the trace's calls do not look like the probe's fp32 one."""
    calls = entry.get("calls") or {}
    if low != "bfloat16" or "bfloat16" not in calls or "float32" not in calls:
        return False
    fp32, bf16 = calls["float32"][direction], calls["bfloat16"][direction]
    per_call_raw, per_call = len(fp32["raw"]), len(fp32["raw"]) + len(fp32["typed"])
    rows = np.flatnonzero(rows_of_op & (key >= 0))
    if not per_call or not len(rows) or len(rows) % per_call:
        return False
    rows = rows[np.argsort(key[rows], kind="stable")].reshape(-1, per_call)
    if any(int(raw[call].sum()) != per_call_raw for call in rows):
        return False
    batch = entry.get("batch") or {}
    half = calls.get("bfloat16-half", {}).get(direction)
    ratio = (batch.get("bfloat16-half", 0) / batch["bfloat16"]) if batch.get("bfloat16") \
        else 1.0
    parts = _batch_parts(bf16, half, ratio)
    for call in rows:
        mine_raw, typed = call[raw[call]], call[~raw[call]]
        size[mine_raw] = 0.0
        ends = np.concatenate([key[call], out.free_key[mine_raw]])
        ends = ends[np.isfinite(ends)]
        anchors = [(-1, float(key[call].min()) - 0.5)]
        unused = list(typed)
        for shape, position in bf16["typed"]:
            found = next((r for r in unused if out.shape[r] == shape), None)
            if found is not None and key[found] > anchors[-1][1]:
                unused.remove(found)
                anchors.append((position, float(key[found])))
        anchors.append((bf16["length"], max(float(ends.max()), anchors[-1][1]) + 0.45))
        positions = np.array([a[0] for a in anchors], float)
        keys = np.array([a[1] for a in anchors])
        for (_, alloc_at, free_at), (fixed, proportional) in zip(bf16["raw"], parts):
            start, end = np.interp([alloc_at, free_at], positions, keys)
            for nbytes, scaled in ((fixed, False), (proportional, scales)):
                if nbytes > 0:
                    extra["size"].append(float(nbytes))
                    extra["alloc_key"].append(float(start))
                    extra["free_key"].append(float(end))
                    extra["module"].append(out.module[call[0]])
                    extra["phase"].append(out.phase[call[0]])
                    extra["op"].append(out.op[call[0]])
                    extra["scales_with_batch"].append(scaled)
    return True


#: GPU blocks whose size no dtype changes: the cuBLAS / cuBLASLt workspaces (one per handle
#: and stream, fixed size), and fp32 accumulators (the efficient attention's dQ workspace, a
#: reduction's staging buffer) -- names as profile/kernel_memory.py, attention_workspace.py
#: and reduction_buffers.py write them (a 32 MiB cuBLAS workspace the size of a 16-bit
#: activation was halved by coincidence: Llama amp-bf16 'other' 64 -> 48 MiB)
DTYPE_INDEPENDENT_BLOCKS = frozenset({"cublas_workspace", "cublaslt_workspace",
                                      "efficient_attention_workspace", "reduction_staging"})


def data_sized_kernel_blocks(timeline: Timeline, low_now: np.ndarray) -> np.ndarray:
    """A kernel's untyped backward block as large as one of its module's forward tensors
    that became 16-bit (batch norm's backward workspace) is that tensor's data: 16-bit too.
    Convolutions are left to the probes (``probed_conv_blocks``)."""
    out = np.zeros(len(timeline), bool)
    raw = np.flatnonzero(timeline.dtype_in((schema.RAW_BYTES_DTYPE,))
                         & (timeline.phase == _BACKWARD) & (timeline.size > 0))
    if not len(low_now):
        return out
    conv = np.array(["convolution" in op or op in DTYPE_INDEPENDENT_BLOCKS
                     for op in timeline.ops] or [False])
    raw = raw[~conv[timeline.op[raw]]]
    low_keys = set(zip(timeline.module[low_now].tolist(), timeline.size[low_now].tolist()))
    for row in raw:
        out[row] = (int(timeline.module[row]), float(timeline.size[row])) in low_keys
    out |= saved_inplace_copies(timeline, low_now)
    return out


def saved_inplace_copies(timeline: Timeline, low_now: np.ndarray) -> np.ndarray:
    """A forward raw block autograd keeps for backward is the copy an in-place op makes of
    its input before overwriting it (``silu_``, ``hardswish_``: their backward needs the
    input), taken inside the op, so no tensor names it: it is as large as that input, the
    latest forward tensor of its size made before it, and 16-bit where that one became
    16-bit.  A checkpointed region's recompute (activations made in backward) makes the
    same copies of the tensors it recomputes."""
    out = np.zeros(len(timeline), bool)
    activation = timeline.category_mask(schema.ACTIVATION)
    forward = ((timeline.phase == _FORWARD) | activation) & (timeline.alloc_key >= 0)
    raw = np.flatnonzero(forward & timeline.dtype_in((schema.RAW_BYTES_DTYPE,))
                         & activation & (timeline.size > 0))
    if not len(raw):
        return out
    typed = np.flatnonzero(forward & ~timeline.dtype_in((schema.RAW_BYTES_DTYPE,)))
    is_low = np.zeros(len(timeline), bool)
    is_low[low_now] = True
    for row in raw:
        same = typed[(timeline.size[typed] == timeline.size[row])
                     & (timeline.alloc_key[typed] < timeline.alloc_key[row])]
        if len(same):
            out[row] = is_low[same[np.argmax(timeline.alloc_key[same])]]
    return out
