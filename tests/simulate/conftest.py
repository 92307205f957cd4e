"""Traces shared by the simulator tests: TinyLM profiled once per variant (a few seconds)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def loops():
    import loops as module
    return module


@pytest.fixture(scope="session")
def baseline_trace(loops):
    return loops.run()


@pytest.fixture(scope="session")
def baseline_file(baseline_trace, tmp_path_factory):
    from memadvisor.trace.io import write_trace
    path = tmp_path_factory.mktemp("traces") / "tiny.trace"
    write_trace(path, baseline_trace.events, baseline_trace.meta)
    return str(path)


@pytest.fixture(scope="session")
def base(baseline_trace):
    from memadvisor.simulate import prepare
    return prepare(baseline_trace)
