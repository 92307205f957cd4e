"""Build and load the fake CUDA runtime (``cuda_hooks/fake_cuda.cpp``).

torch resolves its CUDA hooks exactly once, during ``import torch`` (checked on torch
2.13: a library loaded before the import is asked for its hooks by the import itself; one
loaded after it is never asked).  So :func:`load` must run before the first ``import
torch`` of the process, and it refuses, with a one-line reason, when torch came first.
The device guard is registered whenever the library loads, but without the hooks
``torch.autocast('cuda')`` and pinned memory still see no CUDA.

The library is compiled on first use with the helpers in ``memadvisor/native_build.py``
(about 3 s) and cached next to the profiler's other native hooks.  Loading it never
imports torch; building it does not either.

Environment:
    MEMADVISOR_NO_NATIVE   if set non-empty, the shim is reported unavailable
    (and MEMADVISOR_CACHE / MEMADVISOR_CXX as in native_build.py)
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import native_build

SOURCE_NAME = "fake_cuda.cpp"
API_VERSION = 1
MAX_DEVICES = 8  #: c10::impl::FakeGuardImpl's fixed device count


class FakeCudaUnavailable(native_build.NativeUnavailable):
    """The fake CUDA shim cannot be built or loaded here; ``str(exc)`` is one line."""


@dataclass(frozen=True, slots=True)
class LoadedShim:
    lib: ctypes.CDLL
    path: Path

    def set_device_count(self, count: int) -> int:
        """Devices ``torch.cuda.device_count()``-like queries in C++ see (clamped to 1..8)."""
        return self.lib.ma_fake_set_device_count(int(count))

    @property
    def device_count(self) -> int:
        return self.lib.ma_fake_device_count()

    def set_current_device(self, index: int) -> None:
        """The calling thread's current CUDA device (what ``device='cuda'`` means)."""
        self.lib.ma_fake_set_current_device(int(index))

    @property
    def current_device(self) -> int:
        return self.lib.ma_fake_current_device()

    @property
    def hooks_active(self) -> bool:
        """torch's CUDA hooks are ours (so ``at::globalContext().hasCUDA()`` is true)."""
        return bool(self.lib.ma_fake_hooks_active())

    @property
    def guard_active(self) -> bool:
        return bool(self.lib.ma_fake_guard_active())


_lock = threading.Lock()
_loaded: LoadedShim | None = None


def source_path() -> Path:
    here = Path(__file__).resolve()
    for cand in (here.parents[2] / "cuda_hooks", here.parents[1] / "_native"):
        if (cand / SOURCE_NAME).is_file():
            return cand / SOURCE_NAME
    raise FakeCudaUnavailable(f"{SOURCE_NAME} not found next to the memadvisor package")


def library_path(cache: str | os.PathLike | None = None) -> Path:
    src = source_path()
    try:
        source = src.read_bytes()
    except OSError as exc:
        raise FakeCudaUnavailable(f"cannot read {src}: {exc}") from None
    build_info = native_build.torch_build(FakeCudaUnavailable)
    key = native_build.cache_key(source, build_info)
    return native_build.cache_dir(cache) / f"fake_cuda-{key}.so"


def build(cache: str | os.PathLike | None = None, compiler: str | None = None,
          force: bool = False) -> Path:
    """Compile the shim if it is not cached; its path.  Raises FakeCudaUnavailable."""
    out = library_path(cache)
    if out.is_file() and not force:
        return out
    src = source_path()
    build_info = native_build.torch_build(FakeCudaUnavailable)
    cxx = native_build.find_compiler(compiler, FakeCudaUnavailable)
    return native_build.compile_library(
        src, out,
        lambda tmp: native_build.compile_command(
            cxx, src, tmp, build_info,
            # torch's headers use C++20 bit-field initialisers that g++ accepts in C++17
            flags=("-Wno-c++20-extensions", "-DNDEBUG"), libs=("-ltorch_cpu", "-lc10")),
        FakeCudaUnavailable)


def _open_shim(path: Path) -> tuple[Path, ctypes.CDLL]:
    try:
        # loaded before torch: the libraries it links must be this environment's
        native_build.preload_torch_libraries(native_build.torch_build(FakeCudaUnavailable))
        # RTLD_GLOBAL: the static registrars must land in the registries of the same
        # libtorch_cpu/libc10 that torch's import then finds already loaded
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _bind(lib)
    except (OSError, AttributeError) as exc:
        raise FakeCudaUnavailable(f"cannot load {path.name}: {exc}") from None
    if lib.ma_fake_api_version() != API_VERSION:
        raise FakeCudaUnavailable(f"{path.name} has an unexpected API version")
    return path, lib


def _bind(lib: ctypes.CDLL) -> None:
    int_fns = ("ma_fake_api_version", "ma_fake_device_count", "ma_fake_current_device",
               "ma_fake_hooks_created", "ma_fake_hooks_active", "ma_fake_guard_active")
    for name in int_fns:
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    lib.ma_fake_set_device_count.restype = ctypes.c_int
    lib.ma_fake_set_device_count.argtypes = [ctypes.c_int]
    lib.ma_fake_set_current_device.restype = None
    lib.ma_fake_set_current_device.argtypes = [ctypes.c_int]


def load(device_count: int = 1, *, cache: str | os.PathLike | None = None,
         compiler: str | None = None) -> LoadedShim:
    """Build (first use) and load the shim, before torch is imported; the same object every
    call (a later call only changes the device count).  Raises FakeCudaUnavailable with a
    one-line reason -- also when torch was imported first, since torch then never asks
    for the shim's hooks."""
    global _loaded
    with _lock:
        if _loaded is not None:
            _loaded.set_device_count(device_count)
            return _loaded
        if os.environ.get("MEMADVISOR_NO_NATIVE"):
            raise FakeCudaUnavailable("disabled by MEMADVISOR_NO_NATIVE")
        if "torch" in sys.modules:
            raise FakeCudaUnavailable(
                "torch was imported before the fake CUDA shim was loaded (torch resolves "
                "its CUDA hooks once, while importing): call memadvisor.fake.preload() "
                "before anything imports torch, or run in a fresh process")
        # the device count must be in place before torch's import creates the hooks
        os.environ["MEMADVISOR_FAKE_DEVICE_COUNT"] = str(device_count)
        path, lib = native_build.open_or_rebuild(
            lambda force: build(cache, compiler, force=force), _open_shim, FakeCudaUnavailable)
        shim = LoadedShim(lib, path)
        shim.set_device_count(device_count)
        _loaded = shim
        return shim


def loaded() -> LoadedShim | None:
    """The shim if this process loaded it, else None."""
    return _loaded


def check_active(shim: LoadedShim) -> None:
    """After ``import torch``: raise FakeCudaUnavailable unless torch uses the shim's
    hooks and guard (another CUDA library, or a torch with real CUDA, may have won)."""
    import torch  # noqa: F401  (the import is what makes torch ask for its hooks)
    if not shim.guard_active:
        raise FakeCudaUnavailable("a CUDA device guard other than the fake one is registered "
                                  "(is this a CUDA build of torch?)")
    if not shim.hooks_active:
        raise FakeCudaUnavailable("torch's CUDA hooks are not the fake ones (torch resolved "
                                  "them before the shim was loaded)")


def available() -> tuple[bool, str]:
    """Whether the shim can be built here (never loads it), and why not."""
    try:
        return True, f"built {build()}"
    except native_build.NativeUnavailable as exc:
        return False, exc.reason
    except Exception as exc:  # a probe never takes the caller down
        return False, " ".join(f"{type(exc).__name__}: {exc}".split())
