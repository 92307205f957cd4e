"""The runtime's pieces on their own: the batch split, the calls without a plan, the
optimizer rebuild, host offload math, and prepare's refusals."""
from collections import namedtuple

import pytest
import torch
from torch import nn

import memadvisor.apply as mem
from memadvisor.apply import batching, checkpointing, optimizers, runtime
from memadvisor.apply.offload import HostOptimizer
from memadvisor.plan import Plan, PlanError


@pytest.fixture(autouse=True)
def no_session():
    runtime.finish()
    yield
    runtime.finish()


def parts(values, plan, rank):
    return list(batching.split(values, Plan.parse(plan), rank))


def test_rank_slices_then_micro_batches():
    x = torch.arange(16).view(8, 2)
    y = torch.arange(8)
    mask = torch.ones(3, 3)  # not batch-sized: every micro-batch gets it whole
    plan = "shard=ddp,world=2,accum=2"
    rank0 = parts((x, y, mask, "tag"), plan, 0)
    rank1 = parts((x, y, mask, "tag"), plan, 1)
    assert [p[1].tolist() for p in rank0] == [[0, 1], [2, 3]]
    assert [p[1].tolist() for p in rank1] == [[4, 5], [6, 7]]
    assert all(p[2] is mask and p[3] == "tag" for p in rank0 + rank1)
    assert torch.equal(torch.cat([p[0] for p in rank0 + rank1]), x)


def test_nested_batches_keep_their_types():
    Batch = namedtuple("Batch", "inputs labels")
    batch = {"ids": torch.zeros(4, 3), "pair": Batch(torch.zeros(4), [torch.ones(4, 1)])}
    [first, second] = parts((batch,), "accum=2", 0)
    assert isinstance(first[0]["pair"], Batch)
    assert first[0]["ids"].shape == (2, 3) and first[0]["pair"].labels[0].shape == (2, 1)


def test_split_refusals():
    with pytest.raises(PlanError, match="a batch of 6 samples cannot be split evenly into "
                                        "4 micro-batches"):
        parts((torch.zeros(6),), "accum=4", 0)
    with pytest.raises(PlanError, match="holds no tensor with a batch dimension"):
        parts((3, "x"), "accum=2", 0)
    assert parts((3,), "none", 0) == [(3,)]


def test_without_prepare_the_calls_are_the_plain_ones():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 2)
    assert list(mem.micro_batches(x)) == [x]
    assert list(mem.micro_batches(x, 5)) == [(x, 5)]
    mem.backward(model(x).sum())
    assert torch.equal(model.weight.grad, torch.full((1, 2), 4.0))
    # but a step without prepare means the plan was never applied (issue 13): it stops
    before = model.weight.detach().clone()
    with pytest.raises(PlanError, match="mem.prepare never ran"):
        mem.step(optimizer)
    assert torch.equal(model.weight, before)


def test_prepare_refuses_what_this_process_cannot_run(monkeypatch):
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(PlanError, match=r"the plan runs on world=2 ranks but this is a single "
                                        r"process: launch it with `memadvisor apply --nproc 2`"):
        mem.prepare(model, optimizer, plan="shard=ddp,world=2")
    with pytest.raises(PlanError, match="amp-fp16 needs a CUDA GPU"):
        mem.prepare(model, optimizer, plan="precision=amp-fp16")
    other = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(PlanError, match="not parameters of the model"):
        mem.prepare(model, other, plan="accum=2")


def test_micro_batch_loss_weight_gives_the_full_batch_gradient():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    nn.functional.mse_loss(reference(x), y).backward()
    model, optimizer = mem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   plan="accum=4")
    for xs, ys in mem.micro_batches(x, y):
        mem.backward(nn.functional.mse_loss(model(xs), ys))
    assert torch.allclose(model.weight.grad, reference.weight.grad, rtol=1e-6, atol=1e-7)


def test_checkpointing_keeps_names_and_wraps_only_the_chosen():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()),
                          nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 1))
    names = [n for n, _ in model.named_parameters()]
    assert checkpointing.apply_checkpointing(model, Plan.parse("checkpoint=auto")) == ["0", "1"]
    assert [n for n, _ in model.named_parameters()] == names
    assert "forward" in vars(model[0]) and "forward" not in vars(model[2])


def test_swapped_optimizer_keeps_each_groups_lr_and_weight_decay():
    model = nn.Linear(3, 3)
    original = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
                                  {"params": [model.bias], "weight_decay": 0.0, "lr": 1e-2}],
                                 lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    new = optimizers.build_optimizer(original, Plan.parse("optimizer=sgd-momentum"),
                                     dict(model.named_parameters()), names)
    assert type(new) is torch.optim.SGD
    assert [(g["lr"], g["weight_decay"], g["momentum"]) for g in new.param_groups] == [
        (1e-3, 0.1, 0.9), (1e-2, 0.0, 0.9)]
    kept = optimizers.build_optimizer(original, Plan(), dict(model.named_parameters()), names)
    assert kept is original


def test_host_optimizer_steps_like_the_plain_one():
    """ZeRO-Offload's layout (fp32 copies on the host, step there, copy back) is the plain
    optimizer's math; checked on CPU, where the copies are host-to-host."""
    torch.manual_seed(0)
    plain_model, host_model = nn.Linear(4, 2), nn.Linear(4, 2)
    host_model.load_state_dict(plain_model.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    groups = [{"params": list(host_model.parameters()), "lr": 1e-2, "weight_decay": 0.01}]
    host = HostOptimizer(groups, torch.optim.AdamW, {})
    schedule = torch.optim.lr_scheduler.StepLR(host, step_size=1, gamma=0.5)
    plain_schedule = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    for _ in range(3):
        x = torch.randn(5, 4)
        for model, optimizer in ((plain_model, plain), (host_model, host)):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        schedule.step()
        plain_schedule.step()
    for a, b in zip(plain_model.parameters(), host_model.parameters()):
        assert torch.allclose(a, b, atol=1e-7)
    assert host.host_optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
