"""A GPU prediction counts the GPU's blocks only: host tensors alive during the step (a
DataLoader's batch, pinned buffers, offloaded activations) are in a CUDA trace too, on
'cpu', and the analytic simulator used to add them to the GPU's peak."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from memadvisor.commands.profile_fake import modelled_step_peaks

from .test_profile_fake import CHECKOUT, _profile

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")

SCRIPT = """\
import torch
model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    host = torch.randn(256, 1024, 1024)  # 1 GiB on the host, alive through the step
    batch = host[:64, 0].cuda()
    model(batch).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_host_tensors_are_not_on_the_gpus_peak(tmp_path):
    script = tmp_path / "host.py"
    script.write_text(SCRIPT)
    proc, trace = _profile(tmp_path, script, "--gpu", "h100-80gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    steps, _ = modelled_step_peaks(trace, "cuda:0", 85_017_755_648)
    executed = max(step.peak_allocated_bytes for step in steps)
    result = subprocess.run(
        [sys.executable, "-m", "memadvisor.cli", "simulate", str(trace), "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    assert result.returncode == 0, result.stderr
    predicted = json.loads(result.stdout)["allocated_bytes"]
    assert executed < 2**28  # the GPU holds well under 256 MiB ...
    assert abs(predicted - executed) / executed < 0.01  # ... and so does the prediction (was 2.2 GB)


def test_the_summarys_peak_is_the_gpus(tmp_path):
    script = tmp_path / "host.py"
    script.write_text(SCRIPT)
    proc, trace = _profile(tmp_path, script, "--gpu", "h100-80gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    result = subprocess.run(
        [sys.executable, "-m", "memadvisor.cli", "summary", str(trace), "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["peak_bytes"] < 2**28  # not the 1 GiB host tensor
