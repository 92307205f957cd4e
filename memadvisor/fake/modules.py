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

``tensor.data = moved`` itself (FSDP2's ``fully_shard`` moves the parameters it manages
so, and so do scripts) sets a fake tensor's data but not its device: a FakeTensor answers
``.device`` from its own ``fake_device``, which the C++ setter does not know of, so the
parameter stayed 'cpu' after a move to 'cuda' (``fully_shard`` then refused it: "Expects
the parameter to already be moved to device cuda:1 but got cpu").  ``FakeTensor.data``'s
setter below makes the device follow the data, as on a real build.

A Parameter made inside fake execution is fake, whatever it is made from: a small
``torch.ones(dim)`` (a norm's weight, a bias) runs for real on the CPU (``real_cpu.py``),
and a real parameter cannot take fake data (``param.data = moved`` would leave it a
'meta' tensor, which ``fully_shard`` refuses as never materialised).  Model state is
what the GPU holds; data-pipeline values, which must stay real, are no parameters.
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


_tensor_data = torch._C.TensorBase.data


def _get_data(self):
    return _tensor_data.__get__(self, type(self))


def _set_data(self, value):
    _tensor_data.__set__(self, value)
    if isinstance(value, FakeTensor):
        self.fake_device = value.fake_device


def _fake_parameters(mode, original_new):
    def __new__(cls, data=None, requires_grad=True):
        # a plain real tensor only: a DTensor (FSDP2 wraps its all-gathered shard in
        # one) holds fake data already, and converting it would copy that data
        if (type(data) in (torch.Tensor, torch.nn.Parameter)
                and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
                is mode):
            data = mode.from_tensor(data)
        return original_new(cls, data, requires_grad)
    return __new__


def install(mode=None) -> Patches:
    """``mode``: the fake mode Parameters made under it are converted to (None: not)."""
    patches = Patches()
    patches.set(torch.nn.Module, "_apply", fake_apply)
    patches.set(FakeTensor, "data", property(_get_data, _set_data))
    if mode is not None:
        patches.set(torch.nn.Parameter, "__new__",
                    staticmethod(_fake_parameters(mode, torch.nn.Parameter.__new__)))
    return patches
