"""Bytes the fake GPU would hold: live fake storages, tracked by weak reference.

A fake tensor has no memory, but its storage knows how many bytes it would need
(``untyped_storage().nbytes()``) and dies when the last tensor using it dies (views share
it; autograd's saved tensors keep it alive), as a real CUDA storage would.  So the sum
over live fake storages on one device is that device's ``memory_allocated()`` before the
caching allocator's rounding, and its running maximum is the peak.

This is the default answer of ``torch.cuda.memory_allocated()`` and friends under fake
execution; the profiler can supply its own (the allocator model's, which knows block
rounding and reserved segments) through :class:`MemoryStats`.
"""
from __future__ import annotations

import threading
import weakref
from typing import Protocol


class MemoryStats(Protocol):
    """What ``torch.cuda.memory_allocated()`` & co. answer from, per device index."""

    def allocated_bytes(self, device_index: int) -> int: ...
    def peak_allocated_bytes(self, device_index: int) -> int: ...
    def reserved_bytes(self, device_index: int) -> int: ...
    def peak_reserved_bytes(self, device_index: int) -> int: ...
    def reset_peak(self, device_index: int) -> None: ...


class LiveFakeBytes:
    """Live and peak bytes of fake storages per CUDA device index.

    Reserved memory is reported equal to allocated memory: there is no allocator model
    here (the profiler supplies one), so ``memory_reserved()`` is a lower bound.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, int]] = {}  # id(storage) -> (device, nbytes)
        self._live_bytes: dict[int, int] = {}
        self._peak_bytes: dict[int, int] = {}  # since the script's reset_peak
        self._window_peak_bytes: dict[int, int] = {}  # since the profiler's reset_window
        self.storages_tracked = 0

    def track(self, tensor) -> None:
        """Count ``tensor``'s storage once, until it dies (only CUDA fake tensors)."""
        device = tensor.device
        if device.type != "cuda":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        index = device.index or 0
        with self._lock:
            self._seen[key] = (index, nbytes)
            live = self._live_bytes.get(index, 0) + nbytes
            self._live_bytes[index] = live
            if live > self._peak_bytes.get(index, 0):
                self._peak_bytes[index] = live
            if live > self._window_peak_bytes.get(index, 0):
                self._window_peak_bytes[index] = live
            self.storages_tracked += 1
        weakref.finalize(storage, self._release, key)

    def resized(self, storage) -> None:
        """A tracked storage changed size in place (``untyped_storage().resize_()``: FSDP2
        frees and re-allocates unsharded parameters this way)."""
        key = id(storage)
        with self._lock:
            entry = self._seen.get(key)
            if entry is None:
                return
            index, old_nbytes = entry
            nbytes = storage.nbytes()
            self._seen[key] = (index, nbytes)
            live = self._live_bytes[index] + nbytes - old_nbytes
            self._live_bytes[index] = live
            if live > self._peak_bytes.get(index, 0):
                self._peak_bytes[index] = live
            if live > self._window_peak_bytes.get(index, 0):
                self._window_peak_bytes[index] = live

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._seen.pop(key, None)
            if entry is not None:
                index, nbytes = entry
                self._live_bytes[index] -= nbytes

    # --- MemoryStats ------------------------------------------------------------------
    def allocated_bytes(self, device_index: int = 0) -> int:
        return self._live_bytes.get(device_index, 0)

    def peak_allocated_bytes(self, device_index: int = 0) -> int:
        return self._peak_bytes.get(device_index, 0)

    def reserved_bytes(self, device_index: int = 0) -> int:
        return self.allocated_bytes(device_index)

    def peak_reserved_bytes(self, device_index: int = 0) -> int:
        return self.peak_allocated_bytes(device_index)

    def reset_peak(self, device_index: int = 0) -> None:
        with self._lock:
            self._peak_bytes[device_index] = self._live_bytes.get(device_index, 0)

    # --- the profiler's own window (a script's reset_peak_memory_stats never moves it) --
    def window_peak_bytes(self, device_index: int = 0) -> int:
        return self._window_peak_bytes.get(device_index, 0)

    def reset_window(self, device_index: int = 0) -> int:
        """Start a new window; returns the peak of the one that ended."""
        with self._lock:
            peak = self._window_peak_bytes.get(device_index, 0)
            self._window_peak_bytes[device_index] = self._live_bytes.get(device_index, 0)
            return peak
