"""Autograd's in-place writes, which fake tensors never get.

When several backward paths meet at one node, autograd's ``InputBuffer`` sums their
gradients (torch/csrc/autograd/input_buffer.cpp, ``accumulate``, torch 2.1-2.13):

    if grad mode is off and can_accumulate_inplace(old_var) and var is no subclass:
        buffer[pos] = old_var.add_(var)      # no new memory
    else:
        buffer[pos] = old_var + var          # a new block, the old one freed at once

``can_accumulate_inplace`` asks for a plain tensor (``!isTensorSubclassLike``), non-
overlapping and dense, whose TensorImpl and storage the buffer holds the last references
to.  A FakeTensor is a tensor subclass, so under fake execution every accumulation takes
the second branch: one extra gradient-sized block per meeting point (W medium ctx 512:
313 of them in one backward, 24 of 64 MiB) that a real GPU never allocates.

Backward formulas do the same (torch/csrc/autograd/FunctionsManual.cpp):
``value_selecting_reduction_backward`` (the backward of ``max(dim)``/``min(dim)``) writes
``zeros(...).scatter_(...)`` but ``.scatter(...)`` when any input is subclass-like; the
index and gather backwards likewise (``index_put_``/``index_put``, ``scatter_add_``/
``scatter_add``).  W medium: 24 extra attention-sized blocks per backward from the softmax's
``max``.

The rule: an out-of-place ``add``/``scatter``/``scatter_add``/``index_put`` in backward with
grad mode off whose first input is non-overlapping and dense, the same size as the result,
and freed before any other event, is one of these with the caller holding the last
reference -- exactly when the real code writes in place.  The result then takes over the
first input's block (its row and storage id) and the op allocates nothing.  A shared
``old_var`` (still alive after the add) or a formula's own ``a + b`` (C++ destroys its
temporaries in reverse order: the second operand dies first) keeps its new block, as on
the GPU.
"""
from __future__ import annotations

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from ..trace import schema
from .dispatch import _storage

#: the out-of-place forms torch takes for subclass-like tensors (see above)
_IN_PLACE_FOR_PLAIN_TENSORS = frozenset({"aten::add", "aten::scatter", "aten::scatter_add",
                                         "aten::index_put"})


class InPlaceAccumulation:
    """Merges an accumulation's result into its first input's block (see module doc)."""

    def __init__(self):
        self._session = None
        self.merged = 0

    def attach(self, session) -> None:
        self._session = session
        session.recorder.on_free = self._on_free

    def after_op(self, op_name: str, args, out) -> None:
        recorder = self._session.recorder
        recorder.pending_merge = None
        if op_name not in _IN_PLACE_FOR_PLAIN_TENSORS or recorder.phase != schema.BACKWARD \
                or torch.is_grad_enabled() or len(args) < 2:
            return
        first, result = args[0], out
        if not (isinstance(first, torch.Tensor) and isinstance(result, torch.Tensor)):
            return
        if first._is_view():
            # a gradient that arrives as a view (a tied weight's second use) is added out of
            # place on a real device too: nothing to merge
            return
        first_storage, result_storage = _storage(first), _storage(result)
        if first_storage is None or result_storage is None \
                or first_storage.nbytes() != result_storage.nbytes() \
                or not is_non_overlapping_and_dense_or_false(first):
            return
        result_row = recorder.live_row(result_storage)
        if result_row != len(recorder.rows) - 1 or recorder.live_row(first_storage) is None:
            return  # the result is not this op's fresh block
        recorder.pending_merge = (first_storage._cdata, result_storage._cdata, result_row)

    def _on_free(self, cdata: int) -> bool:
        """The recorder is about to log the free of storage ``cdata``; True: merged
        instead (nothing to log)."""
        recorder = self._session.recorder
        pending = recorder.pending_merge
        recorder.pending_merge = None
        if pending is None or pending[0] != cdata or pending[2] != len(recorder.rows) - 1:
            return False
        first_cdata, result_cdata, result_row = pending
        recorder.merge_into(result_cdata, first_cdata, result_row)
        self.merged += 1
        return True
