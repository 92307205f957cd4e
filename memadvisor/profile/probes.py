"""Device probes: what the recording machine's kernels allocate for the same op in 16-bit.

An fp32 trace cannot show what a bf16 plan's kernels allocate besides their outputs.  On
CPU oneDNN's bf16 kernels allocate scratch blocks that MKL's fp32 gemm does not, and that
no formula from shapes reproduces across machines: a convolution's bf16 weight-gradient
scratch depends on the weight *and* the spatial size through oneDNN's per-thread buffers
(six shapes of one CNN fit no formula, docs/ACCURACY.md), a matmul's on the ISA's blocking.
So the profiler measures them instead of guessing: after the run, each convolution and
Linear module the script ran on the CPU is rebuilt at its recorded input shape, run
forward and backward in fp32 and in bf16, and the untyped blocks its kernels allocate are
written to the trace (``meta.probes``).  The simulator, which imports no torch, maps the
trace onto them (``simulate.precision``).

* ``convolution``: per module, the blocks of one call in order, per direction and dtype
  (``raw_bytes``), and each call's blocks with their lifetimes among the op's own
  tensors (``calls``: fp32, bf16, and both at half the batch, ``batch``): a kernel picks
  its algorithm by ISA (oneDNN's bf16 kernels on an AVX-512 or AMX CPU, ATen's im2col
  fallback where oneDNN has no bf16: one data-sized block instead of several), so the
  bf16 blocks are taken as measured, never mapped one to one onto the fp32 ones;
* ``linear``: per module, the bytes of the forward matmul's blocks and of the backward's
  input-gradient and weight-gradient matmuls, at the recorded rows and at half of them
  (how much of a block follows the micro-batch), in bf16; and how many blocks fp32 made.

Cost: a few forward+backward passes of each distinct module (modules built and called alike
are probed once; milliseconds for the bundled examples); skipped for inputs over
``MAX_PROBE_ELEMENTS`` and once the probes have taken ``PROBE_BUDGET_S``.  The probe runs after the
trace's events are collected, in its own recording session, and leaves the global RNG as
it was.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..trace import schema

#: the CPU target runs matmuls and convolutions in bf16 under amp-bf16 and pure bf16
PROBE_DTYPES = ("float32", "bfloat16")
MAX_PROBE_ELEMENTS = 1 << 26
#: wall time all probes of one trace may take; modules after it are recorded as skipped
PROBE_BUDGET_S = 30.0
_CONV_CLASSES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
                 torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def module_spec(module: torch.nn.Module, args: tuple) -> tuple[str, dict[str, Any]] | None:
    """(kind, what rebuilding ``module`` at this call needs), or None (not a CPU Linear or
    convolution)."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type != "cpu":
        return None
    x = args[0]
    common = dict(input_shape=list(x.shape), input_requires_grad=bool(x.requires_grad))
    if isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward:
        if module.weight.device.type != "cpu" or x.dim() < 1:
            return None
        return "linear", dict(common, cls=torch.nn.Linear, kwargs=dict(
            in_features=module.in_features, out_features=module.out_features,
            bias=module.bias is not None), weight_requires_grad=bool(
                module.weight.requires_grad), channels_last=False)
    cls = next((c for c in _CONV_CLASSES if isinstance(module, c)), None)
    if cls is None or module.weight.device.type != "cpu":
        return None
    kwargs = dict(in_channels=module.in_channels, out_channels=module.out_channels,
                  kernel_size=module.kernel_size, stride=module.stride,
                  padding=module.padding, dilation=module.dilation, groups=module.groups,
                  bias=module.bias is not None, padding_mode=module.padding_mode)
    if module.transposed:
        kwargs["output_padding"] = module.output_padding
    return "convolution", dict(common, cls=cls, kwargs=kwargs,
                               weight_requires_grad=bool(module.weight.requires_grad),
                               channels_last=x.dim() == 4 and not x.is_contiguous()
                               and x.is_contiguous(memory_format=torch.channels_last))


def conv_spec(module: torch.nn.Module, args: tuple) -> dict[str, Any] | None:
    found = module_spec(module, args)
    return found[1] if found and found[0] == "convolution" else None


def _run(spec: dict, dtype: torch.dtype) -> None:
    module = spec["cls"](**spec["kwargs"]).to(dtype)
    module.weight.requires_grad_(spec["weight_requires_grad"])
    if module.bias is not None:
        module.bias.requires_grad_(spec["weight_requires_grad"])
    x = torch.zeros(spec["input_shape"], dtype=dtype)
    if spec["channels_last"]:
        module = module.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(spec["input_requires_grad"])
    y = module(x)
    if y.requires_grad:
        y.backward(torch.zeros_like(y))


def _raw_blocks(frame, op_filter: str | None) -> dict[str, list[int]]:
    """Allocation sizes of untyped blocks made in forward and in backward, in order (only
    inside ops whose name contains ``op_filter``, when given)."""
    raw = frame[(frame["action"] == schema.ALLOC) & (frame["dtype"] == schema.RAW_BYTES_DTYPE)]
    if op_filter:
        raw = raw[raw["op"].astype(str).str.contains(op_filter)]
    backward = (raw["op"].astype(str).str.contains("backward")
                | (raw["phase"].astype(str) == schema.BACKWARD))
    return {"forward": [int(b) for b in raw.loc[~backward, "size_bytes"]],
            "backward": [int(b) for b in raw.loc[backward, "size_bytes"]]}


def _call_events(frame, direction: str) -> dict:
    """One convolution call's blocks in ``direction`` ('forward' or 'backward') as the op
    made them: ``raw`` [[bytes, alloc position, free position]] and ``typed`` [[shape,
    position]] (the op's own tensors: output, gradients), positions counted over the op's
    allocations and its blocks' frees (``length`` of them; a block never freed inside the
    run frees at ``length``)."""
    op = frame["op"].astype(str)
    mine = op.str.contains("convolution") & (op.str.contains("backward")
                                             == (direction == "backward"))
    frame = frame[mine].sort_values("seq")
    raw_ids = set(frame.loc[(frame["action"] == schema.ALLOC)
                            & (frame["dtype"] == schema.RAW_BYTES_DTYPE), "storage_id"])
    events = frame[(frame["action"] == schema.ALLOC) | frame["storage_id"].isin(raw_ids)]
    raw: dict[int, list] = {}
    typed: list[list] = []
    for position, row in enumerate(events.itertuples(index=False)):
        if row.action == schema.ALLOC and row.storage_id in raw_ids:
            raw[row.storage_id] = [int(row.size_bytes), position, len(events)]
        elif row.action == schema.ALLOC:
            typed.append([str(row.shape), position])
        elif row.storage_id in raw:
            raw[row.storage_id][2] = position
    return {"raw": list(raw.values()), "typed": typed, "length": len(events)}


def _half(spec: dict) -> dict | None:
    shape = spec["input_shape"]
    if len(shape) < 2 or int(shape[0]) < 2:
        return None
    return dict(spec, input_shape=[int(shape[0]) // 2, *shape[1:]])


def _runs(kind: str, spec: dict) -> dict[str, tuple[dict, str]]:
    """The runs a module's probe needs: tag -> (spec, dtype)."""
    if kind == "convolution":
        runs = {name: (spec, name) for name in PROBE_DTYPES}
        batched = len(spec["input_shape"]) == len(spec["kwargs"]["kernel_size"]) + 2
        half = _half(spec) if batched else None
        if half is not None:  # how much of each block follows the batch, per dtype
            runs["float32-half"] = (half, "float32")
            runs["bfloat16-half"] = (half, "bfloat16")
        return runs
    runs = {"float32": (spec, "float32")}
    for size, case in (("full", spec), ("half", _half(spec))):
        if case is None:
            continue
        runs[size] = (case, "bfloat16")
        if case["input_requires_grad"]:  # the weight gradient's matmul alone
            runs[size + "-weight"] = (dict(case, input_requires_grad=False), "bfloat16")
    return runs


def _entry(kind: str, spec: dict, blocks: dict[str, dict[str, list[int]]],
           calls: dict[str, dict] | None = None) -> dict:
    """A probe entry from its runs' blocks (see the module doc); ``calls``: each
    convolution run's ``_call_events`` per direction."""
    if kind == "convolution":
        out = {"raw_bytes": {name: blocks[name] for name in PROBE_DTYPES}}
        if calls:
            batch = int(spec["input_shape"][0])
            out["calls"] = calls
            out["batch"] = {tag: batch // 2 if tag.endswith("-half") else batch
                            for tag in calls}
        return out
    shape = spec["input_shape"]
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    out: dict[str, Any] = {"rows": [rows], "float32_blocks": sum(
        len(v) for v in blocks["float32"].values())}
    sizes: dict[str, list[int]] = {"forward": [], "input_gradient": [], "weight_gradient": []}
    for size in ("full", "half"):
        if size not in blocks:
            continue
        run = blocks[size]
        weight = sum(blocks.get(size + "-weight", run)["backward"])
        sizes["forward"].append(sum(run["forward"]))
        sizes["weight_gradient"].append(weight)
        sizes["input_gradient"].append(sum(run["backward"]) - weight)
        if size == "half":
            out["rows"].append(rows * (int(shape[0]) // 2) // int(shape[0]))
    out["bfloat16"] = sizes
    return out


def _signature(kind: str, spec: dict) -> tuple:
    """Modules built alike and called alike allocate alike: probed once (a ResNet's repeated
    blocks, a transformer's layers)."""
    return (kind, spec["cls"].__name__, tuple(sorted((k, str(v))
                                                     for k, v in spec["kwargs"].items())),
            tuple(spec["input_shape"]), spec["input_requires_grad"],
            spec["weight_requires_grad"], spec["channels_last"])


def probe_modules(specs: dict[str, tuple[str, dict]], session_factory: Callable,
                  budget_s: float = PROBE_BUDGET_S) -> dict[str, list[dict]]:
    """``{kind: [entry, ...]}``, one entry per module: {'module', 'input_shape', 'threads',
    ...the kind's measurements}, or 'skipped' (why) where the probe failed, the input was
    too large, or the probes had used ``budget_s`` seconds already.

    Every run of every distinct module goes through one recording session (sessions cost
    more than small runs); each run's blocks are its events between two sequence numbers."""
    unique: dict[tuple, tuple[str, dict]] = {}
    skipped: dict[tuple, str] = {}
    for kind, spec in specs.values():
        elements = 1
        for d in spec["input_shape"]:
            elements *= int(d)
        key = _signature(kind, spec)
        if elements > MAX_PROBE_ELEMENTS:
            skipped[key] = "input too large to probe"
        else:
            unique.setdefault(key, (kind, spec))
    ranges: dict[tuple, dict[str, tuple[int, int, str | None]]] = {}
    started = time.monotonic()
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        session = session_factory()
        with session:
            for key, (kind, spec) in unique.items():
                if time.monotonic() - started > budget_s:
                    skipped[key] = f"probes past their {budget_s:g} s budget"
                    continue
                mine = {}
                try:
                    for tag, (case, dtype_name) in _runs(kind, spec).items():
                        first = session.recorder.now_seq()
                        _run(case, getattr(torch, dtype_name))
                        mine[tag] = (first, session.recorder.now_seq(),
                                     "convolution" if kind == "convolution" else None)
                except Exception as exc:  # a probe must never cost the user their trace
                    skipped[key] = f"{type(exc).__name__}: {exc}"[:200]
                    continue
                ranges[key] = mine
        table, _ = session.build()
    frame = table.to_pandas()
    seq = frame["seq"].to_numpy()
    measured = {}
    for key, mine in ranges.items():
        runs = {tag: frame[(seq >= first) & (seq < last)]
                for tag, (first, last, _) in mine.items()}
        blocks = {tag: _raw_blocks(runs[tag], op_filter)
                  for tag, (_, _, op_filter) in mine.items()}
        calls = None
        if unique[key][0] == "convolution":
            calls = {tag: {d: _call_events(runs[tag], d) for d in ("forward", "backward")}
                     for tag in runs}
        measured[key] = _entry(unique[key][0], unique[key][1], blocks, calls)
    out: dict[str, list[dict]] = {}
    for path, (kind, spec) in specs.items():
        entry = {"module": path, "input_shape": spec["input_shape"],
                 "threads": torch.get_num_threads()}
        key = _signature(kind, spec)
        entry.update(measured[key] if key in measured else {"skipped": skipped[key]})
        out.setdefault(kind, []).append(entry)
    return out
