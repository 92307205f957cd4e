"""``torch.cuda`` as seen on the simulated GPU, while fake execution is on.

A CPU-only torch's ``torch.cuda`` answers "no CUDA" everywhere; a script that picks its
device, checks bf16 support, creates streams or prints memory must instead see the target
GPU.  :func:`install` replaces those functions (module attributes, so calls from inside
torch.cuda, autocast and torch.utils.checkpoint see them too) and the returned
:class:`~memadvisor.fake.patching.Patches` undoes it.  Nothing here runs a kernel:
streams and events are bookkeeping, synchronisation returns at once.

Memory queries (``memory_allocated`` ...) answer from a :class:`~.memory.MemoryStats`
(default: live fake storages, ``memory.LiveFakeBytes``).
"""
from __future__ import annotations

import contextlib
import threading

import torch

from ..gpus import GpuProfile
from .memory import MemoryStats
from .patching import Patches

_CUDA = 1  # c10::DeviceType::CUDA


class FakeDeviceProperties:
    """What ``torch.cuda.get_device_properties()`` returns for the simulated GPU."""

    def __init__(self, gpu: GpuProfile, index: int):
        self.name = gpu.device_name
        self.major, self.minor = gpu.major, gpu.minor
        self.total_memory = gpu.total_memory_bytes
        self.multi_processor_count = gpu.multi_processor_count
        self.L2_cache_size = gpu.l2_cache_bytes
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.warp_size = 32
        # Ampere GA100/Hopper: 2048 threads per SM; consumer Ampere/Ada: 1536; Turing: 1024
        self.max_threads_per_multi_processor = (
            1536 if (gpu.major, gpu.minor) in ((8, 6), (8, 9))
            else 1024 if (gpu.major, gpu.minor) == (7, 5) else 2048)
        self.gcnArchName = "NVIDIA"
        self.uuid = f"00000000-0000-0000-0000-{index:012d}"
        self.pci_bus_id, self.pci_device_id, self.pci_domain_id = index, 0, 0

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // 1024**2}MB, "
                f"multi_processor_count={self.multi_processor_count}, "
                f"L2_cache_size={self.L2_cache_size // 1024**2}MB)")


class FakeStream(torch.Stream):
    """A CUDA stream that orders nothing: fake ops run when called, on one timeline.
    A ``torch.Stream`` so ops taking a stream (``record_stream``) accept it."""

    _next_id = 1
    _id_lock = threading.Lock()

    def __new__(cls, device=None, priority: int = 0, *, stream_id: int | None = None,
                device_index: int | None = None, **_ignored):
        if stream_id is None:
            with cls._id_lock:
                stream_id, cls._next_id = cls._next_id, cls._next_id + 1
        if device_index is None:
            device_index = _device_index(device)
        return super().__new__(cls, stream_id=stream_id, device_index=device_index,
                               device_type=_CUDA)

    def __init__(self, *args, **kwargs):  # torch.Stream.__init__ takes no arguments
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    @property
    def cuda_stream(self) -> int:
        return self.stream_id

    def __eq__(self, other) -> bool:
        return (isinstance(other, torch.Stream) and self.stream_id == other.stream_id
                and self.device_index == other.device_index)

    def __hash__(self) -> int:
        return hash((self.stream_id, self.device_index))


class FakeEvent:
    """A CUDA event that is always complete; elapsed time is zero (no kernels ran)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_ignored):
        self.enable_timing = enable_timing

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event) -> float:
        return 0.0


def _device_index(device=None) -> int:
    if device is None:
        return current_state.device_index
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else current_state.device_index


#: the native shim's current device of the calling thread (``install`` sets it): the C++
#: guard is the truth -- the autograd engine's worker thread for cuda:1 sets it there, in
#: C++, before any Python runs on the thread (DTensor asked "cuda" on rank 1 in backward and
#: got cuda:0 while the guard said 1)
_native_current_device = None


class _CurrentState(threading.local):
    """Per thread, as in CUDA: the current device and the current stream per device."""

    def __init__(self):
        self._device_index = 0
        self.streams: dict[int, FakeStream] = {}

    @property
    def device_index(self) -> int:
        getter = _native_current_device
        return int(getter()) if getter is not None else self._device_index

    @device_index.setter
    def device_index(self, index: int) -> None:
        self._device_index = index


current_state = _CurrentState()


def _default_stream(device=None) -> FakeStream:
    index = _device_index(device)
    return FakeStream(stream_id=0, device_index=index)


def _current_stream(device=None) -> FakeStream:
    index = _device_index(device)
    return current_state.streams.get(index) or _default_stream(index)


def _set_stream(stream) -> None:
    if stream is not None:
        current_state.streams[stream.device_index] = stream


@contextlib.contextmanager
def _stream_context(stream):
    if stream is None:
        yield
        return
    previous = current_state.streams.get(stream.device_index)
    current_state.streams[stream.device_index] = stream
    try:
        yield
    finally:
        if previous is None:
            current_state.streams.pop(stream.device_index, None)
        else:
            current_state.streams[stream.device_index] = previous


def _noop(*_args, **_kwargs):
    return None


def _memory_history_stubs(device_count: int) -> dict:
    """``_record_memory_history`` and the dumps: accepted, nothing recorded.  A dump says
    once, on stderr, that it wrote nothing and where the record is instead."""
    warned = []

    def dump_snapshot(filename="dump_snapshot.pickle", *args, **kwargs) -> None:
        if not warned:
            warned.append(filename)
            import sys
            print(f"memadvisor: torch.cuda.memory._dump_snapshot({filename!r}) under fake "
                  f"execution writes nothing (no allocator ran); `memadvisor "
                  f"export-snapshot TRACE` writes one from the profile", file=sys.stderr)

    def snapshot(*args, **kwargs) -> dict:
        return {"segments": [], "device_traces": [[] for _ in range(device_count)],
                "allocator_settings": {}}

    return {"_record_memory_history": _noop, "_dump_snapshot": dump_snapshot,
            "_snapshot": snapshot, "memory_snapshot": lambda *a, **k: []}


def install(gpu: GpuProfile, device_count: int, stats: MemoryStats,
            set_native_device=None, native_current_device=None) -> Patches:
    """Patch ``torch.cuda`` to describe ``device_count`` GPUs like ``gpu``; memory queries
    answer from ``stats``; ``set_native_device(index)`` (the shim's) keeps the C++ current
    device, which decides where ``device='cuda'`` tensors land, in step;
    ``native_current_device()`` reads it (what ``current_device`` answers on every thread)."""
    cuda = torch.cuda
    patches = Patches()
    if native_current_device is not None:
        import sys
        patches.set(sys.modules[__name__], "_native_current_device", native_current_device)

    def check_index(device) -> int:
        index = _device_index(device)
        if not 0 <= index < device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} "
                               f"(simulating {device_count} x {gpu.device_name})")
        return index

    def set_device(device) -> None:
        index = _device_index(device)
        if index < 0:
            return
        check_index(index)
        current_state.device_index = index
        if set_native_device is not None:
            set_native_device(index)

    def exchange_device(index: int) -> int:
        previous = current_state.device_index
        if index >= 0:
            set_device(index)
        return previous

    properties = [FakeDeviceProperties(gpu, i) for i in range(device_count)]
    rng_state = torch.zeros(16, dtype=torch.uint8)  # what a Philox generator state holds

    def memory_stats(device=None) -> dict:
        index = check_index(device)
        return {"allocated_bytes.all.current": stats.allocated_bytes(index),
                "allocated_bytes.all.peak": stats.peak_allocated_bytes(index),
                "reserved_bytes.all.current": stats.reserved_bytes(index),
                "reserved_bytes.all.peak": stats.peak_reserved_bytes(index),
                "active_bytes.all.current": stats.allocated_bytes(index),
                "active_bytes.all.peak": stats.peak_allocated_bytes(index),
                "num_alloc_retries": 0, "num_ooms": 0}

    replacements = {
        "is_available": lambda: True,
        "device_count": lambda: device_count,
        "is_initialized": lambda: True,
        "_lazy_init": _noop,
        "init": _noop,
        "get_device_properties": lambda device=None: properties[check_index(device)],
        "get_device_name": lambda device=None: properties[check_index(device)].name,
        "get_device_capability": lambda device=None: (
            properties[check_index(device)].major, properties[check_index(device)].minor),
        "current_device": lambda: current_state.device_index,
        "set_device": set_device,
        "_exchange_device": exchange_device,
        "_maybe_exchange_device": exchange_device,
        # emulated bf16 (compute capability < 8) is supported, as torch reports it
        "is_bf16_supported": lambda including_emulation=True: (
            gpu.bf16_supported or including_emulation),
        "is_tf32_supported": lambda: gpu.major >= 8,
        "is_current_stream_capturing": lambda: False,
        "Stream": FakeStream,
        "Event": FakeEvent,
        "ExternalStream": FakeStream,
        "current_stream": _current_stream,
        "default_stream": _default_stream,
        "set_stream": _set_stream,
        "stream": _stream_context,
        "synchronize": _noop,
        "memory_allocated": lambda device=None: stats.allocated_bytes(check_index(device)),
        "max_memory_allocated": lambda device=None: stats.peak_allocated_bytes(
            check_index(device)),
        "memory_reserved": lambda device=None: stats.reserved_bytes(check_index(device)),
        "max_memory_reserved": lambda device=None: stats.peak_reserved_bytes(
            check_index(device)),
        "memory_cached": lambda device=None: stats.reserved_bytes(check_index(device)),
        "max_memory_cached": lambda device=None: stats.peak_reserved_bytes(
            check_index(device)),
        "reset_peak_memory_stats": lambda device=None: stats.reset_peak(check_index(device)),
        "reset_max_memory_allocated": lambda device=None: stats.reset_peak(
            check_index(device)),
        "reset_max_memory_cached": lambda device=None: stats.reset_peak(check_index(device)),
        "reset_accumulated_memory_stats": _noop,
        "memory_stats": memory_stats,
        "mem_get_info": lambda device=None: (
            gpu.total_memory_bytes - stats.reserved_bytes(check_index(device)),
            gpu.total_memory_bytes),
        "empty_cache": _noop,
        "ipc_collect": _noop,
        "manual_seed": _noop,
        "manual_seed_all": _noop,
        "seed": _noop,
        "seed_all": _noop,
        "initial_seed": lambda: 0,
        "get_rng_state": lambda device="cuda": rng_state.clone(),
        "get_rng_state_all": lambda: [rng_state.clone() for _ in range(device_count)],
        "set_rng_state": _noop,
        "set_rng_state_all": _noop,
    }
    for name, value in replacements.items():
        patches.set(cuda, name, value)
    # the device-generic API asks C++ for the stream, which knows no fake device (FSDP2's
    # finalize_backward waits on an unshard a pipeline stage left without its wait)
    patches.set(torch.accelerator, "current_stream", _current_stream)
    patches.set(torch.accelerator, "synchronize", _noop)
    # torch.cuda.memory holds the implementations some callers import from there
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                 "mem_get_info", "empty_cache"):
        patches.set(cuda.memory, name, replacements[name])
    # recording the allocator's history (memory_viz snapshots): there is no allocator
    # here; the profiler's trace is the record (memadvisor export-snapshot writes one)
    for name, value in _memory_history_stubs(device_count).items():
        patches.set(cuda.memory, name, value)
    for name in ("range_push", "range_pop", "mark"):
        patches.set(cuda.nvtx, name, _noop)
    patches.set(cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext())
    # torch.optim and clip_grad_norm_ pick foreach kernels only for tensor types they
    # list (DTensor adds itself the same way); a fake CUDA tensor must get the CUDA
    # default, whose temporaries are part of the step's memory
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim import optimizer
    from torch.utils import _foreach_utils
    patches.append(optimizer._foreach_supported_types, FakeTensor)
    patches.append(_foreach_utils._foreach_supported_types, FakeTensor)
    set_device(0)
    return patches
