"""Which storages scale with the batch, and resizing a timeline to a micro-batch.

Rule (from shapes, one profile): a storage made in forward or backward whose category is
activation, temporary, other or autocast weight scales with the batch when its *first*
dimension is

* the batch size ``B`` recorded in ``meta.batch['batch_size']``, or
* ``B`` times the product of the dimensions before and after it in a batch tensor,
  flattened from the front (a (B, T) token batch makes (B*T, C) activations, a
  sequence-first (T, B) one makes (T*B, C)), or
* it holds the dimensions before the batch dimension of a batch tensor
  (``meta.batch['batch_dims']``) followed by ``B``: the (T, B, C) activations of a
  sequence-first batch (T, B), attention's stacked (3, T, B, C) projections, the
  (layers, B, H) states of an RNN fed (layers, B, H); for a batch-first sequence (B, T)
  or (B, T, F), its length followed by ``B`` (``nn.MultiheadAttention`` works on
  (T, B, E) inside whatever the layout outside), or
* another multiple of ``B`` (B*heads, ...) in a tensor of two or more dimensions *and*
  the shape is not a parameter's shape
  (so weight-shaped temporaries of backward, e.g. an embedding's dense gradient, stay);
* its first dimension is a count a value-counting op made in forward (``nonzero``: the
  tokens a mixture-of-experts router sends to one expert), and the shape is not a
  parameter's;
* a shape that is both (a) and a parameter's ((B*T, C) where the vocabulary is B*T) scales
  unless the row ends where a gradient of that shape is made from it (a tied weight's
  gradient from one of its uses, an embedding's dense gradient);
* a kernel's raw block (dtype ``bytes``, no shape) scales when its byte size equals that of
  a batch-scaled tensor of the same module (a convolution backward's im2col buffer);
* a recurrent module's workspace saved for backward (a flat uint8 buffer whose length is
  a multiple of ``B``: oneDNN's LSTM, cuDNN's reserve space) scales; its kernel's raw
  scratch blocks are left as recorded (some follow the batch, some do not: only a probe
  at another batch size could tell, as for convolutions).

A storage resized in place (op ``UntypedStorage.resize_``: FSDP's unsharded parameters in
a trace profiled under FSDP) records its byte count as its shape and is never scaled by
shape.

The script's input batch does not scale: ``apply`` hands each rank and micro-step a slice
(a view) of the batch the script loaded, whose storage stays whole.

Limits: with ``B == 1`` every first dimension is a multiple of B, so only the first two
rules apply; a sequence-first activation whose length is no batch tensor's (a decoder
that changes the length) is not scaled; sizes
that depend on the batch non-linearly (attention over a packed batch) are treated as
linear.  A second profile at another batch size settles all of these (not yet used).
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from .kernel_blocks import conv_blocks_following_batch
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

_SCALING_CATEGORIES = tuple(CATEGORY_CODE[c] for c in (
    schema.ACTIVATION, schema.TEMPORARY, schema.OTHER, schema.AUTOCAST_WEIGHT))
_SCALING_PHASES = (PHASE_CODE[schema.FORWARD], PHASE_CODE[schema.BACKWARD])
RESIZE_OP = "UntypedStorage.resize_"  #: the profiler's op for a storage resized in place


def batch_multiples(batch: dict) -> set[int]:
    """``B`` and the sizes a batch tensor's batch becomes flattened with its neighbours."""
    size = int(batch.get("batch_size") or 0)
    if size <= 0:
        return set()
    out = {size}
    for shape, dim in zip(batch.get("shapes") or [], schema.batch_dims_of(batch)):
        if dim is None or dim >= len(shape) or int(shape[dim]) != size:
            continue
        product = 1
        for index, extent in enumerate(shape):
            product *= int(extent)
            if index >= dim:
                out.add(product)
    return out


def batch_prefixes(batch: dict) -> set[tuple[int, ...]]:
    """The dimensions before the batch dimension of each batch tensor not batch-first, and
    the length of each batch-first sequence ((B, T) or (B, T, F)): modules lay such a
    batch out sequence-first inside (``nn.MultiheadAttention`` computes on (T, B, E) and
    stacks (3, T, B, E) projections; an RNN without ``batch_first``)."""
    size = int(batch.get("batch_size") or 0)
    out = set()
    for shape, dim in zip(batch.get("shapes") or [], schema.batch_dims_of(batch)):
        if dim is None or dim >= len(shape) or int(shape[dim]) != size:
            continue
        if dim:
            out.add(tuple(int(d) for d in shape[:dim]))
        elif 2 <= len(shape) <= 3 and int(shape[1]) > 1:
            out.add((int(shape[1]),))
    return out


def _after_prefix(shapes: np.ndarray, prefixes: set[tuple[int, ...]], size: int) -> np.ndarray:
    """Shapes (strings) holding a prefix followed by the batch size: (T, B, ...), or
    (3, T, B, C) where attention stacks its projections in front."""
    out = np.zeros(len(shapes), bool)
    for index, text in enumerate(shapes):
        dims = tuple(int(d) for d in text.split(",")) if text else ()
        out[index] = any(dims[start:start + len(p)] == p and dims[start + len(p)] == size
                         for p in prefixes for start in range(len(dims) - len(p)))
    return out


def mark_batch_scaling(timeline: Timeline, batch: dict, parameter_shapes: set[str],
                       probes: dict | None = None,
                       module_types: dict[str, str] | None = None) -> Timeline:
    """Return ``timeline`` with ``scales_with_batch`` set by the rule in the module doc;
    a convolution's raw blocks as its probe at half the batch showed them (``probes``:
    ``meta.probes``); a recurrent module's rows over a packed sequence (``module_types``:
    path -> class name, ``meta.modules``)."""
    size = int(batch.get("batch_size") or 0)
    flags = np.zeros(len(timeline), bool)
    if size > 0:
        multiples = batch_multiples(batch)
        shapes, inverse = np.unique(timeline.shape.astype(str), return_inverse=True)
        first = np.array([int(s.split(",")[0]) if s else 0 for s in shapes], np.int64)
        ndim = np.array([len(s.split(",")) if s else 0 for s in shapes], np.int64)
        is_param_shape = np.array([s in parameter_shapes for s in shapes])
        exact = np.isin(first, list(multiples))
        other = (first % size == 0) & (first > 0) & ~is_param_shape & (size > 1) & (ndim >= 2)
        prefixes = batch_prefixes(batch)
        sequence_first = (_after_prefix(shapes, prefixes, size) & ~is_param_shape
                          if prefixes else np.zeros(len(shapes), bool))
        routed = (np.isin(first, list(_routed_extents(timeline))) & ~is_param_shape
                  & (first > 1))
        by_shape = exact | other | sequence_first | routed
        raw = timeline.dtype_in((schema.RAW_BYTES_DTYPE,))
        # a storage resized in place (FSDP's unsharded parameters) records its byte count
        # as its shape: no tensor shape to go by
        resized = timeline.op_in((RESIZE_OP,))
        flags = (by_shape[inverse] & ~raw & ~resized
                 & np.isin(timeline.category, _SCALING_CATEGORIES)
                 & np.isin(timeline.phase, _SCALING_PHASES))
        # a shape both batch-sized and a parameter's ((B*T, C) = (vocab, C)): a backward
        # contribution summed into that parameter's gradient is weight-sized
        ambiguous = flags & (exact & is_param_shape)[inverse]
        if ambiguous.any():
            flags &= ~_gradient_contributions(timeline, ambiguous)
        scaling_rows = np.isin(timeline.category, _SCALING_CATEGORIES) & np.isin(
            timeline.phase, _SCALING_PHASES)
        flags |= raw & _sized_like_batch_rows(timeline, flags) & scaling_rows
        # measured beats the size rule: a kernel's block can follow the batch and match no
        # tensor's size, or match one by chance and not follow it
        rows, follows = conv_blocks_following_batch(timeline, probes or {})
        flags[rows] = follows & scaling_rows[rows]
        flags |= _packed_rows(timeline, module_types or {}, is_param_shape[inverse]) \
            & scaling_rows & ~resized
        flags |= _recurrent_workspaces(timeline, module_types or {}, first[inverse],
                                       ndim[inverse], size)
    out = timeline.resized(timeline.size)
    out.scales_with_batch = flags
    return out


_PACK_OP = "aten::_pack_padded_sequence"
#: torch's recurrent modules: over a packed sequence they work one time step at a time on
#: the sequences still running (``batch_sizes[t]`` of them)
_RECURRENT_TYPES = frozenset({"RNN", "LSTM", "GRU"})


def _recurrent_modules(timeline: Timeline, module_types: dict[str, str]) -> np.ndarray:
    """Bool per module code: the module is one of torch's recurrent modules."""
    return np.array([module_types.get(name, "") in _RECURRENT_TYPES
                     for name in timeline.modules] or [False], bool)


def _packed_rows(timeline: Timeline, module_types: dict[str, str],
                 parameter_shaped: np.ndarray) -> np.ndarray:
    """Rows that scale with the batch over a packed sequence (``pack_padded_sequence``):
    the packed data the pack made ((tokens, F): the batch's summed lengths) and what a
    recurrent module computes from it, one time step at a time over the ``batch_sizes[t]``
    sequences still running (a (7, 96) gate product at a step where 7 of 8 run): no
    dimension is the batch size, yet the step's total is the micro-batch's tokens.  Taken
    in proportion to the micro-batch (the tokens per micro-batch follow its sequences'
    lengths: in expectation); the weight-shaped partial gradients of backward stay."""
    out = np.zeros(len(timeline), bool)
    if _PACK_OP not in timeline.ops:
        return out
    forward = timeline.phase == PHASE_CODE[schema.FORWARD]
    floating = timeline.dtype_in(("float32", "float64", "float16", "bfloat16"))
    packed = timeline.op_in((_PACK_OP,)) & forward & floating
    recurrent = _recurrent_modules(timeline, module_types)
    out |= packed | (recurrent[timeline.module] & ~parameter_shaped)
    return out & ~timeline.dtype_in((schema.RAW_BYTES_DTYPE,))


def _recurrent_workspaces(timeline: Timeline, module_types: dict[str, str],
                          first: np.ndarray, ndim: np.ndarray, size: int) -> np.ndarray:
    """A recurrent module's workspace: the flat byte buffer (uint8, one dimension) its
    kernel saves for backward (oneDNN's LSTM/GRU on the CPU, cuDNN's reserve space on a
    GPU) holds every time step's gates for every sequence of the batch, so its size
    follows the batch though no dimension shows it (12,554,240 B at 32 sequences,
    6,279,168 B at 16: linear to 4 KiB).  Kept whole, accumulation and data parallelism
    were over-predicted (+64% on one nn.LSTM) and a larger batch under-predicted."""
    recurrent = _recurrent_modules(timeline, module_types)
    return (recurrent[timeline.module] & (ndim == 1) & (first > 0) & (first % size == 0)
            & timeline.dtype_in(("uint8", "int8"))
            & (timeline.category == CATEGORY_CODE[schema.ACTIVATION])
            & (timeline.phase == PHASE_CODE[schema.FORWARD]))


#: ops whose output's extent is a count of the data's values (``torch.where(mask)``)
_VALUE_COUNT_OPS = ("aten::nonzero", "aten::masked_select", "aten::_unique2",
                    "aten::unique_dim", "aten::unique_consecutive")


def _routed_extents(timeline: Timeline) -> set[int]:
    """First dimensions of what value-counting ops made in forward: the tokens a
    mixture-of-experts router sends to each expert (``torch.where(expert_mask)``) -- a
    share of the batch's tokens, so the expert's (n_e, d) tensors scale with the batch (in
    expectation: which tokens go where changes with the data)."""
    rows = np.flatnonzero(timeline.op_in(_VALUE_COUNT_OPS)
                          & (timeline.phase == PHASE_CODE[schema.FORWARD]))
    return {int(text.split(",")[0]) for text in timeline.shape[rows].astype(str) if text}


def _gradient_contributions(timeline: Timeline, rows: np.ndarray) -> np.ndarray:
    """Rows (of ``rows``) that end where a gradient of their shape is made from them: a
    tied weight's gradient from one use (the LM head's ``mm``) or the embedding's dense
    gradient, held until autograd sums the uses into ``.grad``."""
    out = np.zeros(len(timeline), bool)
    grads = np.flatnonzero(timeline.category_mask(schema.GRADIENT)
                           & (timeline.alloc_key >= 0))
    if not len(grads):
        return out
    for row in np.flatnonzero(rows):
        made = timeline.alloc_key[grads[timeline.shape[grads] == timeline.shape[row]]]
        out[row] = bool(((made > timeline.alloc_key[row]) & (made <= timeline.free_key[row])
                         & (timeline.free_key[row] - made <= 2)).any())
    return out


def _sized_like_batch_rows(timeline: Timeline, flags: np.ndarray) -> np.ndarray:
    """Rows whose byte size equals that of a batch-scaled tensor of the same module, or of
    any batch-scaled tensor of the step where no parameter has that size: a kernel's raw
    block (no shape) sized like the batch it works on (a convolution backward's im2col
    buffer; the storage an in-place SiLU claims after oneDNN made it), not like the
    weights."""
    scaled = np.flatnonzero(flags)
    if not len(scaled):
        return np.zeros(len(timeline), bool)
    width = int(timeline.size.max()) + 1
    keys = timeline.module.astype(np.int64) * width + timeline.size.astype(np.int64)
    parameter_sizes = timeline.size[timeline.category_mask(schema.PARAMETER,
                                                           schema.GRADIENT)]
    anywhere = np.setdiff1d(timeline.size[scaled], parameter_sizes)
    return np.isin(keys, keys[scaled]) | np.isin(timeline.size, anywhere)


def parameter_shapes(timeline: Timeline) -> set[str]:
    """Shapes (and transposes) of parameter and gradient storages."""
    mask = timeline.category_mask(schema.PARAMETER, schema.GRADIENT)
    out = set()
    for shape in set(timeline.shape[mask].astype(str)):
        out.add(shape)
        out.add(",".join(reversed(shape.split(","))))
    return out


def scale_batch(timeline: Timeline, factor: float) -> Timeline:
    """Batch-dependent storages resized by ``factor`` (micro-batch / recorded batch)."""
    if factor == 1.0:
        return timeline
    size = np.where(timeline.scales_with_batch, timeline.size * factor, timeline.size)
    return timeline.resized(size)
