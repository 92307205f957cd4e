"""A word-level LSTM language model trained by truncated backpropagation through time with
sequence-first batches (``batchify`` into columns, ``get_batch(source, i)`` slices ``bptt``
rows), hidden states detached between batches, gradient clipping and, by default, a manual
SGD update ``p.data.add_(p.grad, alpha=-lr)`` with no ``torch.optim`` (``--use-optimizer``
switches to ``torch.optim.SGD``).

Imitates the style of pytorch/examples ``word_language_model/main.py`` (written here from
scratch; the "corpus" is a synthetic stream of word ids).

    python zoo/word_lm_manual_sgd.py
"""
# zoo: {"batch_size": 8, "batch_layout": "seq-first", "steps_per_iteration": 1,
#   "optimizers": 0, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "hidden state carried across batches (BPTT) per column; exact only if each rank keeps its own columns",
#   "plans": ["amp-bf16", "accum", "ddp"]}
import argparse
import math

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description='PyTorch Word-level LSTM Language Model')
parser.add_argument('--emsize', type=int, default=32, help='size of word embeddings')
parser.add_argument('--nhid', type=int, default=32, help='number of hidden units per layer')
parser.add_argument('--nlayers', type=int, default=2, help='number of layers')
parser.add_argument('--lr', type=float, default=20, help='initial learning rate')
parser.add_argument('--clip', type=float, default=0.25, help='gradient clipping')
parser.add_argument('--batch_size', type=int, default=8, metavar='N', help='batch size')
parser.add_argument('--bptt', type=int, default=16, help='sequence length')
parser.add_argument('--dropout', type=float, default=0.0, help='dropout applied to layers')
parser.add_argument('--seed', type=int, default=1111, help='random seed')
parser.add_argument('--max-batches', type=int, default=3, help='stop the epoch after this many batches')
parser.add_argument('--use-optimizer', action='store_true', help='use torch.optim.SGD instead of manual updates')
args = parser.parse_args()

torch.manual_seed(args.seed)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ntokens = 200


def make_corpus(n_tokens):
    g = torch.Generator().manual_seed(args.seed)
    words = torch.randint(0, ntokens, (n_tokens,), generator=g)
    words[1::2] = (words[0::2] * 3 + 1) % ntokens  # every other word predictable
    return words


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


train_data = batchify(make_corpus(args.bptt * args.batch_size * (args.max_batches + 1)), args.batch_size)


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super(RNNModel, self).__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


model = RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device)
criterion = nn.NLLLoss()
if args.use_optimizer:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)


def train():
    model.train()
    total_loss = 0.
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        if batch >= args.max_batches:
            break
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()

        # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if args.use_optimizer:
            optimizer.step()
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)

        total_loss += loss.item()
        print('iter {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | loss {:5.2f} | ppl {:8.2f}'.format(
            batch, batch, len(train_data) // args.bptt, lr, loss.item(), math.exp(loss.item())))
    return loss.item()


lr = args.lr
last = train()
print(f"final_loss={last:.6f}")
