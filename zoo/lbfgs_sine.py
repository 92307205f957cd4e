"""Time-sequence prediction with two stacked ``LSTMCell``s unrolled by hand over sine waves,
in double precision, trained with ``optim.LBFGS`` whose ``step(closure)`` re-evaluates the
loss and gradients several times per step; then predicts future values under ``no_grad``.

Imitates the style of pytorch/examples ``time_sequence_prediction/train.py`` (written here
from scratch; the sine waves are generated in code instead of a saved ``traindata.pt``).

    python zoo/lbfgs_sine.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": true,
#   "closure_calls_per_step": "up to max_iter (4)",
#   "plans": ["checkpoint", "accum", "ddp"]}
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim


class Sequence(nn.Module):
    def __init__(self, hidden=16):
        super(Sequence, self).__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double, device=input.device)
        c_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double, device=input.device)
        h_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double, device=input.device)
        c_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double, device=input.device)

        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):  # if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        outputs = torch.cat(outputs, dim=1)
        return outputs


def make_sines(n, length, period=20):
    rng = np.random.RandomState(2)
    x = np.empty((n, length), np.int64)
    x[:] = np.array(range(length)) + rng.randint(-4 * period, 4 * period, n).reshape(n, 1)
    return np.sin(x / 1.0 / period).astype('float64')


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=3, help='steps to run')
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--length', type=int, default=40)
    opt = parser.parse_args()
    # set random seed to 0
    np.random.seed(0)
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = make_sines(opt.batch + 3, opt.length)
    input = torch.from_numpy(data[3:, :-1]).to(device)
    target = torch.from_numpy(data[3:, 1:]).to(device)
    test_input = torch.from_numpy(data[:3, :-1]).to(device)
    test_target = torch.from_numpy(data[:3, 1:]).to(device)
    # build the model
    seq = Sequence().to(device)
    seq.double()
    criterion = nn.MSELoss()
    # use LBFGS as optimizer since we can load the whole data to train
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8, max_iter=4)
    # begin to train
    for i in range(opt.steps):
        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print('loss:', loss.item())
            loss.backward()
            return loss
        optimizer.step(closure)
        # begin to predict, no need to track gradient here
        with torch.no_grad():
            future = 10
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print(f'iter {i} test loss: {loss.item():.6f}')
    print(f"final_loss={loss.item():.6f}")
