"""pp=P x hybrid=G predicted per stage: a stage's state in shards of G ranks (not its D
replicas), its replica's slice of the batch, against ``apply --plan ... --profile`` on 8
CPU ranks."""
import os

import pytest

from .cli_runs import ROOT, check_stages_against_apply_profile, run_cli
from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.trace.io import read_trace

GPT = os.path.join(ROOT, "examples", "gpt_lm.py")
GPT4_ARGS = ["--n-layer", "4", "--d-model", "64", "--batch-size", "8", "--device", "cpu"]
#: the issue's target for the analytic prediction against the measured per-rank peak
ANALYTIC_TARGET = 0.05


@pytest.fixture(scope="module")
def gpt4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp_hybrid")
    path = folder / "gpt4.trace"
    run_cli("profile", GPT, "-o", path, "--steps", "3", "--", *GPT4_ARGS)
    return read_trace(str(path)), folder


def _stages(trace, plan: str) -> list[dict]:
    return simulate(prepare(trace), Plan.parse(plan)).notes["pipeline_parallel"]["stages"]


def test_a_stages_state_is_sharded_over_the_group_not_its_replicas(gpt4):
    """hybrid=2 over 4 replicas per stage holds what shard=zero3 over 2 replicas holds (one
    copy per 2 ranks) and twice what zero3 over 4 holds; zero1's optimizer state too."""
    trace, _ = gpt4
    for shard in ("zero3", "zero1"):
        hybrid = _stages(trace, f"pp=2,shard={shard},hybrid=2,world=8")
        two = _stages(trace, f"pp=2,shard={shard},world=4")
        four = _stages(trace, f"pp=2,shard={shard},world=8")
        for h, t, f in zip(hybrid, two, four):
            state = h["by_category"]["optimizer_state"]
            assert state == t["by_category"]["optimizer_state"], (shard, h, t)
            assert state > 1.8 * f["by_category"]["optimizer_state"], (shard, h, f)


def test_zero2_backwards_that_gather_again_run_zero3s_micro_step(gpt4):
    """1f1b's stage 0 holds 2 micro-batches (F0 F1 B0 B1): B0's post-backward reshards each
    block and FSDP's backward prefetch gathers it again for B1, so zero2 there peaks as
    zero3 (measured: equal to the byte); the last stage (F0 B0 F1 B1) keeps zero2's rows,
    gathered once per forward."""
    trace, _ = gpt4
    zero2 = _stages(trace, "pp=2,shard=zero2,hybrid=2,world=8")
    zero3 = _stages(trace, "pp=2,shard=zero3,hybrid=2,world=8")
    assert zero2[0]["peak_bytes"] == zero3[0]["peak_bytes"]
    assert zero2[1]["peak_bytes"] < zero3[1]["peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["pp=2,shard=zero3,hybrid=2,world=8",
                                  "pp=2,shard=zero2,hybrid=2,world=8",
                                  "pp=2,shard=zero1,hybrid=2,world=8"])
def test_pp_hybrid_predicted_per_rank_against_apply_profile(gpt4, plan):
    """Every rank's measured peak against its stage's prediction from the unmodified trace
    (gloo, 8 processes: 2 stages x 2 replica groups x 2 shards).  Measured 2026-11-26,
    gpt_lm 4 layers d_model 64 batch 8: zero3 stage 0 -4.65%, stage 1 +3.43% (as zero3
    without hybrid on the same 2-sample replicas, world=8: -3.03/+4.50%); zero2 -4.65% /
    -0.02% (-8.95% on stage 0 before its re-gathering backwards ran zero3's micro-step);
    zero1 +2.24/+2.35% and +3.09/+3.20%.  Under zero2/zero3 the ranks of one stage measure
    the same (apply drains the gloo groups within a stage); zero1's own different shares of
    the optimizer state."""
    trace, folder = gpt4
    check_stages_against_apply_profile(GPT, [*GPT4_ARGS, "--steps", "5"], plan,
                                       _stages(trace, plan), folder, ANALYTIC_TARGET,
                                       timeout=900)
