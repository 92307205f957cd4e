"""An op that refuses mixed dtypes (``index_add_``) fed a 16-bit side and an fp32 side under
a 16-bit plan: simulate refuses the plan naming the script's line, advise leaves it out
with that reason (``simulate/inplace_dtypes.py``).  The same layer with the two sides made
to agree by the script (``.to(h.dtype)``, ``dtype=``) is predicted as before."""
import inspect

import pytest
import torch
import torch.nn as nn

from memadvisor.plan import Plan, PlanError
from memadvisor.simulate import advise, prepare, simulate
from memadvisor.simulate.hardware import hardware

NODES, EDGES = 24, 60


class Messages(nn.Module):
    """A GCN layer as PyG-style scripts write it: the degree counted in an fp32 buffer the
    script makes, the messages scaled by it and summed into a buffer like the features."""

    def __init__(self, agree: bool = False):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.agree = agree

    def forward(self, x, src, dst):
        h = self.lin(x)
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        msg = h[src] / deg.clamp(min=1)[dst].unsqueeze(-1)
        if self.agree:  # and a pooled sum into a buffer given the features' dtype
            out = torch.zeros_like(h).index_add_(0, dst, msg.to(h.dtype))
            pooled = torch.zeros(2, 8, dtype=out.dtype)
            return pooled.scatter_add(0, (src[:NODES] % 2).unsqueeze(-1).expand_as(out), out)
        return torch.zeros_like(h).index_add_(0, dst, msg)


def _line(text: str) -> int:
    lines, start = inspect.getsourcelines(Messages)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _graphs(agree: bool, steps: int = 2):
    import loops
    torch.manual_seed(0)
    model = Messages(agree)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        x = torch.randn(NODES, 8)
        src, dst = torch.randint(0, NODES, (2, EDGES))
        loss = model(x, src, dst).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return loops.profile_steps(step, steps)


@pytest.mark.parametrize("precision", ["amp-bf16", "bf16"])
def test_a_16_bit_plan_meeting_index_add_of_two_dtypes_is_refused(loops, precision):
    base = prepare(_graphs(agree=False))
    cpu = hardware(None, "cpu")
    with pytest.raises(PlanError) as refused:
        simulate(base, Plan.parse(f"precision={precision}"), cpu)
    line = _line("return torch.zeros_like(h).index_add_(0, dst, msg)\n")
    assert f"test_inplace_dtypes.py:{line} `" in str(refused.value)
    assert ("index_add_ would write a float32 source into a bfloat16 tensor, which torch "
            "refuses") in str(refused.value)
    # the degree's index_add_ adds fp32 ones into an fp32 buffer: not refused
    assert "torch.ones(dst.shape[0])" not in str(refused.value)
    assert simulate(base, Plan.parse("precision=fp32"), cpu).peak_bytes > 0


def test_advise_leaves_the_plan_out_with_the_reason(loops):
    base = prepare(_graphs(agree=False))
    result = advise(base, hardware(None, "cpu"), 1 << 30, top=50)
    assert result.ranked and all(p.plan.precision == "fp32" for p in result.ranked)
    reasons = [why for plan, why in result.rejected if plan.precision == "amp-bf16"]
    assert reasons and all("index_add_ would write" in why for why in reasons)


def test_sides_the_script_makes_agree_are_not_refused(loops):
    base = prepare(_graphs(agree=True))
    cpu = hardware(None, "cpu")
    for precision in ("amp-bf16", "bf16"):
        assert simulate(base, Plan.parse(f"precision={precision}"), cpu).peak_bytes > 0
