"""Data loading: the batch's host memory, its copy to the GPU, and the time before forward.

What the trace holds: every storage of category ``input`` (the tensors fed to the root
modules and what they were made from), with its device, the op that made it (a device
copy is ``aten::_to_copy``) and the source line; per step its start and end, and every
event's time.  From those, for the analysed step:

- host batch bytes made in the step (a DataLoader's batch: host ``input`` storages and the
  host storages the device copies read, ``input_ids``) -- what ``pin_memory=True`` would
  also hold as page-locked buffers, once per batch in flight;
- the bytes copied to the GPU and the source line of the copy, with the time that copy
  takes at the target's host link -- the time ``pin_memory=True`` with
  ``.to(device, non_blocking=True)`` lets the GPU overlap with compute;
- the time from the step's first event to its first forward event (making and copying
  the batch, ``zero_grad``), measured while profiling: a figure, not a change (``INFO``).

What it does not hold, and so is said rather than guessed: whether a host tensor was
pinned, whether a copy was ``non_blocking``, the DataLoader's ``num_workers`` and
``prefetch_factor`` (so how many batches are in flight), and the workers' own host memory
(forked processes are not profiled).
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from ..trace.analysis import analysed_step, step_slice
from ..trace.io import id_lists
from ..units import format_bytes
from . import INFO, MISSING, SUGGESTED, Advice

KIND = "data_loading"
#: ops that copy a tensor to another device (``.to``, ``.cuda``, ``copy_``)
COPY_OPS = ("aten::_to_copy", "aten::copy_", "aten::to")
#: a copy shorter than this per step has nothing worth overlapping (6.4 MB at 64 GB/s)
MIN_COPY_SECONDS = 1e-4
NOT_RECORDED = ("whether the host batches were pinned", "whether the copies were "
                "non_blocking", "the DataLoader's num_workers and prefetch_factor (batches "
                "in flight)", "the workers' host memory (forked processes are not profiled)")


def data_loading_advice(context) -> list[Advice]:
    trace, hw = context.trace, context.hardware
    events = trace.events
    step = analysed_step(trace)
    window = step_slice(events, step)
    part = events.iloc[window]
    if not len(part):
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
    before_forward_s = _time_before_forward(part)
    target_gpu = hw is not None and hw.device_type == "cuda"
    found = []
    details = {"host_batch_bytes": host_bytes, "device_batch_bytes": device_bytes,
               "seconds_before_forward": before_forward_s,
               "step_seconds": _step_seconds(trace, step)}
    copied = device_bytes or (host_bytes if target_gpu else 0)
    link = float(hw.host_link_bytes_s) if target_gpu else 0.0
    copy_s = copied / link if link else 0.0
    if target_gpu and copy_s >= MIN_COPY_SECONDS:
        where = _copy_location(part, device_rows)
        recorded_copy = bool(device_bytes)
        found.append(Advice(
            kind=KIND, status=SUGGESTED, seconds=copy_s, location=where,
            title="DataLoader(pin_memory=True) and .to(device, non_blocking=True)",
            reason=(f"{format_bytes(copied)} of batch "
                    f"{'is' if recorded_copy else 'would be'} copied to the GPU each step: "
                    f"{copy_s * 1e3:.2f} ms at the target's {link / 1e9:.0f} GB/s host link, "
                    "which a pinned source and a non_blocking copy overlap with compute "
                    "(a pageable source is staged through a pinned buffer and blocks); the "
                    f"pinned buffers cost {format_bytes(host_bytes or copied)} of page-locked "
                    "host memory per batch in flight (the pin thread holds up to "
                    "num_workers x prefetch_factor of them, 2 per worker by default)"),
            details={**details, "copy_bytes": copied, "copy_seconds": copy_s,
                     "pinned_bytes_per_batch": host_bytes or copied}))
    if before_forward_s is not None and (host_bytes or device_bytes):
        share = before_forward_s / details["step_seconds"] if details["step_seconds"] else 0.0
        found.append(Advice(
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
            details={**details, "share_of_step": share}))
    if host_bytes or device_bytes:
        found.append(Advice(
            kind=KIND, status=MISSING, title="not in the trace: " + NOT_RECORDED[0] + ", ...",
            reason="the trace does not record " + "; ".join(NOT_RECORDED) + ": the pinned "
                   "bytes above are per batch, not for the batches in flight",
            details={"not_recorded": list(NOT_RECORDED)}))
    return found


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
