"""Train a small Vision Transformer (ViT) image classifier on random 3x32x32 images.

Patch embedding by a strided convolution, a learned class token and position embedding,
pre-norm transformer blocks (multi-head self-attention through
``F.scaled_dot_product_attention``, a GELU MLP, dropout), a LayerNorm + linear head,
AdamW and label-smoothed cross-entropy: the shape of a typical ViT fine-tuning script,
with synthetic data instead of a download.

    python examples/vit_classifier.py --steps 3
    python examples/vit_classifier.py --d-model 192 --depth 12 --heads 3 --batch-size 64
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d_model, heads, dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model, heads, dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image_size=32, patch=4, d_model=64, depth=2, heads=4, num_classes=10,
                 dropout=0.1):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d_model, kernel_size=patch, stride=patch)
        tokens = (image_size // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, d_model) * 0.02)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, tokens, C)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.dropout(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def make_batch(batch_size, image_size, num_classes, generator):
    labels = torch.randint(num_classes, (batch_size,), generator=generator)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    images[:, 0] += (labels.float() / num_classes - 0.5).view(-1, 1, 1)
    return images, labels


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    data_gen = torch.Generator().manual_seed(args.seed)
    model = ViT(args.image_size, args.patch, args.d_model, args.depth, args.heads,
                args.num_classes, args.dropout).to(device)
    print(f"model has {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    model.train()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        images, labels = make_batch(args.batch_size, args.image_size, args.num_classes, data_gen)
        images, labels = images.to(device), labels.to(device)
        loss = F.cross_entropy(model(images), labels, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step:4d} | loss {loss.item():.4f} | {time.perf_counter() - t0:.2f}s")


if __name__ == "__main__":
    main()
