"""Which dimension of each input tensor is the batch: pure functions over shapes.

Shared by ``profile`` (which records the answer in ``meta.batch``) and ``apply``'s
``micro_batches`` (which has no trace and must split along the same dimension).  No torch
import: shapes are tuples of ints.

The batch size is the size that the most input tensors share (sequence-first source and
target tensors have different lengths but one batch); a square ``[T, T]`` mask relates
positions, not samples, and does not vote (it has no batch dimension unless its size is
the batch's).  Evidence that overrides the count:

* ``layout_sizes``: batch sizes that modules which know their layout reported (an
  ``nn.LSTM``/``nn.MultiheadAttention``/``nn.Transformer`` with its ``batch_first``, an
  ``nn.LSTMCell``, a convolution, a loss module's target): a size seen there is the
  batch, whatever the count says;
* ``varying_sizes``: sizes that changed between two observations of the same input (a
  sequence length varies from batch to batch, the batch size does not).

When the evidence leaves two sizes (``[T, B]`` with nothing else to go by) the answer is
``ambiguous``: the caller decides (profile falls back to dimension 0 and says so; apply
refuses).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

Shape = Sequence[int]


@dataclass(frozen=True)
class BatchLayout:
    """The batch found in a list of input shapes."""

    batch_size: int | None
    #: per input: the index of its batch dimension, or None (no batch dimension: a mask
    #: shared by all samples, a scalar, a step counter)
    dims: tuple[int | None, ...]
    #: how it was decided, in words ('the size 8 shared by 5 of 7 inputs', ...)
    evidence: str
    #: other sizes the evidence could not rule out (empty when decided)
    rivals: tuple[int, ...] = field(default=())

    @property
    def ambiguous(self) -> bool:
        return bool(self.rivals)


def infer_layout(shapes: Sequence[Shape], *, layout_sizes: Iterable[int] = (),
                 varying_sizes: Iterable[int] = (),
                 preferred_dims: Sequence[int | None] | None = None) -> BatchLayout:
    """The batch size and each input's batch dimension (see the module doc).

    ``preferred_dims``: dims decided before for inputs of these shapes' ranks (apply keeps
    the first decision for later batches where ``[T, B]`` has ``T == B``)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    # a square tensor ([T, T]: an attention mask, a distance matrix) relates positions to
    # positions, not samples: it votes only when nothing else does
    voters = [s for s in shapes if not _square(s)] or shapes
    counts: dict[int, int] = {}
    for shape in voters:
        for size in set(shape):
            counts[size] = counts.get(size, 0) + 1
    if not counts:
        return BatchLayout(None, tuple(None for _ in shapes), "no input has a dimension")
    candidates = set(counts)
    evidence = ""
    hinted = candidates & {int(s) for s in layout_sizes}
    if hinted:
        candidates = hinted
        evidence = ("the batch size the model's own modules read in their documented "
                    "layout (batch_first sequence modules, convolutions, a loss's target)")
    varying = candidates - {int(s) for s in varying_sizes}
    if varying and varying != candidates:
        candidates = varying
        evidence = evidence or "the size that stayed the same across batches"
    if preferred_dims is not None and len(preferred_dims) == len(shapes):
        preferred = {shape[dim] for shape, dim in zip(shapes, preferred_dims)
                     if dim is not None and dim < len(shape)}
        if len(preferred) == 1 and preferred <= candidates:
            candidates = preferred
            evidence = evidence or "the dimensions used for the first batch"
    best = max(counts.get(s, 0) for s in candidates)
    top = sorted(s for s in candidates if counts.get(s, 0) == best)
    if len(top) > 1 and 1 in top:
        top.remove(1)  # a size-1 dimension (unsqueezed, one channel) before a real batch of 1
    size = top[0]
    rivals = tuple(top[1:])
    if not evidence:
        evidence = f"the size {size} shared by {best} of {len(voters)} inputs"
    dims = _dims_of(shapes, size, preferred_dims)
    if any(dim == "ambiguous" for dim in dims):
        rivals = rivals or (size,)
        dims = tuple(None if d == "ambiguous" else d for d in dims)
    return BatchLayout(size, dims, evidence, rivals)


def _square(shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and len(set(shape)) == 1


def _dims_of(shapes: list[tuple[int, ...]], size: int,
             preferred_dims: Sequence[int | None] | None) -> tuple:
    """Each shape's dimension of ``size``; where a shape has it twice ([B, B]), the index
    the other inputs use, else the index decided before, else 'ambiguous'."""
    single = [shape.index(size) for shape in shapes if shape.count(size) == 1]
    usual = max(set(single), key=single.count) if single else None
    dims = []
    for index, shape in enumerate(shapes):
        hits = [d for d, s in enumerate(shape) if s == size]
        if not hits:
            dims.append(None)
        elif len(hits) == 1:
            dims.append(hits[0])
        elif preferred_dims is not None and index < len(preferred_dims) \
                and preferred_dims[index] in hits:
            dims.append(preferred_dims[index])
        elif usual in hits:
            dims.append(usual)
        else:
            dims.append("ambiguous")
    return tuple(dims)


def layout_batch_size(kind: str, batch_first: bool, shape: Shape) -> int | None:
    """The batch size a layout-aware module's input shape says: ``kind`` 'sequence' (RNN,
    attention, transformer: ``(T, B, C)`` or, batch_first, ``(B, T, C)``; 2-D is unbatched)
    or 'cell' (an RNN cell: ``(B, C)``; 1-D is unbatched)."""
    if kind == "sequence" and len(shape) == 3:
        return int(shape[0] if batch_first else shape[1])
    if kind == "cell" and len(shape) == 2:
        return int(shape[0])
    return None
