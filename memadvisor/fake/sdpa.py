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
- cuDNN attention first, where torch prefers it (``check_prefer_cudnn_attention``: an sm90
  or sm100 part, minor 0, cuDNN >= 9.9 as torch >= 2.11's CUDA wheels ship, unless
  ``TORCH_CUDNN_SDPA_PREFERRED=0``): fp16/bf16, head dim a multiple of 8 and <= 128, as
  many key/value heads as query heads.  Seen on an H100 with torch 2.11 (2026-11-25): a
  bf16 ViT's attention ran ``_cudnn_attention_backward``.  It keeps what flash keeps
  (output and fp32 logsumexp); its backward's workspace is added by
  ``profile/attention_workspace.py``;
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


CUDNN_MAX_HEAD_DIM = 128
#: the first torch whose CUDA wheels were seen preferring cuDNN attention on an H100
CUDNN_PREFERRED_SINCE = (2, 11)


def prefers_cudnn(capability: tuple[int, int], environ=None) -> bool:
    """Whether torch's SDPA puts cuDNN attention first on this GPU."""
    import os

    import torch
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_CUDNN_SDPA_PREFERRED", "1").lower() in ("0", "false", "off"):
        return False
    if environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"):
        return False
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return version >= CUDNN_PREFERRED_SINCE and capability in ((9, 0), (10, 0))


def install(capability: tuple[int, int]) -> Patches:
    import torch
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    patches = Patches()
    cudnn_first = prefers_cudnn(capability)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, scale=None, enable_gqa=False):
        backend = choose_backend(query, key, value, attn_mask, capability, cudnn_first)
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
            # the efficient and cuDNN kernels take an additive bias: what SDPA converts a
            # mask to
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device) \
                .masked_fill(bias.logical_not(), float("-inf"))
        if backend == "cudnn":
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, bias, needs_grad, dropout_p, is_causal, False,
                scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale)[0]

    scaled_dot_product_attention.__doc__ = original.__doc__
    scaled_dot_product_attention.__wrapped__ = original
    patches.set(F, "scaled_dot_product_attention", scaled_dot_product_attention)
    return patches


def choose_backend(query, key, value, attn_mask, capability: tuple[int, int],
                   cudnn_first: bool = False) -> str:
    """'cudnn', 'flash', 'efficient' or 'math' for these inputs on a GPU of
    ``capability`` (``cudnn_first``: :func:`prefers_cudnn`)."""
    import torch
    if query.device.type != "cuda" or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"
    if not (query.dtype == key.dtype == value.dtype):
        return "math"
    head_dim = query.shape[-1]
    if value.shape[-1] != head_dim:
        return "math"
    sixteen_bit = query.dtype in (torch.float16, torch.bfloat16)
    if (cudnn_first and torch.backends.cuda.cudnn_sdp_enabled() and sixteen_bit
            and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM
            and key.shape[-3] == query.shape[-3] == value.shape[-3]):
        return "cudnn"
    if (torch.backends.cuda.flash_sdp_enabled() and capability >= (8, 0) and sixteen_bit
            and attn_mask is None and head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0):
        return "flash"
    dtype_ok = query.dtype == torch.float32 or query.dtype == torch.float16 or (
        query.dtype == torch.bfloat16 and capability >= (8, 0))
    if (torch.backends.cuda.mem_efficient_sdp_enabled() and capability >= (5, 0) and dtype_ok
            and head_dim % (8 if sixteen_bit else 4) == 0):
        return "efficient"
    return "math"
