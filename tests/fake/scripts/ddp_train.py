"""A script that wraps its own model in DDP (as torchrun scripts do), for fake ranks."""
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
model = DDP(torch.nn.Linear(1024, 1024, bias=False).cuda(), device_ids=[rank])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    loss = model(torch.randn(4, 1024, device="cuda")).sum()
    loss.backward(); opt.step(); opt.zero_grad()
print("ok")
