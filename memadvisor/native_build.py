"""Building the small C++ libraries in ``cuda_hooks/`` against the installed torch.

One place for what every native piece that links torch needs: the compiler, torch's
headers and libraries, the cache key, and an atomic, logged compile whose failure is one
line.  Used by the CPU allocator hook and op tracker (``profile/native.py``) and the fake
CUDA shim (``fake/shim.py``).

Nothing here imports torch unless it already is: the fake CUDA shim must be built and
loaded *before* ``import torch`` (torch resolves its CUDA hooks once, while importing).

The cache is shared by every virtual environment of the user: a library's name carries a
hash of what it was built from -- its sources, torch's version, C++ ABI and headers (their
bytes, not their path), the Python ABI and the compiler -- so a second environment with the
same torch loads the first one's build instead of compiling again (about 5 s).  A library
is loaded only from a file and folder owned by this user (or root) that nobody else may
write to (:func:`ensure_trusted`): loading one is running its code.

Environment:
    MEMADVISOR_CACHE  cache root (default ``$XDG_CACHE_HOME/memadvisor``, else
                      ``~/.cache/memadvisor``); libraries go in ``native/``
    MEMADVISOR_CXX    C++ compiler (default ``$CXX``, then ``g++``, then ``c++``)
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

BUILD_TIMEOUT_S = 300


class NativeUnavailable(RuntimeError):
    """A native library cannot be built or loaded; ``str(exc)`` is one line."""

    def __init__(self, reason: str, log: str = ""):
        reason = " ".join(str(reason).split())  # one line, always
        super().__init__(reason)
        self.reason = reason
        self.log = log  # full compiler output, when there was one


@dataclass(frozen=True, slots=True)
class TorchBuild:
    """Where torch's C++ headers and libraries are, and what a library must match."""
    version: str
    include: Path
    lib: Path
    cxx11_abi: int


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """``<cache>/native``; ``cache`` overrides ``$MEMADVISOR_CACHE``, which overrides
    ``$XDG_CACHE_HOME/memadvisor`` (an absolute ``XDG_CACHE_HOME`` only, as the XDG base
    directory specification says), else ``~/.cache/memadvisor``."""
    if cache is not None:
        return Path(cache).expanduser() / "native"
    root = os.environ.get("MEMADVISOR_CACHE")
    if root:
        return Path(root).expanduser() / "native"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "memadvisor" / "native"


def find_compiler(compiler: str | None = None,
                  error: type[NativeUnavailable] = NativeUnavailable) -> str:
    names = [compiler] if compiler else [
        c for c in (os.environ.get("MEMADVISOR_CXX"), os.environ.get("CXX"), "g++", "c++") if c]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise error(f"no C++ compiler found (tried {', '.join(names)})")


def _abi_without_import(version: str) -> int:
    # torch >= 2.7 is built with the C++11 ABI only (torch.compiled_with_cxx11_abi()
    # returns a constant True); older versions vary, so ask a throwaway interpreter.
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and (int(match[1]), int(match[2])) >= (2, 7):
        return 1
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    return 1 if proc.stdout.strip() != "0" else 0


def torch_build(error: type[NativeUnavailable] = NativeUnavailable) -> TorchBuild:
    """torch's version, include and lib directories and C++ ABI, found without importing
    torch when it is not imported yet."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):
        root = Path(torch.__file__).resolve().parent
        version = torch.__version__
        abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    else:
        try:
            spec = importlib.util.find_spec("torch")
        except (ImportError, ValueError) as exc:
            raise error(f"torch is not importable: {exc}") from None
        if spec is None or not spec.origin:
            raise error("torch is not installed")
        root = Path(spec.origin).resolve().parent
        try:
            text = (root / "version.py").read_text()
        except OSError as exc:
            raise error(f"cannot read torch's version: {exc}") from None
        match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
        if match is None:
            raise error(f"no __version__ in {root / 'version.py'}")
        version = match[1]
        abi = _abi_without_import(version)
    include, lib = root / "include", root / "lib"
    if not (include / "c10" / "core" / "Allocator.h").is_file():
        raise error(f"torch C++ headers not found under {include}")
    if not any(lib.glob("libc10.*")):
        raise error(f"libc10 not found under {lib}")
    return TorchBuild(version, include, lib, abi)


#: headers whose bytes stand for torch's C++ interface in the cache key: the build's
#: configuration and the interfaces the native pieces use (the reference counting and
#: tensor layout the op tracker compiles inline among them)
FINGERPRINT_HEADERS = ("torch/csrc/api/include/torch/version.h", "c10/macros/cmake_macros.h",
                       "c10/core/Allocator.h", "ATen/record_function.h",
                       "c10/core/impl/DeviceGuardImplInterface.h", "c10/core/TensorImpl.h",
                       "c10/util/intrusive_ptr.h", "ATen/core/ivalue.h",
                       "ATen/core/dispatch/Dispatcher.h")


def headers_fingerprint(include: Path) -> bytes:
    """The bytes of FINGERPRINT_HEADERS (those present): equal for two installs of the same
    torch wherever they live, so a second virtual environment reuses the cached build."""
    digest = hashlib.sha256()
    for name in FINGERPRINT_HEADERS:
        try:
            digest.update(name.encode() + b"\0" + (include / name).read_bytes() + b"\0")
        except OSError:
            digest.update(name.encode() + b"\0missing\0")
    return digest.digest()


def compiler_identity(compiler: str | None = None) -> str:
    """What the compiler says it is (``--version``'s first line), or ``"none"``: part of the
    cache key, so that a library built by another compiler (another ABI, other codegen) is
    not taken for this one's.  The compiler's path is not: two environments find the same
    compiler in different places."""
    try:
        return _identity_of(find_compiler(compiler))
    except NativeUnavailable:
        return "none"


@functools.lru_cache(maxsize=8)
def _identity_of(cxx: str) -> str:
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "none"
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return f"{Path(cxx).name}: {lines[0] if lines else proc.returncode}"


def cache_key(sources: bytes, build: TorchBuild, compiler: str | None = None) -> str:
    """A hash of what a compiled library depends on: its source(s), torch's version, C++
    ABI and headers (by content, not by path), the Python ABI, and the compiler
    (``compiler`` or the one :func:`find_compiler` picks; by what it says it is, not by
    path).  Equal for two virtual environments of the same torch and Python."""
    return hashlib.sha256(b"\0".join([
        sources, build.version.encode(), str(build.cxx11_abi).encode(),
        (sys.implementation.cache_tag or "").encode(),
        (sysconfig.get_config_var("SOABI") or "").encode(), headers_fingerprint(build.include),
        compiler_identity(compiler).encode(),
    ])).hexdigest()[:16]


def untrusted_reason(path: Path) -> str | None:
    """Why the library at ``path`` must not be loaded (``None``: it may): the file and the
    folder holding it must be owned by this user or root and writable by nobody else,
    since whoever can write them chooses the code this process runs.  Links are followed
    (to the file they name and its folder)."""
    path = Path(os.path.realpath(path))
    uid = os.getuid() if hasattr(os, "getuid") else None
    for what, where in (("library", path), ("folder", path.parent)):
        try:
            info = os.stat(where)
        except OSError as exc:
            return f"cannot check the {what} {where}: {exc.strerror or exc}"
        if uid is not None and info.st_uid not in (uid, 0):
            return f"the {what} {where} belongs to another user (uid {info.st_uid})"
        writers = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writers == stat.S_IWGRP and _private_group(info.st_gid):
            continue  # umask 002 with a group of one's own (Debian, Ubuntu): only us
        if writers:
            return (f"the {what} {where} is writable by others "
                    f"(mode {stat.S_IMODE(info.st_mode):o})")
    return None


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's own: their primary group, named after them,
    with no other members (user private groups, where a umask of 002 is the default)."""
    try:
        import grp
        import pwd
        user = pwd.getpwuid(os.getuid())
        group = grp.getgrgid(gid)
    except (ImportError, KeyError, OSError):
        return False
    return (gid == user.pw_gid and group.gr_name == user.pw_name
            and set(group.gr_mem) <= {user.pw_name})


def ensure_trusted(path: Path, error: type[NativeUnavailable] = NativeUnavailable) -> None:
    """Raise ``error`` unless :func:`untrusted_reason` finds nothing wrong with ``path``
    (a path that does not exist is left to the loader to report)."""
    if not os.path.lexists(path):
        return
    reason = untrusted_reason(Path(path))
    if reason is not None:
        raise error(f"refusing to load {Path(path).name}: {reason}")


def preload_torch_libraries(build: TorchBuild, names=("libc10.so", "libtorch_cpu.so")) -> None:
    """Load this torch's own libraries globally before a cached library that links them:
    a build made in another environment carries that environment's rpath, and the loader
    takes a library already loaded under the same name before searching any path."""
    import ctypes
    for name in names:
        path = build.lib / name
        if path.is_file():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def compile_command(cxx: str, src: Path, out: Path, build: TorchBuild, *,
                    flags: tuple[str, ...] = (), libs: tuple[str, ...] = ("-lc10",)) -> list[str]:
    return [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={build.cxx11_abi}", f"-I{build.include}", *flags,
            str(src), "-o", str(out), f"-L{build.lib}", *libs, f"-Wl,-rpath,{build.lib}"]


def first_error_line(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln[:300]
    return lines[0][:300] if lines else "no output"


def compile_library(src: Path, out: Path, command: "callable",
                    error: type[NativeUnavailable] = NativeUnavailable) -> Path:
    """Run ``command(tmp_path)`` (a compiler command line writing ``tmp_path``) and move the
    result to ``out`` atomically, so concurrent builders never load a partial file.  On
    failure raises ``error`` with a one-line reason; the full compiler output goes to the
    exception's ``log`` and to ``out`` with suffix ``.log``."""
    out_dir = out.parent
    try:
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{src.stem}-", suffix=".so.tmp", dir=out_dir)
        os.close(fd)
    except OSError as exc:
        raise error(f"cannot write to cache {out_dir}: {exc}") from None
    tmp = Path(tmp_name)
    cmd = command(tmp)
    cxx = cmd[0]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise error(f"could not run {cxx}: {exc}") from None
        if proc.returncode != 0:
            log = (proc.stderr or "") + (proc.stdout or "")
            try:
                out.with_suffix(".log").write_text(" ".join(cmd) + "\n" + log)
            except OSError:
                pass
            raise error(f"building {src.name} failed ({Path(cxx).name} exit "
                        f"{proc.returncode}): {first_error_line(log)}", log=log)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def open_or_rebuild(build: "callable", open_library: "callable",
                    error: type[NativeUnavailable] = NativeUnavailable):
    """``open_library(build(force=False))``; a cached library that will not open (a
    truncated or damaged file, one from a build the cache key did not tell apart) is
    built again once instead of leaving the fallback in place for good.  A library anyone
    but this user (or root) could have written is never opened (:func:`ensure_trusted`):
    that raises ``error``, whether the library was found there or just built there."""
    path = build(force=False)
    ensure_trusted(path, error)
    try:
        return open_library(path)
    except error:
        path = build(force=True)
        ensure_trusted(path, error)
        return open_library(path)
