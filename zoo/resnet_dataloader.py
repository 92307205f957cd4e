"""A CIFAR-style ResNet trained from a ``DataLoader`` with two worker processes whose
dataset applies hand-written augmentation transforms: random crop with padding, random
horizontal flip, to-tensor and per-channel normalisation, composed like torchvision's
``transforms.Compose`` (the flip and the normalisation are ``nn.Module``s, as torchvision's
are).  BasicBlock ResNet with BatchNorm, SGD with Nesterov momentum and ``OneCycleLR``.

Imitates the style of the usual CIFAR-10 ResNet training scripts (kuangliu-style
``main.py``) (written here from scratch; random uint8 images).

    python zoo/resnet_dataloader.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "BatchNorm normalises each micro-batch with its own statistics",
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, img):
        for t in self.transforms:
            img = t(img)
        return img


class RandomCrop:
    """Pad an HWC uint8 array by ``padding`` on each side and crop ``size`` at random."""

    def __init__(self, size, padding):
        self.size, self.padding = size, padding

    def __call__(self, img):
        p = self.padding
        img = np.pad(img, ((p, p), (p, p), (0, 0)), mode="constant")
        top = np.random.randint(0, img.shape[0] - self.size + 1)
        left = np.random.randint(0, img.shape[1] - self.size + 1)
        return img[top:top + self.size, left:left + self.size]


class ToTensor:
    def __call__(self, img):
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))).float().div(255)


class RandomHorizontalFlip(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, img):
        if torch.rand(1).item() < self.p:
            return img.flip(-1)
        return img


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, tensor):
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / std


class RandomImages(Dataset):
    def __init__(self, n, size, num_classes, transform, seed):
        rng = np.random.RandomState(seed)
        self.images = rng.randint(0, 256, (n, size, size, 3), dtype=np.uint8)
        self.targets = rng.randint(0, num_classes, n)
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.transform(self.images[index]), int(self.targets[index])


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, block, num_blocks, num_classes=10, width=8):
        super().__init__()
        self.in_planes = width
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(block, width, num_blocks[0], 1)
        self.layer2 = self._make_layer(block, 2 * width, num_blocks[1], 2)
        self.layer3 = self._make_layer(block, 4 * width, num_blocks[2], 2)
        self.linear = nn.Linear(4 * width * block.expansion, num_classes)

    def _make_layer(self, block, planes, num_blocks, stride):
        layers = []
        for s in [stride] + [1] * (num_blocks - 1):
            layers.append(block(self.in_planes, planes, s))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def seed_worker(worker_id):
    worker_seed = torch.initial_seed() % 2 ** 32
    np.random.seed(worker_seed)


def main():
    parser = argparse.ArgumentParser(description="CIFAR-style ResNet")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    torch.manual_seed(args.seed)
    transform_train = Compose([
        RandomCrop(args.image_size, padding=2),
        ToTensor(),
        RandomHorizontalFlip(),
        Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    ])
    trainset = RandomImages(3 * args.batch_size, args.image_size, 10, transform_train, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    trainloader = DataLoader(trainset, batch_size=args.batch_size, shuffle=True,
                             num_workers=args.workers, worker_init_fn=seed_worker, generator=g)

    net = ResNet(BasicBlock, [1, 1, 1])
    net = net.to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4,
                                nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(trainloader))

    step = 0
    for epoch in range(args.epochs):
        net.train()
        train_loss, correct, total = 0.0, 0, 0
        for batch_idx, (inputs, targets) in enumerate(trainloader):
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()
            scheduler.step()
            train_loss += loss.item()
            correct += outputs.argmax(1).eq(targets).sum().item()
            total += targets.size(0)
            print(f"iter {step} loss {train_loss / (batch_idx + 1):.4f} acc {100. * correct / total:.1f}%")
            step += 1
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
