"""Run unmodified training code on a simulated GPU: ``fake_execution``.

    from memadvisor.fake import preload
    preload()                       # before anything imports torch (or use run_script)
    from memadvisor.fake.runtime import fake_execution
    with fake_execution(gpu="h100-80gb") as run:
        train()                     # .cuda(), autocast('cuda'), FSDP2 ... all fake
    run.peak_bytes, run.step_peak_bytes, run.placeholder_log.uses

Inside, ``torch.cuda`` describes ``gpu`` (``cuda_stubs.py``), every tensor an op makes is
fake (``mode.py``), on the CPU too (``torch.from_numpy`` included: a model built on the
CPU before ``.cuda()`` must cost nothing), so values are known only for real tensors made
before; real tensors mix in freely and one moved to 'cuda' becomes fake; DataLoader
workers load real batches (``_real_data_workers``); modules move to 'cuda' keeping their parameter objects
(``modules.py``), value reads answer placeholders (``placeholders.py``), and with
``nproc`` > 1 (or a script that calls ``init_process_group``) the process is rank
``rank`` of an ``nproc``-rank job on torch's fake process group (``distributed.py``).

The native shim (``shim.py``) must be loaded before torch is imported; ``fake_execution``
loads it if torch is not imported yet and raises ``FakeCudaUnavailable`` (one line)
otherwise.  Fake execution is process-global (torch.cuda is patched for every thread):
one at a time per process.
"""
from __future__ import annotations

import contextlib
import runpy
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from . import shim as shim_module
from ..gpus import GpuProfile, gpu_profile

_active_lock = threading.Lock()


@dataclass(kw_only=True)
class FakeRun:
    """What one fake execution saw; filled in while it runs."""
    gpu: GpuProfile | None
    """The simulated GPU; None: none (fake CPU tensors, torch.cuda untouched)."""
    num_ranks: int
    rank: int
    mode: object = None
    """The SimulatedGpuMode (a FakeTensorMode) the code runs under."""
    live_bytes: object = None
    """memory.LiveFakeBytes: live and peak bytes of fake CUDA storages."""
    step_peak_bytes: list[int] = field(default_factory=list)
    """Peak live fake CUDA bytes (this rank's device) in each optimizer step, from the
    previous step's end (or the start) to this step's end."""

    @property
    def placeholder_log(self):
        return self.mode.placeholder_log

    @property
    def device_index(self) -> int:
        return self.rank % min(self.num_ranks, shim_module.MAX_DEVICES)

    @property
    def peak_bytes(self) -> int:
        """Peak live fake bytes on this rank's device over the whole run."""
        return max([self.live_bytes.window_peak_bytes(self.device_index),
                    *self.step_peak_bytes])


def _load_shim(num_ranks: int):
    devices = min(num_ranks, shim_module.MAX_DEVICES)
    loaded = shim_module.loaded()
    if loaded is None:
        loaded = shim_module.load(devices)  # raises when torch was imported first
    else:
        loaded.set_device_count(devices)
    shim_module.check_active(loaded)
    return loaded


def _step_peaks(run: FakeRun):
    """Per optimizer step peaks: the window closes after each ``optimizer.step()``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def after_step(_optimizer, _args, _kwargs):
        run.step_peak_bytes.append(run.live_bytes.reset_window(run.device_index))
        run.placeholder_log.new_step()

    return register_optimizer_step_post_hook(after_step)


def _track_storage_resizes(live_bytes):
    import torch
    from .patching import Patches
    patches = Patches()
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        live_bytes.resized(storage)
        return out

    patches.set(torch.UntypedStorage, "resize_", resize_)
    return patches


def _real_data_workers():
    """DataLoader workers (forked: they inherit the fake mode) load real CPU batches; the
    main process fakes a batch when it moves to 'cuda', as with num_workers=0."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils.data._utils import worker
    from .patching import Patches
    patches = Patches()
    original = worker._worker_loop

    def worker_loop(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    patches.set(worker, "_worker_loop", worker_loop)
    # and the batches they send are rebuilt as real tensors on shared memory
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter as Iter
    original_get = Iter._try_get_data

    def try_get_data(self, *args, **kwargs):
        with unset_fake_temporarily():
            return original_get(self, *args, **kwargs)

    patches.set(Iter, "_try_get_data", try_get_data)
    return patches


def _real_tensors_copy_as_real():
    """``copy.deepcopy`` of a real tensor (a CPU buffer a library keeps, torchmetrics'
    states) makes a real tensor, as outside fake execution: Tensor.__deepcopy__ builds the
    copy with ``new_empty``, which the fake mode would answer with a fake tensor that a
    real storage cannot be set into."""
    import torch
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
    from .patching import Patches
    patches = Patches()
    original = torch.Tensor.__deepcopy__

    def __deepcopy__(self, memo):
        if is_fake(self):
            return original(self, memo)
        with unset_fake_temporarily():
            return original(self, memo)

    patches.set(torch.Tensor, "__deepcopy__", __deepcopy__)
    return patches


def _fake_scalars_format():
    """``f"{loss:.4f}"`` on a one-value fake tensor formats its value (a placeholder, read
    through ``item`` and logged like any value read), as Tensor.__format__ does for a plain
    tensor; for a subclass torch falls back to ``object.__format__``, which refuses a format
    spec (a TypeError in the script's log line)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from .patching import Patches
    patches = Patches()

    def __format__(self, format_spec):
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    patches.set(FakeTensor, "__format__", __format__)
    return patches


@contextlib.contextmanager
def fake_execution(gpu: str | None = "h100-80gb", nproc: int = 1, rank: int = 0, *,
                   memory_stats=None) -> Iterator[FakeRun]:
    """Run the body with every tensor fake on ``nproc`` simulated ``gpu``s as ``rank``.

    ``gpu=None``: no simulated GPU -- ``torch.cuda`` stays as this build has it (on a
    CPU-only build: unavailable), so a script that picks its device runs on fake CPU
    tensors with the CPU's defaults (the native shim is not needed then).

    ``memory_stats``: a ``memory.MemoryStats`` that ``torch.cuda.memory_allocated()`` and
    friends answer from (the profiler's allocator model); default: live fake bytes.
    Raises ``FakeCudaUnavailable`` when the shim cannot be built or loaded (one line),
    ``UserError`` for an unknown GPU or bad ranks.
    """
    from ..errors import UserError
    profile = gpu_profile(gpu) if gpu is not None else None
    if nproc < 1 or not 0 <= rank < nproc:
        raise UserError(f"rank {rank} of {nproc} ranks is not a rank of the job")
    loaded = _load_shim(nproc) if profile is not None else shim_module.loaded()
    import torch  # after the shim: torch's import resolves the CUDA hooks

    from . import (checkpoint_replay, cuda_stubs, cudnn_rnn, distributed, fused_kernels,
                   initializers, libraries, modules, sdpa)
    from .memory import LiveFakeBytes
    from .mode import SimulatedGpuMode

    run = FakeRun(gpu=profile, num_ranks=nproc, rank=rank)
    run.live_bytes = LiveFakeBytes()
    run.mode = SimulatedGpuMode(live_bytes=run.live_bytes, real_cpu=profile is not None,
                                real_cpu_integers=profile is None)
    if not _active_lock.acquire(blocking=False):
        raise RuntimeError("fake execution is already running in this process")
    undo = []
    try:
        if profile is not None:
            undo.append(cuda_stubs.install(profile, min(nproc, shim_module.MAX_DEVICES),
                                           memory_stats or run.live_bytes,
                                           loaded.set_current_device,
                                           loaded.lib.ma_fake_current_device))
        if profile is not None:
            # SDPA's kernel as the target picks it (the CPU build has no CUDA chooser)
            undo.append(sdpa.install(profile.capability))
            undo.append(cudnn_rnn.install(profile.multi_processor_count))  # RNNs: cuDNN
            undo.append(fused_kernels.install())
        undo.append(modules.install(run.mode))
        undo.append(initializers.install())
        undo.append(libraries.install(run.mode))
        undo.append(checkpoint_replay.install())
        undo.append(_track_storage_resizes(run.live_bytes))
        undo.append(_real_data_workers())
        undo.append(_real_tensors_copy_as_real())
        undo.append(_fake_scalars_format())
        undo.append(distributed.EnvironmentPatch(
            distributed.torchrun_environment(rank, nproc)))
        undo.append(distributed.install(rank, nproc))
        hook = _step_peaks(run)
        try:
            with run.mode:
                yield run
        finally:
            hook.remove()
            distributed.shutdown()
    finally:
        for patch in reversed(undo):
            patch.undo()
        if loaded is not None:
            loaded.set_current_device(0)
        _active_lock.release()


def run_script(script: str | Path, args: list[str] | tuple[str, ...] = (), *,
               gpu: str | None = "h100-80gb", nproc: int = 1, rank: int = 0,
               memory_stats=None) -> FakeRun:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *args]`` under
    :func:`fake_execution`; the run's record.  A ``SystemExit(0)``/``SystemExit(None)``
    from the script counts as success; other exceptions propagate."""
    script = Path(script)
    saved_argv = sys.argv[:]
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        with fake_execution(gpu, nproc, rank, memory_stats=memory_stats) as run:
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (0, None):
                    raise
        return run
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == str(script.resolve().parent):
            sys.path.pop(0)
