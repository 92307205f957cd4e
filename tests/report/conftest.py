"""Traces and a stand-in simulator shared by the report tests."""
from __future__ import annotations

import sys

import pytest

from memadvisor.report.synthetic import make_trace
from report_fakes import install_fake_simulator


@pytest.fixture(scope="session")
def traces(tmp_path_factory):
    """Synthetic traces: ``base`` (hostile names), ``regressed`` (activations x1.3)."""
    folder = tmp_path_factory.mktemp("traces")
    return {
        "base": str(make_trace(folder / "base.trace", 6_000)),
        "regressed": str(make_trace(folder / "regressed.trace", 6_000, activation_scale=1.3)),
    }


@pytest.fixture
def fake_simulator(monkeypatch):
    return install_fake_simulator(monkeypatch)


@pytest.fixture
def no_simulator(monkeypatch):
    """A memadvisor without the simulator package."""
    monkeypatch.setitem(sys.modules, "memadvisor.simulate", None)  # import raises ImportError
