"""Batches that are concatenations of samples of different sizes, seen in the trace.

A graph batch collated PyG-style (the nodes of 32 graphs in one ``x [N, F]``, an
``edge_index [2, E]`` of global node ids, a ``batch [N]`` vector), packed sequences joined
along one token dimension (``cu_seqlens``): the dimension the batch is read from counts
nodes or tokens, not samples, and changes from step to step.  Scaling it by ``1 / (world x
accum)`` predicts a split that cuts samples apart, which no ``batch_dims=`` can realise
(the edges hold global node ids): only the data loader can split such a batch.  Seen as the
model's input along its batch dimension taking a different size in every profiled step,
while the other dimensions stay (a DataLoader's short last batch changes one step only).
"""
from __future__ import annotations

from ..trace import schema
from ..trace.schema import batch_dims_of, shape_from_str

#: how a sentence of ``ragged`` begins (``advise`` lists it among its reasons)
RAGGED = "the batch dimension taken"


def ragged(events, meta: schema.TraceMeta) -> str | None:
    """A sentence saying the batch is a concatenation of samples of different sizes, or
    None.  ``events``: the trace's events; ``meta``: its metadata (``batch``, ``steps``)."""
    batch = meta.batch or {}
    shapes, dtypes = batch.get("shapes") or [], batch.get("dtypes") or []
    dims = batch_dims_of(batch) if shapes else []
    if not shapes or len(meta.steps or ()) < 3 or "category" not in events:
        return None
    inputs = events[(events["category"] == schema.INPUT) & (events["action"] == schema.ALLOC)]
    for index, (shape, dim) in enumerate(zip(shapes, dims)):
        if dim is None:
            continue
        dtype = dtypes[index] if index < len(dtypes) else None
        sizes = _sizes_per_step(inputs, list(shape), dim, dtype)
        if len(sizes) >= 3 and len(set(sizes.values())) == len(sizes):
            constant = _constant_input(inputs, sizes)
            name = (batch.get("names") or [])[index] if index < len(batch.get("names") or []) \
                else f"input {index}"
            also = (f"; another input keeps {constant} rows in every step (the samples?)"
                    if constant else "")
            seen = ", ".join(str(sizes[s]) for s in sorted(sizes))
            return (f"{RAGGED} ({name}'s dimension {dim}) has a different "
                    f"size in every step ({seen}){also}: the batch looks like samples of "
                    "different sizes concatenated (graphs collated into one, packed "
                    "sequences), so its size counts nodes or tokens, not samples: plans that "
                    "split the batch (accum, data parallelism) are not predicted or proposed, "
                    "and `apply` cannot cut such a batch (no batch_dims= keeps a sample "
                    "whole): split it in the data loader (a smaller batch_size) instead")
    return None


def _sizes_per_step(inputs, shape: list[int], dim: int, dtype: str | None) -> dict[int, int]:
    """Per step: the size along ``dim`` of the first input row shaped like ``shape``
    everywhere but ``dim``."""
    out: dict[int, int] = {}
    for step, shape_text, row_dtype in zip(inputs["step"], inputs["shape"], inputs["dtype"]):
        if step in out or (dtype and row_dtype != dtype):
            continue
        other = list(shape_from_str(str(shape_text)))
        if len(other) == len(shape) and all(a == b for i, (a, b) in
                                            enumerate(zip(other, shape)) if i != dim):
            out[int(step)] = int(other[dim])
    return out


def _constant_input(inputs, sizes: dict[int, int]) -> int | None:
    """A 1-D input whose length is the same in every one of those steps (labels per
    sample), and no batch size seen."""
    per_step: dict[int, set[int]] = {}
    for step, shape_text in zip(inputs["step"], inputs["shape"]):
        shape = shape_from_str(str(shape_text))
        if len(shape) == 1 and int(step) in sizes:
            per_step.setdefault(int(step), set()).add(int(shape[0]))
    common = set.intersection(*per_step.values()) if len(per_step) == len(sizes) else set()
    common -= set(sizes.values())
    return min(common) if common else None
