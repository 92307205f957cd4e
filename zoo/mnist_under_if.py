"""A small convolutional classifier for 28x28 digits with dropout and log-softmax, a
``train(args, model, device, train_loader, optimizer, epoch)`` function, a ``test``
function, Adadelta with ``StepLR`` -- and the whole training loop written directly under
``if __name__ == "__main__":`` and ``if args.train:``.

Imitates the style of pytorch/examples ``mnist/main.py`` (written here from scratch; the
"digits" are random images labelled by their brightest quadrant).

    python zoo/mnist_under_if.py            # trains (--no-train only builds the model)
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "dropout draws its masks per micro-batch",
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(2304, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def quadrant_digits(n, seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 1, 28, 28, generator=g) * 0.5
    labels = torch.randint(0, 4, (n,), generator=g)
    for k, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[k, 0, r * 14:(r + 1) * 14, c * 14:(c + 1) * 14] += 0.5
    return TensorDataset((images - 0.1307) / 0.3081, labels)


def test(model, device, test_loader):
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction='sum').item()
            correct += output.argmax(dim=1, keepdim=True).eq(target.view_as(output.argmax(1, keepdim=True))).sum().item()
    test_loss /= len(test_loader.dataset)
    print('Test set: Average loss: {:.4f}, Accuracy: {}/{}'.format(test_loss, correct, len(test_loader.dataset)))


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description='Digits Example')
    parser.add_argument('--batch-size', type=int, default=8, metavar='N')
    parser.add_argument('--epochs', type=int, default=1, metavar='N')
    parser.add_argument('--lr', type=float, default=1.0, metavar='LR')
    parser.add_argument('--gamma', type=float, default=0.7, metavar='M')
    parser.add_argument('--seed', type=int, default=1, metavar='S')
    parser.add_argument('--log-interval', type=int, default=1, metavar='N')
    parser.add_argument('--train', action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_loader = DataLoader(quadrant_digits(3 * args.batch_size, args.seed), batch_size=args.batch_size,
                              shuffle=True)
    test_loader = DataLoader(quadrant_digits(16, args.seed + 1), batch_size=16)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    if args.train:
        iteration = 0
        for epoch in range(1, args.epochs + 1):
            model.train()
            for batch_idx, (data, target) in enumerate(train_loader):
                data, target = data.to(device), target.to(device)
                optimizer.zero_grad()
                output = model(data)
                loss = F.nll_loss(output, target)
                loss.backward()
                optimizer.step()
                if batch_idx % args.log_interval == 0:
                    print('iter {} Train Epoch: {} [{}/{}]\tLoss: {:.6f}'.format(
                        iteration, epoch, batch_idx * len(data), len(train_loader.dataset), loss.item()))
                iteration += 1
            test(model, device, test_loader)
            scheduler.step()
        print(f"final_loss={loss.item():.6f}")
