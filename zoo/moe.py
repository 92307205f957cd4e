"""A small mixture-of-experts language model: each block's feed-forward is a sparse MoE
layer whose router picks the top-2 of 4 SwiGLU experts per token (softmax over the chosen
logits), tokens gathered per expert with ``torch.where`` and scattered back with
``index_add_``, plus a Switch-Transformer load-balancing loss added to the LM loss.

Imitates the style of Mixtral's ``SparseMoeBlock`` and the common "MoE from scratch"
training scripts (written here from scratch; random tokens).

    python zoo/moe.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "the load-balancing loss is a product of two batch means",
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, dim, hidden, num_experts=4, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))

    def forward(self, hidden_states):
        batch, seq, dim = hidden_states.shape
        tokens = hidden_states.view(-1, dim)
        router_logits = self.gate(tokens)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        topk_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        topk_weights = (topk_weights / topk_weights.sum(dim=-1, keepdim=True)).to(tokens.dtype)
        final = torch.zeros_like(tokens)
        expert_mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx, expert in enumerate(self.experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.numel() == 0:
                continue
            current = expert(tokens[top_x]) * topk_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(tokens.dtype))
        # Switch-style auxiliary loss: fraction routed x mean router probability, per expert
        fraction = F.one_hot(selected[:, 0], self.num_experts).float().mean(0)
        probability = routing_weights.mean(0)
        aux_loss = self.num_experts * (fraction * probability).sum()
        return final.view(batch, seq, dim), aux_loss


class MoeLayer(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.moe = SparseMoeBlock(dim, hidden)

    def forward(self, x, causal_mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        moe_out, aux = self.moe(self.ln2(x))
        return x + moe_out, aux


class MoeLM(nn.Module):
    def __init__(self, vocab=128, dim=32, heads=2, hidden=64, layers=2, max_len=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.layers = nn.ModuleList(MoeLayer(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        t = idx.size(1)
        causal = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.embed(idx) + self.pos[:, :t]
        aux_total = 0.0
        for layer in self.layers:
            x, aux = layer(x, causal)
            aux_total = aux_total + aux
        return self.lm_head(self.norm(x)), aux_total / len(self.layers)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--aux-loss-coef", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = MoeLM(max_len=args.seq_len).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        batch = torch.randint(0, 128, (args.batch_size, args.seq_len + 1), generator=generator)
        x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
        logits, aux_loss = model(x)
        lm_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss = lm_loss + args.aux_loss_coef * aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"iter {step} lm {lm_loss.item():.4f} aux {aux_loss.item():.4f}")
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
