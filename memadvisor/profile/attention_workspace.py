"""The memory-efficient attention backward's workspace, which fake execution adds.

``_efficient_attention_backward`` (CUTLASS's kernel_backward.h) allocates, after its
gradients, a transient workspace where blocks of keys accumulate dQ in fp32: per (batch,
head), ``ceil(L_q / 64) * ceil(D / 64)`` tiles of ``GradQTempStorage`` -- 16 bytes of lock,
counter and padding, then a 64 x 64 fp32 accumulator.  Fake kernels make the gradients
only.  Measured on an H100 (torch 2.11, 2026-11-25; fp32 inputs, sm90):

    Llama-style decoder, q (128, 4, 1024, 16): 134,348,800 B = 512 x 16 x 1 x 16,400 B
    ViT, q (64, 6, 197, 64):                    25,190,400 B = 384 x  4 x 1 x 16,400 B

both exactly the rule.  fp16/bf16 inputs (the efficient kernel takes them with an
attention mask; without one flash runs) accumulate dQ in fp32 the same way; that case
was not measured.  Where the reserved memory of a step peaks in attention backward,
leaving this out under-predicted it by 6% (the Llama decoder).
"""
from __future__ import annotations

import torch

from ..trace import schema
from .recorder import _SID

#: the op fake execution dispatches (memadvisor/fake/sdpa.py calls the SDPA-level op)
BACKWARD_OPS = frozenset({"aten::_scaled_dot_product_efficient_attention_backward",
                          "aten::_efficient_attention_backward"})
WORKSPACE_OP = "efficient_attention_workspace"
TILE_ROWS = 64  #: kBlockSizeI: query rows per tile
TILE_COLS = 64  #: MatmulGradQ's ThreadblockShape::kN: head-dim columns per tile
TILE_HEADER_BYTES = 16  #: GradQTempStorage's lock, counter and padding


def workspace_bytes(batch: int, heads: int, query_len: int, head_dim: int) -> int:
    """Bytes of the dQ accumulation workspace for a query of (batch, heads, L, D)."""
    tiles = -(-query_len // TILE_ROWS) * -(-head_dim // TILE_COLS)
    return batch * heads * tiles * (TILE_HEADER_BYTES + TILE_ROWS * TILE_COLS * 4)


class EfficientAttentionWorkspace:
    """Adds the workspace as a transient 'temporary' block after each efficient-attention
    backward on a CUDA device (allocated after the gradients, freed at the kernel's end)."""

    def __init__(self):
        self._session = None
        self.made = 0

    def attach(self, session) -> None:
        self._session = session

    def after_op(self, op_name: str, args, out) -> None:
        if op_name not in BACKWARD_OPS or len(args) < 2:
            return
        query = args[1]  # (grad_out, query, key, value, ...)
        if not isinstance(query, torch.Tensor) or query.device.type != "cuda" \
                or query.dim() != 4:
            return
        batch, heads, query_len, head_dim = query.shape
        size = workspace_bytes(int(batch), int(heads), int(query_len), int(head_dim))
        recorder = self._session.recorder
        row = recorder.internal_alloc(size, f"cuda:{query.device.index or 0}", WORKSPACE_OP,
                                      self._session.locator.locate(3))
        recorder.mark_sid(recorder.rows[row][_SID], schema.TEMPORARY)
        recorder.internal_free(row)
        self.made += 1
