"""A GPU training script using what fake profiling must handle: .cuda(), a device picked
by torch.cuda.is_available(), autocast('cuda', bf16), SDPA, non-reentrant checkpoint,
AdamW, a logged loss.item().  Without a GPU it trains on the CPU."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

device = "cuda" if torch.cuda.is_available() else "cpu"


class Block(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, vocab=100, dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


model = Model().cuda() if device == "cuda" else Model()
optimizer = torch.optim.AdamW(model.parameters())
for step in range(3):
    tokens = torch.randint(0, 100, (4, 32), device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().view(-1, 100), tokens.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")  # LOSS-ITEM
