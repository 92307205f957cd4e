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
capability, ``CUBLAS_WORKSPACE_CONFIG``); cuBLASLt shares the workspace by default.
"""
from __future__ import annotations

import threading

import torch

from ..gpus import cublas_workspace_bytes
from ..trace import schema
from .recorder import _SID

#: aten ops whose CUDA kernels call cuBLAS (as a dispatch mode names them, after
#: decomposition: linear and matmul arrive as mm/addmm/bmm)
CUBLAS_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
    "aten::addmv", "aten::dot", "aten::vdot", "aten::_addmm_activation", "aten::_scaled_mm",
    "aten::_int_mm", "aten::linear", "aten::matmul",
})
WORKSPACE_OP = "cublas_workspace"  #: the op name the snapshot importer gives them too


class CublasWorkspaces:
    """Adds one ``cublas_workspace`` row (category 'other', never freed) the first time
    each cuBLAS handle and stream would run: per (thread, device, stream), where every op
    inside autograd's backward counts as autograd's device thread."""

    def __init__(self, capability: tuple[int, int], config: str | None = None):
        self.workspace_bytes = cublas_workspace_bytes(capability, config)
        self._seen: set[tuple] = set()
        #: one dict per workspace added: device, phase, step-independent (for the trace's meta)
        self.made: list[dict] = []
        self._session = None

    def attach(self, session) -> None:
        self._session = session

    def after_op(self, op_name: str, args, out) -> None:
        if op_name not in CUBLAS_OPS:
            return
        tensor = out[0] if isinstance(out, (tuple, list)) and out else out
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            return
        device_index = tensor.device.index or 0
        in_backward = torch._C._current_graph_task_id() != -1
        thread = "autograd" if in_backward else threading.get_ident()
        stream = torch.cuda.current_stream(device_index).stream_id
        key = (thread, device_index, stream)
        if key in self._seen:
            return
        self._seen.add(key)
        self._add(f"cuda:{device_index}", op_name, in_backward, stream)

    def _add(self, device: str, op_name: str, in_backward: bool, stream: int) -> None:
        session = self._session
        recorder = session.recorder
        row = recorder.internal_alloc(self.workspace_bytes, device, WORKSPACE_OP,
                                      session.locator.locate(3))
        recorder.mark_sid(recorder.rows[row][_SID], schema.OTHER)
        self.made.append({"device": device, "bytes": self.workspace_bytes,
                          "thread": "autograd backward" if in_backward else "python",
                          "first_op": op_name, "stream": stream, "phase": recorder.phase})


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
