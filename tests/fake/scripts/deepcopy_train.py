"""deepcopy of modules on the GPU (an EMA copy; nn.TransformerEncoder clones its layer)."""
import copy, torch
model = torch.nn.Linear(2, 2).cuda()
ema = copy.deepcopy(model)
layer = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2), 2).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    loss = model(torch.randn(4, 2, device="cuda")).sum() + layer(torch.randn(3, 4, 8, device="cuda")).sum()
    loss.backward(); opt.step(); opt.zero_grad()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 0.1)
print("ok", ema.weight.device, ema.weight is not model.weight)
