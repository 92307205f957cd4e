"""What gloo allocates inside FSDP's collectives on the CPU, added to a fake CPU run.

A fake process group runs no collective, and its collectives do not reach the dispatch
mode as ops; a real CPU run's FSDP (fully_shard) goes through gloo, whose collectives take
memory of their own.  Measured on this CPU's real runs (native engine, torch 2.13,
zoo/moe ``shard=zero3,world=2``, every call of the step):

* ``all_gather_single`` / ``all_gather_into_tensor`` (``c10d::_allgather_base_``): a block of the output's bytes,
  taken and freed inside the call, while the output is alive (116,224 B for a 116,224 B
  output; the real run's peak was at one of these: zoo/moe zero3 -4.69% without it);
* ``reduce_scatter_single`` / ``reduce_scatter_tensor`` (``c10d::_reduce_scatter_base_``): a copy of the input, alive
  while the collective runs (116,224 B for a 116,224 B input).

Each is logged as a transient raw block (category temporary) right after the fake call,
with the collective's name.  Only CPU tensors: a GPU run's NCCL works in place.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..trace import schema

#: ``torch.distributed`` function -> (op name in the trace, the position and name of the
#: argument whose bytes the block has; FSDP passes them by name).  torch 2.13's FSDP calls the ``*_single`` names; the older names (which
#: call the module's own ``*_single``, not these attributes: no double count) are what
#: earlier FSDPs and scripts call
_COLLECTIVES = {
    "all_gather_single": ("c10d::_allgather_base_", 0, "output_tensor"),
    "all_gather_into_tensor": ("c10d::_allgather_base_", 0, "output_tensor"),
    "reduce_scatter_single": ("c10d::_reduce_scatter_base_", 1, "input"),
    "reduce_scatter_tensor": ("c10d::_reduce_scatter_base_", 1, "input"),
}


class GlooCollectiveBuffers:
    """Installs the wrappers for one profile session (``attach``); ``uninstall`` undoes."""

    def __init__(self):
        self._session = None
        self._undo: list = []
        self.blocks = 0

    def attach(self, session) -> None:
        self._session = session
        for name, (op, position, keyword) in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                self._undo.append((name, original))
                setattr(dist, name, self._wrap(original, op, position, keyword))

    def _wrap(self, original, op: str, position: int, keyword: str):
        def collective(*args, **kwargs):
            result = original(*args, **kwargs)
            tensor = args[position] if len(args) > position else kwargs.get(keyword)
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                session = self._session
                session.recorder.kernel_scratch(
                    (tensor.numel() * tensor.element_size(),), "cpu", op,
                    session.locator.locate(2), schema.TEMPORARY)
                self.blocks += 1
            return result

        collective.__name__ = collective.__qualname__ = original.__name__
        collective.__doc__ = original.__doc__
        return collective

    def uninstall(self) -> None:
        while self._undo:
            name, original = self._undo.pop()
            setattr(dist, name, original)

    def after_op(self, op_name: str, args, out) -> None:
        pass  # a rule of the session's: the collectives are not ops it sees
