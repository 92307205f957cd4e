"""A 16-bit plan leaves the GPU blocks no dtype changes alone: the cuBLAS and cuBLASLt
workspaces (per handle and stream) and fp32 accumulators.  A backward cuBLAS workspace of
32 MiB is exactly the size of a 16-bit activation of 2,048 x 4,096 fp32 values, and the
simulator's rule for data-sized kernel blocks halved it (seen on the Llama decoder against
the H100: 'other' 64 -> 48 MiB)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from memadvisor.profile import attention_workspace, kernel_memory, reduction_buffers
from memadvisor.simulate.kernel_blocks import DTYPE_INDEPENDENT_BLOCKS

from .test_profile_fake import CHECKOUT, _profile

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")


def test_the_names_are_the_ones_the_rules_write():
    assert DTYPE_INDEPENDENT_BLOCKS == {kernel_memory.WORKSPACE_OP,
                                        kernel_memory.LT_WORKSPACE_OP,
                                        attention_workspace.WORKSPACE_OP,
                                        reduction_buffers.BUFFER_OP}


SCRIPT = """\
import torch
model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2048, 2048, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_an_amp_plan_keeps_the_library_workspaces(tmp_path):
    script = tmp_path / "wide.py"
    script.write_text(SCRIPT)
    proc, trace = _profile(tmp_path, script, "--gpu", "h100-80gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    result = subprocess.run(
        [sys.executable, "-m", "memadvisor.cli", "simulate", str(trace), "--plan",
         "precision=amp-bf16", "--json"], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["by_category"]["other"] == plan["baseline_by_category"]["other"]
    assert plan["baseline_by_category"]["other"] >= 2 * 32 * 2**20  # both cuBLAS handles
