"""One set of gradients however often a step makes them: DDP's buckets (``ddp``, ``zero1``)
hold one copy of each parameter's gradient.  An LBFGS step evaluates its closure several
times and the closure clears gradients each time, so the step makes each gradient anew
per evaluation; counting every one made the zoo's lbfgs_sine ``shard=ddp`` +8.46%."""
import torch
import torch.nn as nn

from memadvisor.simulate import prepare
from memadvisor.simulate.replay import CATEGORY_CODE
from memadvisor.simulate.sharding import gradient_bytes
from memadvisor.trace import schema


def test_an_lbfgs_step_has_one_set_of_gradients(loops):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def step():
        def closure():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        optimizer.step(closure)

    timeline = prepare(loops.profile_steps(step, 2)).timeline
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gradient = CATEGORY_CODE[schema.GRADIENT]
    made = timeline.size[(timeline.category == gradient) & (timeline.alloc_key >= 0)].sum()
    assert made >= 2 * parameter_bytes  # the closure ran several times in the step
    assert gradient_bytes(timeline) == parameter_bytes
