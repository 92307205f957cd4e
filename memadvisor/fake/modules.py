"""``model.cuda()`` / ``model.to('cuda')`` / ``model.bfloat16()`` under fake execution.

``nn.Module._apply`` (behind ``to``, ``cuda``, ``half``, ``to_empty``) swaps a fake
parameter with its converted copy via ``torch.utils.swap_tensors``, which refuses: fake
mode holds a weak reference to every tensor it converted.  On a real GPU build the
parameter object survives the move (``param.data = moved``), so optimizers built before
the move and tied weights (``lm_head.weight is embed.weight``) keep working; scripts
rely on that.  The replacement below keeps that contract:

* a fake parameter keeps its identity: its data is set to the converted tensor and its
  fake device follows (what ``param.data = moved`` does on a real build);
* a real parameter (a module built before fake execution began) cannot hold fake data,
  so it is replaced by a new Parameter -- once per parameter, so tied weights stay tied.
"""
from __future__ import annotations

import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .patching import Patches

_state = threading.local()


def _convert_parameter(param: torch.nn.Parameter, applied: torch.Tensor):
    if applied is param:
        return param
    if isinstance(param, FakeTensor) and isinstance(applied, FakeTensor):
        with torch.no_grad():
            param.data = applied
        param.fake_device = applied.fake_device
        return param
    return torch.nn.Parameter(applied, requires_grad=param.requires_grad)


def _convert_grad(param, grad, fn):
    with torch.no_grad():
        applied = fn(grad)
    if applied is grad:
        return
    if isinstance(grad, FakeTensor) and isinstance(applied, FakeTensor) and param.grad is grad:
        with torch.no_grad():
            grad.data = applied
        grad.fake_device = applied.fake_device
        return
    param.grad = applied


def fake_apply(self: torch.nn.Module, fn, recurse: bool = True):
    outermost = getattr(_state, "converted", None) is None
    if outermost:
        _state.converted = {}  # id(old parameter) -> (old, new): ties stay tied
    try:
        if recurse:
            for module in self.children():
                module._apply(fn)
        converted = _state.converted
        for key, param in self._parameters.items():
            if param is None:
                continue
            if id(param) in converted:
                self._parameters[key] = converted[id(param)][1]
                continue
            grad = param.grad
            with torch.no_grad():
                applied = fn(param)
            new = _convert_parameter(param, applied)
            if new is not param:
                self._parameters[key] = new
            if grad is not None:
                _convert_grad(new, grad, fn)
            converted[id(param)] = (param, new)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self
    finally:
        if outermost:
            _state.converted = None


def install() -> Patches:
    patches = Patches()
    patches.set(torch.nn.Module, "_apply", fake_apply)
    return patches
