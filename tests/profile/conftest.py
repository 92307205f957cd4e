"""Every profiler test runs with both engines: the native one (C++ op tracker, the default
without a GPU) and the dispatch one (a Python TorchDispatchMode, used with a GPU)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, params=["native", "dispatch"])
def engine(request, monkeypatch) -> str:
    monkeypatch.setenv("MEMADVISOR_ENGINE", request.param)
    return request.param
