"""A small convolutional network trained on the CPU, in bf16 autocast when asked
(``--bf16``), its middle checkpointed when asked (``--checkpoint``: checkpoint keeps the
CPU generator's state, a tensor made outside any op): the kernels here allocate blocks of
their own (oneDNN scratch, im2col buffers), which a fake CPU run must show as the real run
does."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--bf16", action="store_true")
parser.add_argument("--checkpoint", action="store_true")
options = parser.parse_args()



class Middle(nn.Sequential):
    def forward(self, x):
        if options.checkpoint:
            return checkpoint(super().forward, x, use_reentrant=False)
        return super().forward(x)


model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
    Middle(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32), nn.SiLU(),
           nn.Dropout(0.1)),
    nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
    nn.Conv2d(16, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(options.steps):
    images = torch.randn(8, 3, 32, 32)
    labels = torch.randint(0, 10, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.bf16):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.3f}")
