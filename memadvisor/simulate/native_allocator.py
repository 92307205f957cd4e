"""The allocator model's replay loop compiled (``cuda_hooks/allocator_model.cpp``), loaded
with ctypes; ``allocator.replay`` uses it when it loads and its own Python loop (the
reference: same results, ~100x slower) when it does not.  It takes the stream as
``replay.replay_events`` gives it (signed sizes, row ids) and rounds and pairs the events
itself: nothing per event is made in Python.

Built on first use with the system C++ compiler (no torch headers: plain C++17, well under
a second) and cached under ``$MEMADVISOR_CACHE`` or ``~/.cache/memadvisor/native/``, keyed
by the source.  No compiler, a failed build or ``MEMADVISOR_NO_NATIVE`` set: ``load()``
returns None and the reason is in ``unavailable_reason()``.  Imports neither torch nor
anything outside ``memadvisor.simulate``'s own dependencies.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

SOURCE_NAME = "allocator_model.cpp"
API_VERSION = 2
_BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict = {}


def _source() -> Path | None:
    here = Path(__file__).resolve()
    for folder in (here.parents[2] / "cuda_hooks", here.parents[1] / "_native"):
        if (folder / SOURCE_NAME).is_file():
            return folder / SOURCE_NAME
    return None


def _cache_dir() -> Path:
    root = os.environ.get("MEMADVISOR_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "memadvisor") \
        / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("MEMADVISOR_CXX"), os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> Path:
    src = _source()
    if src is None:
        raise OSError(f"{SOURCE_NAME} not found")
    key = hashlib.sha256(src.read_bytes() + platform.machine().encode()).hexdigest()[:16]
    out = _cache_dir() / f"allocator_model-{key}.so"
    if out.is_file():
        return out
    cxx = _compiler()
    if cxx is None:
        raise OSError("no C++ compiler found")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".allocator_model-", suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", str(src), "-o",
                               tmp], capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln.lower()),
                         proc.stderr.strip()[:200])
            raise OSError(f"building {SOURCE_NAME} failed: {first}")
        os.replace(tmp, out)  # atomic: a concurrent builder never loads a partial file
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def load():
    """The replay function of the compiled model, or None (see ``unavailable_reason``)."""
    with _lock:
        if "replay" in _state:
            return _state["replay"]
        replay = None
        try:
            if os.environ.get("MEMADVISOR_NO_NATIVE"):
                raise OSError("MEMADVISOR_NO_NATIVE is set")
            lib = ctypes.CDLL(str(_build()))
            if lib.memadvisor_allocator_model_api() != API_VERSION:
                raise OSError("stale allocator_model library")
            fn = lib.memadvisor_allocator_replay
            fn.restype = None
            fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [
                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            replay = _wrap(fn)
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            _state["reason"] = str(exc)
        _state["replay"] = replay
        return replay


def unavailable_reason() -> str | None:
    load()
    return _state.get("reason")


def _wrap(fn):
    def replay(signed_sizes: np.ndarray, rows: np.ndarray, constants: tuple[int, ...],
               capacity: int, stop_above: int) -> tuple:
        """``allocator.replay``'s loop over the stream (> 0 an allocation, else a free);
        ``constants``: MIN_BLOCK (a power of two), SMALL_SIZE, SMALL_BUFFER, LARGE_BUFFER,
        MIN_LARGE_ALLOC, ROUND_LARGE."""
        sizes = np.ascontiguousarray(signed_sizes, np.float64)
        rows = np.ascontiguousarray(rows, np.int64)
        if len(sizes) != len(rows):
            raise ValueError(f"{len(sizes)} sizes for {len(rows)} rows")
        consts = np.asarray(constants, np.int64)
        out = np.zeros(5, np.int64)
        fn(len(sizes), sizes.ctypes.data, rows.ctypes.data, consts.ctypes.data,
           int(capacity), int(stop_above), out.ctypes.data)
        return int(out[0]), int(out[1]), int(out[2]), bool(out[3]), bool(out[4])
    return replay
