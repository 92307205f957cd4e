"""Train an MLP to regress a fixed random nonlinear function.

The target is a frozen random two-layer network, so the data is deterministic
for a given seed and the MSE loss goes down as the regressor learns it.

    python examples/mlp_regressor.py --steps 3
    python examples/mlp_regressor.py --hidden 4096 --depth 8 --in-features 1024 --batch-size 512
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPRegressor(nn.Module):
    def __init__(self, in_features, hidden, depth, out_features=1):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        layers = []
        prev = in_features
        for _ in range(depth):
            layers += [nn.Linear(prev, hidden), nn.ReLU()]
            prev = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(prev, out_features)

    def forward(self, x):
        return self.head(self.body(x))


class RandomTarget:
    """y = tanh(x @ W1) @ W2 with W1, W2 drawn once from the seed."""

    def __init__(self, in_features, out_features, generator, hidden=32):
        self.w1 = torch.randn(in_features, hidden, generator=generator) / in_features**0.5
        self.w2 = torch.randn(hidden, out_features, generator=generator) / hidden**0.5

    def __call__(self, x):
        return torch.tanh(x @ self.w1) @ self.w2


def make_batch(target, batch_size, in_features, generator):
    x = torch.randn(batch_size, in_features, generator=generator)
    with torch.no_grad():
        y = target(x)
    return x, y


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3, help="number of hidden Linear+ReLU layers")
    parser.add_argument("--out-features", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    data_gen = torch.Generator().manual_seed(args.seed)
    target = RandomTarget(args.in_features, args.out_features, data_gen)

    model = MLPRegressor(args.in_features, args.hidden, args.depth, args.out_features).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model has {n_params / 1e6:.3f}M parameters")

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    model.train()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = make_batch(target, args.batch_size, args.in_features, data_gen)
        x, y = x.to(device), y.to(device)

        pred = model(x)
        loss = F.mse_loss(pred, y)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - t0
            print(f"step {step:5d} | loss {loss.item():.6f} | {elapsed:.2f}s")


if __name__ == "__main__":
    main()
