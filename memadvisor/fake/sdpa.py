"""``scaled_dot_product_attention`` choosing its kernel as the target GPU would.

On a CPU-only build torch has no CUDA kernel chooser (``_fused_sdp_choice`` is a CUDA
DispatchStub), so SDPA on fake CUDA tensors silently takes the math path: it materialises
the (L x S) attention matrix and saves it for backward, which a real GPU running flash or
memory-efficient attention never does -- an 8B model at 2,048 tokens would be predicted
hundreds of MiB per layer too high.  This patch makes the choice the way
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp does for the default priority order
(flash, then memory-efficient, then math), honouring the script's own
``torch.backends.cuda.enable_*_sdp`` flags and ``sdpa_kernel`` contexts, and calls that
kernel's aten op, whose fake kernel gives the outputs (and autograd the saved tensors) the
real kernel has: flash saves the output and a (B, H, L) fp32 logsumexp; memory-efficient
a logsumexp padded to 32 rows.

Rules, per the source (checked against torch 2.6-2.13's sdp_utils):
- flash: compute capability >= 8.0, fp16/bf16, head dim <= 256 and a multiple of 8, no
  ``attn_mask`` (``is_causal`` is fine), q/k/v of one dtype, 4-D inputs;
- memory-efficient: capability >= 5.0, fp32/fp16/bf16 (bf16 from 8.0), head dim a multiple
  of 8 (16-bit) or 4 (fp32), any ``attn_mask``;
- math otherwise (the original function).
Grouped-query attention (``enable_gqa`` with fewer key/value heads) repeats k/v first, as
the math path does: a small over-estimate where the real kernel reads the groups directly.
"""
from __future__ import annotations

from .patching import Patches

FLASH_MAX_HEAD_DIM = 256


def install(capability: tuple[int, int]) -> Patches:
    import torch
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    patches = Patches()

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, scale=None, enable_gqa=False):
        backend = choose_backend(query, key, value, attn_mask, capability)
        if backend == "math":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            groups = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(groups, dim=-3)
            value = value.repeat_interleave(groups, dim=-3)
        if backend == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value))
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            # the efficient kernel takes an additive bias: what SDPA converts a mask to
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device) \
                .masked_fill(bias.logical_not(), float("-inf"))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]

    scaled_dot_product_attention.__doc__ = original.__doc__
    scaled_dot_product_attention.__wrapped__ = original
    patches.set(F, "scaled_dot_product_attention", scaled_dot_product_attention)
    return patches


def choose_backend(query, key, value, attn_mask, capability: tuple[int, int]) -> str:
    """'flash', 'efficient' or 'math' for these inputs on a GPU of ``capability``."""
    import torch
    if query.device.type != "cuda" or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"
    if not (query.dtype == key.dtype == value.dtype):
        return "math"
    head_dim = query.shape[-1]
    if value.shape[-1] != head_dim:
        return "math"
    sixteen_bit = query.dtype in (torch.float16, torch.bfloat16)
    if (torch.backends.cuda.flash_sdp_enabled() and capability >= (8, 0) and sixteen_bit
            and attn_mask is None and head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0):
        return "flash"
    dtype_ok = query.dtype == torch.float32 or query.dtype == torch.float16 or (
        query.dtype == torch.bfloat16 and capability >= (8, 0))
    if (torch.backends.cuda.mem_efficient_sdp_enabled() and capability >= (5, 0) and dtype_ok
            and head_dim % (8 if sixteen_bit else 4) == 0):
        return "efficient"
    return "math"
