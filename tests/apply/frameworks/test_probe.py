"""The run-time check of a framework plan: it stops a run whose knob did not take effect at
the first optimizer step, refuses what this machine cannot run, and never lets a run that
was not checked end with exit 0.  Plain torch loops stand in for the frameworks here."""
import pytest
import torch
from torch import nn

from memadvisor.apply.frameworks import probe
from memadvisor.errors import UserError
from memadvisor.plan import PlanError


@pytest.fixture(autouse=True)
def no_probe_left():
    yield
    probe.finish(completed=False)


def train(steps=1, micro_batches=1, autocast=False, recompute=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        for _ in range(micro_batches):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if recompute:
                    out = torch.utils.checkpoint.checkpoint(model, torch.randn(2, 4),
                                                            use_reentrant=False)
                else:
                    out = model(torch.randn(2, 4))
            out.float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_a_plan_that_took_effect_passes_and_says_what_was_seen(capsys):
    probe.expect_plan("accum=2,precision=amp-bf16", framework="accelerate")
    train(micro_batches=2, autocast=True)
    err = capsys.readouterr().err
    assert "2 forward pass(es) per step" in err and "autocast torch.bfloat16" in err
    probe.finish()


@pytest.mark.parametrize("plan, run, knob", [
    ("accum=2", {}, "accum=2: 1 forward pass(es)"),
    ("precision=amp-bf16", {}, "precision=amp-bf16: the forward ran with no autocast"),
    ("checkpoint=auto", {}, "checkpoint=auto: no module of the model was recomputed"),
])
def test_a_knob_that_did_not_take_effect_stops_the_first_step(plan, run, knob):
    probe.expect_plan(plan, framework="lightning")
    with pytest.raises(PlanError, match="did not take effect") as error:
        train(**run)
    assert knob in str(error.value)


def test_recomputation_is_seen_when_the_model_is_checkpointed(capsys):
    probe.expect_plan("checkpoint=auto", framework="lightning")
    train(recompute=True)
    assert "recomputed in backward" in capsys.readouterr().err


def test_a_run_without_an_optimizer_step_is_an_error_not_exit_0():
    probe.expect_plan("accum=2", framework="hf-trainer")
    with pytest.raises(UserError, match="never checked"):
        probe.finish()


def test_fsdp_is_refused_up_front_on_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanError, match="shard=zero2 under accelerate needs CUDA"):
        probe.expect_plan("shard=zero2,world=2", framework="accelerate")


def test_a_plan_for_two_ranks_in_one_process_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(PlanError, match="--nproc 2"):
        probe.expect_plan("shard=ddp,world=2", framework="hf-trainer")


def test_split_batch_refuses_a_batch_that_does_not_divide():
    assert probe.split_batch(8, parts=4) == 2
    with pytest.raises(PlanError, match="multiple of 4"):
        probe.split_batch(6, parts=4)


def test_saved_parameters_carry_the_users_names(tmp_path):
    probe.expect_plan("none", framework="accelerate")
    model = train()
    probe.finish(str(tmp_path / "p.pt"))
    saved = torch.load(tmp_path / "p.pt")
    assert saved["names"] == [n for n, _ in model.named_parameters()]
    assert torch.equal(saved["tensors"][0], model[0].weight.detach())


def test_a_rewritten_script_this_machine_cannot_run_is_refused_before_launch(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    script = tmp_path / "train.py"
    script.write_text('import memadvisor.apply.frameworks as mem\n'
                      'mem.expect_plan("shard=zero3,world=2", framework="lightning")\n')
    with pytest.raises(PlanError, match="shard=zero3 under Lightning needs CUDA"):
        probe.refuse_before_launch(script)
    script.write_text('mem.expect_plan("shard=ddp,world=2", framework="lightning")\n')
    probe.refuse_before_launch(script)  # DDP runs here: nothing to refuse


def test_an_optimizer_swap_that_did_not_happen_stops_the_first_step():
    probe.expect_plan("optimizer=sgd-momentum", framework="hf-trainer")
    with pytest.raises(PlanError, match="optimizer=sgd-momentum: the step ran SGD with momentum 0"):
        train()  # plain SGD, no momentum
