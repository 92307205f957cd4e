"""The GPUs memadvisor knows: what ``torch.cuda.get_device_properties`` reports on each.

One table for the whole package: fake execution presents these devices to a script, the
simulator (``simulate/hardware.py``) takes each one's memory, compute capability and cuBLAS
workspace from here and adds throughputs under the same names, so ``--gpu NAME`` means one
device everywhere (``tests/test_gpus.py`` keeps the name lists equal).

``total_memory_bytes`` is what ``get_device_properties().total_memory`` returns, which is
less than the marketing size (the driver keeps some).  Only the H100 figure was checked
against a real device (FACTS.md: 79.18 GiB); the others are the capacities torch is
commonly seen to report for those parts (its "GPU 0 has a total capacity of ..." OOM
message), each noted in ``memory_source``: good to about 0.5%.  A figure measured on a
real device should replace its estimate here, and nowhere else.

No torch import: the simulator may read this table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UserError

MiB = 1024**2


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuProfile:
    name: str
    """Profile key, as in simulate/hardware.py (``h100-80gb``)."""
    device_name: str
    """``torch.cuda.get_device_name()`` on that part."""
    major: int
    """Compute capability, major (8 = Ampere, 9 = Hopper)."""
    minor: int
    """Compute capability, minor."""
    total_memory_bytes: int
    """``get_device_properties().total_memory``: the caching allocator's ceiling."""
    multi_processor_count: int
    """Streaming multiprocessors."""
    l2_cache_bytes: int
    """L2 cache size (``L2_cache_size``)."""
    memory_source: str
    """Where ``total_memory_bytes`` comes from: 'measured' or how it was estimated."""

    def __post_init__(self):
        if self.total_memory_bytes <= 0 or self.multi_processor_count <= 0:
            raise ValueError(f"{self.name}: memory and SM count must be positive")

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)

    @property
    def bf16_supported(self) -> bool:
        """Native bf16 (Ampere and later), as ``torch.cuda.is_bf16_supported()`` answers."""
        return self.major >= 8

    @property
    def cublas_workspace_bytes(self) -> int:
        """cuBLAS's default workspace per (handle, stream), ``cublas_workspace_bytes``."""
        return cublas_workspace_bytes(self.capability)


#: cuBLAS's default workspace per (handle, stream), CublasHandlePool.cpp (torch 2.6-2.13):
#: ":4096:8" (32 MiB) on compute capability 9.x/10.x/12.x, else ":4096:2:16:8"
#: (8,519,680 B).  Allocated through the caching allocator on a thread's first matmul and
#: kept: the real traces in ../shared/gpu-truth show one from the forward (main) thread and
#: one from autograd's backward thread, at these sizes.
CUBLAS_WORKSPACE_CONFIG_DEFAULT = {True: ":4096:8", False: ":4096:2:16:8"}


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace on a GPU of ``capability``; ``config`` is a
    CUBLAS_WORKSPACE_CONFIG value (":SIZE_KiB:COUNT" pairs) overriding the default, as
    torch reads it."""
    text = config or CUBLAS_WORKSPACE_CONFIG_DEFAULT[capability[0] in (9, 10, 12)]
    pairs = re.findall(r":(\d+):(\d+)", text)
    if not pairs:
        raise UserError(f"CUBLAS_WORKSPACE_CONFIG={text!r}: expected ':SIZE_KiB:COUNT' pairs, "
                        "e.g. ':4096:8'")
    return sum(int(size_kib) * 1024 * int(count) for size_kib, count in pairs)


_ESTIMATE = "estimate: the capacity torch commonly reports for this part ({})"

GPUS: dict[str, GpuProfile] = {g.name: g for g in (
    GpuProfile(name="h100-80gb", device_name="NVIDIA H100 80GB HBM3", major=9, minor=0,
               total_memory_bytes=85_017_755_648, multi_processor_count=132,
               l2_cache_bytes=50 * MiB,
               memory_source="measured on an H100 80GB HBM3 (79.18 GiB, FACTS.md)"),
    GpuProfile(name="h200-141gb", device_name="NVIDIA H200", major=9, minor=0,
               total_memory_bytes=143_167 * MiB, multi_processor_count=132,
               l2_cache_bytes=50 * MiB, memory_source=_ESTIMATE.format("139.81 GiB")),
    GpuProfile(name="a100-80gb", device_name="NVIDIA A100-SXM4-80GB", major=8, minor=0,
               total_memory_bytes=81_251 * MiB, multi_processor_count=108,
               l2_cache_bytes=40 * MiB, memory_source=_ESTIMATE.format("79.35 GiB")),
    GpuProfile(name="a100-40gb", device_name="NVIDIA A100-SXM4-40GB", major=8, minor=0,
               total_memory_bytes=40_536 * MiB, multi_processor_count=108,
               l2_cache_bytes=40 * MiB, memory_source=_ESTIMATE.format("39.59 GiB")),
    GpuProfile(name="l4-24gb", device_name="NVIDIA L4", major=8, minor=9,
               total_memory_bytes=22_579 * MiB, multi_processor_count=58,
               l2_cache_bytes=48 * MiB, memory_source=_ESTIMATE.format("22.05 GiB")),
    GpuProfile(name="a10g-24gb", device_name="NVIDIA A10G", major=8, minor=6,
               total_memory_bytes=22_723 * MiB, multi_processor_count=80,
               l2_cache_bytes=6 * MiB, memory_source=_ESTIMATE.format("22.19 GiB")),
    GpuProfile(name="rtx4090-24gb", device_name="NVIDIA GeForce RTX 4090", major=8, minor=9,
               total_memory_bytes=24_217 * MiB, multi_processor_count=128,
               l2_cache_bytes=72 * MiB, memory_source=_ESTIMATE.format("23.65 GiB")),
    GpuProfile(name="v100-32gb", device_name="Tesla V100-SXM2-32GB", major=7, minor=0,
               total_memory_bytes=32_510 * MiB, multi_processor_count=80,
               l2_cache_bytes=6 * MiB, memory_source=_ESTIMATE.format("31.75 GiB")),
    GpuProfile(name="t4-16gb", device_name="Tesla T4", major=7, minor=5,
               total_memory_bytes=15_104 * MiB, multi_processor_count=40,
               l2_cache_bytes=4 * MiB, memory_source=_ESTIMATE.format("14.75 GiB")),
)}

#: simulate/hardware.py's aliases, plus the spelled-out ones the CLI help uses
ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb", "l4": "l4-24gb",
           "a10g": "a10g-24gb", "4090": "rtx4090-24gb", "rtx4090": "rtx4090-24gb",
           "v100": "v100-32gb", "t4": "t4-16gb", "a100-40": "a100-40gb",
           "a100-80": "a100-80gb"}

DEFAULT_GPU = "h100-80gb"


def gpu_profile(name: str | None) -> GpuProfile:
    """The named profile (case-insensitive, aliases accepted); None means the default."""
    if not name:
        return GPUS[DEFAULT_GPU]
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    try:
        return GPUS[key]
    except KeyError:
        raise UserError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} "
                         f"(aliases: {', '.join(sorted(ALIASES))})") from None
