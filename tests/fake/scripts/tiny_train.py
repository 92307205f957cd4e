"""A small training script written for a GPU, as users write them (fake execution demo).

Run normally on a CPU it trains on the CPU; under fake execution it believes it has the
target GPU.  It records what it saw in ``OBSERVED`` for the tests to check.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

OBSERVED = {}


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, seq, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        OBSERVED.setdefault("attention_dtype", attn.dtype)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as many LMs do

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(x)
        OBSERVED.setdefault("logits_dtype", logits.dtype)
        return logits


def main(steps=2):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    OBSERVED["device"] = device
    OBSERVED["device_name"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    OBSERVED["bf16"] = device == "cuda" and torch.cuda.is_bf16_supported()
    model = TinyLM()
    model = model.cuda() if device == "cuda" else model
    OBSERVED["tied_after_cuda"] = model.head.weight is model.embed.weight
    OBSERVED["param_device"] = str(next(model.parameters()).device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 32))  # a CPU batch, as a data loader yields
        tokens = tokens.to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"loss {loss.item():.4f}")
        if device == "cuda":
            OBSERVED.setdefault("max_memory_allocated", []).append(
                torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
    OBSERVED["losses"] = losses
    OBSERVED["grad_device"] = str(model.embed.weight.device)
    return losses


if __name__ == "__main__":
    main()
