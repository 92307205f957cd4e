"""How one batch is split across ranks and micro-batches (the rule is in ``memadvisor.plan``).

Every tensor whose first dimension is the batch size ``B`` (the first tensor found fixes
``B``) is sliced; anything else (a shared mask, a step counter, a string) is handed to
every micro-batch unchanged.  Tuples, lists, dicts and namedtuples are walked.
"""
from __future__ import annotations

import warnings

import torch

from ..plan import Plan, PlanError


def batch_size_of(value) -> int | None:
    """First dimension of the first tensor (with at least one dimension) in ``value``."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() > 0 else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            size = batch_size_of(item)
            if size is not None:
                return size
    return None


def slice_batch(value, start: int, stop: int, batch_size: int, skipped: list):
    """``value`` with every batch-sized tensor cut to ``[start, stop)``."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 0 and value.shape[0] == batch_size:
            return value[start:stop]
        skipped.append(tuple(value.shape))
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(slice_batch(v, start, stop, batch_size, skipped) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(slice_batch(v, start, stop, batch_size, skipped) for v in value)
    if isinstance(value, dict):
        sliced = {k: slice_batch(v, start, stop, batch_size, skipped) for k, v in value.items()}
        try:
            return type(value)(sliced)
        except TypeError:
            return sliced
    return value


def split(values: tuple, plan: Plan, rank: int):
    """Yield this rank's micro-batches of ``values`` (each a tuple like ``values``)."""
    parts = plan.world * plan.accum
    batch_size = batch_size_of(values)
    if batch_size is None:
        if parts > 1:
            raise PlanError("the batch handed to micro_batches holds no tensor with a batch "
                            "dimension, so it cannot be split across ranks or micro-batches")
        yield values
        return
    micro = plan.micro_batch_size(batch_size)
    start = rank * micro * plan.accum
    for index in range(plan.accum):
        skipped: list = []
        lo = start + index * micro
        part = slice_batch(values, lo, lo + micro, batch_size, skipped)
        if skipped and parts > 1:
            warnings.warn(f"memadvisor: tensors of shape {skipped[0]} do not have the batch "
                          f"size {batch_size} as first dimension; every micro-batch gets them "
                          "whole", stacklevel=3)
        yield part
