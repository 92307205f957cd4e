"""Packed sequences on fake tensors: the shapes follow from the real lengths.

``pack_padded_sequence``'s output size is the sum of the lengths, and
``pad_packed_sequence``'s the longest length: values, which FakeTensorMode cannot know.
On a simulated GPU the lengths are real (they stay on the CPU, small: ``real_cpu.py``), so
the shapes are computed from them here -- the data itself stays fake -- and the packing's
``batch_sizes`` (a CPU tensor in a real run too) are real as well.  With fake lengths
(fake CPU execution) these return ``NotImplemented`` and the op is refused by name.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

_aten = torch.ops.aten


def _real(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and not is_fake(tensor)


def pack_padded(empty, input, lengths, batch_first):
    """``_pack_padded_sequence(input, lengths, batch_first) -> (data, batch_sizes)``."""
    if not _real(lengths):
        return NotImplemented
    lengths = lengths.to(torch.int64)
    longest = int(lengths.max()) if lengths.numel() else 0
    steps = torch.arange(longest, dtype=torch.int64)
    batch_sizes = (lengths[None, :] > steps[:, None]).sum(1)
    rest = tuple(input.shape[2:])
    data = empty((int(lengths.sum()), *rest), input.dtype, input.device)
    return data, batch_sizes


def pack_padded_backward(empty, grad, input_size, batch_sizes, batch_first):
    """``_pack_padded_sequence_backward``: a gradient of the padded input's size."""
    return empty(tuple(input_size), grad.dtype, grad.device)


def pad_packed(empty, data, batch_sizes, batch_first, padding_value, total_length):
    """``_pad_packed_sequence(...) -> (padded, lengths)``."""
    if not _real(batch_sizes):
        return NotImplemented
    batch_sizes = batch_sizes.to(torch.int64)
    batch = int(batch_sizes[0]) if batch_sizes.numel() else 0
    steps = max(int(total_length), batch_sizes.numel())
    lengths = (batch_sizes[None, :] > torch.arange(batch)[:, None]).sum(1)
    shape = (batch, steps) if batch_first else (steps, batch)
    padded = empty((*shape, *data.shape[1:]), data.dtype, data.device)
    return padded, lengths


HANDLERS = {
    _aten._pack_padded_sequence.default: pack_padded,
    _aten._pack_padded_sequence_backward.default: pack_padded_backward,
    _aten._pad_packed_sequence.default: pad_packed,
}
