"""A loss over in-batch similarities couples the batch's samples: said in the warnings,
and no largest micro-batch extrapolated linearly from a (B, B) tensor.  A latent width
equal to the batch size (elementwise products of (B, B)-shaped tensors) is no coupling."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from memadvisor.plan import Plan
from memadvisor.simulate import max_micro_batch, prepare
from memadvisor.simulate.hardware import hardware

BATCH = 16


def _contrastive(steps: int = 2):
    import loops
    torch.manual_seed(0)
    image, text = nn.Linear(24, 32), nn.Linear(20, 32)
    opt = torch.optim.SGD(list(image.parameters()) + list(text.parameters()), lr=0.1)

    def step():
        a = F.normalize(image(torch.randn(BATCH, 24)), dim=-1)
        b = F.normalize(text(torch.randn(BATCH, 20)), dim=-1)
        logits = a @ b.t() / 0.07  # every sample against every other
        labels = torch.arange(BATCH)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()

    return loops.profile_steps(step, steps)


def _latent_as_wide_as_the_batch(steps: int = 2):
    import loops
    torch.manual_seed(0)
    encoder = nn.Linear(24, 2 * BATCH)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.1)

    def step():
        mu, logvar = encoder(torch.randn(BATCH, 24)).chunk(2, dim=-1)  # (B, B) each
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        loss = z.pow(2).mean() - 0.5 * (1 + logvar - mu * mu - logvar.exp()).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return loops.profile_steps(step, steps)


def test_in_batch_similarities_are_said_and_not_extrapolated(loops):
    base = prepare(_contrastive())
    assert base.batch_coupled and "aten::mm" in base.batch_coupled
    assert any("couples the samples of a batch" in w for w in base.warnings)
    cpu = hardware(None, "cpu")
    assert max_micro_batch(base, Plan.parse("accum=2"), cpu, 1 << 30) == 0


def test_a_latent_as_wide_as_the_batch_couples_nothing(loops):
    base = prepare(_latent_as_wide_as_the_batch())
    assert base.batch_coupled is None
    cpu = hardware(None, "cpu")
    assert max_micro_batch(base, Plan.parse("accum=2"), cpu, 1 << 30) > 0


def test_advise_proposes_no_plan_that_splits_a_coupled_batch(loops):
    from memadvisor.simulate import advise
    from memadvisor.simulate.batch_coupling import SPLIT_REFUSAL
    base = prepare(_contrastive())
    result = advise(base, hardware(None, "cpu"), 1 << 30, 2, top=100)
    assert result.ranked
    assert all(p.plan.accum == 1 and p.plan.world == 1 for p in result.ranked)
    split = [why for plan, why in result.rejected if plan.accum > 1 or plan.world > 1]
    assert split and all(why.startswith(SPLIT_REFUSAL) and "aten::mm" in why for why in split)
