"""``tp=T`` on the token embedding and the LM head, per rank, as ``apply`` splits them along
the vocabulary (``plan.tensor_parallel_vocabulary`` finds both, for apply too):

* the embedding's weight (``RowwiseParallel``: V/T rows) and the head's (``ColwiseParallel``:
  V/T output rows, and its bias) -- parameters, gradients, optimizer state and the weight-
  gradient temporaries their backward makes (the rows that do not scale with the batch) --
  are divided by T; a weight tied between them is one tensor, divided once;
* the embedding's output is whole on every rank (its partial lookups all-reduced); the
  local lookup is a transient copy beside it (measured: ``aten::embedding`` freed right
  after ``all_reduce``);
* the head's logits are whole on every rank (``output_layouts=Replicate()``: the script
  computes its loss on them); while they are gathered the local V/T logits and the
  all-gather's own output (T x V/T, concatenated into the logits by ``aten::cat``) are
  alive beside them: V + V/T more at the head's forward;
* in backward the head takes its V/T columns of the logits' gradient as a copy (alive
  over its weight- and input-gradient matmuls); its input gradient is a partial sum,
  all-reduced as every column-parallel Linear's (``tensor_parallel``'s whole partials).

Communication per micro-step: the embedding's output all-reduced, the logits all-gathered
(a ring sends (T-1)/T of them), the head's input gradient all-reduced.

Pure numpy over the timeline (no torch).
"""
from __future__ import annotations

import numpy as np

from ..plan import TensorParallelVocabulary
from ..trace import schema
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_FORWARD, _BACKWARD = PHASE_CODE[schema.FORWARD], PHASE_CODE[schema.BACKWARD]
_GRADIENT, _TEMPORARY = CATEGORY_CODE[schema.GRADIENT], CATEGORY_CODE[schema.TEMPORARY]
_ACTIVATION = CATEGORY_CODE[schema.ACTIVATION]


def vocabulary_rows(timeline: Timeline, vocabulary: TensorParallelVocabulary) -> np.ndarray:
    """Rows divided by T: the embedding's and the head's gradients and, in their backward,
    what does not scale with the batch (the weight gradient's pieces, summed into the
    gradient of a tied weight)."""
    codes = _codes(timeline, vocabulary)
    mine = np.isin(timeline.module, codes)
    weight_like = (timeline.phase == _BACKWARD) & np.isin(
        timeline.category, [_ACTIVATION, _TEMPORARY]) & ~timeline.scales_with_batch
    return mine & ((timeline.category == _GRADIENT) | weight_like)


def transient_rows(timeline: Timeline, vocabulary: TensorParallelVocabulary, tp: int,
                   held_until=lambda key: None) -> tuple[dict, dict]:
    """The copies the split adds (rows to append) and the bytes each collective moves
    ({"all_reduce_forward": ..., "all_gather_forward": ...}).  ``held_until(key)``: where
    a backend's worker thread frees what the collective at ``key`` used, None: at once."""
    rows = {"size": [], "alloc_key": [], "free_key": [], "phase": [],
            "scales_with_batch": [], "module": []}
    volume = {"all_reduce_forward": 0.0, "all_gather_forward": 0.0}
    embedding = _output(timeline, vocabulary.embedding, _FORWARD)
    if embedding is not None:  # the local lookup, beside its all-reduced sum
        size = float(timeline.size[embedding])
        _add(rows, size, timeline.alloc_key[embedding], timeline.alloc_key[embedding],
             _FORWARD, timeline.module[embedding])
        volume["all_reduce_forward"] += size
    logits = _output(timeline, vocabulary.head, _FORWARD)
    if logits is not None:
        size = float(timeline.size[logits])
        key = float(timeline.alloc_key[logits])
        later = held_until(key)  # _add frees half a key after its last key
        end = later - 0.5 if later is not None and later > key + 0.5 else key
        head = timeline.module[logits]
        _add(rows, size / tp, key, end, _FORWARD, head)  # the local logits
        _add(rows, size, key, end, _FORWARD, head)  # the all-gather's output, before the cat
        volume["all_gather_forward"] += size
        backward = _rows(timeline, vocabulary.head, _BACKWARD)
        flowing = backward[timeline.category[backward] != _GRADIENT]
        if len(flowing):  # this rank's columns of the logits' gradient, over its matmuls
            # (not to the gradient's own key: FSDP moves that to its reduce-scatter)
            _add(rows, size / tp, timeline.alloc_key[backward].min(),
                 timeline.alloc_key[flowing].max(), _BACKWARD, head)
    count = len(rows["size"])
    out = {name: np.array(values) for name, values in rows.items()}
    out["scales_with_batch"] = out["scales_with_batch"].astype(bool)
    out["category"] = np.full(count, _TEMPORARY, np.int8)
    out["phase"] = out["phase"].astype(np.int8)
    out["module"] = out["module"].astype(np.int32)
    return out, volume


def _add(rows: dict, size: float, first_key: float, last_key: float, phase: int,
         module: int) -> None:
    rows["module"].append(int(module))
    rows["size"].append(size)
    rows["alloc_key"].append(float(first_key) - 0.5)
    rows["free_key"].append(float(last_key) + 0.5)
    rows["phase"].append(phase)
    rows["scales_with_batch"].append(True)


def _codes(timeline: Timeline, vocabulary: TensorParallelVocabulary) -> np.ndarray:
    paths = {p for p in (vocabulary.embedding, vocabulary.head) if p is not None}
    return np.array([code for code, name in enumerate(timeline.modules) if name in paths],
                    np.int64)


def _rows(timeline: Timeline, path: str | None, phase: int) -> np.ndarray:
    if path is None or path not in timeline.modules:
        return np.zeros(0, np.int64)
    code = timeline.modules.index(path)
    return np.flatnonzero((timeline.module == code) & (timeline.phase == phase)
                          & (timeline.alloc_key >= 0))


def _output(timeline: Timeline, path: str | None, phase: int) -> int | None:
    """The module's output in this step: its largest batch-sized row (the lookup, the
    logits)."""
    rows = _rows(timeline, path, phase)
    rows = rows[timeline.scales_with_batch[rows]]
    if not len(rows):
        return None
    return int(rows[np.argmax(timeline.size[rows])])
