"""A variational autoencoder on 28x28 images: fully connected encoder to a mean and a
log-variance, the reparameterisation trick, a decoder with a sigmoid, and a loss of binary
cross-entropy plus KL divergence summed over the batch.  After each epoch it samples
images from the prior through its own method ``model.decode``.

Imitates the style of pytorch/examples ``vae/main.py`` (written here from scratch; the
"digits" are random strokes drawn in code).

    python zoo/vae.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "the loss is a sum over the batch, not a mean: scaling each micro-batch's loss by 1/accum scales the gradient (Adam hides it, SGD would not)",
#   "model_methods": ["decode"],
#   "plans": ["amp-bf16", "accum", "ddp", "zero2", "zero3"]}
import argparse

import torch
import torch.utils.data
from torch import nn, optim
from torch.nn import functional as F

parser = argparse.ArgumentParser(description='VAE Example')
parser.add_argument('--batch-size', type=int, default=8, metavar='N',
                    help='input batch size for training (default: 8)')
parser.add_argument('--epochs', type=int, default=1, metavar='N',
                    help='number of epochs to train (default: 1)')
parser.add_argument('--seed', type=int, default=1, metavar='S',
                    help='random seed (default: 1)')
parser.add_argument('--log-interval', type=int, default=1, metavar='N',
                    help='how many batches to wait before logging training status')
args = parser.parse_args()

torch.manual_seed(args.seed)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Strokes(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(args.seed)
        images = torch.zeros(n, 1, 28, 28)
        for k in range(n):
            row = int(torch.randint(4, 24, (1,), generator=g))
            col = int(torch.randint(4, 24, (1,), generator=g))
            images[k, 0, row, 4:24] = 1.0
            images[k, 0, 4:24, col] = 1.0
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], 0


train_loader = torch.utils.data.DataLoader(Strokes(3 * args.batch_size), batch_size=args.batch_size,
                                           shuffle=True)


class VAE(nn.Module):
    def __init__(self):
        super(VAE, self).__init__()
        self.fc1 = nn.Linear(784, 128)
        self.fc21 = nn.Linear(128, 8)
        self.fc22 = nn.Linear(128, 8)
        self.fc3 = nn.Linear(8, 128)
        self.fc4 = nn.Linear(128, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


model = VAE().to(device)
optimizer = optim.Adam(model.parameters(), lr=1e-3)


def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction='sum')
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


iteration = 0


def train(epoch):
    global iteration
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(train_loader):
        data = data.to(device)
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print('iter {} Train Epoch: {} [{}/{}]\tLoss: {:.6f}'.format(
                iteration, epoch, batch_idx * len(data), len(train_loader.dataset),
                loss.item() / len(data)))
        iteration += 1
    print('====> Epoch: {} Average loss: {:.4f}'.format(epoch, train_loss / len(train_loader.dataset)))
    return loss.item() / len(data)


if __name__ == "__main__":
    for epoch in range(1, args.epochs + 1):
        last = train(epoch)
        with torch.no_grad():
            sample = torch.randn(16, 8).to(device)
            sample = model.decode(sample).cpu()
            print(f"sampled {tuple(sample.view(16, 1, 28, 28).shape)} images, mean {sample.mean():.4f}")
    print(f"final_loss={last:.6f}")
