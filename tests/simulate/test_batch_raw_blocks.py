"""A kernel's raw blocks (no dtype, no shape) sized like a batch-scaled tensor scale with the
batch too: a U-Net's GroupNorm -> in-place SiLU -> convolution chain leaves storages that
oneDNN made raw and an in-place SiLU claims, sized like the activations of *another* module
(the block's convolution), so the same-module rule missed them: the zoo's unet_groupnorm
accum=2 and every data-parallel plan were 27-29% high.  Whether a CPU's kernels make such
blocks is its own business; the prediction is checked against this machine's run."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate

from .loops import measured_peak, profile_steps

BATCH = 4


class Block(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm = nn.GroupNorm(4, c_out)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


def run(accum: int):
    torch.manual_seed(0)
    model = nn.Sequential(Block(3, 8), Block(8, 16), nn.MaxPool2d(2), Block(16, 16),
                          nn.Conv2d(16, 2, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)

    def step():
        x = torch.randn(BATCH, 3, 32, 32, generator=generator)
        y = torch.randint(2, (BATCH, 16, 16), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        micro = BATCH // accum
        for k in range(accum):
            out = model(x[k * micro:(k + 1) * micro])
            (F.cross_entropy(out, y[k * micro:(k + 1) * micro]) / accum).backward()
        optimizer.step()

    return profile_steps(step, 2)


def test_raw_blocks_sized_like_activations_scale():
    baseline, accumulated = run(1), run(2)
    measured = measured_peak(accumulated)
    predicted = simulate(prepare(baseline), Plan.parse("accum=2")).peak_bytes
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)
