"""Data loading: the batch's host memory, its copy to the GPU, and what the input
pipeline costs per step.

What the trace holds: every storage of category ``input`` (the tensors fed to the root
modules and what they were made from), with its device, the op that made it (a device
copy is ``aten::_to_copy``) and the source line; per step its start and end, and every
event's time.  Traces profiled since 2026-11-26 also hold each DataLoader the script
iterated (``meta.data_loaders``, read by ``loader_pipeline.py``): its settings, the time
the main process waited in ``__next__`` per step, the batch's host bytes, each copy's
``non_blocking`` flag and whether its source was pinned, and the workers' memory.

- host batch bytes made in the step (a DataLoader's batch: host ``input`` storages and the
  host storages the device copies read, ``input_ids``) -- what ``pin_memory=True`` would
  also hold as page-locked buffers, once per batch in flight;
- the bytes copied to the GPU and the source line of the copy, with the time that copy
  takes at the target's host link -- the time ``pin_memory=True`` with
  ``.to(device, non_blocking=True)`` lets the GPU overlap with compute; never suggested
  for what the script already does (the loader's ``pin_memory``, ``non_blocking`` copies);
- with a recorded loader: the step's wait for its batch (more workers where it is over a
  tenth of the step) and the host memory of the batches in flight and the workers (fewer
  where that is large while the workers are ahead);
- without one: the time from the step's first event to its first forward event (making
  and copying the batch, ``zero_grad``), measured while profiling (``INFO``), and for an
  older trace what it did not record (``MISSING``).
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from ..trace.analysis import analysed_step, step_slice
from ..trace.io import id_lists
from ..units import format_bytes
from . import INFO, MISSING, SUGGESTED, Advice
from .loader_pipeline import (
    copies_done, largest_copy_site, loader_of_step, loader_wait_advice, pipeline_memory_advice,
)

KIND = "data_loading"
#: ops that copy a tensor to another device (``.to``, ``.cuda``, ``copy_``)
COPY_OPS = ("aten::_to_copy", "aten::copy_", "aten::to")
#: a copy shorter than this per step has nothing worth overlapping (6.4 MB at 64 GB/s)
MIN_COPY_SECONDS = 1e-4
#: the least a GPU step's op costs (a kernel launch), for the target's modelled step
KERNEL_LAUNCH_SECONDS = 5e-6
#: what a trace profiled before the DataLoader record (meta.data_loaders None) lacks
NOT_RECORDED = ("whether the host batches were pinned", "whether the copies were "
                "non_blocking", "the DataLoader's num_workers and prefetch_factor (batches "
                "in flight)", "the workers' host memory")


def data_loading_advice(context) -> list[Advice]:
    trace, hw = context.trace, context.hardware
    events = trace.events
    step = analysed_step(trace)
    window = step_slice(events, step)
    part = events.iloc[window]
    loaders = trace.meta.data_loaders
    loader, entry = loader_of_step(loaders or [], step)
    if not len(part) and loader is None:
        return []
    is_input = (part["category"] == schema.INPUT).to_numpy() \
        & (part["action"] == schema.ALLOC).to_numpy()
    on_gpu = _on_gpu(part["device"])
    sizes = part["size_bytes"].to_numpy(dtype=np.int64)
    # the batch's copies to the GPU: inputs, and copies made before the forward (a label
    # tensor a loss saves is categorised an activation)
    copies = part["op"].isin(COPY_OPS).to_numpy() & (part["phase"] == schema.OTHER_PHASE
                                                      ).to_numpy() \
        & (part["action"] == schema.ALLOC).to_numpy()
    device_rows = np.flatnonzero((is_input | copies) & on_gpu)
    device_bytes = int(sizes[device_rows].sum())
    host_bytes = _host_batch_bytes(part, is_input & ~on_gpu, device_rows, on_gpu, sizes)
    if loader is not None and not host_bytes:
        # a worker's batch in shared memory is made where no allocator hook sees it
        host_bytes = int(entry.get("batch_bytes") or 0)
    before_forward_s = _time_before_forward(part)
    target_gpu = hw is not None and hw.device_type == "cuda"
    found = []
    step_seconds = _step_seconds(trace, step)
    details = {"host_batch_bytes": host_bytes, "device_batch_bytes": device_bytes,
               "seconds_before_forward": before_forward_s, "step_seconds": step_seconds}
    copied = device_bytes or (host_bytes if target_gpu else 0)
    link = float(hw.host_link_bytes_s) if target_gpu else 0.0
    copy_s = copied / link if link else 0.0
    done = copies_done(loader, entry, link, MIN_COPY_SECONDS)
    if target_gpu and copy_s >= MIN_COPY_SECONDS:
        found += _copy_advice(part, device_rows, loader, done, copied, copy_s, link,
                              host_bytes, details)
    if loader is not None:
        target_step = _target_step_seconds(context) if target_gpu else None
        found += [item for item in (loader_wait_advice(loader, entry, step_seconds,
                                                       target_step, hw.name if hw else ""),
                                    pipeline_memory_advice(loader, entry, step_seconds))
                  if item is not None]
    elif before_forward_s is not None and (host_bytes or device_bytes):
        found.append(_before_forward_info(before_forward_s, details))
    if loaders is None and (host_bytes or device_bytes):
        found.append(Advice(
            kind=KIND, status=MISSING, title="not in the trace: " + NOT_RECORDED[0] + ", ...",
            reason="the trace was profiled before memadvisor recorded DataLoaders, so it "
                   "does not hold " + "; ".join(NOT_RECORDED) + ": the pinned bytes above are "
                   "per batch, not for the batches in flight (profile again to have them)",
            details={"not_recorded": list(NOT_RECORDED)}))
    return found


def _copy_advice(part, device_rows, loader, done, copied, copy_s, link, host_bytes,
                 details) -> list[Advice]:
    """pin_memory and non_blocking for the batch's copy, less what the script does."""
    figures = {**details, "copy_bytes": copied, "copy_seconds": copy_s,
               "pinned_bytes_per_batch": host_bytes or copied, "already": done}
    recorded_copy = bool(details["device_batch_bytes"])
    copy_text = (f"{format_bytes(copied)} of batch "
                 f"{'is' if recorded_copy else 'would be'} copied to the GPU each step: "
                 f"{copy_s * 1e3:.2f} ms at the target's {link / 1e9:.0f} GB/s host link")
    where = largest_copy_site(loader) or _copy_location(part, device_rows)
    if done["pinned"] and done["non_blocking"]:
        return [Advice(
            kind=KIND, status=INFO, seconds=copy_s, location=where,
            title="batch copies already pinned and non_blocking",
            reason=copy_text + ", overlapped with compute: the loader pins "
                   "(pin_memory=True) and the copies are non_blocking", details=figures)]
    if done["pinned"]:
        return [Advice(
            kind=KIND, status=SUGGESTED, seconds=copy_s, location=where,
            title=".to(device, non_blocking=True) for the batch",
            reason=copy_text + f"; the loader already pins, but "
                   f"{format_bytes(done.get('blocking_copy_bytes', copied))} of it is copied "
                   "blocking: non_blocking=True lets the GPU overlap it with compute (a "
                   "pinned source needs no staging)", details=figures)]
    pinned_cost = (f"the pinned buffers cost {format_bytes(host_bytes or copied)} of "
                   "page-locked host memory per batch in flight ("
                   + (f"{loader['num_workers'] * (loader.get('prefetch_factor') or 0) + 1} "
                      "with this loader" if loader is not None else
                      "the pin thread holds up to num_workers x prefetch_factor of them, 2 "
                      "per worker by default") + ")")
    if done["non_blocking"]:
        return [Advice(
            kind=KIND, status=SUGGESTED, seconds=copy_s,
            location=(loader or {}).get("source") or where,
            title="DataLoader(pin_memory=True)",
            reason=copy_text + "; the copies are already non_blocking, but from pageable "
                   "memory a non_blocking copy is staged through a pinned buffer and the "
                   "host waits for it: pinned batches make it overlap with compute; "
                   + pinned_cost, details=figures)]
    return [Advice(
        kind=KIND, status=SUGGESTED, seconds=copy_s, location=where,
        title="DataLoader(pin_memory=True) and .to(device, non_blocking=True)",
        reason=copy_text + ", which a pinned source and a non_blocking copy overlap with "
               "compute (a pageable source is staged through a pinned buffer and blocks); "
               + pinned_cost, details=figures)]


def _target_step_seconds(context) -> float | None:
    """The step's compute on a GPU target, modelled (the cost model's FLOPs at the target's
    fp32 rate, as for a step it did not measure; at least one kernel launch per op), for a trace measured on the CPU or fake-executed;
    None for a real GPU's trace (its step is measured there)."""
    meta = context.trace.meta
    if context.base is None or (str(meta.device).startswith("cuda")
                                and not (meta.allocator or {}).get("fake")):
        return None  # a real GPU's step, measured (a fake run's is CPU time)
    from ..simulate.cost import MATMUL_EFFICIENCY
    rate = float(getattr(context.hardware, "fp32_flops", 0) or 0) * MATMUL_EFFICIENCY
    work = getattr(context.base, "work", None)
    # the cost model's estimate of an unmeasured step (simulate/cost.py)
    seconds = work.total_flops / rate if work is not None and rate > 0 else 0.0
    # a small model's FLOPs take less than launching its kernels: one launch per op of
    # the forward, backward and optimizer at least
    calls = sum(int(s.get("calls") or 0) for s in meta.op_stats or []
                if s.get("phase") in (schema.FORWARD, schema.BACKWARD, schema.OPTIMIZER))
    launches = calls / max(int(meta.steps_completed or 0), 1) * KERNEL_LAUNCH_SECONDS
    seconds = max(seconds, launches)
    return seconds if seconds > 0 else None


def _before_forward_info(before_forward_s: float, details: dict) -> Advice:
    share = before_forward_s / details["step_seconds"] if details["step_seconds"] else 0.0
    return Advice(
        kind=KIND, status=INFO, seconds=before_forward_s,
        title="input side of the step (batch made and copied, zero_grad)",
        reason=(f"{before_forward_s * 1e3:.2f} ms from the step's first event to its first "
                f"forward op, {share:.0%} of the {details['step_seconds'] * 1e3:.1f} ms "
                "step (measured while profiling).  Not counted: the wait before the "
                "step's first event (a DataLoader worker's batch arrives without an "
                "allocation the profiler sees; the profiler's own step-boundary work "
                "is there too)"
                + ("; over a tenth of the step: a DataLoader with workers (or more of "
                   "them) would prepare batches in parallel" if share >= 0.1 else "")),
        details={**details, "share_of_step": share})


def _host_batch_bytes(part, host_inputs: np.ndarray, device_rows: np.ndarray,
                      on_gpu: np.ndarray, sizes: np.ndarray) -> int:
    """Bytes of the host tensors the step's batch came from: host storages of category
    ``input`` made in the step, and the host storages the device copies read (data flow:
    a DataLoader's collated batch is fed to the model only through its copy, so it is not
    an input itself).  Each storage once."""
    allocs = (part["action"] == schema.ALLOC).to_numpy()
    ids = part["storage_id"].to_numpy()
    chosen = set(ids[host_inputs].tolist())
    offsets, values = id_lists(part)
    if len(device_rows) and len(values):
        starts, stops = offsets[device_rows], offsets[device_rows + 1]
        read = np.concatenate([values[a:b] for a, b in zip(starts.tolist(), stops.tolist())]
                              or [np.zeros(0, np.int64)])
        host_allocs = allocs & ~on_gpu
        copied = host_allocs & np.isin(ids, read)
        chosen |= set(ids[copied].tolist())
    made = allocs & ~on_gpu & np.isin(ids, np.fromiter(chosen, np.int64, len(chosen)))
    return int(sizes[made].sum())


def _time_before_forward(part) -> float | None:
    """Seconds from the step's first event to its first forward event (None: no
    forward).  The step's recorded start is not used: the profiler's step-boundary work
    (writing the trace so far) lies between it and the script's first event."""
    forward = np.flatnonzero((part["phase"] == schema.FORWARD).to_numpy())
    if not len(forward):
        return None
    times = part["time_ns"].to_numpy()
    seconds = (int(times[forward[0]]) - int(times[0])) / 1e9
    return seconds if seconds >= 0 else None


def _on_gpu(devices) -> np.ndarray:
    """Which rows are on a GPU, by category where the column is one (no string per row)."""
    if hasattr(devices, "cat"):
        gpu = np.array([str(name).startswith("cuda") for name in devices.cat.categories], bool)
        codes = devices.cat.codes.to_numpy()
        return np.where(codes >= 0, gpu[np.maximum(codes, 0)] if len(gpu) else False, False)
    return devices.astype(str).str.startswith("cuda").to_numpy()


def _step_seconds(trace, step) -> float:
    for info in trace.meta.steps or []:
        if info.get("index") == step:
            return float(info.get("duration_s") or 0.0)
    return 0.0


def _copy_location(part, device_rows: np.ndarray) -> str:
    """'file:line' of the largest device copy of the batch ('' when unknown)."""
    if not len(device_rows):
        return ""
    largest = device_rows[np.argmax(part["size_bytes"].to_numpy()[device_rows])]
    name = str(part["source_file"].to_numpy()[largest])
    line = int(part["source_line"].to_numpy()[largest])
    return f"{name}:{line}" if name else ""
