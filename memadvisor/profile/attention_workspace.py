"""The memory-efficient attention backward's workspace, which fake execution adds.

``_efficient_attention_backward`` (CUTLASS's kernel_backward.h) allocates, after its
gradients, a transient workspace where blocks of keys accumulate dQ in fp32: per (batch,
head), ``ceil(L_q / 64) * ceil(D / 64)`` tiles of ``GradQTempStorage`` -- 16 bytes of lock,
counter and padding, then a 64 x 64 fp32 accumulator.  Fake kernels make the gradients
only.  Measured on an H100 (torch 2.11, 2026-11-25; fp32 inputs, sm90):

    Llama-style decoder, q (128, 4, 1024, 16): 134,348,800 B = 512 x 16 x 1 x 16,400 B
    ViT, q (64, 6, 197, 64):                    25,190,400 B = 384 x  4 x 1 x 16,400 B

both exactly the rule.  With dropout (nn.Transformer in training, with its key padding
mask: q (64, 8, L <= 64, 64)) the kernel also accumulated dK/dV in fp32: 16,785,408 B =
512 x (16,400 + 64 x 64 x 4) B.  With a mask and no dropout (zoo/moe.py's causal
nn.MultiheadAttention, 16 batch x heads): 262,656 B = 16 x (16,400 + 16) B.  The rule
takes both as measured (dropout: the dK/dV term; a bias without dropout: 16 B per batch x
head), one measurement each.  fp16/bf16 inputs (the efficient kernel takes them with an
attention mask; without one flash or cuDNN runs) accumulate dQ in fp32 the same way; not
measured.  Small batch x heads can make the kernel split keys across blocks
(num_splits_key > 1), multiplying the dK/dV term; not measured either.  Where the
reserved memory of a step peaks in attention backward, leaving this out under-predicted it by 6% (the Llama decoder).

cuDNN attention's backward (where torch prefers it: fake/sdpa.py) takes a workspace too;
one measurement, a bf16 ViT on the H100, q (64, 6, 197, 64): 19,668,992 B per call, which
is a (B, H, L, D) fp32 dQ accumulator plus a (B, H, L) fp32 row statistic (19,668,480 B)
and 512 B more; that is the rule used (cuDNN sizes its workspace from its execution plan,
so other shapes may differ).
"""
from __future__ import annotations

import torch

from ..trace import schema

#: the op fake execution dispatches (memadvisor/fake/sdpa.py calls the SDPA-level op)
BACKWARD_OPS = frozenset({"aten::_scaled_dot_product_efficient_attention_backward",
                          "aten::_efficient_attention_backward"})
CUDNN_BACKWARD_OPS = frozenset({"aten::_scaled_dot_product_cudnn_attention_backward",
                                "aten::_cudnn_attention_backward"})
CUDNN_EXTRA_BYTES = 512  #: measured beyond the two fp32 accumulators
WORKSPACE_OP = "efficient_attention_workspace"
TILE_ROWS = 64  #: kBlockSizeI: query rows per tile
TILE_COLS = 64  #: MatmulGradQ's ThreadblockShape::kN: head-dim columns per tile
TILE_HEADER_BYTES = 16  #: GradQTempStorage's lock, counter and padding


KEY_BLOCK = 64  #: kBlockSizeJ: keys per block (the dK/dV accumulator's rows)


BIAS_EXTRA_BYTES = 16  #: per batch x head, with a bias and no dropout (measured once)


def workspace_bytes(batch: int, heads: int, query_len: int, head_dim: int,
                    bias: bool = False, dropout: bool = False) -> int:
    """Bytes of the dQ (and, with dropout, dK/dV) accumulation workspace for a query of
    (batch, heads, L, D)."""
    tiles = -(-query_len // TILE_ROWS) * -(-head_dim // TILE_COLS)
    per_head = tiles * (TILE_HEADER_BYTES + TILE_ROWS * TILE_COLS * 4)
    if dropout:
        per_head += KEY_BLOCK * -(-head_dim // TILE_ROWS) * TILE_ROWS * 4
    elif bias:
        per_head += BIAS_EXTRA_BYTES
    return batch * heads * per_head


def cudnn_workspace_bytes(batch: int, heads: int, query_len: int, head_dim: int) -> int:
    """Bytes of cuDNN attention's backward workspace (one H100 measurement, above)."""
    return batch * heads * query_len * (head_dim + 1) * 4 + CUDNN_EXTRA_BYTES


class EfficientAttentionWorkspace:
    """Adds the workspace as a transient 'temporary' block after each efficient-attention
    backward on a CUDA device (allocated after the gradients, freed at the kernel's end)."""

    def __init__(self):
        self._session = None
        self.made = 0

    def attach(self, session) -> None:
        self._session = session

    def after_op(self, op_name: str, args, out) -> None:
        cudnn = op_name in CUDNN_BACKWARD_OPS
        if not (cudnn or op_name in BACKWARD_OPS) or len(args) < 2:
            return
        query = args[1]  # (grad_out, query, key, value, attn_bias, out, lse, seed, offset, p)
        if not isinstance(query, torch.Tensor) or query.device.type != "cuda" \
                or query.dim() != 4:
            return
        batch, heads, query_len, head_dim = query.shape
        if cudnn:
            size = cudnn_workspace_bytes(int(batch), int(heads), int(query_len),
                                         int(head_dim))
        else:
            bias = args[4] if len(args) > 4 else None
            dropout_p = args[9] if len(args) > 9 and isinstance(args[9], float) else 0.0
            size = workspace_bytes(int(batch), int(heads), int(query_len), int(head_dim),
                                   bias=bias is not None, dropout=dropout_p > 0)
        self._session.recorder.kernel_scratch(
            (size,), f"cuda:{query.device.index or 0}", WORKSPACE_OP,
            self._session.locator.locate(3), schema.TEMPORARY)
        self.made += 1
