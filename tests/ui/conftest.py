"""Traces for the dashboard tests: a tiny model profiled in-process (a real trace, with
this folder's source lines in it) and small synthetic ones for the baseline."""
from __future__ import annotations

import pytest

from memadvisor.report.synthetic import make_trace

#: the line of ``ui_model_trace`` that allocates the hidden activation (checked by tests)
HIDDEN_LINE_MARK = "# <- hidden activation"


def _train(steps: int = 5):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(16, 32)
        hidden = model[1](model[0](x))  # <- hidden activation
        loss = model[2](hidden).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


@pytest.fixture(scope="session")
def ui_model_trace(tmp_path_factory) -> str:
    """A three-step trace of a two-layer MLP trained with Adam (batch 16)."""
    from memadvisor.profile import ProfileSession, StopProfiling

    path = tmp_path_factory.mktemp("ui") / "mlp.trace"
    session = ProfileSession(steps=3)
    try:
        with session:
            _train()
    except StopProfiling:
        pass
    session.write(path, script=__file__, args=[])
    return str(path)


@pytest.fixture(scope="session")
def synthetic_traces(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("ui-synthetic")
    return {"base": str(make_trace(folder / "base.trace", 4_000)),
            "bigger": str(make_trace(folder / "bigger.trace", 4_000, activation_scale=1.3))}
