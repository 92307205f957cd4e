"""Keeping a long-running dashboard's memory where it started.

Every request runs on a thread of its own (werkzeug's threaded server) and every simulation
on the plan worker; glibc gives threads arenas of their own (up to eight per core) and keeps
what a freed array leaves in them, and after a large free it raises the size below which it
keeps memory instead of unmapping it.  So after a few budget edits a server held hundreds of
MiB it no longer used.  ``bound_malloc`` fixes both at start (two arenas, large blocks always
mapped and unmapped); ``trim`` hands back what the last job freed (the plan worker calls it
after each job).  The plan worker itself takes ``compute_malloc`` instead: a simulation
makes and drops arrays of megabytes by the thousand, and a block mapped on its own is
page-faulted in anew each time (a ranking at 1M events took 1.8x the CPU time with the
server's 1 MiB threshold); blocks up to 32 MiB come from its heap and are reused, and
``trim`` still hands the heap's free pages back after each job.  Elsewhere than glibc all
of these do nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: blocks from this size up are mapped on their own and unmapped when freed
MMAP_THRESHOLD_BYTES = 1 << 20
#: the plan worker's: glibc's largest (4 Mi longs on 64-bit systems)
COMPUTE_MMAP_THRESHOLD_BYTES = 32 << 20
ARENAS = 2


def arrow_purges_at_once() -> bool:
    """Have pyarrow's allocator (mimalloc) give pages back as soon as they are freed, not
    after its 10 ms purge delay (pages it freed then waited for an allocation or collection
    that a worker between jobs never makes: the plan worker grew 20-60 MiB over 20 budget
    edits, a ranking's data-flow columns being Arrow buffers).  mimalloc reads its options
    once, when the library loads: False when pyarrow is already loaded (nothing changed),
    or when the user set the option themselves (theirs is kept)."""
    if "pyarrow" in sys.modules or "MIMALLOC_PURGE_DELAY" in os.environ:
        return False
    os.environ["MIMALLOC_PURGE_DELAY"] = "0"
    return True


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc's; musl has neither
    except (OSError, AttributeError):
        return None
    return libc


def bound_malloc() -> bool:
    """Two malloc arenas and a fixed mmap threshold for this process; False where the C
    library does not take them."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, ARENAS)) and bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def compute_malloc() -> bool:
    """Two malloc arenas, and blocks up to ``COMPUTE_MMAP_THRESHOLD_BYTES`` from the heap,
    for a process that computes between ``trim`` calls (the plan worker: it inherits the
    server's ``bound_malloc`` when forked); False where the C library does not take them."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, ARENAS)) and bool(
        libc.mallopt(M_MMAP_THRESHOLD, COMPUTE_MMAP_THRESHOLD_BYTES))


def trim() -> None:
    """Give memory freed by the last job back to the system (malloc and pyarrow's pool)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    try:
        import pyarrow
    except ImportError:
        return
    release = getattr(pyarrow.default_memory_pool(), "release_unused", None)
    if release is not None:
        release()
