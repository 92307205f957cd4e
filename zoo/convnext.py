"""A ConvNeXt image classifier: a 4x4 patchify stem, stages of blocks with a 7x7 depthwise
convolution, LayerNorm over channels in channels-last order (``permute``), an inverted
bottleneck MLP of Linear layers with GELU, layer scale and stochastic depth (drop path),
strided-convolution downsampling between stages; AdamW with no weight decay on norms,
biases and layer scales (two parameter groups), a linear-warmup cosine ``LambdaLR``, label
smoothing and gradient-norm clipping.

Imitates the style of timm's ``convnext.py`` and its ``train.py`` loop (written here from
scratch; random images whose class is a colour bias).

    python zoo/convnext.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "drop path draws one keep/drop per sample from the global generator: split batches draw them in another order",
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    return x * random_tensor.div_(keep_prob)


class DropPath(nn.Module):
    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim, drop_path=0.0, ls_init_value=1e-6):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(ls_init_value * torch.ones(dim))
        self.drop_path = DropPath(drop_path)

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x)
        x = x.permute(0, 2, 3, 1)
        x = self.fc2(self.act(self.fc1(self.norm(x))))
        x = x.mul(self.gamma)
        x = x.permute(0, 3, 1, 2)
        return self.drop_path(x) + shortcut


class ConvNeXtStage(nn.Module):
    def __init__(self, in_chs, out_chs, depth, drop_rates):
        super().__init__()
        if in_chs != out_chs:
            self.downsample = nn.Sequential(LayerNorm2d(in_chs, eps=1e-6),
                                            nn.Conv2d(in_chs, out_chs, kernel_size=2, stride=2))
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.Sequential(*[ConvNeXtBlock(out_chs, drop_path=drop_rates[i])
                                      for i in range(depth)])

    def forward(self, x):
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    def __init__(self, num_classes=10, depths=(2, 2), dims=(24, 48), drop_path_rate=0.1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4),
                                  LayerNorm2d(dims[0], eps=1e-6))
        rates = torch.linspace(0, drop_path_rate, sum(depths)).split(list(depths))
        stages, prev = [], dims[0]
        for depth, dim, dp in zip(depths, dims, rates):
            stages.append(ConvNeXtStage(prev, dim, depth, dp.tolist()))
            prev = dim
        self.stages = nn.Sequential(*stages)
        self.norm_pre = nn.Identity()
        self.head_norm = nn.LayerNorm(prev, eps=1e-6)
        self.head = nn.Linear(prev, num_classes)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.trunc_normal_(module.weight, std=.02)
            nn.init.zeros_(module.bias)

    def forward_features(self, x):
        return self.stages(self.stem(x))

    def forward_head(self, x):
        x = x.mean((2, 3))
        return self.head(self.head_norm(x))

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


def param_groups_weight_decay(model, weight_decay):
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim <= 1 or name.endswith(".bias") or name.endswith("gamma"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [{"params": no_decay, "weight_decay": 0.0},
            {"params": decay, "weight_decay": weight_decay}]


def warmup_cosine(warmup, total):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def synthetic_batch(batch_size, img_size, num_classes, generator):
    target = torch.randint(0, num_classes, (batch_size,), generator=generator)
    images = torch.randn(batch_size, 3, img_size, img_size, generator=generator)
    images[:, 1] += (target.float() / num_classes)[:, None, None]
    return images, target


def main():
    parser = argparse.ArgumentParser(description="ConvNeXt training")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps-per-epoch", type=int, default=3)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = ConvNeXt().to(device)
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, args.weight_decay),
                                  lr=args.lr, betas=(0.9, 0.999))
    total = args.epochs * args.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  warmup_cosine(args.warmup_steps, total))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    generator = torch.Generator().manual_seed(args.seed)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch_idx in range(args.steps_per_epoch):
            images, target = synthetic_batch(args.batch_size, args.img_size, 10, generator)
            images, target = images.to(device), target.to(device)
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            scheduler.step()
            print(f"iter {step} epoch {epoch} [{batch_idx}] loss {loss.item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e}")
            step += 1
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
