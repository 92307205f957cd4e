"""A U-Net for binary segmentation: double-convolution blocks with GroupNorm and SiLU, max
pooling down, transposed convolutions up, skip connections joined with ``torch.cat``, and a
loss of BCE-with-logits plus soft Dice.  AdamW.

Imitates the style of the widely copied "U-Net in PyTorch" implementations (milesial-style
``unet_parts.py``), with GroupNorm/SiLU as in modern variants (written here from scratch;
random images whose mask is a bright disc).

    python zoo/unet_groupnorm.py
"""
# zoo: {"batch_size": 4, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "soft Dice is a ratio of sums over the batch",
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class DoubleConv(nn.Module):
    """(convolution => GroupNorm => SiLU) * 2"""

    def __init__(self, in_channels, out_channels, groups=4):
        super().__init__()
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.GroupNorm(groups, out_channels),
            nn.SiLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.GroupNorm(groups, out_channels),
            nn.SiLU(inplace=True),
        )

    def forward(self, x):
        return self.double_conv(x)


class Down(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))

    def forward(self, x):
        return self.maxpool_conv(x)


class Up(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1, x2):
        x1 = self.up(x1)
        diff_y, diff_x = x2.size(2) - x1.size(2), x2.size(3) - x1.size(3)
        x1 = F.pad(x1, [diff_x // 2, diff_x - diff_x // 2, diff_y // 2, diff_y - diff_y // 2])
        return self.conv(torch.cat([x2, x1], dim=1))


class UNet(nn.Module):
    def __init__(self, n_channels=3, n_classes=1, base=8):
        super().__init__()
        self.inc = DoubleConv(n_channels, base)
        self.down1 = Down(base, base * 2)
        self.down2 = Down(base * 2, base * 4)
        self.up1 = Up(base * 4, base * 2)
        self.up2 = Up(base * 2, base)
        self.outc = nn.Conv2d(base, n_classes, kernel_size=1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x = self.up1(x3, x2)
        x = self.up2(x, x1)
        return self.outc(x)


def dice_loss(logits, target, eps=1e-6):
    prob = torch.sigmoid(logits)
    inter = (prob * target).sum()
    return 1 - (2 * inter + eps) / (prob.sum() + target.sum() + eps)


def disc_batch(batch_size, size, generator):
    yy, xx = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    centers = torch.rand(batch_size, 2, generator=generator) * size
    radius = 3 + torch.rand(batch_size, generator=generator) * size / 4
    d = ((yy - centers[:, 0, None, None]) ** 2 + (xx - centers[:, 1, None, None]) ** 2).sqrt()
    masks = (d < radius[:, None, None]).float().unsqueeze(1)
    images = torch.randn(batch_size, 3, size, size, generator=generator) * 0.3 + masks
    return images, masks


def main():
    parser = argparse.ArgumentParser(description="Train a U-Net")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = UNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    criterion = nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(args.seed)

    model.train()
    for global_step in range(args.iterations):
        images, true_masks = disc_batch(args.batch_size, args.size, generator)
        images, true_masks = images.to(device), true_masks.to(device)
        masks_pred = model(images)
        loss = criterion(masks_pred, true_masks) + dice_loss(masks_pred, true_masks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"iter {global_step} loss {loss.item():.4f}")
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
