"""A convolution's raw kernel blocks follow the batch as the profiler's probe at half the
batch measured them, not as their size suggests.  oneDNN's fp32 convolutions make reorder
buffers of the data (halving with the batch) and of the weights or scratch (not): in the
zoo's ResNet over a DataLoader the data-sized ones (128 KiB at batch 8) matched no tensor's
size, so accumulation and every data-parallel plan kept them whole (+9.5% to +24%), and a
1 KiB weight reorder matched a batch-scaled tensor's size by chance and was halved.  Which
blocks a CPU's kernels make is that CPU's business: the prediction is checked against the
run on the machine running the test, and the probe's classification against the blocks
the accumulated run made."""
import collections

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.simulate.kernel_blocks import conv_blocks_following_batch

from .loops import measured_peak, profile_steps

BATCH = 8


class Residual(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                      nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def run(accum: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          Residual(8, 16, 2), Residual(16, 32, 2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(0)

    def step():
        x = torch.randn(BATCH, 3, 16, 16, generator=generator)
        y = torch.randint(10, (BATCH,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        micro = BATCH // accum
        for k in range(accum):
            out = model(x[k * micro:(k + 1) * micro])
            (F.cross_entropy(out, y[k * micro:(k + 1) * micro]) / accum).backward()
        optimizer.step()

    return profile_steps(step, 2)


def _conv_blocks(timeline) -> collections.Counter:
    """(module, op, bytes) of every convolution raw block the step made."""
    raw = np.array([timeline.dtypes[d] == "bytes" for d in timeline.dtype], bool)
    conv = np.array(["convolution" in timeline.ops[o] for o in timeline.op], bool)
    rows = np.flatnonzero(raw & conv & (timeline.alloc_key >= 0))
    return collections.Counter((timeline.modules[timeline.module[r]],
                                timeline.ops[timeline.op[r]], int(timeline.size[r]))
                               for r in rows)


def test_conv_blocks_follow_the_batch_as_probed():
    baseline, accumulated = run(1), run(2)
    assert baseline.meta.probes.get("convolution"), "the profiler probed no convolution"
    base = prepare(baseline)
    rows, follows = conv_blocks_following_batch(base.timeline, baseline.meta.probes)
    conv_raw = sum(_conv_blocks(base.timeline).values())
    assert len(rows) == conv_raw  # every block of every call matched its probe
    # what the probe says the blocks become at half the batch is what the accumulated
    # run made (twice as many calls, each block halved or kept)
    expected = collections.Counter()
    t = base.timeline
    for row, halves in zip(rows, follows):
        size = int(t.size[row]) // 2 if halves else int(t.size[row])
        expected[(t.modules[t.module[row]], t.ops[t.op[row]], size)] += 2
    assert expected == _conv_blocks(prepare(accumulated).timeline)
    measured = measured_peak(accumulated)
    predicted = simulate(base, Plan.parse("accum=2")).peak_bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
