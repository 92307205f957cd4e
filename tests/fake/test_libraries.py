"""fake/libraries.py: a library's "is this a fake tensor (so: tracing)?" check answers as in
a real run for fake execution's own tensors, also for a module imported during the run."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memadvisor.fake import libraries
from memadvisor.fake.runtime import fake_execution


def test_a_module_imported_during_the_run_is_patched_and_restored(tmp_path, monkeypatch):
    (tmp_path / "tracing_check.py").write_text(
        "def is_fake_tensor(x):\n    return hasattr(x, 'fake_mode')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(libraries._RULES, "tracing_check", libraries._RULES[
        "transformers.utils.import_utils"])
    monkeypatch.delitem(sys.modules, "tracing_check", raising=False)
    with fake_execution(gpu=None):
        import tracing_check
        ours = torch.randn(2)
        assert hasattr(ours, "fake_mode") and not tracing_check.is_fake_tensor(ours)
        with FakeTensorMode() as other:  # a fake tensor of the script's own mode still is one
            assert tracing_check.is_fake_tensor(other.from_tensor(torch.zeros(1)))
    with FakeTensorMode() as mode:
        assert tracing_check.is_fake_tensor(mode.from_tensor(torch.zeros(1)))
    assert not any(isinstance(f, libraries._AfterImport) for f in sys.meta_path)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed (the zoo extra)")
def test_transformers_sees_no_tracing_under_fake_execution():
    from transformers.utils import import_utils
    with fake_execution(gpu=None):
        mask = torch.ones(2, 8, dtype=torch.bool) & (torch.randn(2, 8) > -10)
        assert hasattr(mask, "fake_mode")
        assert not import_utils.is_tracing(mask)
    with FakeTensorMode() as mode:
        assert import_utils.is_tracing(mode.from_tensor(torch.zeros(1)))
