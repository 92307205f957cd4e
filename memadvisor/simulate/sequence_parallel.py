"""``sp`` per rank: what the sequence split moves at the edges of the split blocks, as
``apply`` realises it (a DTensor redistribute cuts the first block's input, ``full_tensor``
gathers the last block's output, ``ColwiseParallel(input_layouts=Shard(1))`` gathers each
column-parallel Linear's input).  ``tensor_parallel`` divides what the blocks make; this
module adds and re-times the tensors at the edges, each read from the unsplit trace's data
flow (``Timeline.reads``: which rows each op read):

* **the cut**: the first block's input (the embeddings' sum, made whole before the
  blocks) is cut by the block's pre-hook, but the model's forward still holds the whole
  (``h = layer(h)``) until the first block returns; each rank keeps its 1/T part for as
  long as the unsplit run kept the whole (measured: ``aten::clone`` of 1/T saved by the
  first block, the whole freed as the block's forward ends);
* **the gather**: the last block's output is this rank's part, gathered whole for what
  follows (the final norm saves the whole, ``aten::cat``); the part is freed at once;
* **each column-parallel Linear's input** (a norm's output): the Linear gathers it and
  saves the gathered copy (``gathered_inputs``), so the part it read is freed after the
  last gather instead of living until the Linear's backward; likewise the input of an
  attention kept whole (``kept_inputs``), gathered by its hook;

Without data flow in the trace (older formats) only the gathered copies are added.
Measured against ``apply --plan tp=2,world=2,sp --profile`` (docs/APPLY.md).

Pure numpy over the timeline (no torch).
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from .module_paths import inside_any
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_FORWARD, _BACKWARD = PHASE_CODE[schema.FORWARD], PHASE_CODE[schema.BACKWARD]
_TEMPORARY = CATEGORY_CODE[schema.TEMPORARY]
_ACTIVATION = CATEGORY_CODE[schema.ACTIVATION]
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def readers_of(timeline: Timeline) -> tuple[np.ndarray, np.ndarray] | None:
    """(read row, reading row) pairs of the step's data flow, or None without it."""
    reads = timeline.reads
    if reads is None:
        return None
    owner = np.repeat(np.arange(len(timeline)), reads.counts())
    return reads.rows, owner


def edge_changes(timeline: Timeline, stack: list[str], rerouted: np.ndarray, tp: int
                 ) -> tuple[np.ndarray, np.ndarray, dict]:
    """(per-row size factor against the unsplit run, NaN where ``tensor_parallel``'s own
    stands; per-row free key; rows to append) for the cut, the gather and the inputs the
    Linears gather.  ``rerouted``: rows made by ops that read a gathered
    copy under ``sp`` instead of what they read unsplit (the column-parallel Linears' and
    the kept attentions' ops)."""
    factor = np.full(len(timeline), np.nan)
    free_key = timeline.free_key.copy()
    rows = _new_rows()
    flow = readers_of(timeline)
    if flow is None or not stack:
        return factor, free_key, _as_arrays(rows)
    read, reader = flow
    forward = timeline.phase == _FORWARD
    batch_activation = forward & timeline.scales_with_batch & np.isin(
        timeline.category, [_ACTIVATION, _TEMPORARY])
    names = timeline.modules
    starts = {}
    for block in stack:
        inside = inside_any(names, [block])[timeline.module] & forward
        if inside.any():
            starts[block] = (float(timeline.alloc_key[inside].min()),
                             float(timeline.alloc_key[inside].max()), inside)
    if not starts:
        return factor, free_key, _as_arrays(rows)
    first = min(starts, key=lambda b: starts[b][0])
    last = max(starts, key=lambda b: starts[b][0])
    in_stack = inside_any(names, stack)[timeline.module]

    # the cut: made before the first block, read only inside the blocks
    start, first_end = starts[first][0], starts[first][1]
    for row in np.unique(read[in_stack[reader]]):
        if (batch_activation[row] and not in_stack[row] and timeline.alloc_key[row] < start
                and timeline.free_key[row] > start and in_stack[reader[read == row]].all()):
            factor[row] = 1.0 / tp
            _add(rows, timeline.size[row] * (1 - 1.0 / tp), timeline.alloc_key[row],
                 max(first_end, start), _FORWARD, timeline.module[row])

    # the gather: made in the last block, read after it only by what follows the blocks
    made_last = starts[last][2] & batch_activation
    for row in np.flatnonzero(made_last):
        mine = reader[read == row]
        if len(mine) and not in_stack[mine].any():
            factor[row] = 1.0
            _add(rows, timeline.size[row] / tp, timeline.alloc_key[row],
                 timeline.alloc_key[row], _FORWARD, timeline.module[row])

    # what the gathering Linears read: freed after its last read by anything else
    for row in np.unique(read[rerouted[reader] & forward[reader]]):
        if not (batch_activation[row] and in_stack[row]) or rerouted[row]:
            continue
        mine = reader[read == row]
        others = mine[~rerouted[mine]]
        gathers = mine[rerouted[mine] & forward[mine]]
        last_read = max(timeline.alloc_key[np.concatenate([others, gathers])].max(),
                        timeline.alloc_key[row])
        free_key[row] = min(free_key[row], float(last_read) + 0.5)
    return factor, free_key, _as_arrays(rows)


def gathered_inputs(timeline: Timeline, styles: dict[str, str]) -> dict:
    """Each column-parallel Linear all-gathers its sequence-split input and saves the whole
    gathered tensor for its weight gradient, from its forward until its backward is done
    (PyTorch's ColwiseParallel gathers per Linear: q, k and v keep three).  Its size: the
    Linear's input, the block's hidden states -- as big as the row-parallel output of the
    same block."""
    names = np.asarray(timeline.modules, object)
    matmul = timeline.op_in(_MATMUL_OPS)
    rows = {"size": [], "alloc_key": [], "free_key": [], "scales_with_batch": [], "module": []}
    by_block: dict[str, tuple[float, bool]] = {}
    for path, style in styles.items():
        if style != "rowwise":
            continue
        code = np.flatnonzero(names == path)
        mine = np.isin(timeline.module, code) & (timeline.phase == _FORWARD) & matmul
        outputs = np.flatnonzero(mine)
        if len(outputs):
            by_block[path.rpartition(".")[0]] = (float(timeline.size[outputs[0]]),
                                                 bool(timeline.scales_with_batch[outputs[0]]))
    for path, style in styles.items():
        block = path.rpartition(".")[0]
        if style != "colwise" or block not in by_block:
            continue
        code = np.flatnonzero(names == path)
        mine = np.isin(timeline.module, code)
        forward = np.flatnonzero(mine & (timeline.phase == _FORWARD))
        backward = np.flatnonzero(mine & (timeline.phase == _BACKWARD))
        if not len(forward):
            continue
        size, scaled = by_block[block]
        rows["size"].append(size)
        rows["module"].append(int(timeline.module[forward[0]]))  # the Linear
        rows["alloc_key"].append(float(timeline.alloc_key[forward].min()) - 0.5)
        rows["free_key"].append(float(timeline.alloc_key[backward].max()) + 0.5
                                if len(backward) else float(timeline.free_key[forward].max()))
        rows["scales_with_batch"].append(scaled)
    return activation_rows(rows)


def kept_inputs(timeline: Timeline, kept: list[str]) -> dict:
    """A block left whole (fused-qkv attention) gets its input gathered to the whole
    sequence, which its first Linear saves until its backward; as big as the block's
    output (its last matmul in forward)."""
    names = np.asarray(timeline.modules, object)
    matmul = timeline.op_in(_MATMUL_OPS)
    rows = {"size": [], "alloc_key": [], "free_key": [], "scales_with_batch": [], "module": []}
    for path in kept:
        codes = np.flatnonzero(inside_any(names, [path]))
        mine = np.isin(timeline.module, codes)
        forward = np.flatnonzero(mine & (timeline.phase == _FORWARD))
        backward = np.flatnonzero(mine & (timeline.phase == _BACKWARD))
        outputs = forward[matmul[forward]]
        if not len(outputs):
            continue
        last = outputs[np.argmax(timeline.alloc_key[outputs])]
        rows["size"].append(float(timeline.size[last]))
        rows["module"].append(int(timeline.module[forward[0]]))
        rows["alloc_key"].append(float(timeline.alloc_key[forward].min()) - 0.5)
        rows["free_key"].append(float(timeline.alloc_key[backward].max()) + 0.5
                                if len(backward) else float(timeline.free_key[forward].max()))
        rows["scales_with_batch"].append(bool(timeline.scales_with_batch[last]))
    return activation_rows(rows)


def activation_rows(rows: dict) -> dict:
    """Lists of sizes, keys and batch flags as the forward activation rows to append."""
    count = len(rows["size"])
    return {"size": np.array(rows["size"]), "alloc_key": np.array(rows["alloc_key"]),
            "free_key": np.array(rows["free_key"]),
            "category": np.full(count, _ACTIVATION, np.int8),
            "phase": np.full(count, _FORWARD, np.int8),
            "module": np.array(rows["module"], np.int32),
            "scales_with_batch": np.array(rows["scales_with_batch"], bool)}


def _new_rows() -> dict:
    return {"size": [], "alloc_key": [], "free_key": [], "phase": [], "module": []}


def _add(rows: dict, size: float, first_key: float, last_key: float, phase: int,
         module: int) -> None:
    rows["module"].append(int(module))
    rows["size"].append(float(size))
    rows["alloc_key"].append(float(first_key) - 0.5)
    rows["free_key"].append(float(last_key) + 0.5)
    rows["phase"].append(phase)


def _as_arrays(rows: dict) -> dict:
    count = len(rows["size"])
    return {"size": np.array(rows["size"], float),
            "alloc_key": np.array(rows["alloc_key"], float),
            "free_key": np.array(rows["free_key"], float),
            "category": np.full(count, _TEMPORARY, np.int8),
            "phase": np.array(rows["phase"], np.int8),
            "module": np.array(rows["module"], np.int32),
            "scales_with_batch": np.ones(count, bool)}
