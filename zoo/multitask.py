"""A multi-task model: a shared convolutional encoder over 1-D signals with two heads, a
classification head trained with cross-entropy and a regression head trained with MSE, the
two losses weighted and summed into one backward; Adam with ``StepLR``.

Imitates the style of the common "hard parameter sharing" multi-task training loops
(written here from scratch; random signals whose class and amplitude are the targets).

    python zoo/multitask.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": true,
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class SharedEncoder(nn.Module):
    def __init__(self, channels=16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, channels, 5, padding=2), nn.ReLU(),
            nn.Conv1d(channels, channels, 5, padding=2, stride=2), nn.ReLU(),
            nn.Conv1d(channels, 2 * channels, 5, padding=2, stride=2), nn.ReLU(),
        )

    def forward(self, x):
        return self.net(x).mean(-1)


class MultiTaskNet(nn.Module):
    def __init__(self, num_classes=4, channels=16):
        super().__init__()
        self.encoder = SharedEncoder(channels)
        self.cls_head = nn.Sequential(nn.Linear(2 * channels, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.reg_head = nn.Sequential(nn.Linear(2 * channels, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        features = self.encoder(x)
        return self.cls_head(features), self.reg_head(features).squeeze(-1)


def make_batch(batch_size, length, num_classes, generator):
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
    amplitude = torch.rand(batch_size, generator=generator) * 2
    t = torch.linspace(0, 1, length)
    freq = (labels.float() + 1)[:, None] * 4
    signal = amplitude[:, None] * torch.sin(2 * torch.pi * freq * t)
    signal = signal + 0.1 * torch.randn(batch_size, length, generator=generator)
    return signal.unsqueeze(1), labels, amplitude


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--reg-weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = MultiTaskNet().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    generator = torch.Generator().manual_seed(args.seed)

    for it in range(args.iterations):
        signals, labels, amplitude = make_batch(args.batch_size, args.length, 4, generator)
        signals, labels, amplitude = signals.to(device), labels.to(device), amplitude.to(device)
        class_logits, amplitude_pred = model(signals)
        cls_loss = F.cross_entropy(class_logits, labels)
        reg_loss = F.mse_loss(amplitude_pred, amplitude)
        loss = cls_loss + args.reg_weight * reg_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        print(f"iter {it} cls {cls_loss.item():.4f} reg {reg_loss.item():.4f}")
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
