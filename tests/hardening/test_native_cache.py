"""The native engine's cached library: a damaged one is built again; a fallback to the
dispatch engine is told to the user, not only written into the trace."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memadvisor import native_build
from memadvisor.profile import native, native_engine
from memadvisor.trace.io import read_meta

CHECKOUT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import torch
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
''')


def _profile(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, "-m", "memadvisor.cli", "profile", str(script), "-o",
         str(tmp_path / "t.trace"), "-q", "--no-probes"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(CHECKOUT), **env},
        capture_output=True, text=True, timeout=600)


def test_open_or_rebuild_builds_again_once_when_the_cached_file_will_not_open():
    calls = []

    def build(force):
        calls.append(force)
        return Path("fresh.so" if force else "cached.so")

    def open_library(path):
        if path.name == "cached.so":
            raise native_build.NativeUnavailable("invalid ELF header")
        return path

    assert native_build.open_or_rebuild(build, open_library) == Path("fresh.so")
    assert calls == [False, True]


def test_a_rebuild_that_will_not_open_either_is_one_error():
    def open_library(path):
        raise native_build.NativeUnavailable(f"cannot load {path}")
    with pytest.raises(native_build.NativeUnavailable, match="cannot load"):
        native_build.open_or_rebuild(lambda force: Path("x.so"), open_library)


@pytest.mark.skipif(not native.available()[0], reason="no C++ toolchain for the native engine")
def test_a_damaged_cached_library_is_rebuilt_and_used(tmp_path):
    cache = tmp_path / "cache"
    damaged = native.library_path(cache, native_engine.SOURCE_NAME)
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a shared library\n")
    proc = _profile(tmp_path, MEMADVISOR_CACHE=str(cache))
    assert proc.returncode == 0, proc.stderr
    assert "note:" not in proc.stderr
    assert read_meta(tmp_path / "t.trace").allocator["engine"] == "native"
    assert damaged.read_bytes()[:4] == b"\x7fELF"


def test_the_fallback_to_the_dispatch_engine_is_told(tmp_path):
    proc = _profile(tmp_path, MEMADVISOR_CACHE=str(tmp_path / "empty-cache"),
                    MEMADVISOR_CXX="false")
    assert proc.returncode == 0, proc.stderr
    assert "note: recorded with the slower dispatch engine: native engine unavailable" \
        in proc.stderr
    assert read_meta(tmp_path / "t.trace").allocator["engine"] == "dispatch"


def test_the_cache_key_follows_the_headers_bytes_not_the_environments_path(tmp_path):
    import dataclasses
    import shutil
    build = native_build.torch_build()
    copies = []
    for where in ("venv-a", "venv-b"):
        include = tmp_path / where / "include"
        for name in native_build.FINGERPRINT_HEADERS:
            if (build.include / name).is_file():
                (include / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(build.include / name, include / name)
        copies.append(dataclasses.replace(build, include=include, lib=tmp_path / where / "lib"))
    key_a, key_b = (native_build.cache_key(b"source", c) for c in copies)
    assert key_a == key_b == native_build.cache_key(b"source", build)
    changed = copies[1].include / "c10" / "core" / "Allocator.h"
    changed.write_bytes(changed.read_bytes() + b"\n// another torch\n")
    assert native_build.cache_key(b"source", copies[1]) != key_a
    assert native_build.cache_key(b"other source", copies[0]) != key_a


def test_the_cache_folder_follows_xdg_cache_home_unless_memadvisor_cache_is_set(
        tmp_path, monkeypatch):
    monkeypatch.delenv("MEMADVISOR_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_build.cache_dir() == tmp_path / "xdg" / "memadvisor" / "native"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored, as the spec says
    assert native_build.cache_dir() == Path.home() / ".cache" / "memadvisor" / "native"
    monkeypatch.setenv("MEMADVISOR_CACHE", str(tmp_path / "mine"))
    assert native_build.cache_dir() == tmp_path / "mine" / "native"
    assert native_build.cache_dir(tmp_path / "given") == tmp_path / "given" / "native"


def _fake_compiler(path: Path, version: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


def test_the_cache_key_follows_what_the_compiler_is_not_where_it_is(tmp_path):
    build = native_build.torch_build()
    same_a = _fake_compiler(tmp_path / "venv-a" / "bin" / "c++", "c++ (GCC) 12.2.0")
    same_b = _fake_compiler(tmp_path / "venv-b" / "bin" / "c++", "c++ (GCC) 12.2.0")
    other = _fake_compiler(tmp_path / "venv-c" / "bin" / "c++", "c++ (GCC) 13.1.0")
    key_a, key_b, key_other = (native_build.cache_key(b"source", build, c)
                               for c in (same_a, same_b, other))
    assert key_a == key_b != key_other


def test_a_library_anyone_else_could_write_is_never_loaded(tmp_path):
    folder = tmp_path / "native"
    folder.mkdir(mode=0o700)
    library = folder / "op_tracker-0123456789abcdef.so"
    library.write_bytes(b"\x7fELF")
    library.chmod(0o755)
    assert native_build.untrusted_reason(library) is None

    opened = []

    def attempt():
        return native_build.open_or_rebuild(lambda force: library, opened.append)

    library.chmod(0o777)
    assert "library" in native_build.untrusted_reason(library)
    with pytest.raises(native_build.NativeUnavailable, match="writable by others"):
        attempt()
    library.chmod(0o755)
    folder.chmod(0o777)
    assert "folder" in native_build.untrusted_reason(library)
    with pytest.raises(native_build.NativeUnavailable, match="refusing to load"):
        attempt()
    folder.chmod(0o700)
    # writable by its group: only where the group is the user's own (umask 002 with user
    # private groups), never another group
    library.chmod(0o775)
    own_group = native_build._private_group(os.stat(library).st_gid)
    assert (native_build.untrusted_reason(library) is None) == own_group
    if os.getuid() == 0:  # only root can give a file away
        os.chown(library, 0, 12345)
        assert "writable by others" in native_build.untrusted_reason(library)
        os.chown(library, 12345, 12345)
        assert "another user" in native_build.untrusted_reason(library)
        with pytest.raises(native_build.NativeUnavailable, match="another user"):
            attempt()
        os.chown(library, 0, 0)
    library.chmod(0o755)
    assert opened == []
    attempt()
    assert opened == [library]
