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
