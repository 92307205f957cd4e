"""The memory-efficient attention backward's dQ workspace under fake execution
(memadvisor/profile/attention_workspace.py), against sizes an H100 allocated."""
from __future__ import annotations

import shutil

import pytest

from memadvisor.profile.attention_workspace import WORKSPACE_OP, workspace_bytes
from memadvisor.trace.io import read_trace

from .test_profile_fake import _profile

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")


@pytest.mark.parametrize("shape, measured_bytes", [
    ((128, 4, 1024, 16), 134_348_800),  # zoo/llama_decoder.py --batch-size 128 --seq-len 1024
    ((64, 6, 197, 64), 25_190_400),  # examples/vit_classifier.py at 224 px, patch 16
])
def test_the_rule_gives_what_an_h100_allocated(shape, measured_bytes):
    assert workspace_bytes(*shape) == measured_bytes


def test_with_dropout_a_key_gradient_accumulates_too():
    # zoo/seq2seq_transformer.py --batch-size 64 --emb-size 512: 8 heads of 64, L <= 64
    assert workspace_bytes(64, 8, 40, 64, bias=True, dropout=True) == 16_785_408


def test_a_mask_alone_adds_sixteen_bytes_per_head():
    # zoo/moe.py: causal nn.MultiheadAttention, 16 batch x heads, one tile each
    assert workspace_bytes(8, 2, 32, 64, bias=True) == 262_656


SCRIPT = """\
import torch
import torch.nn.functional as F
q = torch.randn(2, 3, 100, 32, device="cuda", requires_grad=True)
k = torch.randn(2, 3, 100, 32, device="cuda", requires_grad=True)
v = torch.randn(2, 3, 100, 32, device="cuda", requires_grad=True)
opt = torch.optim.SGD([q, k, v], lr=0.1)
for _ in range(2):
    F.scaled_dot_product_attention(q, k, v).sum().backward()  # fp32: the efficient kernel
    opt.step()
    opt.zero_grad()
"""


def test_each_efficient_backward_adds_its_transient_workspace(tmp_path):
    script = tmp_path / "attn.py"
    script.write_text(SCRIPT)
    proc, trace_path = _profile(tmp_path, script, "--gpu", "h100-80gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    events = read_trace(trace_path).events
    rows = events[events["op"] == WORKSPACE_OP]
    allocs = rows[rows["action"] == "alloc"]
    assert len(allocs) == 2 and set(allocs["phase"]) == {"backward"}
    assert set(allocs["size_bytes"]) == {workspace_bytes(2, 3, 100, 32)}
    assert set(allocs["category"]) == {"temporary"}
    assert (rows["action"] == "free").sum() == 2  # freed at the kernel's end


def test_cudnn_attention_backward_workspace_is_the_h100_measurement():
    from memadvisor.profile.attention_workspace import cudnn_workspace_bytes
    assert cudnn_workspace_bytes(64, 6, 197, 64) == 19_668_992  # bf16 ViT, torch 2.11


def test_torch_prefers_cudnn_attention_on_hopper_only(monkeypatch):
    from memadvisor.fake.sdpa import prefers_cudnn
    assert prefers_cudnn((9, 0), environ={})
    assert prefers_cudnn((10, 0), environ={})
    assert not prefers_cudnn((8, 0), environ={}) and not prefers_cudnn((8, 9), environ={})
    assert not prefers_cudnn((9, 0), environ={"TORCH_CUDNN_SDPA_PREFERRED": "0"})


BF16_SCRIPT = """\
import torch
import torch.nn.functional as F
q = torch.randn(2, 3, 100, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
opt = torch.optim.SGD([q], lr=0.1)
for _ in range(2):
    F.scaled_dot_product_attention(q, q, q).float().sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("gpu, op", [("h100-80gb", "aten::_scaled_dot_product_cudnn_attention"),
                                     ("a100-80gb", "aten::_scaled_dot_product_flash_attention")])
def test_bf16_attention_runs_the_kernel_torch_prefers_there(gpu, op, tmp_path):
    from memadvisor.profile.attention_workspace import cudnn_workspace_bytes
    script = tmp_path / "attn_bf16.py"
    script.write_text(BF16_SCRIPT)
    proc, trace_path = _profile(tmp_path, script, "--gpu", gpu, "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    events = read_trace(trace_path).events
    assert op in set(events["op"])
    workspaces = events[(events["op"] == WORKSPACE_OP) & (events["action"] == "alloc")]
    if "cudnn" in op:
        assert set(workspaces["size_bytes"]) == {cudnn_workspace_bytes(2, 3, 100, 32)}
    else:
        assert workspaces.empty  # flash's own workspace is not modelled (not measured)
