"""Ops a CUDA build runs as one kernel stay one op under fake execution (fused_kernels.py).

silu's backward on a real GPU is one kernel writing the gradient; the CPU build's composite
fallback for 'cuda' tensors is sigmoid, empty_like, mul, add, mul -- four full-size
temporaries an H100 never made (measured 2026-11-25: +21% peak on a GroupNorm/SiLU U-Net).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from memadvisor.fake.fused_kernels import _decomposed_on_cuda
from memadvisor.trace.io import read_trace

from .test_profile_fake import _profile

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")

SCRIPT = """\
import torch
import torch.nn.functional as F
x = torch.randn(256, 1024, device="cuda", requires_grad=True)
opt = torch.optim.SGD([x], lr=0.1)
for _ in range(2):
    (F.silu(x).sum() + F.mish(x).sum()).backward()
    opt.step()
    opt.zero_grad()
"""


def test_the_set_is_read_from_the_dispatcher():
    names = _decomposed_on_cuda()
    assert "silu_backward" in names and "mish_backward" in names
    assert "gelu_backward" not in names  # one CPU kernel, no composite fallback


def test_silu_and_mish_backward_are_one_op_on_the_simulated_gpu(tmp_path):
    script = tmp_path / "act.py"
    script.write_text(SCRIPT)
    proc, trace_path = _profile(tmp_path, script, "--gpu", "h100-80gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    events = read_trace(trace_path).events
    backward = events[(events["phase"] == "backward") & (events["action"] == "alloc")
                      & (events["step"] == 1)]
    ops = set(backward["op"])
    assert {"aten::silu_backward", "aten::mish_backward"} <= ops, ops
    assert "aten::sigmoid" not in ops and "aten::empty_like" not in ops, ops
    full_bytes = 256 * 1024 * 4
    # each backward kernel makes its output and nothing else of full size (autograd sums
    # the two branches' gradients in place)
    assert (backward["size_bytes"] == full_bytes).sum() == 2
