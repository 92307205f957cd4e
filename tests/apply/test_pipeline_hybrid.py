"""pp=P x hybrid=G: a stage's D = world / pp replicas split as (D / G) x G -- FSDP2's HSDP
on the (dp_replicate, dp_shard) dims of one (dp_replicate, dp_shard, pp) mesh, or zero1's
optimizer state sharded over G ranks -- the plan's refusals, the mesh, and runs on 8 CPU
ranks (gloo) compared with the unmodified single-process run."""
import pytest

from apply_runs import (REPO, relative_error, run_applied, run_distributed, run_original,
                        same_math_error)
from memadvisor.apply import pipeline_data_parallel
from memadvisor.plan import Plan, PlanError

GPT = REPO / "examples" / "gpt_lm.py"
GPT4_ARGS = ["--steps", "3", "--batch-size", "8", "--log-every", "100", "--n-layer", "4"]
#: SGD's step is the clipped gradient times lr: 0.5 makes a wrong clip coefficient move the
#: parameters by far more than the float tolerance
SGD_ARGS = [*GPT4_ARGS, "--lr", "0.5"]


@pytest.mark.parametrize("text", ["pp=2,shard=zero3,hybrid=2,world=8",
                                  "pp=2,shard=zero2,hybrid=2,world=8",
                                  "pp=2,shard=zero1,hybrid=2,world=8",
                                  "pp=2,shard=zero3,hybrid=3,world=12"])
def test_hybrid_shards_within_a_stages_replicas(text):
    plan = Plan.parse(text)
    replicas = plan.world // plan.pp
    assert plan.data_parallel_size == replicas  # every replica still takes its slice
    assert plan.shard_group_size == plan.hybrid  # one copy of the state per G ranks
    assert [pipeline_data_parallel.data_parallel_rank(plan, r) for r in range(plan.world)] \
        == [r // plan.pp for r in range(plan.world)]


@pytest.mark.parametrize("text, words", [
    ("pp=2,shard=zero3,hybrid=3,world=8",
     "hybrid=3 must divide the 4 data-parallel replicas of each stage"),
    ("pp=2,shard=zero1,hybrid=4,world=8",
     "more data-parallel replicas per stage than the group: with the 4"),
    ("pp=2,shard=zero2,hybrid=2,world=6", "hybrid=2 must divide the 3 data-parallel replicas"),
    ("pp=2,shard=ddp,hybrid=2,world=8", "it needs shard=zero1, zero2 or zero3"),
    ("pp=2,shard=zero3,hybrid=2,world=2", "world must be a multiple of 2 with at least 2"),
    ("pp=2,tp=2,shard=zero3,hybrid=2,world=16", "tp=2 with hybrid=2 is not supported yet"),
])
def test_impossible_pp_hybrid_plans_are_refused_in_one_line(text, words):
    with pytest.raises(PlanError, match=words) as caught:
        Plan.parse(text)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_pp_with_hybrid_on_eight_ranks_trains_as_the_unmodified_run(tmp_path):
    """2 stages x 4 replicas of each, the replicas in 2 groups of 2 (gloo, 8 processes):
    zero3 reduce-scatters each stage's gradients over its group's 2 ranks and all-reduces
    the shards over the 2 groups (HSDP), zero1 averages them over the 4 replicas and steps
    each group's optimizer state in 2 shards -- the same math in 4 replicas x M parts.
    gpt_lm clips the gradient norm (about 1.4 against its max_norm 1.0): FSDP's shards'
    squares are summed over the shard group only.  AdamW is blind to a gradient scale the
    same on every step, so a norm counting each square once per replica group passes under
    it (measured); the SGD run (against ``optimizer=sgd`` in one process) is not, and
    catches it."""
    jobs = [(GPT, "pp=2,shard=zero3,hybrid=2,world=8", GPT4_ARGS),
            (GPT, "pp=2,shard=zero1,hybrid=2,world=8", GPT4_ARGS),
            (GPT, "pp=2,shard=zero3,hybrid=2,world=8,optimizer=sgd", SGD_ARGS)]
    results = run_distributed(jobs, 8, tmp_path, timeout_s=900)
    original = run_original(GPT, GPT4_ARGS)
    sgd = run_applied(GPT, "optimizer=sgd", SGD_ARGS, tmp_path)
    for (_, plan, _), params in zip(jobs, results):
        reference = sgd if "sgd" in plan else original
        parts = Plan.parse(plan).pipeline_microbatches * 4
        assert same_math_error(params, reference, parts) <= 1, \
            (plan, relative_error(params, reference))
