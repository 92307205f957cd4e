"""The profiler must not change what the script keeps alive: a batch it looked at is freed
when the script drops it.  Before Python 3.13 reading a frame's ``f_locals`` leaves a
snapshot in the frame; read at the first forward (to name the model) it held the first
batch for the whole run -- on a real H100 that was one batch more at every later peak."""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from memadvisor.profile import ProfileSession, StopProfiling


def test_the_first_batch_is_freed_when_the_script_drops_it():
    first_alive_at_last_step: list[bool] = []

    def train():  # a function, as most scripts' main(): its locals are fast locals
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = []
        for step in range(3):
            inputs = torch.randn(256, 64)
            batches.append(weakref.ref(inputs))
            model(inputs).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 2:
                first_alive_at_last_step.append(batches[0]() is not None)

    session = ProfileSession(probes=False)
    try:
        with session:
            train()
    except StopProfiling:
        pass
    assert first_alive_at_last_step == [False]


class _Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x, memory):
        return self.linear(x) + memory


def test_a_modules_first_input_gradient_is_freed_before_its_last_arrives():
    """A module whose inputs get their gradients far apart (a decoder layer's input and the
    encoder output that later layers also read): knowing when the module's backward ends
    must not keep the first gradient until the last one -- torch's multi-grad hook does
    (zoo/seq2seq_transformer: two LayerNorm gradients kept, +2.5% at a checkpointed peak)."""
    seen: dict[str, object] = {}

    def train():
        mix = _Mix()
        for _ in range(3):
            source = torch.randn(8, 16, requires_grad=True)
            memory = source.exp()            # its gradient completes last: `early` reads it
            early = memory * 3
            x = torch.randn(8, 16, requires_grad=True).exp()
            x.register_hook(lambda grad: seen.__setitem__("x_grad", weakref.ref(grad)))
            early.register_hook(lambda grad: seen.__setitem__(
                "x_grad_alive", seen["x_grad"]() is not None))
            (mix(x, memory) + early).sum().backward()

    session = ProfileSession(probes=False, steps=2)
    try:
        with session:
            train()
    except StopProfiling:
        pass
    assert seen["x_grad_alive"] is False
