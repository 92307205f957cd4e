"""Precision: ``torch.autocast`` around the model's forward, bf16 storage, gradient scaling;
and ``offload=activations`` (saved tensors to pinned host memory, ``offload_saved_tensors``).

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
    """Run the root module's forward under autocast and/or ``offload_saved_tensors``; returns
    whether anything was wrapped.  Floating outputs come back as fp32 under autocast.

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
                stack.enter_context(offload_saved_tensors(device_type, pin_memory=True))
            if dtype is not None:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
                if evidence is not None and torch.is_autocast_enabled(device_type):
                    evidence.autocast_forwards += 1  # checked before the first step
            output = forward(*args, **kwargs)
        return _to_dtype(output, torch.float32) if dtype is not None else output

    model.forward = run
    return True


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """``torch.autograd.graph.save_on_cpu`` that keeps each saved tensor's layout.

    save_on_cpu packs a saved tensor into ``torch.empty(size)`` (pinned) and unpacks it with
    ``.to(device)``: backward gets a compact, contiguous copy whatever was saved.  Kernels
    that saved a layout they need get something else: the memory-efficient attention's
    backward wants the padded, aligned ``attn_bias`` its forward saved (``attn_bias is not
    correctly aligned (strideM)`` on nn.Transformer with a key-padding mask), and a
    transposed weight view comes back as a contiguous copy.  Here the host copy, and the
    device copy backward gets, have the saved tensor's sizes and strides:

    * dense tensors (any dimension order: channels-last, transposed) are copied as they lie
      (``empty_strided`` with the same strides, storage offset 0);
    * views with gaps or overlaps (padded rows, expanded dimensions) carry the stretch of
      storage they span, at most ``MAX_SPAN`` times their elements, and come back as the
      same view of that stretch (``as_strided``): padding (and alignment) survives, and an
      expanded tensor moves only its distinct elements;
    * a view spanning more (a narrow slice of a wide tensor) is copied densely, keeping the
      order of its dimensions (strides as close as a dense layout allows).

    Tensors not on ``device_type`` (CPU tensors a GPU forward saves) and tensors of other
    layouts or subclasses are kept as they are, or moved as save_on_cpu moves them.
    Like save_on_cpu, each save is its own host copy and each unpack its own device copy
    (freed when backward is done with it), copied asynchronously through pinned memory.
    """

    #: the most storage elements per tensor element a view's host copy may span
    MAX_SPAN = 2

    def __init__(self, device_type: str = "cuda", pin_memory: bool = True):
        device_module = getattr(torch, device_type, None)
        is_available = getattr(device_module, "is_available", None)
        # pinning needs an accelerator (and pinned memory is that accelerator's host memory)
        self.pinned = bool(pin_memory and device_type != "cpu" and is_available is not None
                           and is_available())
        self.device_type = device_type
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        if tensor.device.type != self.device_type:
            return ("kept", tensor)
        if tensor.layout != torch.strided or _is_wrapper_subclass(tensor):
            return ("moved", tensor.device, tensor.to("cpu"))  # as save_on_cpu without pinning
        with torch.no_grad():
            tensor = tensor.detach()
            size, stride = tuple(tensor.size()), tuple(tensor.stride())
            numel = tensor.numel()
            span = _storage_span(size, stride)
            if numel == 0 or _is_dense(size, stride):
                host = self._host(size, stride, tensor.dtype)
                host.copy_(tensor, non_blocking=self.pinned)
                return ("dense", tensor.device, host)
            if span <= self.MAX_SPAN * numel:
                flat = tensor.as_strided((span,), (1,), tensor.storage_offset())
                host = self._host((span,), (1,), tensor.dtype)
                host.copy_(flat, non_blocking=self.pinned)
                return ("span", tensor.device, host, size, stride)
            host = self._host(size, _dense_strides_like(size, stride), tensor.dtype)
            host.copy_(tensor, non_blocking=self.pinned)
            return ("dense", tensor.device, host)

    def unpack(self, packed):
        kind = packed[0]
        if kind == "kept":
            return packed[1]
        if kind == "moved":
            return packed[2].to(packed[1])
        device, host = packed[1], packed[2]
        with torch.no_grad():
            # a dense tensor's copy keeps its strides (memory_format=torch.preserve_format)
            out = host.to(device, non_blocking=self.pinned)
            return out.as_strided(packed[3], packed[4], 0) if kind == "span" else out

    def _host(self, size, stride, dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu",
                                   pin_memory=self.pinned)


def _is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    return is_traceable_wrapper_subclass(tensor)


def _storage_span(size, stride) -> int:
    """Storage elements from a strided view's first element to its last, inclusive."""
    if any(n == 0 for n in size):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(size, stride))


def _is_dense(size, stride) -> bool:
    """Every element in one storage slot and no slot skipped (any dimension order), as
    ``TensorImpl::is_non_overlapping_and_dense``: dimensions of size 1 do not count."""
    expected = 1
    for n, s in sorted(((n, s) for n, s in zip(size, stride) if n != 1), key=lambda d: d[1]):
        if s != expected:
            return False
        expected *= n
    return True


def _dense_strides_like(size, stride) -> tuple[int, ...]:
    """Dense strides for ``size`` that keep the order of ``stride`` (innermost: smallest)."""
    order = sorted(range(len(size)), key=lambda d: (stride[d], -d))
    out = [0] * len(size)
    expected = 1
    for d in order:
        out[d] = expected
        expected *= max(size[d], 1)
    return tuple(out)


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
