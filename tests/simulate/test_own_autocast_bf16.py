"""A script that runs its own ``torch.autocast(bf16)`` records autocast's bf16 copies of its
fp32 weights; under ``precision=bf16`` the parameters are bf16 already and autocast makes no
copy of them (its cast of a tensor already in the target dtype returns it).  Predicted from
the fp32 trace against the same loop run with the plan set up by ``apply``'s helpers (the
new-user trial's own-AMP MLP: +6.9% when the copies were kept)."""
import torch
import torch.nn as nn

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.trace import schema

from loops import measured_peak, run_with_apply_precision

BATCH, WIDTH = 8, 256


class OwnAutocastMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(),
                                    nn.Linear(WIDTH, WIDTH), nn.GELU(),
                                    nn.Linear(WIDTH, 10))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the script's own mixed precision
            return self.layers(x).float()


def run(precision: str = "fp32"):
    torch.manual_seed(0)

    def batch(gen):
        return (torch.randn(BATCH, WIDTH, generator=gen),
                torch.randint(10, (BATCH,), generator=gen))

    return run_with_apply_precision(OwnAutocastMLP(), batch, precision)


def test_bf16_parameters_leave_the_scripts_autocast_nothing_to_copy():
    fp32 = run()
    events = fp32.events
    copies = events[(events["category"] == schema.AUTOCAST_WEIGHT)
                    & (events["action"] == "alloc")]
    assert len(copies), "the script's own autocast copies its fp32 weights"
    prediction = simulate(prepare(fp32), Plan.parse("precision=bf16"))
    measured_trace = run("bf16")
    measured = measured_peak(measured_trace)
    m_events = measured_trace.events
    assert not len(m_events[(m_events["category"] == schema.AUTOCAST_WEIGHT)
                             & (m_events["action"] == "alloc")])
    timeline = prediction.timeline
    code = schema.CATEGORIES.index(schema.AUTOCAST_WEIGHT)
    assert timeline.size[timeline.category == code].sum() == 0  # no copy left anywhere
    assert abs(prediction.peak_bytes - measured) / measured <= 0.01, (
        prediction.peak_bytes, measured)
