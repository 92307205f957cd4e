"""16-bit convolutions on CPU: predicted from an fp32 trace (with the profiler's probes of
oneDNN's bf16 blocks, ``meta.probes``) against the same loop run in 16-bit, the model cast
by ``apply``'s own precision helpers."""
import pytest
import torch
import torch.nn as nn

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.trace.io import Trace

from loops import measured_peak, run_with_apply_precision

BATCH = 4


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def run(precision: str = "fp32") -> Trace:
    torch.manual_seed(0)

    def batch(gen):
        return (torch.randn(BATCH, 3, 16, 16, generator=gen),
                torch.randint(10, (BATCH,), generator=gen))

    return run_with_apply_precision(TinyCNN(), batch, precision)


@pytest.fixture(scope="module")
def baseline():
    return run()


def test_the_trace_holds_each_convolutions_probe(baseline):
    probes = {e["module"]: e for e in baseline.meta.probes["convolution"]}
    assert set(probes) == {"features.0", "features.3", "features.7"}
    events = baseline.events
    for path, entry in probes.items():
        fp32 = entry["raw_bytes"]["float32"]
        # the fp32 probe rebuilds what the script's own call allocated (same order)
        ours = events[(events["module"] == path) & (events["action"] == "alloc")
                      & (events["dtype"] == "bytes") & (events["op"] == "aten::convolution")
                      & (events["step"] == 0)]
        assert [int(b) for b in ours["size_bytes"]] == fp32["forward"]
        assert entry["raw_bytes"]["bfloat16"]["backward"]


@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_16bit_convolutions_predicted_within_1_percent(baseline, precision):
    predicted = simulate(prepare(baseline), Plan.parse(f"precision={precision}")).peak_bytes
    measured = measured_peak(run(precision))
    assert abs(predicted - measured) / measured <= 0.01, (predicted, measured)


def test_probed_matmul_parts_split_fixed_and_batch_sized_bytes():
    from memadvisor.simulate.kernel_blocks import probed_matmul_parts

    entry = {"rows": [256, 128], "float32_blocks": 0,
             "bfloat16": {"forward": [149120, 83584], "weight_gradient": [91904, 91904]}}
    assert probed_matmul_parts(entry, "forward", "bfloat16") == (18048.0, 131072.0)
    assert probed_matmul_parts(entry, "weight_gradient", "bfloat16") == (91904.0, 0.0)
    assert probed_matmul_parts(entry, "forward", "float16") is None
    # fp32 made blocks of its own: the trace holds them, the probe cannot be added on top
    assert probed_matmul_parts(dict(entry, float32_blocks=2), "forward", "bfloat16") is None


def test_each_probe_records_its_calls_blocks_among_the_ops_tensors(baseline):
    for entry in baseline.meta.probes["convolution"]:
        calls = entry["calls"]
        assert set(calls) == {"float32", "bfloat16", "float32-half", "bfloat16-half"}
        assert entry["batch"] == {"float32": BATCH, "bfloat16": BATCH,
                                  "float32-half": BATCH // 2, "bfloat16-half": BATCH // 2}
        for tag in ("float32", "bfloat16"):
            for direction in ("forward", "backward"):
                call = calls[tag][direction]
                # the same blocks as the sizes-only record, each freed after it was made
                assert [b[0] for b in call["raw"]] == entry["raw_bytes"][tag][direction]
                assert all(0 <= made < freed <= call["length"] for _, made, freed in call["raw"])
        # the forward's tensor is the output, (B, C_out, H, W)
        assert [shape.split(",")[0] for shape, _ in calls["bfloat16"]["forward"]["typed"]] \
            == [str(BATCH)]


def test_a_blocks_batch_part_comes_from_the_half_batch_probe():
    from memadvisor.simulate.kernel_blocks import _batch_parts

    full = {"raw": [[147456, 0, 2], [64, 3, 4]]}
    half = {"raw": [[73728, 0, 2], [64, 3, 4]]}
    assert _batch_parts(full, half, 0.5) == [(0.0, 147456.0), (64.0, 0.0)]
    # the smaller batch ran another algorithm: nothing to say, all batch-independent
    other = {"raw": [[9000, 0, 1]]}
    assert _batch_parts(full, other, 0.5) == [(147456.0, 0.0), (64.0, 0.0)]
    assert _batch_parts(full, None, 0.5) == [(147456.0, 0.0), (64.0, 0.0)]
