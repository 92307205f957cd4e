"""Small training loops, each a hand-modified copy of one baseline, profiled in-process.

The measured peak of a modified loop (checkpointing, micro-batches, another optimizer, bf16)
is what the simulator must predict from the baseline loop's trace alone.  Torch is imported
here, in tests only: ``memadvisor.simulate`` never imports it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memadvisor.profile.session import ProfileSession, StopProfiling
from memadvisor.trace.io import Trace
from memadvisor.trace.analysis import analysed_step

BATCH, SEQ, D_MODEL, VOCAB, LAYERS = 8, 32, 64, 128, 3


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.ln(x))))


class TinyLM(nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL) for _ in range(LAYERS))
        self.head = nn.Linear(D_MODEL, VOCAB)
        self.checkpointed = checkpointed

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            if self.checkpointed:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def run(*, checkpointed=False, accum=1, optimizer="adamw", dtype=torch.float32,
        batch=BATCH, steps=2) -> Trace:
    """Profile ``steps`` optimizer steps of TinyLM with one modification; returns the trace."""
    torch.manual_seed(0)
    model = TinyLM(checkpointed).to(dtype)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    elif optimizer == "sgd-momentum":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        raise ValueError(optimizer)
    gen = torch.Generator().manual_seed(0)

    def step():
        tokens = torch.randint(VOCAB, (batch, SEQ + 1), generator=gen)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        opt.zero_grad(set_to_none=True)
        micro = batch // accum
        for k in range(accum):
            xs, ys = x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]
            # as ``apply`` does: floating outputs of a 16-bit model come back in fp32
            logits = model(xs).float()
            loss = F.cross_entropy(logits.view(-1, VOCAB), ys.reshape(-1))
            (loss / accum).backward()
        opt.step()

    return profile_steps(step, steps)


def profile_steps(step, steps: int) -> Trace:
    """Run ``step()`` under a ProfileSession until it has recorded ``steps`` steps."""
    session = ProfileSession(steps=steps)
    try:
        with session:
            for _ in range(steps + 1):
                step()
    except StopProfiling:
        pass
    table, meta = session.build()
    return Trace(events=table.to_pandas(), meta=meta)


def measured_peak(trace: Trace) -> int:
    return int(trace.meta.steps[analysed_step(trace)]["peak_bytes"])


def run_autocast(dtype=torch.bfloat16, steps=2) -> Trace:
    """TinyLM with its forward under CPU autocast (the loss outside, on fp32 logits)."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step():
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(x)
        logits = logits.float()  # apply hands autocast's outputs back in fp32
        F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()

    return profile_steps(step, steps)


def run_with_apply_precision(model: nn.Module, make_batch, precision: str = "fp32",
                             steps: int = 2) -> Trace:
    """Profile ``steps`` AdamW steps of ``model`` with ``precision`` set up by ``apply``'s own
    helpers (bf16 parameters, autocast and input casts around the root forward);
    ``make_batch(generator)`` returns (inputs, labels) for cross-entropy."""
    from memadvisor.apply.precision import cast_parameters, wrap_forward
    from memadvisor.plan import Plan

    plan = Plan.parse(f"precision={precision}")
    cast_parameters(model, plan)
    wrap_forward(model, plan, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step():
        x, y = make_batch(gen)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()

    return profile_steps(step, steps)
