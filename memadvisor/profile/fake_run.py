"""Profile a script on fake tensors on a simulated GPU (``memadvisor profile --fake``).

The script runs unmodified under ``memadvisor.fake.runtime.fake_execution`` with the
dispatch engine recording (the native engine follows c10's CPU allocator, which fake
tensors never touch), so the trace has the categories, modules, phases, steps and source
lines of a real run, on device ``cuda:R`` with the fake tensors' dtypes and shapes.

What a GPU holds that is no tensor is added by rule (``kernel_memory.py``: cuBLAS
workspaces).  ``torch.cuda.memory_allocated()`` and friends answer from the recorder's
live bytes on the device (:class:`DeviceBytesRecorder`); reserved equals allocated inside
the run (there is no allocator model in the profiler: the command replays the trace
through one afterwards).

The native fake CUDA shim must have been loaded before torch was imported
(``memadvisor.fake.preload``): this module imports torch.
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path

from ..fake.depth import cut_stacks
from ..fake.placeholders import DataDependentLoop
from ..fake.recorded_sizes import RecordedReads, RecordedShares
from ..fake.runtime import fake_execution
from .attention_workspace import EfficientAttentionWorkspace
from .cpu_scratch import CpuKernelBlocks, run_threads
from .gloo_buffers import GlooCollectiveBuffers
from .gradient_accumulation import InPlaceAccumulation
from .kernel_memory import CublasWorkspaces, KeptLossStorage
from .reduction_buffers import ReductionBuffers
from .recorder import EventRecorder, _DEVICE, _SIZE
from .runner import ProfileResult, profile_script

#: the caching allocator's smallest block and rounding step (kMinBlockSize)
_BLOCK_ROUND_BYTES = 512


def _block_bytes(size_bytes: int) -> int:
    """A request's block as memory_allocated() counts it (no block for 0 bytes)."""
    if size_bytes <= 0:
        return 0
    return -(-size_bytes // _BLOCK_ROUND_BYTES) * _BLOCK_ROUND_BYTES


class DeviceBytesRecorder(EventRecorder):
    """The event recorder, also counting live bytes per device: what the script's
    ``torch.cuda.memory_allocated(i)`` answers (``fake.memory.MemoryStats``).  Requests
    are rounded to 512 B as the caching allocator's blocks are; reserved memory is
    reported equal to allocated (a lower bound: no segments are modelled while the
    script runs)."""

    def __init__(self):
        super().__init__()
        self._device_live_bytes: dict[str, int] = {}
        self._device_peak_bytes: dict[str, int] = {}

    def _log_alloc(self, cdata, size, device, *args) -> int:
        sid = super()._log_alloc(cdata, size, device, *args)
        self._add(device, _block_bytes(size))
        return sid

    def _log_free(self, alloc_row: int) -> None:
        row = self.rows[alloc_row]
        super()._log_free(alloc_row)
        self._add(row[_DEVICE], -_block_bytes(row[_SIZE]))

    def _unlog_alloc(self, row: tuple) -> None:
        super()._unlog_alloc(row)
        # the peak it may have raised stays: memory_allocated() is a lower-bound-free
        # figure for one accumulation's block at most
        self._add(row[_DEVICE], -_block_bytes(row[_SIZE]))

    def _add(self, device: str, delta_bytes: int) -> None:
        live = self._device_live_bytes.get(device, 0) + delta_bytes
        self._device_live_bytes[device] = live
        if live > self._device_peak_bytes.get(device, 0):
            self._device_peak_bytes[device] = live

    # --- fake.memory.MemoryStats ---------------------------------------------------------
    def allocated_bytes(self, device_index: int) -> int:
        return self._device_live_bytes.get(f"cuda:{device_index}", 0)

    def peak_allocated_bytes(self, device_index: int) -> int:
        return self._device_peak_bytes.get(f"cuda:{device_index}", 0)

    reserved_bytes = allocated_bytes
    peak_reserved_bytes = peak_allocated_bytes

    def reset_peak(self, device_index: int) -> None:
        device = f"cuda:{device_index}"
        self._device_peak_bytes[device] = self._device_live_bytes.get(device, 0)


class FakeProfile:
    """The profiler's extension for fake execution (``runner.profile_script``)."""

    def __init__(self, run, recorder: DeviceBytesRecorder, workspaces: CublasWorkspaces | None,
                 kernel_rules: tuple = (), cpu_blocks: CpuKernelBlocks | None = None,
                 cpu_blocks_reason: str = ""):
        self.run = run
        self.recorder = recorder
        self.workspaces = workspaces
        #: the CPU target: real kernels' own blocks, measured per op signature
        self.cpu_blocks = cpu_blocks
        self.cpu_blocks_reason = cpu_blocks_reason
        self.gloo: GlooCollectiveBuffers | None = None
        #: more memory GPU kernels take that is no tensor (attention, reduction buffers)
        self.kernel_rules = list(kernel_rules)
        self.accumulation = InPlaceAccumulation()
        #: fake/depth.py: the layers each stack kept and the stacks cut (None: not cut)
        self.keep_layers: int | None = None
        self.layer_stacks: list[dict] | None = None

    def output_path(self, output) -> Path:
        # the rank was chosen on the command line: write where the user said
        return Path(output)

    def session_options(self) -> dict:
        # the native engine and allocator hook follow real CPU memory: fake tensors have
        # none; the bf16 probes would run real kernels
        return {"engine": "dispatch", "native_hook": False, "probes": False,
                "recorder": self.recorder, "cuda_peaks": False}

    def attach(self, session) -> None:
        rules = [self.accumulation, KeptLossStorage()]
        if self.workspaces is not None:
            rules.append(self.workspaces)
        if self.run.gpu is None:  # the CPU target: FSDP's collectives run on gloo
            self.gloo = GlooCollectiveBuffers()
            rules.append(self.gloo)
        rules += self.kernel_rules
        for rule in rules:
            rule.attach(session)

        def after_op(op_name, args, out) -> None:
            for rule in rules:
                rule.after_op(op_name, args, out)
        session.mode.after_op = after_op
        if self.cpu_blocks is not None:
            session.mode.kernel_blocks = self.cpu_blocks
        on_step = session.on_step

        def step_done(info: dict) -> None:
            # a step ended (also one counted by backward): loops reading values per step
            # are fine
            self.run.placeholder_log.new_step()
            if on_step is not None:
                on_step(info)
        session.on_step = step_done

    def explain(self, status: str, error: str, exc: BaseException) -> tuple[str, str]:
        """One line, naming the script's line, for a run fake execution could not finish."""
        if isinstance(exc, DataDependentLoop):
            return str(exc), ""
        if status == "timeout":
            busiest = self.run.placeholder_log.busiest_location()
            if busiest is not None:
                location, iterations = busiest
                error += (f"; {location} read placeholder values in {iterations:,} loop "
                          f"iterations since the last step: a loop on tensor values cannot "
                          f"end under fake execution")
            return error, ""
        if status == "interrupted":
            return error, ""
        return f"{error} (at {_innermost_user_line(exc)})", ""

    def close(self) -> None:
        """Undo what ``attach`` patched (the run ended, however it ended)."""
        if self.gloo is not None:
            self.gloo.uninstall()

    def finish(self, meta) -> None:
        gpu = self.run.gpu
        log = self.run.placeholder_log
        first = {}
        for use in log.uses:
            if not use.inside_torch:
                first.setdefault(use.location, use)
        # counted by location beyond the first uses the log keeps
        reads = Counter({location: log.count_by_location[location] for location in first})
        meta.extra["fake"] = {
            "gpu": gpu.name if gpu else None,
            "device_name": gpu.device_name if gpu else "",
            "nproc": self.run.num_ranks,
            "rank": self.run.rank,
            "placeholder_reads": [
                {"location": location, "reads": count, "op": first[location].op,
                 "value": first[location].value}
                for location, count in reads.most_common()],
            "placeholder_reads_inside_torch": sum(
                1 for use in self.run.placeholder_log.uses if use.inside_torch),
            "cublas_workspaces": self.workspaces.made if self.workspaces else [],
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
            "gradient_accumulations_in_place": self.accumulation.merged,
            "gloo_collective_blocks": self.gloo.blocks if self.gloo else 0,
        }
        if self.layer_stacks is not None:
            # the model ran with fewer layers than the script makes (fake/depth.py)
            meta.extra["fake"]["layer_stacks"] = {"kept": self.keep_layers,
                                                  "stacks": list(self.layer_stacks)}
        if self.cpu_blocks is not None:
            meta.extra["fake"]["cpu_kernel_blocks"] = self.cpu_blocks.summary()
        elif gpu is None:
            meta.extra["fake"]["cpu_kernel_blocks"] = {"unavailable": self.cpu_blocks_reason}
        meta.allocator["fake"] = True
        if gpu is not None:
            meta.device_name = gpu.device_name


def _cpu_kernel_blocks(num_ranks: int) -> tuple[CpuKernelBlocks | None, str]:
    """The CPU target's kernel-block measurements (the native allocator hook measures them),
    or None and why not."""
    from .native import AllocatorHook, NativeHookUnavailable
    try:
        hook = AllocatorHook.load()
    except NativeHookUnavailable as exc:
        return None, exc.reason
    return CpuKernelBlocks(hook, run_threads(num_ranks)), ""


def _innermost_user_line(exc: BaseException) -> str:
    import traceback
    package = str(Path(__file__).resolve().parents[1])
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if not frame.filename.startswith(package)
              and "site-packages" not in frame.filename and not frame.filename.startswith("<")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown line"


def profile_fake_script(script: str | os.PathLike, args: list[str], output: str | os.PathLike,
                        *, gpu: str | None, num_ranks: int = 1, rank: int = 0,
                        steps: int | None = 3, timeout_s: float | None = None,
                        step_boundary: str = "auto", on_step=None,
                        value_sizes: dict | None = None,
                        value_reads: dict | None = None,
                        keep_layers: int | None = None,
                        light_layers: list[str] | None = None) -> ProfileResult:
    """Profile ``script`` under fake execution on ``gpu`` (None: fake CPU tensors, no GPU)
    as ``rank`` of ``num_ranks``; the trace is always written (``ProfileResult``).
    ``value_sizes``: a real profile's ``meta.extra['value_sizes']`` of the same script
    (value-dependent lengths answered from it, ``profile/value_sizes.py``); ``value_reads``:
    its ``meta.extra['value_reads']`` (scalar reads answered from it); ``keep_layers``: each
    repeated stack of layers the script makes keeps that many (``fake/depth.py``), the
    stacks cut listed in ``meta.extra['fake']['layer_stacks']``; ``light_layers``: layer
    classes whose instances past the kept ones are built on the meta device (the recorded
    model has one stack of each: ``verify/shallow_runs.py``)."""
    from ..gpus import gpu_profile
    recorder = DeviceBytesRecorder()
    profile = gpu_profile(gpu) if gpu is not None else None
    workspaces = None
    kernel_rules: tuple = ()
    if profile is not None:
        workspaces = CublasWorkspaces(profile.capability,
                                      os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        kernel_rules = (EfficientAttentionWorkspace(),
                        ReductionBuffers(profile.multi_processor_count, profile.capability))
    cpu_blocks, reason = (None, "") if profile is not None else _cpu_kernel_blocks(num_ranks)
    with fake_execution(gpu, num_ranks, rank, memory_stats=recorder) as run:
        if value_sizes:
            run.mode.placeholder_log.recorded = RecordedShares(value_sizes)
        if value_reads:
            run.mode.placeholder_log.recorded_reads = RecordedReads(value_reads)
        extension = FakeProfile(run, recorder, workspaces, kernel_rules, cpu_blocks, reason)
        cutting = cut_stacks(keep_layers, light_layers or ()) if keep_layers else \
            contextlib.nullcontext()
        try:
            with cutting as stacks:
                extension.keep_layers, extension.layer_stacks = keep_layers, stacks
                return profile_script(script, args, output, steps=steps, timeout_s=timeout_s,
                                      step_boundary=step_boundary, on_step=on_step,
                                      extension=extension)
        finally:
            extension.close()


__all__ = ["DeviceBytesRecorder", "FakeProfile", "profile_fake_script"]
