"""The cost model's terms: each priced from what the plan actually moves or recomputes, the
same in ``advise``'s fast pass as in ``simulate``."""
import pytest

from memadvisor.plan import Plan
from memadvisor.simulate import simulate
from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.simulator import quick_simulate

H100 = hardware("h100-80gb")


def _term(prediction, start):
    found = [seconds for what, seconds in prediction.cost.terms if what.startswith(start)]
    assert len(found) == 1, prediction.cost.terms
    return found[0]


def test_activation_offload_is_priced_from_the_bytes_it_moves(base):
    for spec in ("offload=activations", "accum=2,offload=activations",
                 "precision=amp-bf16,offload=activations"):
        plan = Plan.parse(spec)
        exact = simulate(base, plan, H100, run_allocator=False)
        moved = exact.host_bytes["activations_peak"]
        assert moved > 0
        copy = _term(exact, "offload traffic")
        # to the host and back, every micro-step, half of it hidden behind compute
        assert copy == pytest.approx(2 * moved * plan.accum / H100.host_link_bytes_s * 0.5)
        # the fast pass advise ranks with prices the same traffic
        quick = quick_simulate(base, plan, H100, {}, {})
        assert quick is not None
        assert quick.step_time_factor == pytest.approx(exact.step_time_factor, rel=1e-9)


def test_recompute_runs_at_the_plans_matmul_rate(base):
    fp32 = _term(simulate(base, Plan.parse("checkpoint=auto"), H100), "recompute")
    amp = _term(simulate(base, Plan.parse("precision=amp-bf16,checkpoint=auto"), H100),
                "recompute")
    assert amp == pytest.approx(fp32 * H100.fp32_flops / H100.bf16_flops)


def test_host_optimizer_steps_the_ranks_own_parameters(base):
    whole = _term(simulate(base, Plan.parse("offload=optimizer"), H100), "optimizer step on")
    shard = _term(simulate(base, Plan.parse("shard=zero3,world=4,offload=optimizer+params"),
                           H100), "optimizer step on")
    assert shard == pytest.approx(whole / 4)
    # bf16 storage halves the bytes, not the number of parameters
    bf16 = _term(simulate(base, Plan.parse("precision=bf16,offload=optimizer"), H100),
                 "optimizer step on")
    assert bf16 == pytest.approx(whole)


def test_fsdp_collectives_repeat_every_micro_step(base):
    from memadvisor.simulate.sharding import communication_bytes
    for shard, repeats in (("zero2", True), ("zero3", True), ("ddp", False), ("zero1", False)):
        one = communication_bytes(Plan.parse(f"shard={shard},world=2"), 1e6, 1e6)
        four = communication_bytes(Plan.parse(f"shard={shard},world=2,accum=4"), 1e6, 1e6)
        assert four == pytest.approx(4 * one if repeats else one), shard
