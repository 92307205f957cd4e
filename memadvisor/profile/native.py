"""A native hook on c10's CPU allocator: every CPU allocation and free, in order.

The dispatch-level view (``dispatch.py``) sees storages that ops return; it cannot see
memory a kernel allocates and frees internally (oneDNN convolution scratchpads,
max_pool2d / convolution_backward temporaries).  ``torch.profiler(profile_memory=True)``
sees those because they go through c10's CPU allocator, and so does this hook: a tiny
C++ library (``cuda_hooks/allocator_hook.cpp``) that wraps the current CPU allocator and
records ``(kind, ptr, size)`` events, ``kind`` being +1 for an allocation and -1 for a
free, into a buffer this module drains.

The library is compiled on first use with the system C++ compiler against torch's own
headers and ``libc10.so`` (about a second), and cached under ``$MEMADVISOR_CACHE``,
``$XDG_CACHE_HOME/memadvisor/`` or ``~/.cache/memadvisor/``, keyed by the sources, torch's
version, C++ ABI and headers (their bytes: virtual environments of the same torch share
one build), the Python ABI and the compiler; it is loaded only from a file and folder
nobody but this user (or root) can write (``native_build.ensure_trusted``).
Anything going wrong -- no compiler, no headers, a failed build, a library that will not
load -- surfaces as :class:`NativeHookUnavailable` with a one-line reason; the profiler
then falls back to the dispatch-level view and says so.

Environment:
    MEMADVISOR_CACHE       cache root (default ``$XDG_CACHE_HOME/memadvisor``, else
                           ``~/.cache/memadvisor``)
    MEMADVISOR_CXX         C++ compiler (default ``$CXX``, then ``g++``, then ``c++``)
    MEMADVISOR_NATIVE_SRC  directory holding ``allocator_hook.cpp`` (default: the
                           checkout's ``cuda_hooks/``)
    MEMADVISOR_NO_NATIVE   if set non-empty, the hook is reported unavailable

Semantics worth knowing (details in ``cuda_hooks/README.md``):
    * the hook is process-global and, once installed, stays installed (it is
      transparent: allocations are forwarded to the original allocator);
    * ``ptr`` is the storage's data pointer: ``t.untyped_storage().data_ptr()``
      (``t.data_ptr()`` adds the storage offset of a view);
    * while recording is on, every free is logged, including frees of allocations made
      after install but before ``start()``; allocations made before install are
      invisible (neither their allocation nor their free is ever logged);
    * zero-byte allocations are not logged;
    * the wrapper is registered with ``c10::SetAllocator``, so it sees what goes through
      ``c10::GetAllocator(CPU)`` (every ATen op and kernel).  Storages built from Python
      (``torch.UntypedStorage(n)``, ``storage.clone()`` and so ``copy.deepcopy``,
      unpickling) call ``c10::GetDefaultCPUAllocator()`` directly and are missed unless
      :meth:`AllocatorHook.cover_default_allocator` (opt-in) is called;
    * weakref callbacks of a dying tensor/storage run *before* its native free is
      recorded.
"""
from __future__ import annotations

import ctypes
import os
import sysconfig
import threading
from pathlib import Path

import numpy as np

from .. import native_build
from ..native_build import NativeUnavailable

SOURCE_NAME = "allocator_hook.cpp"
API_VERSION = 1
_DRAIN_CAPACITY = 8192


class NativeHookUnavailable(NativeUnavailable):
    """The native allocator hook cannot be built or loaded; ``str(exc)`` is one line."""


# --- locating, building -----------------------------------------------------------------
def source_dir() -> Path:
    """Where ``allocator_hook.cpp`` lives (raises NativeHookUnavailable if nowhere)."""
    candidates = []
    env = os.environ.get("MEMADVISOR_NATIVE_SRC")
    if env:
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[2] / "cuda_hooks")  # checkout
    candidates.append(Path(__file__).resolve().parents[1] / "_native")  # packaged data
    for cand in candidates:
        if (cand / SOURCE_NAME).is_file():
            return cand
    raise NativeHookUnavailable(
        f"{SOURCE_NAME} not found (looked in {', '.join(str(c) for c in candidates)})")


def cache_dir() -> Path:
    return native_build.cache_dir()


def _find_compiler(compiler: str | None) -> str:
    return native_build.find_compiler(compiler, NativeHookUnavailable)


def _torch_paths() -> tuple[str, Path, Path, int]:
    build_info = native_build.torch_build(NativeHookUnavailable)
    return build_info.version, build_info.include, build_info.lib, build_info.cxx11_abi


def _compile_command(cxx: str, src: Path, out: Path, build_info: native_build.TorchBuild,
                     with_aten: bool = False) -> list[str]:
    if not with_aten:
        return native_build.compile_command(cxx, src, out, build_info)
    # the op tracker: ATen's RecordFunction and Python's frame API
    return native_build.compile_command(
        cxx, src, out, build_info,
        flags=(f"-I{sysconfig.get_paths()['include']}", "-Wno-c++20-extensions", "-DNDEBUG"),
        libs=("-ltorch_cpu", "-lc10"))


_first_error_line = native_build.first_error_line


def library_path(cache: str | os.PathLike | None = None,
                 source_name: str = SOURCE_NAME, compiler: str | None = None) -> Path:
    """Where the library for this source, torch, Python and compiler lives in the cache
    (built or not).  The name carries a hash of the sources, torch's version, C++ ABI and
    headers' bytes, the Python ABI and the compiler (``native_build.cache_key``): changing
    any of them means a rebuild, and another virtual environment of the same torch finds
    the same library."""
    src_dir = source_dir()
    try:
        # the op tracker compiles the allocator hook in: both sources count
        source = b"".join((src_dir / name).read_bytes()
                          for name in dict.fromkeys((SOURCE_NAME, source_name)))
    except OSError as exc:
        raise NativeHookUnavailable(f"cannot read {src_dir / source_name}: {exc}") from None
    key = native_build.cache_key(source, native_build.torch_build(NativeHookUnavailable),
                                 compiler)
    out_dir = native_build.cache_dir(cache)
    return out_dir / f"{Path(source_name).stem}-{key}.so"


def build(cache: str | os.PathLike | None = None, compiler: str | None = None,
          force: bool = False, source_name: str = SOURCE_NAME) -> Path:
    """Compile the hook (if not cached) and return the shared library's path.

    ``cache`` overrides ``$MEMADVISOR_CACHE``; ``compiler`` overrides
    ``$MEMADVISOR_CXX``.  Raises NativeHookUnavailable with a one-line reason on any
    failure (the full compiler output is in the exception's ``log`` and in a ``.log``
    file next to where the library would be).
    """
    out = library_path(cache, source_name, compiler)
    if out.is_file() and not force:
        return out
    src = source_dir() / source_name
    build_info = native_build.torch_build(NativeHookUnavailable)
    cxx = _find_compiler(compiler)
    return native_build.compile_library(
        src, out,
        lambda tmp: _compile_command(cxx, src, tmp, build_info,
                                     with_aten=source_name != SOURCE_NAME),
        NativeHookUnavailable)


def _open_hook(path: Path) -> tuple[Path, ctypes.CDLL]:
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        _bind(lib)
    except (OSError, AttributeError) as exc:
        raise NativeHookUnavailable(f"cannot load {path.name}: {exc}") from None
    version = lib.ma_api_version()
    if version != API_VERSION:
        raise NativeHookUnavailable(
            f"{path.name} has API version {version}, expected {API_VERSION}")
    return path, lib


# --- the loaded hook ---------------------------------------------------------------------
_I64P = ctypes.c_void_p


def _bind(lib: ctypes.CDLL) -> None:
    sigs = {
        "ma_install": (ctypes.c_int, []),
        "ma_installed": (ctypes.c_int, []),
        "ma_set_recording": (None, [ctypes.c_int]),
        "ma_recording": (ctypes.c_int, []),
        "ma_drain": (ctypes.c_int64, [_I64P, _I64P, _I64P, ctypes.c_int64]),
        "ma_drain_ex": (ctypes.c_int64, [_I64P, _I64P, _I64P, _I64P, ctypes.c_int64]),
        "ma_pending": (ctypes.c_int64, []),
        "ma_clear": (None, []),
        "ma_next_seq": (ctypes.c_int64, []),
        "ma_live_bytes": (ctypes.c_int64, []),
        "ma_live_count": (ctypes.c_int64, []),
        "ma_peak_bytes": (ctypes.c_int64, []),
        "ma_reset_peak": (None, []),
        "ma_api_version": (ctypes.c_int, []),
        "ma_cover_default_allocator": (ctypes.c_int, []),
        "ma_default_covered": (ctypes.c_int, []),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def _frozen_empty(dtype) -> np.ndarray:
    arr = np.empty(0, dtype)
    arr.flags.writeable = False
    return arr


_EMPTY_I64 = _frozen_empty(np.int64)  # what an empty drain returns (read-only, shared)
_EMPTY_U64 = _frozen_empty(np.uint64)

_lock = threading.Lock()
_instance: "AllocatorHook | None" = None
_COVER_ERRORS = {1: "the hook is not installed",
                 2: "the wrapped allocator is not c10's default CPU allocator",
                 3: "the default CPU allocator is not a c10::DefaultCPUAllocator",
                 4: "the default CPU allocator is not in writable memory",
                 5: "c10 raised while covering the default allocator"}
_INSTALL_ERRORS = {1: "there is no CPU allocator to wrap",
                   2: "another CPU allocator is registered at a higher priority",
                   3: "c10 raised (or pthread_atfork failed) while installing"}


class AllocatorHook:
    """The process-wide CPU allocator hook.  Get it with :meth:`load`."""

    def __init__(self, lib: ctypes.CDLL, path: Path, capacity: int = _DRAIN_CAPACITY):
        self._lib = lib
        self.path = path
        self._cap = capacity
        self._kinds = np.empty(capacity, np.int64)
        self._ptrs = np.empty(capacity, np.uint64)
        self._sizes = np.empty(capacity, np.int64)
        self._seqs = np.empty(capacity, np.int64)
        self._addr = (self._kinds.ctypes.data, self._ptrs.ctypes.data,
                      self._sizes.ctypes.data)
        self._seq_addr = self._seqs.ctypes.data
        self._drain = lib.ma_drain
        self._drain_ex = lib.ma_drain_ex

    @classmethod
    def load(cls, *, cache: str | os.PathLike | None = None,
             compiler: str | None = None) -> "AllocatorHook":
        """Build (if needed), load and install the hook; the same object every call.

        ``cache`` / ``compiler`` override ``$MEMADVISOR_CACHE`` / ``$MEMADVISOR_CXX`` for
        the build.  The hook is process-global: once one library is installed, later calls
        return it (after checking that a build with the given settings would succeed).
        Raises NativeHookUnavailable(reason).
        """
        global _instance
        with _lock:
            if _instance is not None and cache is None and compiler is None:
                return _instance
            if os.environ.get("MEMADVISOR_NO_NATIVE"):
                raise NativeHookUnavailable("disabled by MEMADVISOR_NO_NATIVE")
            if _instance is not None:
                build(cache, compiler)  # the settings given must still build
                return _instance
            path, lib = native_build.open_or_rebuild(
                lambda force: build(cache, compiler, force=force), _open_hook,
                NativeHookUnavailable)
            rc = lib.ma_install()
            if rc != 0:
                raise NativeHookUnavailable(
                    f"installing the allocator hook failed: {_INSTALL_ERRORS.get(rc, rc)}")
            _instance = cls(lib, path)
            return _instance

    def cover_default_allocator(self) -> None:
        """Also see allocations that bypass ``GetAllocator(CPU)`` and call
        ``c10::GetDefaultCPUAllocator()`` directly: storages built from Python
        (``torch.UntypedStorage(n)``, its ``resize_()``, ``storage.clone()``, so
        ``copy.deepcopy`` of tensors and modules, unpickling).  Opt-in and irreversible:
        it re-points the vtable pointer of c10's (stateless) default allocator object at
        a forwarder into the hook.  Raises NativeHookUnavailable(reason) when the safety
        checks fail (then nothing was changed)."""
        rc = self._lib.ma_cover_default_allocator()
        if rc != 0:
            raise NativeHookUnavailable(
                f"cannot cover the default CPU allocator: {_COVER_ERRORS.get(rc, rc)}")

    @property
    def default_covered(self) -> bool:
        return bool(self._lib.ma_default_covered())

    # --- recording ---------------------------------------------------------------------
    def start(self) -> None:
        """Recording on: from now on every allocation and free is logged."""
        self._lib.ma_set_recording(1)

    def stop(self) -> None:
        """Recording off (pending events stay until drained or cleared)."""
        self._lib.ma_set_recording(0)

    @property
    def recording(self) -> bool:
        return bool(self._lib.ma_recording())

    def pending(self) -> int:
        return self._lib.ma_pending()

    def clear(self) -> None:
        """Discard pending events."""
        self._lib.ma_clear()

    def drain(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Remove and return pending events, oldest first: kinds (int64, +1 alloc /
        -1 free), ptrs (uint64), sizes (int64 bytes).  The arrays are fresh copies (an empty
        drain returns shared read-only empty arrays).  One C call when few events are
        pending; it loops while the preallocated buffers come back full."""
        cap = self._cap
        k, p, s = self._addr
        n = self._drain(k, p, s, cap)
        if n == 0:
            return _EMPTY_I64, _EMPTY_U64, _EMPTY_I64
        if n < cap:
            return self._kinds[:n].copy(), self._ptrs[:n].copy(), self._sizes[:n].copy()
        chunks = [(self._kinds.copy(), self._ptrs.copy(), self._sizes.copy())]
        while n == cap:
            n = self._drain(k, p, s, cap)
            chunks.append((self._kinds[:n].copy(), self._ptrs[:n].copy(),
                           self._sizes[:n].copy()))
        return tuple(np.concatenate(parts) for parts in zip(*chunks))  # type: ignore

    def drain_with_seq(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Like :meth:`drain` plus each event's sequence number (int64, gapless and
        increasing over the process: the count of events recorded before it)."""
        cap = self._cap
        k, p, s = self._addr
        chunks = []
        while True:
            n = self._drain_ex(k, p, s, self._seq_addr, cap)
            chunks.append((self._kinds[:n].copy(), self._ptrs[:n].copy(),
                           self._sizes[:n].copy(), self._seqs[:n].copy()))
            if n < cap:
                break
        if len(chunks) == 1:
            return chunks[0]
        return tuple(np.concatenate(parts) for parts in zip(*chunks))  # type: ignore

    def drain_lists(self) -> tuple[list, list, list, list]:
        """Pending events as Python lists (kinds, ptrs, sizes, seqs), oldest first: the
        cheapest form for a caller that walks them in Python (called after every op)."""
        cap = self._cap
        k, p, s = self._addr
        n = self._drain_ex(k, p, s, self._seq_addr, cap)
        if n == 0:
            return [], [], [], []
        kinds, ptrs = self._kinds[:n].tolist(), self._ptrs[:n].tolist()
        sizes, seqs = self._sizes[:n].tolist(), self._seqs[:n].tolist()
        while n == cap:
            n = self._drain_ex(k, p, s, self._seq_addr, cap)
            kinds += self._kinds[:n].tolist()
            ptrs += self._ptrs[:n].tolist()
            sizes += self._sizes[:n].tolist()
            seqs += self._seqs[:n].tolist()
        return kinds, ptrs, sizes, seqs

    @property
    def next_seq(self) -> int:
        return self._lib.ma_next_seq()

    # --- totals (everything allocated through the hook since install) ----------------
    @property
    def live_bytes(self) -> int:
        return self._lib.ma_live_bytes()

    @property
    def live_count(self) -> int:
        return self._lib.ma_live_count()

    @property
    def peak_bytes(self) -> int:
        return self._lib.ma_peak_bytes()

    def reset_peak(self) -> None:
        self._lib.ma_reset_peak()


def available() -> tuple[bool, str]:
    """Whether the hook can be built and loaded here, and why not (or where from)."""
    try:
        hook = AllocatorHook.load()
    except NativeHookUnavailable as exc:
        return False, exc.reason
    except Exception as exc:  # never let a probe take the profiler down
        return False, " ".join(f"{type(exc).__name__}: {exc}".split())
    return True, f"loaded {hook.path}"


def replay_peak(kinds: np.ndarray, sizes: np.ndarray) -> int:
    """Peak of the running sum of ``kinds * sizes`` (0 for no events), relative to the
    bytes live before the first event."""
    if len(kinds) == 0:
        return 0
    running = np.cumsum(kinds * sizes)
    return max(0, int(running.max()))
