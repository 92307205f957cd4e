"""``tp=T`` (and ``sp``) per rank, as ``apply`` realises it with ``parallelize_module``.

The blocks split are ``plan.tensor_parallel_blocks`` of the trace's module tree (the same
function apply uses): in each, the column-parallel Linears (q/k/v, MLP up and gate) hold
1/T of their rows and the row-parallel one (attention output, MLP down) 1/T of its
columns.  Per rank, on the one micro-step timeline (after the batch split):

* parameters, gradients and optimizer state of the split Linears (weights; biases of the
  column-parallel ones -- a row-parallel bias is replicated) are divided by T.  Gradient
  rows carry their Linear's path; parameter and optimizer-state rows do not, so they are
  divided by size: of the tensors of one byte size, the share that are split tensors;
* activations and temporaries made inside a split block (its Linears' outputs, attention
  scores, the MLP hidden) are divided by T, except the two kinds of tensor that stay
  whole: the row-parallel Linear's output (each rank's partial sum of the whole output)
  and, in backward, a column-parallel Linear's input gradient (likewise partial);
* each of those partial sums is all-reduced by a functional collective into a new tensor:
  one transient copy of it exists beside the original (measured in the traces of
  ``apply --plan tp=2 --profile``: the partial is freed right after the all-reduce);
* the token embedding and the LM head are split along the vocabulary
  (``tensor_parallel_vocabulary``: their weights divided, their outputs whole with the
  gather's and the all-reduce's transient copies);
* everything else (norms, residual stream, attention kept whole) is replicated: every
  rank of the group holds it whole;
* ``sp``: activations and temporaries of the blocks' other modules (norms, residual adds)
  are divided by T too, so are the partial sums' results (reduce-scattered); each
  column-parallel Linear keeps a whole copy of its gathered input for its backward
  (PyTorch's ColwiseParallel gathers per Linear); a block left whole keeps its gathered
  input too.  Against ``apply --profile``: +2.8% / +5.7% (llama_decoder, rank 0 / 1; gloo
  frees one all-gather output late on one rank) and +3.6% (gpt_lm); since apply drains
  gloo (apply/gloo_release.py) every run measures the prompt figure, predicted to -0.00%
  on both ranks of both (tp=2 and tp=2,sp, 5 runs each, 2026-11-26).

Communication (for the step time): per micro-step, one all-reduce of each row-parallel
output in forward and of each column-parallel input gradient in backward (PyTorch's
ColwiseParallel all-reduces each such Linear's input gradient on its own: q, k and v make
three); a ring all-reduce sends 2(T-1)/T of the bytes.  It is on the critical path.

Pure numpy over the timeline (no torch).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..plan import Plan, module_entries, tensor_parallel_blocks, tensor_parallel_vocabulary
from ..trace import schema
from .module_paths import inside_any
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline
from .sequence_parallel import edge_changes, gathered_inputs, kept_inputs
from .tensor_parallel_flow import split_by_data_flow
from .tensor_parallel_vocabulary import transient_rows, vocabulary_rows

_FORWARD, _BACKWARD = PHASE_CODE[schema.FORWARD], PHASE_CODE[schema.BACKWARD]
_OPTIMIZER = PHASE_CODE[schema.OPTIMIZER]
_GRADIENT, _PARAMETER = CATEGORY_CODE[schema.GRADIENT], CATEGORY_CODE[schema.PARAMETER]
_STATE, _TEMPORARY = CATEGORY_CODE[schema.OPTIMIZER_STATE], CATEGORY_CODE[schema.TEMPORARY]
_ACTIVATION = CATEGORY_CODE[schema.ACTIVATION]
#: ops whose output is a matmul's (the partial sums; a DTensor's bookkeeping makes bytes-size
#: side tensors in the same module that are not)
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def apply_tensor_parallel(timeline: Timeline, plan: Plan, modules,
                          copies: dict | None = None) -> tuple[Timeline, dict]:
    """The per-rank timeline under ``plan.tp`` and notes (what was split, the bytes each
    rank all-reduces per micro-step).  ``copies['held_until_next']`` (gloo on a group
    ``apply`` did not make; apply drains its own, apply/gloo_release.py): an all-gather's
    input and output outlive it until the rank's next collective (``held_until``)."""
    if plan.tp < 2:
        return timeline, {}
    tp = plan.tp
    blocks = tensor_parallel_blocks(modules)
    vocabulary = tensor_parallel_vocabulary(modules, blocks)
    styles = blocks.linear_styles()
    if vocabulary.head is not None:
        styles[vocabulary.head] = "colwise"
    regions = list(blocks.attention) + list(blocks.mlp)
    notes = {"tensor_parallel": {"attention_blocks": len(blocks.attention),
                                 "mlp_blocks": len(blocks.mlp),
                                 "kept_replicated": dict(blocks.kept),
                                 "vocabulary_split": [p for p in (vocabulary.embedding,
                                                                  vocabulary.head) if p],
                                 "vocabulary_tied": vocabulary.tied}}
    if not regions:
        notes["tensor_parallel"]["problem"] = "no attention or MLP block to split"
        return timeline, notes

    names = timeline.modules
    in_region = inside_any(names, regions)[timeline.module]
    colwise = np.array([styles.get(m) == "colwise" for m in names], bool)[timeline.module]
    rowwise = np.array([styles.get(m) == "rowwise" for m in names], bool)[timeline.module]
    matmul = timeline.op_in(_MATMUL_OPS)
    category, phase = timeline.category, timeline.phase
    flowing = np.isin(category, [_ACTIVATION, _TEMPORARY]) & np.isin(phase, [_FORWARD, _BACKWARD])

    split_vocabulary = vocabulary_rows(timeline, vocabulary)
    split_gradients = _split_gradient_rows(timeline, styles) | (
        split_vocabulary & (category == _GRADIENT))
    whole_partials = flowing & matmul & ~split_vocabulary & (
        ((phase == _FORWARD) & rowwise) | ((phase == _BACKWARD) & colwise))
    # of a block's tensors, those computed from a split Linear's output (forward) or input
    # gradient (backward) up to the partial sums; the block's path where no data flow
    sources = flowing & in_region & matmul & ~split_vocabulary & (
        ((phase == _FORWARD) & colwise) | ((phase == _BACKWARD) & rowwise))
    split_flowing = flowing & in_region & ~whole_partials
    by_flow = split_by_data_flow(timeline, split_flowing, sources)
    if by_flow is not None:
        split_flowing = by_flow
    free_key = timeline.free_key.copy()
    views, free_key = _repeat_views(timeline, blocks, modules, tp, free_key)
    split_flowing &= ~views
    edges = None
    if plan.sp:
        stack = sorted({r.rpartition(".")[0] for r in regions})
        in_stack = inside_any(names, stack)[timeline.module]
        kept = list(blocks.kept)
        in_kept = inside_any(names, kept)[timeline.module] \
            if kept else np.zeros(len(timeline), bool)
        split_flowing |= flowing & in_stack & ~in_region & ~in_kept & timeline.scales_with_batch
        # the all-reduce becomes a reduce-scatter: what the block hands on is this rank's
        # part of the sequence (its partial sum is the transient copy added below)
        split_flowing |= whole_partials
        block_linears = colwise & inside_any(names, stack)[timeline.module]
        edges = edge_changes(timeline, stack, (block_linears & in_region) | in_kept, tp)
    factor = np.ones(len(timeline))
    factor[split_gradients | split_flowing | split_vocabulary] = 1.0 / tp
    factor *= _state_factors(timeline, split_gradients, tp)
    if edges is not None:
        override, edge_free_key, _ = edges
        factor = np.where(np.isnan(override), factor, override)
        # the edges only shorten (a norm's output), the repeat views only lengthen
        free_key = np.where(edge_free_key < timeline.free_key, edge_free_key, free_key)
    factor[views] = 0.0
    out = timeline
    if (free_key != timeline.free_key).any():
        out = out.retimed(timeline.alloc_key, free_key)
    out = out.resized(timeline.size * factor)

    partial = np.flatnonzero(whole_partials & (timeline.size > 0))
    forward_bytes = float(timeline.size[partial[phase[partial] == _FORWARD]].sum())
    backward_bytes = float(timeline.size[partial[phase[partial] == _BACKWARD]].sum())
    added = {"size": timeline.size[partial], "alloc_key": timeline.alloc_key[partial] - 0.5,
             "free_key": timeline.alloc_key[partial] + 0.5,
             "category": np.full(len(partial), _TEMPORARY, np.int8),
             "dtype": timeline.dtype[partial], "module": timeline.module[partial],
             "phase": phase[partial], "op": timeline.op[partial],
             "scales_with_batch": timeline.scales_with_batch[partial],
             "shape": timeline.shape[partial]}
    out = out.appended(added)
    collectives = _collective_keys(timeline, partial, vocabulary, styles, plan.sp)
    held = bool((copies or {}).get("held_until_next"))
    vocabulary_added, vocabulary_bytes = transient_rows(
        timeline, vocabulary, tp, lambda key: held_until(collectives, key) if held else None)
    out = out.appended(vocabulary_added)
    forward_bytes += vocabulary_bytes["all_reduce_forward"]
    if edges is not None:
        out = out.appended(edges[2])
        out = out.appended(gathered_inputs(timeline, styles))
        out = out.appended(kept_inputs(timeline, list(blocks.kept)))
    ring = 2 * (tp - 1) / tp
    notes["tensor_parallel"].update({
        "split_linear_count": len(styles),
        "all_reduce_bytes_forward": forward_bytes,
        "all_reduce_bytes_backward": backward_bytes,
        "all_gather_bytes_forward": vocabulary_bytes["all_gather_forward"],
        "communication_bytes_per_micro_step": ring * (forward_bytes + backward_bytes)
        + (tp - 1) / tp * vocabulary_bytes["all_gather_forward"],
        # what a rank's data-parallel collectives carry of the model's gradients
        "gradient_share": _split_share(timeline, category == _GRADIENT, factor),
        "sequence_parallel": plan.sp})
    return out, notes


def _split_share(timeline: Timeline, rows: np.ndarray, factor: np.ndarray) -> float:
    """The share of ``rows``' bytes a rank keeps after the split (1.0 without rows)."""
    total = float(timeline.size[rows].sum())
    return float((timeline.size[rows] * factor[rows]).sum()) / total if total > 0 else 1.0


def _split_gradient_rows(timeline: Timeline, styles: dict[str, str]) -> np.ndarray:
    """Gradient rows of split tensors: every gradient of a column-parallel Linear; of a
    row-parallel one its weight's (its largest), not its replicated bias'."""
    names = timeline.modules
    style = np.array([styles.get(m, "") for m in names], object)[timeline.module]
    gradient = timeline.category == _GRADIENT
    split = gradient & (style == "colwise")
    rows = np.flatnonzero(gradient & (style == "rowwise"))
    if len(rows):
        largest: dict[int, float] = {}
        for row in rows:
            code = int(timeline.module[row])
            largest[code] = max(largest.get(code, 0.0), float(timeline.size[row]))
        for row in rows:
            if timeline.size[row] == largest[int(timeline.module[row])]:
                split[row] = True
    return split


def _state_factors(timeline: Timeline, split_gradients: np.ndarray, tp: int) -> np.ndarray:
    """Per row: the factor for parameter and optimizer-state rows (and the optimizer's
    per-parameter temporaries) of each byte size: of the gradients of that size, the share
    that are split tensors' (their parameters carry no module path)."""
    gradient = timeline.category == _GRADIENT
    # one gradient per parameter: the step's own (made in backward), else those alive
    current = gradient & (timeline.alloc_key >= 0)
    pool = current if current.any() else gradient
    every = Counter(timeline.size[pool].tolist())
    split = Counter(timeline.size[pool & split_gradients].tolist())
    share = {size: split[size] / count for size, count in every.items() if split[size]}
    factors = np.ones(len(timeline))
    if not share:
        return factors
    state_like = np.isin(timeline.category, [_PARAMETER, _STATE]) | (
        (timeline.phase == _OPTIMIZER) & (timeline.category == _TEMPORARY))
    for size, fraction in share.items():
        rows = state_like & (timeline.size == size)
        factors[rows] = 1.0 - fraction * (1.0 - 1.0 / tp)
    return factors


def _repeat_views(timeline: Timeline, blocks, modules, tp: int, free_key: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Grouped-query attention repeats each K/V head n_rep times with ``expand`` then
    ``reshape`` (Llama's ``repeat_kv``, HF's ``repeat_kv``): a copy, of shape (..., n_kv,
    n_rep, ...) in the trace, unless one K/V head is left: then the expanded dimension
    merges with a dimension of size 1 and the reshape is a view (measured: llama_decoder
    tp=2, 2 K/V heads, no ``aten::clone`` in the split run; the repeated K/V then are the
    rotary output and the value projection, saved in the copy's place).  Returns (rows that
    vanish, free keys with their sources kept until the copy's free)."""
    views = np.zeros(len(timeline), bool)
    reads = timeline.reads
    if reads is None or not blocks.attention:
        return views, free_key
    counts = {m.path: m.total_parameter_count for m in module_entries(modules)}
    clone = timeline.op_in(("aten::clone",)) & (timeline.phase == _FORWARD)
    names = timeline.modules
    for path, roles in blocks.attention.items():
        query, key = (f"{path}.{n}" if path else n for n in roles["up"][:2])
        if not counts.get(key) or counts[query] % counts[key]:
            continue
        repeats = counts[query] // counts[key]
        if repeats < 2 or path not in names:
            continue
        for row in np.flatnonzero(clone & (timeline.module == names.index(path))):
            dims = [int(d) for d in str(timeline.shape[row]).split(",") if d.strip().isdigit()]
            if not any(h == tp and r == repeats for h, r in zip(dims, dims[1:])):
                continue
            views[row] = True
            for source in reads.of(row):
                free_key[source] = max(free_key[source], timeline.free_key[row])
    return views, free_key


def _collective_keys(timeline: Timeline, partial: np.ndarray, vocabulary, styles: dict,
                     sequence_parallel: bool) -> np.ndarray:
    """Where on the step's key axis each tensor-parallel collective runs: after each
    partial sum (all-reduce), the embedding's lookup (all-reduce), the head's logits
    (all-gather) and, with ``sp``, at each column-parallel Linear's first op (all-gather)."""
    keys = [timeline.alloc_key[partial]]
    for path in (vocabulary.embedding, vocabulary.head):
        if path is not None and path in timeline.modules:
            mine = (timeline.module == timeline.modules.index(path)) & (
                timeline.phase == _FORWARD) & timeline.scales_with_batch
            keys.append(timeline.alloc_key[mine][-1:] if mine.any() else np.zeros(0))
    if sequence_parallel:
        names = timeline.modules
        for path, style in styles.items():
            if style == "colwise" and path in names:
                mine = (timeline.module == names.index(path)) & (timeline.phase == _FORWARD)
                if mine.any():
                    keys.append(np.array([timeline.alloc_key[mine].min()]))
    out = np.sort(np.concatenate(keys)) if keys else np.zeros(0)
    return out[out >= 0]


def held_until(collective_keys: np.ndarray, key: float) -> float | None:
    """gloo without apply's drain: what a collective at ``key`` used is freed by its
    worker thread, which can stay unscheduled until the rank's next collective (measured:
    gpt_lm ``tp=2`` rank 0 frees the head's gathered logits after the backward's first
    all-reduce, rank 1 at once).  Just after that next collective's copy is made; None
    where no collective follows in the step."""
    at = int(np.searchsorted(collective_keys, key, side="right"))
    return float(collective_keys[at]) + 0.75 if at < len(collective_keys) else None


def communication_seconds(notes: dict, accum: int, link_bytes_s: float) -> float:
    """Time of the tensor-parallel all-reduces per optimizer step (not overlapped: each
    block waits for its output)."""
    volume = notes.get("tensor_parallel", {}).get("communication_bytes_per_micro_step", 0.0)
    return volume * accum / link_bytes_s if link_bytes_s > 0 else 0.0
