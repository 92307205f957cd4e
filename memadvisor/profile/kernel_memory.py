"""Memory a GPU kernel library holds that is no tensor, added to a fake run by rule.

A dispatch mode sees storages; on a real GPU the caching allocator also hands blocks to
libraries for their own use.  Fake tensors run no kernels, so those blocks are added here,
each by a rule with its source.

cuBLAS workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp, torch 2.6-2.13): the first
cuBLAS call of a thread on a device and stream gets the handle and a workspace
(``getNewWorkspace()``, through the caching allocator), kept until the process exits.
Autograd runs CUDA backward on its own device thread, so a training step holds two: the
forward's (main thread) and the backward's.  Both real traces in ../shared/gpu-truth show
exactly that pair (K: 2 x 32 MiB made inside the recorded first step; W: 2 x 8,519,680 B
made in the warm-up).  Size: ``memadvisor.gpus.cublas_workspace_bytes`` (compute
capability, ``CUBLAS_WORKSPACE_CONFIG``).

Measured on an H100 (torch 2.11.0+cu130, cuDNN 9.19; docs/FAKE.md, "GPU workspaces measured
on an H100"), two more kinds of block are no tensor:

* the cuBLASLt workspace (``getCUDABlasLtWorkspace``, 1 MiB, ``CUBLASLT_WORKSPACE_SIZE``
  KiB): made, and kept, by the first ``gemm_and_bias`` -- an ``addmm`` with a 1-D bias, which
  is what ``nn.Linear`` with a bias runs -- of a (thread, device, stream).  It is a block
  of its own: the workspace is not unified with cuBLAS's in that build.  The ~1.1 MiB every
  small case was short of.
* cuDNN convolution workspaces (``run_conv_plan``): one transient block per kernel
  (forward, data gradient, weight gradient), allocated after the op's output and freed
  when the kernel returns.  Their size is the plan cuDNN's heuristics pick, which cannot
  be derived here: ``conv_workspace_bytes`` is a rule from the measurements, at or above
  them for most kernels measured, short for a few (its docstring says which).
"""
from __future__ import annotations

import os
import threading

import torch

from ..gpus import cublas_workspace_bytes
from ..trace import schema
from .recorder import _SID

MiB = 1 << 20

#: aten ops whose CUDA kernels call cuBLAS (as a dispatch mode names them, after
#: decomposition: linear and matmul arrive as mm/addmm/bmm)
CUBLAS_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
    "aten::addmv", "aten::dot", "aten::vdot", "aten::_addmm_activation", "aten::_scaled_mm",
    "aten::_int_mm", "aten::linear", "aten::matmul",
})
WORKSPACE_OP = "cublas_workspace"  #: the op name the snapshot importer gives them too
LT_WORKSPACE_OP = "cublaslt_workspace"
CONV_WORKSPACE_OP = "cudnn_conv_workspace"

#: ops whose CUDA kernel is cuBLASLt's ``gemm_and_bias`` when the bias is 1-D
#: (Blas.cpp's addmm_out_cuda_impl: ``useLtInterface``)
LT_OPS = frozenset({"aten::addmm", "aten::_addmm_activation"})
#: dtypes gemm_and_bias takes (others run plain cuBLAS gemm)
LT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
#: torch 2.11's default cuBLASLt workspace, KiB (``CUBLASLT_WORKSPACE_SIZE``)
CUBLASLT_WORKSPACE_KIB_DEFAULT = 1024


def cublaslt_workspace_bytes(environ=os.environ) -> int:
    """Bytes of the cuBLASLt workspace a handle and stream get (0: unified with cuBLAS's,
    as ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` asks)."""
    unified = environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().lower()
    if unified in ("1", "true", "on", "yes"):
        return 0
    text = environ.get("CUBLASLT_WORKSPACE_SIZE", "").strip()
    kib = int(text) if text.isdigit() else CUBLASLT_WORKSPACE_KIB_DEFAULT
    return kib * 1024


class CublasWorkspaces:
    """Adds one ``cublas_workspace`` row (category 'other', never freed) the first time
    each cuBLAS handle and stream would run: per (thread, device, stream), where every op
    inside autograd's backward counts as autograd's device thread.  Also the GPU library
    memory measured beside it (module docstring): one ``cublaslt_workspace`` row per
    (thread, device, stream) at its first ``gemm_and_bias``, and cuDNN's transient
    convolution workspaces (:class:`CudnnConvWorkspaces`, owned here so that one rule
    object carries what a GPU run adds)."""

    def __init__(self, capability: tuple[int, int], config: str | None = None,
                 environ=os.environ):
        self.workspace_bytes = cublas_workspace_bytes(capability, config)
        self.lt_workspace_bytes = cublaslt_workspace_bytes(environ)
        self._seen: set[tuple] = set()
        self._lt_seen: set[tuple] = set()
        #: one dict per workspace added: device, phase, step-independent (for the trace's meta)
        self.made: list[dict] = []
        self.conv = CudnnConvWorkspaces()
        self._session = None

    def attach(self, session) -> None:
        self._session = session
        self.conv.attach(session)

    def after_op(self, op_name: str, args, out) -> None:
        if op_name not in CUBLAS_OPS:
            self.conv.after_op(op_name, args, out)
            return
        tensor = out[0] if isinstance(out, (tuple, list)) and out else out
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            return
        device_index = tensor.device.index or 0
        in_backward = torch._C._current_graph_task_id() != -1
        thread = "autograd" if in_backward else threading.get_ident()
        stream = torch.cuda.current_stream(device_index).stream_id
        key = (thread, device_index, stream)
        if key not in self._seen:
            self._seen.add(key)
            self._add(f"cuda:{device_index}", op_name, in_backward, stream)
        if (self.lt_workspace_bytes and key not in self._lt_seen
                and _runs_gemm_and_bias(op_name, args, tensor)):
            self._lt_seen.add(key)
            self._add(f"cuda:{device_index}", op_name, in_backward, stream, lt=True)

    def _add(self, device: str, op_name: str, in_backward: bool, stream: int,
             lt: bool = False) -> None:
        session = self._session
        recorder = session.recorder
        size = self.lt_workspace_bytes if lt else self.workspace_bytes
        row = recorder.internal_alloc(size, device, LT_WORKSPACE_OP if lt else WORKSPACE_OP,
                                      session.locator.locate(3))
        recorder.mark_sid(recorder.rows[row][_SID], schema.OTHER)
        self.made.append({"device": device, "bytes": size,
                          "thread": "autograd backward" if in_backward else "python",
                          "first_op": op_name, "stream": stream, "phase": recorder.phase,
                          **({"library": "cublaslt"} if lt else {})})


def _runs_gemm_and_bias(op_name: str, args, out: torch.Tensor) -> bool:
    """An addmm whose bias is a 1-D vector over the output's columns (nn.Linear's): torch
    runs cuBLASLt's gemm_and_bias for it, which takes the Lt workspace."""
    if op_name not in LT_OPS or not args or out.dim() != 2 or out.dtype not in LT_DTYPES:
        return False
    bias = args[0]
    return isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.numel() == out.shape[1]


# --- cuDNN convolution workspaces ----------------------------------------------------------

#: what each kind of kernel takes beyond in + out + weight: the channels-last plan's own
#: workspace, which the NCHW plan runs after its layout transforms.  Measured on the H100
#: (cuDNN 9.19) over the NCHW convolutions of 8+ input channels (docs/FAKE.md): forward
#: 147 B for 25 of 31 (6 MiB at most), data gradient 147 B for 30 of 31 (2 MiB at most),
#: weight gradient 0 to 15.75 MiB (fp32: 8.25 MiB at most).  The rule takes 8.25 MiB for the
#: weight gradient and nothing more for the others: of the values tried (the largest of
#: each kind, 6/2/16 MiB, gave cnn_large +11.5% reserved and its fp16 plan -4.6%), the one
#: whose replayed reserved peaks fell short least (docs/FAKE.md)
CONV_EXTRA_BYTES = {"forward": 0, "dgrad": 0, "wgrad": 8 * MiB + MiB // 4}
#: the same for fewer than 8 input channels per group (image stems, ViT's patch
#: embedding: cuDNN pads the channels), whatever the layout: up to 31.8 MiB and up to 2.96
#: times the input's bytes measured; the rule adds min(4 x input, 32 MiB)
CONV_UNALIGNED_EXTRA_BYTES = 32 * MiB
CONV_UNALIGNED_EXTRA_PER_INPUT = 4
#: what a plan adds beyond its tensors in bytes (alignment): at most 563 B measured
CONV_SLACK_BYTES = 1024
#: channels-last convolutions need no layout transform: every one measured took <= 16 MiB
CONV_CHANNELS_LAST_CAP_BYTES = 16 * MiB
#: convolutions this small ran with no workspace (in + out + weight, the largest measured)
CONV_TINY_BYTES = 1 * MiB
#: below this (in + out + weight) the measured plans transformed nothing: the zoo's small
#: networks (4 MiB and less) took <= 0.4 MiB forward and a split-K weight gradient, the
#: probe's smallest transforming plan had 26 MiB; where between is not measured
CONV_SMALL_BYTES = 16 * MiB
#: a 1x1 convolution's weight gradient: 64 fp32 partial weights (split-K), measured exact
#: to 400 B on three shapes in fp32 and bf16
CONV_POINTWISE_WGRAD_SPLITS = 64


def conv_workspace_bytes(kind: str, *, in_bytes: int, out_bytes: int, weight: torch.Tensor,
                         stride, padding, groups: int, channels_last: bool) -> int:
    """The cuDNN workspace one convolution kernel takes on an H100 (``kind``: 'forward',
    'dgrad' or 'wgrad'), by the rule measured there (docs/FAKE.md, "GPU workspaces
    measured on an H100").  cuDNN's heuristics pick the plan, so this is a bound from the
    measurements, not a derivation (``in``/``out``: the convolution's input and output
    bytes, whichever kernel; ``io`` = in + out + weight):

    * NCHW (the default layout), a kernel wider than 1x1: the plan transforms input, output
      and weight to NHWC inside the workspace, then runs the NHWC plan with its own
      workspace: ``io`` + ``CONV_EXTRA_BYTES[kind]`` (forward and data gradient: exact to
      147 B for most kernels measured, short by up to 6 MiB for a few; plans that skip a
      transform are over-predicted; weight gradient: 8.25 MiB, short by up to 7.5 MiB
      for some bf16 ones);
    * fewer than 8 input channels per group, whatever the layout: ``io`` + 32 MiB;
    * 1x1, stride 1, no padding: forward and data gradient none (<= 400 B); weight
      gradient 64 fp32 partial weights, at most ``io``;
    * channels-last (8+ channels): ``min(io, 16 MiB)``;
    * depthwise (one input channel per group) and tiny convolutions (``io`` < 1 MiB): none.
    """
    weight_bytes = weight.numel() * weight.element_size()
    io = in_bytes + out_bytes + weight_bytes
    in_channels_per_group = weight.shape[1] if weight.dim() > 1 else 1
    if groups > 1 and in_channels_per_group == 1:
        return 0  # depthwise: torch's own kernels or a plan with no workspace
    if io < CONV_TINY_BYTES:
        return 0
    split_k = min(io, CONV_POINTWISE_WGRAD_SPLITS * weight.numel() * 4) + CONV_SLACK_BYTES
    if io < CONV_SMALL_BYTES:
        return split_k if kind == "wgrad" else 0
    if in_channels_per_group % 8:
        extra = min(CONV_UNALIGNED_EXTRA_PER_INPUT * in_bytes, CONV_UNALIGNED_EXTRA_BYTES)
        return io + extra + CONV_SLACK_BYTES
    if channels_last:
        return min(io, CONV_CHANNELS_LAST_CAP_BYTES) + CONV_SLACK_BYTES
    pointwise = (all(k == 1 for k in weight.shape[2:]) and all(s == 1 for s in stride)
                 and all(p == 0 for p in padding))
    if pointwise:
        return split_k if kind == "wgrad" else 0
    return io + CONV_EXTRA_BYTES[kind] + CONV_SLACK_BYTES


def _is_channels_last(tensor: torch.Tensor) -> bool:
    if tensor.dim() == 4:
        fmt = torch.channels_last
    elif tensor.dim() == 5:
        fmt = torch.channels_last_3d
    else:
        return False
    return tensor.is_contiguous(memory_format=fmt) and not tensor.is_contiguous()


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


class CudnnConvWorkspaces:
    """Adds each cuDNN convolution kernel's workspace as a transient raw block (alloc and
    free, category 'temporary', op ``cudnn_conv_workspace``) right after the op's outputs:
    where the caching allocator hands it out on the GPU (``run_conv_plan`` allocates it
    after the output and frees it when the kernel returns).  A backward adds the data
    gradient's, then the weight gradient's, as cuDNN runs them."""

    def __init__(self):
        self._session = None
        #: kernels given a workspace and their bytes, by kind (for tests and the report)
        self.counts = {"forward": 0, "dgrad": 0, "wgrad": 0}
        self.bytes_max = {"forward": 0, "dgrad": 0, "wgrad": 0}

    def attach(self, session) -> None:
        self._session = session

    def after_op(self, op_name: str, args, out) -> None:
        if op_name == "aten::convolution":
            self._forward(args, out)
        elif op_name == "aten::convolution_backward":
            self._backward(args, out)

    def _forward(self, args, out) -> None:
        # convolution(input, weight, bias, stride, padding, dilation, transposed,
        #             output_padding, groups)
        if len(args) < 9 or not isinstance(out, torch.Tensor) or out.device.type != "cuda":
            return
        x, weight = args[0], args[1]
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
            return
        channels_last = _is_channels_last(x) or _is_channels_last(weight)
        size = conv_workspace_bytes("forward", in_bytes=_nbytes(x), out_bytes=_nbytes(out),
                                    weight=weight, stride=args[3], padding=args[4],
                                    groups=int(args[8]), channels_last=channels_last)
        self._transient(size, out.device, "forward")

    def _backward(self, args, out) -> None:
        # convolution_backward(grad_output, input, weight, bias_sizes, stride, padding,
        #                      dilation, transposed, output_padding, groups, output_mask)
        if len(args) < 11 or not isinstance(out, (tuple, list)) or len(out) < 2:
            return
        grad_output, x, weight = args[0], args[1], args[2]
        if not all(isinstance(t, torch.Tensor) for t in (grad_output, x, weight)) \
                or grad_output.device.type != "cuda":
            return
        channels_last = _is_channels_last(x) or _is_channels_last(weight)
        common = dict(in_bytes=_nbytes(x), out_bytes=_nbytes(grad_output), weight=weight,
                      stride=args[4], padding=args[5], groups=int(args[9]),
                      channels_last=channels_last)
        for kind, result in (("dgrad", out[0]), ("wgrad", out[1])):
            if isinstance(result, torch.Tensor):
                self._transient(conv_workspace_bytes(kind, **common), grad_output.device, kind)

    def _transient(self, size: int, device: torch.device, kind: str) -> None:
        if size <= 0:
            return
        session = self._session
        session.recorder.kernel_scratch((size,), f"cuda:{device.index or 0}",
                                        CONV_WORKSPACE_OP, session.locator.locate(5),
                                        schema.TEMPORARY)
        self.counts[kind] += 1
        self.bytes_max[kind] = max(self.bytes_max[kind], size)


#: losses whose CPU kernel computes the elementwise loss into its output, then reduces it
#: in place and shrinks the shape (``resize_({})``): the 0-dim loss keeps the input-sized
#: storage while it lives.  Which ones do is measured on this machine's build at start
#: (``KeptLossStorage.measure``), never assumed.
LOSS_CANDIDATES = ("mse_loss", "smooth_l1_loss", "soft_margin_loss", "l1_loss", "huber_loss")


class KeptLossStorage:
    """A fake CPU loss gets the storage capacity the real CPU kernel leaves it (fake
    kernels make a fresh 4-byte scalar).  CUDA kernels are not measured here (no GPU):
    their losses are left as the fake kernels make them."""

    def __init__(self):
        self.kept = self.measure()

    @staticmethod
    def measure() -> frozenset[str]:
        import torch.nn.functional as F
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        kept = set()
        with unset_fake_temporarily():
            x, y = torch.rand(4, 8), torch.rand(4, 8)
            for name in LOSS_CANDIDATES:
                loss = getattr(F, name)(x, y.sign() if name == "soft_margin_loss" else y)
                if loss.untyped_storage().nbytes() == x.untyped_storage().nbytes():
                    kept.add(f"aten::{name}")
        return frozenset(kept)

    def attach(self, session) -> None:
        self._session = session

    def after_op(self, op_name: str, args, out) -> None:
        if op_name not in self.kept or not args or not isinstance(out, torch.Tensor):
            return
        source = args[0]
        if out.device.type != "cpu" or out.dim() != 0 or not isinstance(source, torch.Tensor):
            return
        session = self._session
        session.recorder.check_resize(out.untyped_storage(), op_name, "",
                                      session.locator.locate(3),
                                      size_bytes=source.numel() * out.element_size())
