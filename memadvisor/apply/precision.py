"""Precision: ``torch.autocast`` around the model's forward, bf16 storage, gradient scaling.

The model's own ``forward`` is wrapped (as accelerate's ``prepare`` does) instead of
asking the script to add ``with torch.autocast(...)`` around its forward: the loss the
script computes from the outputs then runs in fp32 on fp32 outputs, which is what the
autocast documentation recommends, and the rewrite stays a few lines.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..plan import Plan

#: dtype autocast computes in, per plan precision (``bf16`` autocasts too, see wrap_forward)
AUTOCAST_DTYPES = {"amp-fp16": torch.float16, "amp-bf16": torch.bfloat16, "bf16": torch.bfloat16}


def cast_parameters(model: nn.Module, plan: Plan) -> None:
    """``bf16``: parameters and buffers stored in bfloat16; gradients and optimizer state follow
    (``Module.to`` keeps the Parameter objects, so the script's optimizer still holds them)."""
    if plan.precision == "bf16":
        model.to(torch.bfloat16)


def wrap_forward(model: nn.Module, plan: Plan, device_type: str, evidence=None) -> bool:
    """Run the root module's forward under autocast and/or ``save_on_cpu``; returns whether
    anything was wrapped.  Floating outputs come back as fp32 under autocast.

    ``bf16`` also runs forward under bf16 autocast and casts floating inputs to bf16: the
    parameters are bf16 already, and autocast absorbs the fp32 tensors a forward makes on
    the side (position tables, masks) that would otherwise meet bf16 weights.
    """
    dtype = AUTOCAST_DTYPES.get(plan.precision)
    offload_activations = "activations" in plan.offload
    if dtype is None and not offload_activations:
        return False
    forward = model.forward
    cast_inputs = plan.precision == "bf16"

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if cast_inputs:
            args, kwargs = _to_dtype((args, kwargs), torch.bfloat16)
        with contextlib.ExitStack() as stack:
            if offload_activations and torch.is_grad_enabled():
                stack.enter_context(torch.autograd.graph.save_on_cpu(
                    pin_memory=True, device_type=device_type))
            if dtype is not None:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
                if evidence is not None and torch.is_autocast_enabled(device_type):
                    evidence.autocast_forwards += 1  # checked before the first step
            output = forward(*args, **kwargs)
        return _to_dtype(output, torch.float32) if dtype is not None else output

    model.forward = run
    return True


def make_grad_scaler(plan: Plan, device_type: str):
    """``amp-fp16`` needs loss scaling; FSDP2's DTensor gradients work with the plain scaler."""
    if plan.precision != "amp-fp16":
        return None
    return torch.amp.GradScaler(device_type)


def _to_dtype(value, dtype):
    """Floating tensors in a nested structure converted to ``dtype``; the rest unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_to_dtype(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_dtype(v, dtype) for v in value)
    if isinstance(value, dict):
        converted = {k: _to_dtype(v, dtype) for k, v in value.items()}
        try:
            return type(value)(converted)
        except TypeError:
            return converted
    return value
