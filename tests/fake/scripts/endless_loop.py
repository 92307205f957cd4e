"""Control flow on tensor values: under fake execution the loss never gets small."""
import torch

model = torch.nn.Linear(8, 1).cuda()
loss = model(torch.randn(16, 8, device="cuda")).pow(2).mean()
while loss > 1e-3:  # DATA-DEPENDENT
    loss = loss * 0.5
print("converged")
