"""A DDPM-style denoising diffusion model: a small U-Net whose residual blocks add a
sinusoidal timestep embedding (through an MLP) after GroupNorm/SiLU, self-attention at the
lowest resolution, a linear beta schedule, ``q_sample`` noising at random timesteps, an MSE
loss on the predicted noise, gradient clipping, and an exponential moving average of the
weights updated after every optimizer step.

Imitates the style of the popular "denoising-diffusion-pytorch" / DDPM training scripts
(written here from scratch; random 16x16 images).

    python zoo/diffusion_unet.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": true,
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def timestep_embedding(timesteps, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch, time_dim, groups=4):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.time_proj = nn.Linear(time_dim, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x, t_emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_proj(F.silu(t_emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class AttnBlock(nn.Module):
    def __init__(self, ch, groups=4):
        super().__init__()
        self.norm = nn.GroupNorm(groups, ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.proj = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        attn = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), dim=-1)
        out = (v @ attn.transpose(1, 2)).reshape(b, c, h, w)
        return x + self.proj(out)


class DiffusionUNet(nn.Module):
    def __init__(self, ch=16, time_dim=64):
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(ch, time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim))
        self.ch = ch
        self.inc = nn.Conv2d(3, ch, 3, padding=1)
        self.down1 = ResBlock(ch, ch, time_dim)
        self.pool1 = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
        self.down2 = ResBlock(ch, 2 * ch, time_dim)
        self.pool2 = nn.Conv2d(2 * ch, 2 * ch, 3, stride=2, padding=1)
        self.mid1 = ResBlock(2 * ch, 2 * ch, time_dim)
        self.mid_attn = AttnBlock(2 * ch)
        self.mid2 = ResBlock(2 * ch, 2 * ch, time_dim)
        self.up2 = ResBlock(4 * ch, ch, time_dim)
        self.up1 = ResBlock(2 * ch, ch, time_dim)
        self.out_norm = nn.GroupNorm(4, ch)
        self.out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, x, t):
        t_emb = self.time_mlp(timestep_embedding(t, self.ch))
        h1 = self.down1(self.inc(x), t_emb)
        h2 = self.down2(self.pool1(h1), t_emb)
        h = self.pool2(h2)
        h = self.mid2(self.mid_attn(self.mid1(h, t_emb)), t_emb)
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        h = self.up2(torch.cat([h, h2], dim=1), t_emb)
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        h = self.up1(torch.cat([h, h1], dim=1), t_emb)
        return self.out(F.silu(self.out_norm(h)))


class GaussianDiffusion:
    def __init__(self, timesteps=100, beta_start=1e-4, beta_end=0.02, device="cpu"):
        self.timesteps = timesteps
        betas = torch.linspace(beta_start, beta_end, timesteps)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.sqrt_alphas_cumprod = alphas_cumprod.sqrt().to(device)
        self.sqrt_one_minus_alphas_cumprod = (1.0 - alphas_cumprod).sqrt().to(device)

    def q_sample(self, x_start, t, noise):
        return (self.sqrt_alphas_cumprod[t][:, None, None, None] * x_start
                + self.sqrt_one_minus_alphas_cumprod[t][:, None, None, None] * noise)


@torch.no_grad()
def update_ema(ema_model, model, decay):
    for ema_p, p in zip(ema_model.parameters(), model.parameters()):
        ema_p.lerp_(p, 1 - decay)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--ema-decay", type=float, default=0.999)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = DiffusionUNet().to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    diffusion = GaussianDiffusion(device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)
    generator = torch.Generator().manual_seed(args.seed)
    dataset = torch.rand(4 * args.batch_size, 3, args.image_size, args.image_size, generator=generator) * 2 - 1

    for step in range(args.train_steps):
        idx = torch.randint(0, len(dataset), (args.batch_size,), generator=generator)
        x_start = dataset[idx].to(device)
        t = torch.randint(0, diffusion.timesteps, (args.batch_size,), generator=generator).to(device)
        noise = torch.randn(x_start.shape, generator=generator).to(device)
        x_noisy = diffusion.q_sample(x_start, t, noise)
        predicted_noise = model(x_noisy, t)
        loss = F.mse_loss(predicted_noise, noise)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        update_ema(ema, model, args.ema_decay)
        print(f"iter {step} loss {loss.item():.4f}")
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
