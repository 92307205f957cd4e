"""How one batch is split across ranks and micro-batches (the rule is in ``memadvisor.plan``).

The batch dimension of each tensor is derived from the tensors themselves (apply has no
trace at run time): the size the most tensors share is the batch size (a sequence-first
source ``[S, B]`` and target ``[T, B]`` share ``B``), each tensor is sliced along its own
dimension of that size, and a tensor without one (a ``[T, T]`` attention mask shared by
every sample, a step counter, a string) is handed to every micro-batch whole.  Where the
shapes cannot tell (``[T, B]`` and ``[T, B]`` alone), the dimensions decided for an
earlier batch of the same structure decide, then the layout the model's own sequence
modules declare (``batch_first``), then -- where every tensor's dimension 0 is one of the
tied sizes -- the batch-first convention of the plan's split, with a warning; otherwise
the split is refused with the ``batch_dims=`` argument that settles it.  Tuples, lists, dicts and namedtuples are walked.
"""
from __future__ import annotations

import math
import warnings

import torch

from ..plan import Plan, PlanError
from ..profile.batch_layout import BatchLayout, infer_layout

_PACKED = torch.nn.utils.rnn.PackedSequence

def tensors_of(value) -> list[torch.Tensor]:
    """The tensors of ``value`` in the order ``slice_batch`` visits them."""
    if isinstance(value, _PACKED):
        raise PlanError("a PackedSequence cannot be split into micro-batches: hand "
                        "micro_batches the padded tensors and lengths, and pack each part")
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_of(item)]
    return []


def model_layout_dim(model: torch.nn.Module | None) -> int | None:
    """1 when the model's sequence modules all say (T, B, ...), 0 when all say batch-first
    or it has none but convolutions (batched as (B, C, ...)), None when it has neither or
    they disagree."""
    if model is None:
        return None
    modules = list(model.modules())
    flags = {bool(getattr(m, "batch_first", False)) for m in modules
             if isinstance(m, (torch.nn.RNNBase, torch.nn.MultiheadAttention,
                               torch.nn.Transformer, torch.nn.TransformerEncoderLayer,
                               torch.nn.TransformerDecoderLayer))}
    if not flags and any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in modules):
        return 0
    return None if len(flags) != 1 else (0 if flags.pop() else 1)


def batch_layout(values, *, model=None, batch_dims=None, decided: dict | None = None
                 ) -> BatchLayout:
    """Each tensor's batch dimension (in ``tensors_of`` order); refuses what is ambiguous.
    ``decided``: tensor ranks of a batch structure -> the dims decided for an earlier batch
    (kept by the caller for the run: a later batch whose sequence length happens to equal
    the batch size is split the same way)."""
    tensors = tensors_of(values)
    shapes = [tuple(t.shape) for t in tensors]
    if batch_dims is not None:
        return _explicit_layout(shapes, batch_dims)
    decided = {} if decided is None else decided
    structure = tuple(len(s) for s in shapes)
    layout = infer_layout(shapes, preferred_dims=decided.get(structure))
    tie_dim = model_layout_dim(model)
    if layout.ambiguous and tie_dim is not None:
        sizes = {layout.batch_size, *layout.rivals}
        preferred = tuple(tie_dim if len(s) > tie_dim and s[tie_dim] in sizes else None
                          for s in shapes)
        layout = infer_layout(shapes, preferred_dims=preferred)
    if layout.ambiguous:
        layout = _batch_first_reading(shapes, layout)
    if layout.ambiguous:
        sizes = sorted({layout.batch_size, *layout.rivals})
        raise PlanError(
            f"cannot tell which dimension of the batch handed to micro_batches is the batch: "
            f"shapes {[list(s) for s in shapes]} fit more than one batch dimension (sizes "
            f"{sizes}); pass it, e.g. mem.micro_batches(..., batch_dims="
            f"{_example_dims(shapes)}) (one entry per tensor, None for a tensor shared by all "
            f"samples)")
    _check_flattened(shapes, layout)
    if layout.batch_size is not None:
        decided.setdefault(structure, layout.dims)
    return layout


def _batch_first_reading(shapes, layout: BatchLayout) -> BatchLayout:
    """A tie the model does not settle ([B, T] tokens and labels; a [B, C, H, W] image
    batch of a model without convolutions) read the batch-first way when every tensor has
    one of the tied sizes as its dimension 0 (the plan's documented split), with a warning
    naming the way out; left ambiguous (refused) otherwise."""
    tied = {layout.batch_size, *layout.rivals}
    first = {s[0] for s in shapes if s}
    if len(first) != 1 or not first <= tied:
        return layout
    read = infer_layout(shapes, preferred_dims=[0] * len(shapes))
    if read.ambiguous:
        return layout
    warnings.warn(f"memadvisor: the batch's shapes {[list(s) for s in shapes]} fit more than "
                  f"one batch dimension (sizes {sorted(tied)}); dimension 0 is taken, as in "
                  f"a batch-first layout: if the batch is elsewhere, pass batch_dims= to "
                  f"mem.micro_batches", stacklevel=5)  # the script's micro_batches line
    return BatchLayout(read.batch_size, read.dims, "batch-first by convention (a tie)")


def _example_dims(shapes) -> tuple:
    return tuple(0 if s else None for s in shapes)


def _explicit_layout(shapes, batch_dims) -> BatchLayout:
    dims = tuple(batch_dims)
    if len(dims) != len(shapes):
        raise PlanError(f"batch_dims has {len(dims)} entries for {len(shapes)} tensors")
    sizes = {shapes[i][d] for i, d in enumerate(dims) if d is not None}
    if len(sizes) != 1 or any(d is not None and d >= len(shapes[i]) for i, d in enumerate(dims)):
        raise PlanError(f"batch_dims {dims} do not pick one batch size in shapes "
                        f"{[list(s) for s in shapes]}")
    return BatchLayout(sizes.pop(), dims, "batch_dims given")


def _check_flattened(shapes, layout: BatchLayout) -> None:
    """A tensor without the batch size whose length is a batch tensor's dimensions
    flattened ((T*B,) targets of a (T, B) batch) holds the batch interleaved: refuse."""
    products = {math.prod(s[:k]) for s, d in zip(shapes, layout.dims) if d is not None
                for k in range(d + 2, len(s) + 1)}
    products |= {math.prod(s[:d + 1]) for s, d in zip(shapes, layout.dims) if d}
    for shape, dim in zip(shapes, layout.dims):
        if dim is None and shape and shape[0] in products and shape[0] != layout.batch_size:
            raise PlanError(
                f"a tensor of shape {list(shape)} handed to micro_batches is the batch "
                f"flattened (its {shape[0]} rows are another tensor's dimensions multiplied "
                f"out): it cannot be cut into micro-batches; hand micro_batches the tensor "
                f"before it is flattened (.view(-1)/.reshape) and flatten each part")


def slice_batch(value, start: int, stop: int, dims: list, skipped: list):
    """``value`` with every batch tensor cut to ``[start, stop)`` along its batch dimension;
    ``dims`` yields each tensor's dimension (or None) in ``tensors_of`` order."""
    if isinstance(value, torch.Tensor):
        dim = dims.pop(0)
        if dim is None:
            skipped.append(tuple(value.shape))
            return value
        return value.narrow(dim, start, stop - start)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(slice_batch(v, start, stop, dims, skipped) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(slice_batch(v, start, stop, dims, skipped) for v in value)
    if isinstance(value, dict):
        sliced = {k: slice_batch(v, start, stop, dims, skipped) for k, v in value.items()}
        try:
            return type(value)(sliced)
        except TypeError:
            return sliced
    return value


def split(values: tuple, plan: Plan, rank: int, *, model=None, batch_dims=None,
          decided: dict | None = None):
    """Yield this rank's micro-batches of ``values`` (each a tuple like ``values``)."""
    parts = plan.data_parallel_size * plan.accum  # a tensor-parallel group shares its batch
    if parts == 1:
        yield values
        return
    layout = batch_layout(values, model=model, batch_dims=batch_dims, decided=decided)
    if layout.batch_size is None or all(d is None for d in layout.dims):
        raise PlanError("the batch handed to micro_batches holds no tensor with a batch "
                        "dimension, so it cannot be split across ranks or micro-batches")
    micro = plan.micro_batch_size(layout.batch_size)
    start = rank * micro * plan.accum
    for index in range(plan.accum):
        skipped: list = []
        lo = start + index * micro
        part = slice_batch(values, lo, lo + micro, list(layout.dims), skipped)
        if skipped and index == 0 and rank == 0:
            warnings.warn(f"memadvisor: tensors of shape {skipped[0]} have no dimension of the "
                          f"batch size {layout.batch_size}; every micro-batch gets them whole",
                          stacklevel=3)
        yield part
