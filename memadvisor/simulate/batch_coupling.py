"""Losses that couple the samples of a batch: seen in the trace, said before a plan splits it.

A contrastive loss over in-batch negatives (CLIP, SimCLR, InfoNCE: ``logits = a @ b.T``,
labels ``arange(B)``) compares every sample with every other: its (B, B) similarity
matrix is the product of two batch tensors.  Two consequences the linear batch model
cannot express:

* accumulation and data parallelism hand each micro-batch and rank only its own samples,
  so the loss itself changes (fewer negatives), not only the memory;
* that matrix grows with the square of the batch, so "the largest micro-batch that fits",
  extrapolated linearly from one profile, is wrong (it said 7,257 samples where 1.2 GiB
  were needed for 40 MiB).

Found from data flow (trace format 3): a 2-D floating tensor of shape (B, B) made in
forward by a product or a distance (``PAIRWISE_OPS``) that read two different batch-scaled
tensors.  A Linear whose output width happens to equal B reads one batch tensor and a
weight; attention's scores are 4-D; an elementwise op on (B, F) tensors with F == B (a
VAE's latent of 8 at batch 8) pairs no samples.
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from .replay import PHASE_CODE, Timeline

#: a product or a distance pairs the rows of its two operands
PAIRWISE_OPS = ("aten::mm", "aten::matmul", "aten::bmm", "aten::einsum", "aten::addmm",
                "aten::_cdist_forward", "aten::cdist", "aten::_euclidean_dist")


def coupling(timeline: Timeline, batch_size: int, where=None) -> str | None:
    """A sentence naming the first op that couples the batch's samples, or None;
    ``where(row)``: the script's line that made a row ('' where unknown)."""
    reads = timeline.reads
    if reads is None or batch_size <= 1:
        return None
    square = f"{batch_size},{batch_size}"
    candidates = np.flatnonzero(
        (timeline.shape.astype(str) == square)
        & (timeline.phase == PHASE_CODE[schema.FORWARD])
        & timeline.dtype_in(("float32", "float64", "float16", "bfloat16"))
        & timeline.op_in(PAIRWISE_OPS))
    for row in candidates.tolist():
        read = np.unique(reads.of(row))
        if (timeline.scales_with_batch[read]).sum() >= 2:
            op = timeline.ops[int(timeline.op[row])] or "an op"
            module = timeline.modules[int(timeline.module[row])] or "the top level"
            line = where(row) if where is not None else ""
            return (f"{op} in {module}{f' at {line}' if line else ''} makes a ({batch_size}, "
                    f"{batch_size}) tensor from two batch tensors (in-batch similarities, as a "
                    "contrastive loss computes)")
    return None


def coupling_warning(found: str) -> str:
    return (f"the loss couples the samples of a batch: {found}; accumulation and data "
            "parallelism give each micro-batch and rank only its own samples, which changes "
            "the loss, not only the memory (gather the other ranks' embeddings, or keep the "
            "batch whole): `apply` refuses such a plan (--allow-batch-coupling runs it) and "
            "`advise` does not propose one; that tensor grows with the square of the batch: "
            "the largest micro-batch that fits is not extrapolated")


#: how a refusal of ``split_refusal`` begins (``advise`` lists these reasons)
SPLIT_REFUSAL = "the loss couples the samples of a batch"


def split_refusal(found: str | None, plan) -> str | None:
    """Why ``advise`` leaves out ``plan``: it splits a batch whose loss couples the samples
    (``apply`` refuses it, naming the line, unless told --allow-batch-coupling), else None."""
    if not found or plan.data_parallel_size * plan.accum * plan.pipeline_microbatches <= 1:
        return None
    return (f"{SPLIT_REFUSAL} ({found}): plans that split the batch (accum, data "
            "parallelism, pipeline micro-batches) change the loss; `apply` refuses them unless "
            "--allow-batch-coupling")
