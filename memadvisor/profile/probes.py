"""Device probes: what the recording machine's kernels allocate for the same op in 16-bit.

An fp32 trace cannot show what a bf16 plan's kernels allocate besides their outputs.  For
most ops the blocks are data-sized and halve; oneDNN's bf16 convolution backward on CPU
is the exception: its weight-gradient scratch is batch-independent and neither the fp32
block nor half of it (it depends on the weight *and* the spatial size, through oneDNN's
per-thread buffers; six shapes of one CNN fit no formula, docs/ACCURACY.md).  So the
profiler measures it instead of guessing: after the run, each convolution module the
script ran on the CPU is rebuilt at its recorded input shape, run forward and backward
once in fp32 and once in bf16, and the untyped blocks its kernels allocate are written to
the trace (``meta.probes['convolution']``).  The simulator, which imports no torch, maps
the trace's blocks onto them (``simulate.precision``).

Cost: one forward+backward of each distinct convolution, twice; skipped for inputs over
``MAX_PROBE_ELEMENTS`` (and then the simulator falls back to halving data-sized blocks).
The probe runs after the trace's events are collected, in its own recording session, and
leaves the global RNG as it was.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..trace import schema

#: the CPU target runs convolutions in bf16 under amp-bf16 and pure bf16 (no fp16 autocast)
PROBE_DTYPES = ("float32", "bfloat16")
MAX_PROBE_ELEMENTS = 1 << 26
_CONV_CLASSES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
                 torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def conv_spec(module: torch.nn.Module, args: tuple) -> dict[str, Any] | None:
    """What rebuilding ``module`` at this call needs, or None (not a CPU convolution)."""
    cls = next((c for c in _CONV_CLASSES if isinstance(module, c)), None)
    if cls is None or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if x.device.type != "cpu" or module.weight.device.type != "cpu":
        return None
    kwargs = dict(in_channels=module.in_channels, out_channels=module.out_channels,
                  kernel_size=module.kernel_size, stride=module.stride,
                  padding=module.padding, dilation=module.dilation, groups=module.groups,
                  bias=module.bias is not None, padding_mode=module.padding_mode)
    if module.transposed:
        kwargs["output_padding"] = module.output_padding
    return dict(cls=cls, kwargs=kwargs, input_shape=list(x.shape),
                input_requires_grad=bool(x.requires_grad),
                weight_requires_grad=bool(module.weight.requires_grad),
                channels_last=x.dim() == 4 and not x.is_contiguous()
                and x.is_contiguous(memory_format=torch.channels_last))


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


def _raw_blocks(table) -> dict[str, list[int]]:
    """Allocation sizes of untyped blocks made inside convolution ops, per direction."""
    frame = table.to_pandas()
    raw = frame[(frame["action"] == schema.ALLOC) & (frame["dtype"] == schema.RAW_BYTES_DTYPE)
                & frame["op"].astype(str).str.contains("convolution")]
    backward = raw["op"].astype(str).str.contains("backward")
    return {"forward": [int(b) for b in raw.loc[~backward, "size_bytes"]],
            "backward": [int(b) for b in raw.loc[backward, "size_bytes"]]}


def probe_convolutions(specs: dict[str, dict], session_factory: Callable) -> list[dict]:
    """One entry per probed module: {'module', 'input_shape', 'threads', 'raw_bytes':
    {dtype: {'forward': [bytes...], 'backward': [bytes...]}}}; modules whose probe failed
    or was too large carry 'skipped' instead of 'raw_bytes'."""
    out = []
    for path, spec in specs.items():
        entry = {"module": path, "input_shape": spec["input_shape"],
                 "threads": torch.get_num_threads()}
        elements = 1
        for d in spec["input_shape"]:
            elements *= int(d)
        if elements > MAX_PROBE_ELEMENTS:
            entry["skipped"] = "input too large to probe"
            out.append(entry)
            continue
        try:
            entry["raw_bytes"] = {name: _probe_one(spec, getattr(torch, name), session_factory)
                                  for name in PROBE_DTYPES}
        except Exception as exc:  # a probe must never cost the user their trace
            entry["skipped"] = f"{type(exc).__name__}: {exc}"[:200]
        out.append(entry)
    return out


def _probe_one(spec: dict, dtype: torch.dtype, session_factory: Callable) -> dict:
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        with session_factory() as session:
            _run(spec, dtype)
        table, _ = session.build(probe=False)
    return _raw_blocks(table)
