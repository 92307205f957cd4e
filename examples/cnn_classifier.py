"""Train a small VGG-style CNN image classifier on random 3x32x32 images.

Conv / BatchNorm / ReLU stages with max pooling, global average pooling and a
linear head, trained with SGD + momentum + weight decay and cross-entropy --
the shape of a typical CIFAR-10 script, with synthetic data instead of a download.

    python examples/cnn_classifier.py --steps 3
    python examples/cnn_classifier.py --channels 64 --width 4 --image-size 64 --batch-size 128
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def conv_bn_relu(in_channels, out_channels):
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class ConvNet(nn.Module):
    """`num_stages` stages of two conv-bn-relu layers followed by 2x2 max pooling.

    The first stage has `channels` channels and each later stage doubles it,
    scaled overall by `width`.
    """

    def __init__(self, num_classes=10, in_channels=3, channels=16, width=1, num_stages=3):
        super().__init__()
        stages = []
        prev = in_channels
        for i in range(num_stages):
            out = channels * width * 2**i
            stages.append(nn.Sequential(conv_bn_relu(prev, out), conv_bn_relu(out, out), nn.MaxPool2d(2)))
            prev = out
        self.features = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(prev, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(self.pool(x), 1)
        return self.head(x)


def make_batch(batch_size, image_size, num_classes, generator):
    """A batch of random images whose label is encoded in the mean of one channel,
    so the network has something learnable."""
    labels = torch.randint(num_classes, (batch_size,), generator=generator)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    images[:, 0] += (labels.float() / num_classes - 0.5).view(-1, 1, 1)
    return images, labels


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=16, help="channels of the first stage")
    parser.add_argument("--width", type=int, default=1, help="channel multiplier for every stage")
    parser.add_argument("--num-stages", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    data_gen = torch.Generator().manual_seed(args.seed)

    model = ConvNet(
        num_classes=args.num_classes,
        channels=args.channels,
        width=args.width,
        num_stages=args.num_stages,
    ).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model has {n_params / 1e6:.2f}M parameters")

    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        nesterov=True,
    )

    model.train()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        images, labels = make_batch(args.batch_size, args.image_size, args.num_classes, data_gen)
        images, labels = images.to(device), labels.to(device)

        logits = model(images)
        loss = F.cross_entropy(logits, labels)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        if step % args.log_every == 0 or step == args.steps:
            acc = (logits.argmax(dim=1) == labels).float().mean().item()
            elapsed = time.perf_counter() - t0
            print(f"step {step:5d} | loss {loss.item():.4f} | acc {acc:.3f} | {elapsed:.2f}s")


if __name__ == "__main__":
    main()
