"""16-bit plans follow dtypes along the trace's data flow (``input_ids``).

Under autocast an op on neither list runs in the dtype its inputs promote to: a residual
add or a ``cat`` of two 16-bit tensors is 16-bit, a product with an fp32 parameter is
fp32.  An fp32 trace alone cannot tell them apart; the data flow the profiler records
can.  A GroupNorm + in-place SiLU block with a residual add and a concatenated skip (the
U-Net pattern the zoo's unet_groupnorm measured +17% on without it), predicted from the
fp32 trace against the same loop run with the plan set up by ``apply``'s helpers."""
import numpy as np
import pytest
import pyarrow as pa
import torch
import torch.nn as nn

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.trace.io import Trace

from loops import measured_peak, run_with_apply_precision

BATCH = 4


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(4, channels)
        self.act = nn.SiLU(inplace=True)  # autograd keeps a copy of its input (no tensor)

    def forward(self, x):
        return x + self.act(self.norm(self.conv(x)))  # residual add of two 16-bit tensors


class SkipNet(nn.Module):
    def __init__(self, layer_scale: bool = False):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.merge = nn.Conv2d(32, 16, 1)
        # a LayerScale (ConvNeXt, DeiT-III): a 16-bit tensor times an fp32 parameter
        self.scale = nn.Parameter(torch.ones(16, 1, 1)) if layer_scale else None
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        stem = self.stem(x)
        deep = self.blocks(stem)
        merged = self.merge(torch.cat([stem, deep], dim=1))  # a cat of two 16-bit tensors
        if self.scale is not None:
            merged = merged * self.scale
        return self.head(merged.mean((2, 3)))


def run(precision: str = "fp32", layer_scale: bool = False) -> Trace:
    torch.manual_seed(0)

    def batch(gen):
        return (torch.randn(BATCH, 3, 16, 16, generator=gen),
                torch.randint(10, (BATCH,), generator=gen))

    return run_with_apply_precision(SkipNet(layer_scale), batch, precision)


@pytest.fixture(scope="module")
def baseline():
    return run()


def _forward_dtypes(timeline, rows) -> dict:
    """(module, op, shape) -> sorted dtypes of the forward storages made in the step."""
    out: dict = {}
    modules = np.asarray(timeline.modules, dtype=object)
    ops = np.asarray(timeline.ops, dtype=object)
    dtypes = np.asarray(timeline.dtypes, dtype=object)
    for row in rows:
        key = (modules[timeline.module[row]], ops[timeline.op[row]], timeline.shape[row])
        out.setdefault(key, []).append(dtypes[timeline.dtype[row]])
    return {k: sorted(v) for k, v in out.items()}


def test_forward_storages_take_the_dtypes_the_run_gives_them():
    """Every forward storage the fp32 trace records (casts aside) gets the dtype the
    amp-bf16 run gave it -- the LayerScale's product with its fp32 parameter stays fp32,
    the residual adds and the cat become 16-bit."""
    from memadvisor.simulate.precision import apply_precision
    from memadvisor.simulate.replay import PHASE_CODE, build_timeline

    fp32, amp = run(layer_scale=True), run("amp-bf16", layer_scale=True)
    base = build_timeline(fp32)
    predicted = apply_precision(base, "amp-bf16", "cpu")
    measured = build_timeline(amp)
    forward = PHASE_CODE["forward"]

    def recorded(timeline, count):
        rows = np.arange(count)
        keep = (timeline.phase[rows] == forward) & (timeline.alloc_key[rows] >= 0) \
            & ~timeline.dtype_in(("bytes",))[rows] \
            & ~timeline.op_in(("aten::_to_copy",))[rows]
        return rows[keep]

    want = _forward_dtypes(measured, recorded(measured, len(measured)))
    got = _forward_dtypes(predicted, recorded(predicted, len(base)))
    assert got == want
    assert want[("", "aten::mul", "4,16,16,16")] == ["float32"]
    assert want[("", "aten::cat", "4,32,16,16")] == ["bfloat16"]


def _without_data_flow(trace: Trace) -> Trace:
    """The same trace as a format-2 file reads: no op's reads recorded."""
    events = trace.events.copy()
    events["input_ids"] = pa.array([[]] * len(events), pa.list_(pa.int64())).to_pandas(
        types_mapper=lambda t: __import__("pandas").ArrowDtype(t))
    return Trace(events=events, meta=trace.meta, path=trace.path)


def test_the_trace_records_what_each_op_read(baseline):
    events = baseline.events
    forward = events[(events["phase"] == "forward") & (events["action"] == "alloc")
                     & (events["op"] == "aten::add")]
    assert len(forward)
    assert all(len(ids) == 2 for ids in forward["input_ids"])


@pytest.mark.parametrize("precision", ["amp-bf16", "bf16"])
def test_16bit_plans_follow_the_data_flow_within_1_percent(baseline, precision):
    plan = Plan.parse(f"precision={precision}")
    predicted = simulate(prepare(baseline), plan).peak_bytes
    measured = measured_peak(run(precision))
    assert abs(predicted - measured) / measured <= 0.01, (predicted, measured)


def test_without_data_flow_the_residual_adds_stay_fp32(baseline):
    """What the data flow changes: without it an add fed by two 16-bit tensors is kept
    fp32, a larger prediction (the old rule, still used for traces without data flow)."""
    plan = Plan.parse("precision=amp-bf16")
    with_flow = simulate(prepare(baseline), plan).peak_bytes
    without = simulate(prepare(_without_data_flow(baseline)), plan).peak_bytes
    assert without > with_flow
    assert np.isfinite(without)
