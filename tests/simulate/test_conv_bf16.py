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
