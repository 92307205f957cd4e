"""A recurrent module's workspace (the flat uint8 buffer its kernel saves for backward:
oneDNN's LSTM on the CPU, cuDNN's reserve space on a GPU) follows the batch though no
dimension shows it.  The premise is measured on the machine running the test (two
profiles, a batch and its half); where this CPU's LSTM saves no such buffer there is
nothing to scale and the test says so."""
import numpy as np
import pytest
import torch
import torch.nn as nn

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.trace import schema

HIDDEN, FEATURES, LENGTH = 64, 32, 40


def _steps(batch: int):
    import loops
    torch.manual_seed(0)
    model = nn.LSTM(FEATURES, HIDDEN, batch_first=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        out, _ = model(torch.randn(batch, LENGTH, FEATURES))
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()

    return loops.profile_steps(step, 2)


def _workspace_rows(timeline) -> np.ndarray:
    return np.flatnonzero(timeline.dtype_in(("uint8",))
                          & (timeline.category == _ACTIVATION)
                          & np.array([s.count(",") == 0 and s != "" for s in
                                      timeline.shape.astype(str)]))


_ACTIVATION = schema.CATEGORIES.index(schema.ACTIVATION)


def test_an_lstm_workspace_scales_with_the_micro_batch(loops):
    full, half = prepare(_steps(16)), prepare(_steps(8))
    rows_full, rows_half = _workspace_rows(full.timeline), _workspace_rows(half.timeline)
    if not len(rows_full):
        pytest.skip("this CPU build's LSTM saves no flat workspace for backward")
    # the premise, measured here: half the sequences, half the workspace (to its alignment)
    total_full = full.timeline.size[rows_full].sum()
    total_half = half.timeline.size[rows_half].sum()
    assert abs(total_full - 2 * total_half) <= 0.01 * total_full, (total_full, total_half)
    assert full.timeline.scales_with_batch[rows_full].all()
    # accumulation over two micro-batches of 8 holds the workspace of 8 sequences
    predicted = simulate(full, Plan.parse("accum=2")).timeline
    kept = _workspace_rows(predicted)
    assert abs(predicted.size[kept].sum() - total_half) <= 0.01 * total_half
