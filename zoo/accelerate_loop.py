"""A training loop driven by Hugging Face ``accelerate``: ``Accelerator()`` built from
flags (``--mixed_precision``, ``--gradient_accumulation_steps``), model, optimizer,
dataloader and scheduler passed through ``accelerator.prepare``, the step inside
``with accelerator.accumulate(model):``, ``accelerator.backward(loss)``, gradient clipping
with ``accelerator.clip_grad_norm_`` and ``accelerator.print``.

Imitates the style of accelerate's ``examples/nlp_example.py`` (written here from scratch;
a small regression MLP-mixer on random features instead of BERT on GLUE).

    python zoo/accelerate_loop.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "accelerate", "iterations": 3, "exact_split": true,
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


class MixerBlock(nn.Module):
    def __init__(self, tokens, dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, tokens=16, in_dim=8, dim=32, depth=2):
        super().__init__()
        self.stem = nn.Linear(in_dim, dim)
        self.blocks = nn.Sequential(*[MixerBlock(tokens, dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.stem(x))).mean(1)).squeeze(-1)


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    features = torch.randn(3 * args.batch_size, 16, 8, generator=g)
    targets = features[:, :, 0].mean(1) + 0.1 * torch.randn(3 * args.batch_size, generator=g)
    train_dataloader = DataLoader(TensorDataset(features, targets), batch_size=args.batch_size, shuffle=True)

    model = Mixer()
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1,
                                                     total_iters=len(train_dataloader))
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)

    step = 0
    for epoch in range(args.num_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                inputs, labels = batch
                outputs = model(inputs)
                loss = nn.functional.mse_loss(outputs, labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            accelerator.print(f"iter {step} epoch {epoch} loss {loss.item():.4f}")
            step += 1
    accelerator.print(f"final_loss={loss.item():.6f}")


def main():
    parser = argparse.ArgumentParser(description="Simple example of a training script.")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    training_function(args)


if __name__ == "__main__":
    main()
