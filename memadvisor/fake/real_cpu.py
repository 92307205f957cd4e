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

import os
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.utils._pytree import tree_flatten, tree_map

#: elements an op may make for real on the CPU (4 MiB of float32): data-sized, never a
#: model's weight matrix at any realistic size
REAL_ELEMENTS_LIMIT = 1 << 20

_CPU = torch.device("cpu")

#: what ids, lengths, counts, indices and masks are made of (``integers_only``); not uint8:
#: raw bytes (``send_object_list`` pickles into a ByteTensor whose storage it then swaps)
#: and pixels, which steer no shape
INDEX_DTYPES = frozenset({torch.int16, torch.int32, torch.int64, torch.bool})


def runs_for_real(func, args, kwargs, value_reads=frozenset(), *,
                  integers_only: bool = False, stale=frozenset()) -> bool:
    """Whether ``func(*args, **kwargs)`` reads only real CPU tensors and makes only small
    CPU ones.  ``value_reads``: ops that read values (``item``, ``nonzero``): real on a
    small real tensor, whose values are there to read.  ``integers_only`` (fake execution
    on the CPU target, where every tensor is a CPU tensor and the device cannot tell data
    from model): only ops that make ``INDEX_DTYPES`` tensors -- token ids, lengths, masks,
    indices, the values that steer shapes and control flow -- never a float tensor.
    ``stale``: data pointers of real tensors a fake op wrote into (``mark_stale``): their
    values are not what the run would hold, so what reads them stays fake."""
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
            if stale and leaf.data_ptr() in stale:
                return False
        elif isinstance(leaf, (torch.UntypedStorage, torch.TypedStorage)):
            # ``set_`` onto a storage (send_object_list's pickled bytes): the storage may be
            # a fake tensor's, which a real tensor cannot take
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
    if not _small_cpu_outputs(func, args, kwargs, integers_only):
        return False
    # a factory torch calls on its own behalf stays fake (a view of the script's data it
    # takes, a pipeline's micro-batch of token ids, stays real)
    return not (integers_only and not any(isinstance(leaf, torch.Tensor) for leaf in leaves)
                and _made_inside_torch())


def _small_cpu_outputs(func, args, kwargs, integers_only: bool = False) -> bool:
    """The op's outputs, from its meta kernel: all on the CPU, all small (and with
    ``integers_only`` none of them floating point)."""
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
    if integers_only and any(o.dtype not in INDEX_DTYPES for o in outputs):
        return False
    return all(o.numel() <= REAL_ELEMENTS_LIMIT for o in outputs)


_TORCH = os.path.dirname(torch.__file__)
#: where torch makes tensors for itself: a collective's buffers (filled with another
#: rank's values), decompositions' outputs (``one_hot``'s ``empty_strided`` that a
#: ``copy_`` from a fake tensor then fills -- in a fake copy: the real one stays garbage)
_INTERNAL_DIRS = tuple(os.path.join(_TORCH, name) + os.sep for name in (
    "distributed", "_refs", "_prims", "_prims_common", "_decomp", "_functorch"))


def _made_inside_torch() -> bool:
    """Whether torch's own code (``_INTERNAL_DIRS``) is making this tensor: on the fake
    process group a collective fills nothing, so a real buffer would keep its initial
    values (a pipeline's vote read 0: dynamic shape inference instead of the real run's
    static one), and a decomposition fills its output from fake tensors."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
            return True
        frame = frame.f_back
    return False


def mark_stale(func, args, kwargs, stale: set) -> None:
    """A fake op about to write into a real tensor (``one_hot``'s ``zeros(...).scatter_``
    with fake indices: FakeTensorMode mutates a fake copy, the real zeros stay zeros): its
    data pointer joins ``stale``, so no op reads those values for real afterwards."""
    if not func._schema.is_mutable:
        return
    for target in (args[0] if args else None, kwargs.get("out")):
        if isinstance(target, torch.Tensor) and not is_fake(target) \
                and target.device.type == "cpu":
            stale.add(target.data_ptr())
