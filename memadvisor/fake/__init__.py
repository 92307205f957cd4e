"""Fake-tensor execution on a simulated GPU, on any torch build (CPU-only included).

``with fake_execution(gpu="h100-80gb"): train()`` runs unmodified training code with every
CUDA tensor fake (shapes, dtypes and devices, no memory, no compute) while torch believes
the named GPU is present.  See ``runtime.py``.

Importing this package does not import torch: :func:`preload` must be able to load the
native shim before torch is imported.
"""
from __future__ import annotations

from ..gpus import GPUS, GpuProfile, gpu_profile


def preload(device_count: int = 1):
    """Build and load the fake CUDA shim; call before anything imports torch."""
    from . import shim
    return shim.load(device_count)


__all__ = ["GPUS", "GpuProfile", "gpu_profile", "preload"]
