"""A small residual CNN written with functional activations and `x = x + ...` residuals:
a realistic case for the in-place advice (benchmarks/inplace_advice.py measures it)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        h = h + x
        return F.relu(h)


class Net(nn.Module):
    def __init__(self, channels=16, blocks=3):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.blocks = nn.ModuleList(Block(channels) for _ in range(blocks))
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        x = x.mean(dim=(2, 3))
        return self.head(x)


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
images = torch.randn(16, 3, 32, 32)
labels = torch.randint(0, 10, (16,))
for step in range(3):
    opt.zero_grad()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    opt.step()
