"""``advise`` proposes pipeline-parallel plans where the model has a stack of repeated blocks
to cut, ranked beside the ZeRO/FSDP and tp plans by the same objective (a few per degree
chosen from their twins' fast-pass figures, replayed exactly), their step time stretched by
the bubble."""
import json
import os

import pytest

from .cli_runs import ROOT, run_cli
from memadvisor.cli import main
from memadvisor.plan import Plan
from memadvisor.simulate import hardware, prepare, simulate
from memadvisor.simulate.candidates import (EXACT_PER_DEGREE, candidate_plans, estimated,
                                            pipeline_parallel_candidates, rank_key)
from memadvisor.simulate.ranking import price_plans, rank
from memadvisor.simulate.search import advise
from memadvisor.trace.io import read_trace

GPT = os.path.join(ROOT, "examples", "gpt_lm.py")
#: 4 blocks (pp=2 and pp=4 can cut them), batch 8, on the CPU: a stage of pp=2 holds half
#: the blocks' state and, under 1F1B with M=8, 2 micro-batches of 1 sample in flight
GPT_ARGS = ["--n-layer", "4", "--d-model", "64", "--batch-size", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp_search") / "gpt4.trace"
    run_cli("profile", GPT, "-o", path, "--steps", "3", "-q", "--", *GPT_ARGS)
    return str(path)


@pytest.fixture(scope="module")
def base(trace_path):
    return prepare(read_trace(trace_path))


def _pp(predictions):
    return [p for p in predictions if p.plan.pp > 1]


def _only_pipelining_fits(base, hw, gpus):
    """The usable bytes just under every plan without pp (tp's included): the leanest pp
    plan must be below them for the test to mean anything.  (``memory``: under the other
    objectives a budget every plan fits leaves pp unreplayed, test below.)"""
    every = advise(base, hw, 1 << 40, gpus, margin=0.0, top=100_000, objective="memory")
    others = min(p.peak_bytes for p in every.ranked if p.plan.pp == 1)
    leanest = min(p.peak_bytes for p in _pp(every.ranked))
    assert leanest < others, (leanest, others)
    return others - 1


def test_a_pp_plan_fits_where_no_plan_without_pp_does(base):
    hw = hardware("cpu")
    usable = _only_pipelining_fits(base, hw, 2)
    result = advise(base, hw, usable, 2, margin=0.0)
    plain = candidate_plans(base, 2, set(), hw)
    # one degree of each kind (tp=2, pp=2): EXACT_PER_DEGREE of each replayed
    assert result.evaluated == len(plain) + 2 * EXACT_PER_DEGREE
    assert result.ranked and all(p.plan.pp == 2 and p.plan.world == 2 for p in result.ranked)
    best = result.ranked[0]
    assert best.plan.schedule == "1f1b" and best.plan.microbatches in (2, 4, 8)
    # the figures advise ranks by are simulate's for the same plan: the worst stage's peak
    exact = simulate(base, best.plan, hw)
    assert best.peak_bytes == exact.peak_bytes <= usable
    assert best.peak_bytes == max(s["peak_bytes"] for s in
                                  exact.notes["pipeline_parallel"]["stages"])
    assert best.step_time_factor == pytest.approx(exact.step_time_factor)
    # its largest micro-batch: the worst stage's peak replayed (max_micro_batch knows no
    # stages), here as tight as the plan's own
    assert result.max_micro_batch[best.plan.to_compact()] == best.micro_batch_size


def test_a_pp_plans_largest_micro_batch_is_its_worst_stages(base):
    hw = hardware("cpu")
    usable = 4_000_000  # about 1.5x the leanest pp plan's 2.5 MB
    result = advise(base, hw, usable, 2, margin=0.0, objective="memory")
    pipelined = [p.plan for p in _pp(result.ranked[:3])]
    assert pipelined
    for plan in pipelined:
        size = result.max_micro_batch[plan.to_compact()]
        assert size > plan.micro_batch_size(base.batch_size)
        assert simulate(base, plan, hw, micro_batch=size).peak_bytes <= usable
        assert simulate(base, plan, hw, micro_batch=size + 1).peak_bytes > usable


def test_the_step_time_holds_the_bubble(base):
    hw = hardware("cpu")
    result = advise(base, hw, 1 << 40, 2, top=100_000)
    for prediction in _pp(result.ranked):
        plan, cost = prediction.plan, prediction.cost
        stretch = 1 - (plan.pp - 1) / (plan.pipeline_microbatches + plan.pp - 1)
        bubble = [s for what, s in cost.terms if what.startswith(f"pp={plan.pp}: each rank "
                                                                  "idle for the bubble")]
        sends = [s for what, s in cost.terms if "between stages" in what]
        assert len(bubble) == len(sends) == 1 and bubble[0] > 0
        compute = cost.step_time_s - bubble[0] - sends[0]
        # (M + P - 1) / M of the work split over the world's ranks
        assert compute + bubble[0] == pytest.approx(compute / stretch)
    # one objective: GPU-time per step, the bubble included
    costs = [round(round(p.step_time_factor, 4) * p.plan.world, 3) for p in result.ranked]
    assert costs == sorted(costs)


def test_twins_place_a_pipeline_by_its_bubble(base):
    # the same twin figures: M = 4P ranks before M = P (a smaller bubble), by every objective
    # that weighs time
    hw = hardware("cpu")
    twin = simulate(base, Plan.parse("accum=8"), hw)
    short, long = Plan.parse("pp=2,microbatches=2"), Plan.parse("pp=2,microbatches=8")
    for objective in ("cost", "speed"):
        key = rank_key(objective)
        assert key(estimated(long, twin)) < key(estimated(short, twin))
    assert estimated(short, twin).step_time_factor == pytest.approx(
        twin.step_time_factor * 3 / 2)  # (M + P - 1) / M at P = M = 2
    assert estimated(Plan.parse("tp=2,world=2"), twin) is twin


def test_pp_plans_rank_beside_zero_and_tp(base):
    hw = hardware("h100-80gb")
    result = advise(base, hw, 10 << 30, 4, top=1000)
    pp = _pp(result.ranked)
    # degrees 2 (two pipelines side by side, sharded) and 4 (one pipeline), beside tp;
    # and pp=2 x tp=2 (one pipeline of tp-split stages)
    assert {(p.plan.pp, p.plan.tp, p.plan.world, p.plan.shard == "none") for p in pp} == {
        (2, 1, 4, False), (4, 1, 4, True), (2, 2, 4, True)}
    assert 0 < len(pp) <= 3 * EXACT_PER_DEGREE
    assert any(p.plan.tp > 1 for p in result.ranked)
    # the dashboard's ranking is advise's, pp plans included
    once = rank(price_plans(base, hw, 4), 10 << 30, top=1000)
    assert [p.plan.to_compact() for p in once.ranked] == [
        p.plan.to_compact() for p in result.ranked]


def test_candidates_follow_the_gpus_and_the_blocks(base):
    hw = hardware("cpu")
    assert pipeline_parallel_candidates(base, 1, set(), hw) == []

    def layouts(gpus):
        return {(p.pp, p.world, p.shard, p.schedule) for p, _ in
                pipeline_parallel_candidates(base, gpus, set(), hw)}
    assert layouts(2) == {(2, 2, "none", "1f1b")}
    # pp=8 would need 8 blocks; the model has 4
    shards = ("ddp", "zero1", "zero2", "zero3")
    assert layouts(8) == {(p, 8, s, "1f1b") for p in (2, 4) for s in shards}
    # each twin: the plan without pp on GPUs / P ranks, its micro-batch as accumulation
    for plan, twin in pipeline_parallel_candidates(base, 8, set(), hw):
        assert (twin.world, twin.accum, twin.shard, twin.pp) == (
            8 // plan.pp, plan.microbatches, plan.shard, 1)
        assert plan.micro_batch_size(8) == twin.micro_batch_size(8)


def test_no_pp_plan_without_blocks_or_with_one_gpu(trace_path, base):
    trace = read_trace(trace_path)
    # the same trace, each block now of its own class: no stack of repeated blocks
    trace.meta.modules = [dict(m, type=f"Block{m['path']}") if m["type"] == "Block" else m
                          for m in trace.meta.modules]
    no_blocks = prepare(trace)
    hw = hardware("cpu")
    assert no_blocks.blocks == [] and pipeline_parallel_candidates(no_blocks, 4, set(),
                                                                   hw) == []
    result = advise(no_blocks, hw, 1 << 40, 4, top=1000)
    assert not _pp(result.ranked + result.too_big)
    one = advise(base, hw, 1 << 40, 1, top=1000)
    assert one.evaluated == len(candidate_plans(base, 1, set(), hw))
    assert not _pp(one.ranked + one.too_big)


def test_advise_shows_a_pp_plan_with_its_stages(trace_path, base, capsys):
    usable = _only_pipelining_fits(base, hardware("cpu"), 2)
    argv = ["advise", trace_path, "--budget", f"{usable}B", "--gpus", "2", "--margin", "0"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.strip().startswith("1 ")]
    assert rows and "pp=2" in rows[0]
    assert "stage 0 (blocks 0-1, " in text and "stage 1 (blocks 2-3, 1 in flight)" in text
    assert "pipeline parallel over 2 stages (1f1b" in text
    # the terms shown are one micro-step's: the line after them says what the peak adds
    assert "(the terms are stage 0's one micro-step" in text and "in flight (" in text
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["plans"][data["best"]]
    assert best["plan"]["pp"] == 2
    stages = best["pipeline_stages"]
    assert [s["blocks"] for s in stages] == [[0, 1], [2, 3]]
    assert best["peak_bytes"] == max(s["peak_bytes"] for s in stages) <= usable


def test_model_parallel_is_not_replayed_where_a_plan_that_surely_fits_wins(base, monkeypatch):
    """A budget every plan fits, ``speed``: the plans shown fit with room without model
    parallelism and rank above what the tp / pp twins estimate, so no tp or pp plan is
    replayed (each replay costs what a fast pass of hundreds of plans does: on the
    1M-event benchmark trace the model-parallel part went 0.94 -> 0.22 CPU s), and what
    is shown is what pricing every plan (the dashboard's way) shows; under ``memory``
    they are replayed and lead."""
    hw = hardware("cpu")
    plain = len(candidate_plans(base, 2, set(), hw))
    from memadvisor.simulate import search
    replayed = []

    def recording(base, plan, *args, **kwargs):
        replayed.append(plan)
        return simulate(base, plan, *args, **kwargs)
    monkeypatch.setattr(search, "simulate", recording)
    roomy = advise(base, hw, 1 << 40, 2, margin=0.0, top=3, objective="speed")
    assert not [p for p in replayed if p.tp > 1 or p.pp > 1]
    monkeypatch.undo()
    every = rank(price_plans(base, hw, 2, objective="speed"), 1 << 40, margin=0.0, top=3)
    assert [p.plan.to_compact() for p in roomy.ranked] == [
        p.plan.to_compact() for p in every.ranked]
    # the plans ruled out count as evaluated (by their twins), as the dashboard counts them
    assert roomy.evaluated == every.evaluated > plain
    lean = advise(base, hw, 1 << 40, 2, margin=0.0, top=3, objective="memory")
    assert lean.evaluated > plain and lean.ranked[0].plan.pp > 1


def test_three_dimensional_plans_are_proposed_and_priced_as_simulate_does(base):
    """On 4 GPUs pp x tp (a pipeline of tp-split stages) is a candidate beside pp and tp
    alone; under ``memory`` it is the leanest here (gpt_lm 4 layers: pp=2,tp=2, amp-bf16,
    checkpointing, M=8: 1,802,403 B against pp=4's 1,888,961 B), its figure simulate's."""
    hw = hardware("cpu")
    result = advise(base, hw, 1 << 40, 4, margin=0.0, top=10, objective="memory")
    both = [p for p in result.ranked if p.plan.pp > 1 and p.plan.tp > 1]
    assert both and result.ranked[0] is both[0]
    exact = simulate(base, both[0].plan, hw)
    assert both[0].peak_bytes == exact.peak_bytes
