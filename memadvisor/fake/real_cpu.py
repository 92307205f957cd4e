"""Small CPU tensors run for real under fake execution on a simulated GPU.

A script's data pipeline computes on the CPU before anything reaches the GPU: sequence
lengths from padding, token counts, masks, indices, labels.  On fake tensors those values
would be placeholders (a length of 1, so ``length - 2`` makes a negative dimension), and
control flow or shapes built from them would go wrong.  Yet such tensors are small, and
the GPU's memory -- what fake execution is for -- never holds them as they are.

So an op runs for real when every tensor it reads is a real CPU tensor and everything it
makes is on the CPU and at most ``REAL_ELEMENTS_LIMIT`` elements (read from the op's meta
kernel first, so a large factory call never allocates).  Everything else stays fake: a
model's weight matrices built on the CPU before ``.cuda()`` (larger than the limit), any op
that reads a fake tensor, every op on the GPU.  Moving a real tensor to the GPU makes a
fake one (FakeTensorMode converts real inputs), as a host-to-device copy would.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.utils._pytree import tree_flatten, tree_map

#: elements an op may make for real on the CPU (4 MiB of float32): data-sized, never a
#: model's weight matrix at any realistic size
REAL_ELEMENTS_LIMIT = 1 << 20

_CPU = torch.device("cpu")


def runs_for_real(func, args, kwargs, value_reads=frozenset()) -> bool:
    """Whether ``func(*args, **kwargs)`` reads only real CPU tensors and makes only small
    CPU ones.  ``value_reads``: ops that read values (``item``, ``nonzero``): real on a
    small real tensor, whose values are there to read."""
    if args:
        # the usual answer, without flattening every argument: an op on a fake tensor
        # (a foreach op: a list of them) stays fake
        first = args[0]
        if isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, FakeTensor):
            return False
    leaves, _ = tree_flatten((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if is_fake(leaf) or leaf.device.type != "cpu":
                return False
        elif isinstance(leaf, torch.device) and leaf.type != "cpu":
            return False
        elif isinstance(leaf, str) and leaf.startswith(("cuda", "meta")):
            return False
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return False
    if func in value_reads:
        return all(leaf.numel() <= REAL_ELEMENTS_LIMIT for leaf in leaves
                   if isinstance(leaf, torch.Tensor))
    return _small_cpu_outputs(func, args, kwargs)


def _small_cpu_outputs(func, args, kwargs) -> bool:
    """The op's outputs, from its meta kernel: all on the CPU, all small."""
    def to_meta(value):
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                       device="meta")
        return value

    meta_kwargs = tree_map(to_meta, kwargs)
    leaves, _ = tree_flatten((args, kwargs))
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        meta_kwargs["device"] = "meta"  # a factory: it would make CPU tensors
    try:
        out = func(*tree_map(to_meta, args), **meta_kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel or not a factory: stay fake
        return False
    outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    return all(o.numel() <= REAL_ELEMENTS_LIMIT for o in outputs)
