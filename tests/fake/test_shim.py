"""The fake CUDA shim builds, caches, and fails in one line (memadvisor/fake/shim.py)."""
from __future__ import annotations

import shutil

import pytest

from memadvisor.fake import shim

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")


def test_builds_once_and_is_cached(tmp_path):
    first = shim.build(cache=tmp_path)
    assert first.is_file() and first.suffix == ".so" and first.parent == tmp_path / "native"
    assert shim.build(cache=tmp_path) == first
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp files left


def test_a_failed_build_is_one_line(tmp_path):
    with pytest.raises(shim.FakeCudaUnavailable) as info:
        shim.build(cache=tmp_path, compiler="/nonexistent/g++")
    assert "\n" not in str(info.value) and "compiler" in str(info.value)
    failing = tmp_path / "cxx"
    failing.write_text("#!/bin/sh\necho 'fake_cuda.cpp:1: error: nope' >&2\nexit 4\n")
    failing.chmod(0o755)
    with pytest.raises(shim.FakeCudaUnavailable) as info:
        shim.build(cache=tmp_path / "c", compiler=str(failing))
    message = str(info.value)
    assert "\n" not in message and "exit 4" in message and "nope" in message
    assert not list((tmp_path / "c").rglob("*.so"))


def test_loading_after_torch_is_refused_in_one_line():
    import torch  # noqa: F401  (this test process imported torch long ago)
    if shim.loaded() is not None:
        pytest.skip("the shim is loaded in this process")
    with pytest.raises(shim.FakeCudaUnavailable, match="before anything imports torch"):
        shim.load()
