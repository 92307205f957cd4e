"""Normalization statistics on the CPU in fp32 when a 16-bit input meets fp32 parameters.

CPU kernels of batch, group and layer norm run "mixed type" when the input is bf16/fp16
and the weight is fp32 (a model under CPU autocast: a convolution's bf16 output into an
fp32 BatchNorm/GroupNorm): the saved mean and inverse std are fp32 (``is_mixed_type``,
aten/src/ATen/native/cpu/mixed_data_type.h).  The fake kernels make them in the input's
dtype, and the backward then runs on statistics a real backward never sees (the real
kernel refuses them: "expected scalar type BFloat16 but found Float").

Given fp32 statistics, the fake ``native_group_norm_backward`` returns the input's
gradient in the statistics' dtype; a real kernel returns it in the input's (as every
backward does).  Both rules are checked against the real kernels op by op
(``profile/cpu_scratch.py`` compares each measured op's outputs; tests/fake/
test_profile_fake.py).
"""
from __future__ import annotations

import torch

_aten = torch.ops.aten
#: op -> position of its weight argument
_WEIGHT_INDEX = {
    _aten.native_batch_norm.default: 1,
    _aten._native_batch_norm_legit.default: 1,
    _aten._native_batch_norm_legit.no_stats: 1,
    _aten._native_batch_norm_legit_no_training.default: 1,
    _aten.native_group_norm.default: 1,
    _aten.native_layer_norm.default: 2,
}
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def cpu_mixed_statistics(func, args, out, empty):
    """A norm op's fake outputs with the dtypes the real kernel gives them (``out``
    itself when they already have); ``empty(shape, dtype, device)`` makes a fake tensor."""
    if func is _aten.native_group_norm_backward.default:
        return _input_gradient_dtype(args, out, empty)
    return _statistics(func, args, out, empty)


def _input_gradient_dtype(args, out, empty):
    """native_group_norm_backward(grad_out, input, mean, rstd, ...): the input's gradient
    has the input's dtype."""
    if not isinstance(out, tuple) or len(args) < 2 or not isinstance(args[1], torch.Tensor):
        return out
    grad, dtype = out[0], args[1].dtype
    if not isinstance(grad, torch.Tensor) or grad.dtype == dtype:
        return out
    return (empty(grad.shape, dtype, grad.device), *out[1:])


def _statistics(func, args, out, empty):
    """The statistics (every output after the first) in fp32 where the real CPU kernel
    makes them so."""
    index = _WEIGHT_INDEX.get(func)
    if index is None or not isinstance(out, tuple) or len(args) <= index:
        return out
    x, weight = args[0], args[index]
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype not in _SIXTEEN_BIT \
            or not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
        return out
    return (out[0], *(empty(t.shape, torch.float32, t.device)
                      if isinstance(t, torch.Tensor) and t.dtype == x.dtype else t
                      for t in out[1:]))
