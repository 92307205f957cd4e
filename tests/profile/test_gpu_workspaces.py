"""The GPU library blocks that are no tensor, as fake execution adds them
(memadvisor/profile/kernel_memory.py), against what an H100 did (docs/FAKE.md, "GPU
workspaces measured on an H100"; the measurements: tests/fixtures/gpu_h100/
workspaces_h100.json.gz, made by probe_workspaces.py beside it)."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memadvisor.profile.kernel_memory import (
    CONV_EXTRA_BYTES, CONV_SLACK_BYTES, MiB, _runs_gemm_and_bias, conv_workspace_bytes,
    cublaslt_workspace_bytes)

CHECKOUT = Path(__file__).resolve().parents[2]
MEASURED = CHECKOUT / "tests" / "fixtures" / "gpu_h100" / "workspaces_h100.json.gz"
KINDS = {"fwd": "forward", "dgrad": "dgrad", "wgrad": "wgrad"}


def _measured() -> dict:
    return json.loads(gzip.decompress(MEASURED.read_bytes()))


def _rule(case: dict, kind: str) -> int:
    """The rule's bytes for one measured convolution kernel (transposed convolutions are
    measured but named by the kernel cuDNN ran, so they are checked on their own)."""
    dims = 1 if case["kind"] == "conv1d" else 2
    shape = (case["Cout"], case["Cin"] // case["groups"]) + (case["k"],) * dims
    weight = torch.empty(shape, dtype=getattr(torch, case["dtype"]), device="meta")
    pad = case["k"] // 2
    return conv_workspace_bytes(kind, in_bytes=case["in_bytes"], out_bytes=case["out_bytes"],
                                weight=weight, stride=(case["stride"],) * dims,
                                padding=(pad,) * dims, groups=case["groups"],
                                channels_last=case["fmt"] == "cl")


def _kernels():
    for case in _measured()["convs"]:
        if case["kind"] == "convT":
            continue
        for short, kind in KINDS.items():
            yield case, kind, case["ws"][short]


def test_the_measurements_are_the_h100s():
    measured = _measured()
    assert measured["dev"] == "NVIDIA H100 80GB HBM3" and measured["cap"] == [9, 0]
    assert measured["torch"].startswith("2.11") and measured["cudnn"] == 91900
    # cuDNN's heuristic choice is the same every time in a process (what the rule assumes):
    # the probe's repeat, and cnn_large's step-3 snapshot, took these exact bytes
    assert measured["repeat"]["ws"] == {"fwd": [1080623667], "dgrad": [1074331795],
                                        "wgrad": [1082589863]}


@pytest.mark.parametrize("engine", ["any"])
def test_where_the_rule_falls_short_of_a_measured_kernel_and_by_how_much(engine):
    """Of the 156 kernels measured, those that took more than the rule: a few NCHW
    forwards (the NHWC plan's own workspace, up to 6 MiB) and data gradients (2 MiB), and
    16-bit weight gradients (up to 15.75 MiB against the rule's 8.25), besides the <= 400 B
    of 1x1 forwards and data gradients (counted as none)."""
    kernels = over = 0
    short = {"forward": [], "dgrad": [], "wgrad": []}
    for case, kind, sizes in _kernels():
        rule = _rule(case, kind)
        for size in sizes:
            kernels += 1
            over = max(over, rule - size)
            if size > rule + 400:
                short[kind].append((case["dtype"], size - rule))
    assert kernels == 156
    assert len(short["forward"]) == 4 and max(b for _, b in short["forward"]) <= 6 * MiB
    assert len(short["dgrad"]) == 1 and max(b for _, b in short["dgrad"]) <= 2 * MiB
    assert {dtype for dtype, _ in short["wgrad"]} == {"bfloat16"}
    assert max(b for _, b in short["wgrad"]) <= 7.5 * MiB
    # and where it is wrong upwards it can be far off: a 3-channel stem's 16 MiB forward
    # is predicted as the whole layout transform (524 MiB)
    assert over > 500 * MiB


@pytest.mark.parametrize("engine", ["any"])
def test_nchw_convolutions_take_input_output_and_weight(engine):
    """The NCHW kernels of 8+ input channels transform all three tensors to NHWC inside
    their workspace and then run the NHWC plan: in + out + weight + that plan's workspace,
    which the channels-last run of the same convolution takes alone."""
    extras = {"forward": [], "dgrad": [], "wgrad": []}
    cases = _measured()["convs"]
    for case, kind, sizes in _kernels():
        if case["fmt"] != "nchw" or case["k"] == 1 or case["Cin"] < 8 or case["groups"] > 1 \
                or case["in_bytes"] + case["out_bytes"] < 16 * MiB:
            continue
        io = case["in_bytes"] + case["out_bytes"] + case["w_bytes"]
        extras[kind] += [size - io for size in sizes]
        twin = [c for c in cases if c["fmt"] == "cl" and all(
            c[key] == case[key] for key in ("N", "Cin", "Cout", "H", "k", "dtype"))]
        if twin and kind == "wgrad":
            assert abs(twin[0]["ws"]["wgrad"][0] - (sizes[0] - io)) <= 400
    assert len(extras["forward"]) == len(extras["dgrad"]) == 31
    # a forward may transform fewer tensors (then it is smaller)
    assert sum(1 for v in extras["forward"] if 0 <= v <= 147) == 25
    assert sum(1 for v in extras["dgrad"] if 0 <= v <= 147) == 30
    assert max(extras["wgrad"]) <= 16 * MiB
    assert max(extras["forward"]) <= 6 * MiB + 1024 and max(extras["dgrad"]) <= 2 * MiB + 1024


@pytest.mark.parametrize("engine", ["any"])
def test_pointwise_weight_gradients_are_64_fp32_weights(engine):
    for case, kind, sizes in _kernels():
        if case["k"] == 1 and case["stride"] == 1 and kind == "wgrad":
            assert 0 <= _rule(case, kind) - sizes[0] <= CONV_SLACK_BYTES, case


@pytest.mark.parametrize("engine", ["any"])
def test_the_cublaslt_workspace_is_a_1_mib_block_of_gemm_and_bias(engine):
    blocks = _measured()["blas"]["allocs"]
    lt = [b for b in blocks if b["sig"][0] == "at::cuda::getCUDABlasLtWorkspace"]
    # made by the first addmm with a bias (Linear's), once for the main stream and once
    # for another; bf16 Linear and the backward (mm + sum) made none
    assert [(b["stage"], b["size"]) for b in lt] == [("addmm_f32", 1 << 20),
                                                     ("linear_bias_other_stream", 1 << 20)]
    assert cublaslt_workspace_bytes({}) == 1 << 20
    assert cublaslt_workspace_bytes({"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 << 20
    assert cublaslt_workspace_bytes({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0


@pytest.mark.parametrize("engine", ["any"])
def test_which_ops_run_gemm_and_bias(engine):
    def meta(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta")
    out = meta(32, 64)
    assert _runs_gemm_and_bias("aten::addmm", (meta(64), meta(32, 16), meta(16, 64)), out)
    assert _runs_gemm_and_bias("aten::addmm", (meta(64, dtype=torch.bfloat16),),
                               meta(32, 64, dtype=torch.bfloat16))
    # a 2-D self (beta * C) is plain cuBLAS; so are mm and float64
    assert not _runs_gemm_and_bias("aten::addmm", (meta(32, 64),), out)
    assert not _runs_gemm_and_bias("aten::mm", (meta(32, 16), meta(16, 64)), out)
    assert not _runs_gemm_and_bias("aten::addmm", (meta(64, dtype=torch.float64),),
                                   meta(32, 64, dtype=torch.float64))


SCRIPT = '''
import torch, torch.nn as nn
model = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(64, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    x = torch.randn(32, 64, 64, 64, device="cuda", requires_grad=True)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
'''


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="no C++ compiler (the fake CUDA shim)")
def test_a_fake_h100_run_has_the_lt_workspace_and_the_conv_workspaces(tmp_path, engine):
    if engine != "dispatch":
        pytest.skip("fake execution always records with the dispatch engine")
    from memadvisor.trace.io import read_trace
    script = tmp_path / "convnet.py"
    script.write_text(SCRIPT)
    trace_path = tmp_path / "convnet.trace"
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
                 "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "memadvisor.cli", "profile", "--fake", "--gpu",
                           "h100-80gb", str(script), "-o", str(trace_path), "--steps", "0"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    events = read_trace(trace_path).events
    lt = events[events.op == "cublaslt_workspace"]
    assert list(lt.action) == ["alloc"] and list(lt.size_bytes) == [1 << 20]
    assert list(lt.phase) == ["forward"] and set(lt.category) == {"other"}
    # the cuBLAS pair is unchanged: forward's thread and autograd's
    assert list(events[events.op == "cublas_workspace"].phase) == ["forward", "backward"]
    conv = events[events.op == "cudnn_conv_workspace"]
    io = 2 * 32 * 64 * 64 * 64 * 4 + 64 * 64 * 9 * 4 + CONV_SLACK_BYTES
    allocs = conv[conv.action == "alloc"]
    # per step: the forward's, then the backward's data and weight gradients; each freed
    assert list(allocs.size_bytes[:3]) == [io + CONV_EXTRA_BYTES["forward"],
                                           io + CONV_EXTRA_BYTES["dgrad"],
                                           io + CONV_EXTRA_BYTES["wgrad"]]
    assert list(allocs.phase[:3]) == ["forward", "backward", "backward"]
    assert (conv.action == "free").sum() == len(allocs) == 6
    assert set(allocs.category) == {"temporary"}
