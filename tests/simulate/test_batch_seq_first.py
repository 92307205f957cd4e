"""Batch scaling on a sequence-first model: activations are (T, B, C), so scaling by the
first dimension misses them; meta.batch's batch_dims says where the batch is."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.trace.io import Trace

from .loops import measured_peak, profile_steps

SEQ, BATCH, VOCAB, HIDDEN = 20, 8, 50, 64  # T*B = 160 is no parameter's dimension


class SeqFirstLM(nn.Module):
    """An encoder in nn.Transformer's default layout.  (Not an nn.LSTM: oneDNN's RNN
    workspace is a raw block no tensor's size matches, a limit of the shape rules whatever
    the layout.)"""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, 4, 2 * HIDDEN, dropout=0.0)  # (T, B, C)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.decoder(self.encoder(self.embed(tokens)))


def run(accum: int) -> Trace:
    torch.manual_seed(0)
    model = SeqFirstLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)

    def step():
        tokens = torch.randint(VOCAB, (SEQ + 1, BATCH), generator=generator)
        data, target = tokens[:-1], tokens[1:]
        optimizer.zero_grad(set_to_none=True)
        micro = BATCH // accum
        for k in range(accum):  # as apply cuts them: along dimension 1
            x, y = data[:, k * micro:(k + 1) * micro], target[:, k * micro:(k + 1) * micro]
            logits = model(x)
            (F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / accum).backward()
        optimizer.step()

    return profile_steps(step, 2)


@pytest.fixture(scope="module")
def traces():
    return run(1), run(2)


def test_the_trace_says_the_batch_is_dimension_1(traces):
    batch = traces[0].meta.batch
    assert batch["batch_size"] == BATCH and batch["batch_dims"] == [1]


def test_accumulation_on_sequence_first_activations(traces):
    baseline, accumulated = traces
    measured = measured_peak(accumulated)
    predicted = simulate(prepare(baseline), Plan.parse("accum=2")).peak_bytes
    assert abs(predicted - measured) / measured < 0.03, (predicted, measured)
    # a trace read as the older format (no batch_dims: dimension 0 where it is the batch)
    # scales none of the (T, B, C) activations: the prediction stays near the baseline's
    old = copy.deepcopy(baseline)
    old.meta.batch = {k: v for k, v in old.meta.batch.items() if k != "batch_dims"}
    stale = simulate(prepare(old), Plan.parse("accum=2")).peak_bytes
    assert abs(stale - measured) > abs(predicted - measured)


class BatchFirstEncoder(nn.Module):
    """A batch-first encoder (the HF / kwargs style): nn.MultiheadAttention still computes
    on (T, B, E) inside and stacks its projections as (3, T, B, E)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, 4, 2 * HIDDEN, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.decoder(self.encoder(self.embed(tokens)))


def run_batch_first(accum: int) -> Trace:
    torch.manual_seed(0)
    model = BatchFirstEncoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)

    def step():
        tokens = torch.randint(VOCAB, (BATCH, SEQ), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        micro = BATCH // accum
        for k in range(accum):
            x = tokens[k * micro:(k + 1) * micro]
            logits = model(x)
            (F.cross_entropy(logits.reshape(-1, VOCAB), x.reshape(-1)) / accum).backward()
        optimizer.step()

    return profile_steps(step, 2)


def test_accumulation_scales_attention_inner_sequence_first_tensors():
    baseline, accumulated = run_batch_first(1), run_batch_first(2)
    assert baseline.meta.batch["batch_dims"] == [0]
    base = prepare(baseline)
    inner = [i for i, shape in enumerate(base.timeline.shape)
             if shape.startswith(f"{SEQ},{BATCH},") or shape.startswith(f"3,{SEQ},{BATCH},")]
    assert inner and base.timeline.scales_with_batch[inner].all()
    measured = measured_peak(accumulated)
    predicted = simulate(base, Plan.parse("accum=2")).peak_bytes
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)
