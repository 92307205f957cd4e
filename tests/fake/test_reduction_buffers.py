"""CUDA reductions' global-reduce staging buffers under fake execution
(memadvisor/profile/reduction_buffers.py, a port of Reduce.cuh's setReduceConfig), against
the buffers an H100 allocated for a ViT's bias gradients (12,608 rows)."""
from __future__ import annotations

import shutil

import pytest

from memadvisor.profile.reduction_buffers import (BUFFER_OP, max_threads_per_sm,
                                                  staging_bytes)
from memadvisor.trace.io import read_trace

from .test_profile_fake import _profile

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")
H100 = dict(sm_count=132, threads_per_sm=max_threads_per_sm((9, 0)))


@pytest.mark.parametrize("features, measured_bytes", [
    (1536, 138_412_032), (1152, 116_195_328), (384, 38_731_776)])
def test_bias_gradient_sums_match_the_h100(features, measured_bytes):
    buffer, semaphores = staging_bytes((12608, features), (features, 1), [0], 4, **H100)
    assert buffer == measured_bytes
    assert semaphores == 4 * features // 128  # one int per block of 32 x 4 outputs
    # the same sum written over the 3-D activation coalesces to the same reduction
    assert staging_bytes((64, 197, features), (197 * features, features, 1), [0, 1], 4,
                         **H100)[0] == measured_bytes


def test_reductions_that_fit_one_block_per_output_take_no_buffer():
    assert staging_bytes((64, 197, 1536), (197 * 1536, 1536, 1), [2], 4, **H100) == (0, 0)
    assert staging_bytes((8, 16), (16, 1), [0], 4, **H100) == (0, 0)


def test_the_sm_count_moves_the_split():
    small = staging_bytes((12608, 1536), (1536, 1), [0], 4, sm_count=40, threads_per_sm=2048)
    assert 0 < small[0] < 138_412_032


SCRIPT = """\
import torch
layer = torch.nn.Linear(512, 1024, device="cuda")
x = torch.randn(32, 200, 512, device="cuda")
opt = torch.optim.SGD(layer.parameters(), lr=0.1)
for _ in range(2):
    layer(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_bias_gradient_adds_its_staging_buffer(tmp_path):
    script = tmp_path / "bias.py"
    script.write_text(SCRIPT)
    proc, trace_path = _profile(tmp_path, script, "--gpu", "h100-80gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    events = read_trace(trace_path).events
    rows = events[(events["op"] == BUFFER_OP) & (events["action"] == "alloc")
                  & (events["phase"] == "backward")]
    expected = staging_bytes((6400, 1024), (1024, 1), [0], 4, **H100)[0]
    assert expected > 0 and expected in set(rows["size_bytes"])
    assert set(rows["category"]) == {"temporary"}
