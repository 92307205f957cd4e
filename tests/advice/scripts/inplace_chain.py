"""A small training loop whose forward scales, shifts and rectifies a large hidden tensor
out of place: both moments hold two copies of it (the in-place advice's measured case),
and ends with a residual whose input fc2 saves for backward (an in-place change refused)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.fc = nn.Linear(width, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        h = x * 2.0
        h = h - 1.0
        h = F.relu(h)
        out = self.fc(h)
        out = out + self.fc2(out)
        return out


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4096, 64)
y = torch.randn(4096, 8)
for step in range(3):
    opt.zero_grad()
    out = model(x)
    loss = F.mse_loss(out, y)
    loss.backward()
    opt.step()
