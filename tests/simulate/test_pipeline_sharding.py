"""pp x zero2/zero3 per stage (simulate/pipeline_sharding.py): each stage gathers its own
blocks and the root (the layers outside the stack), a stage before the last keeps its last
block's all-gather buffer, and the per-rank peaks against ``apply --plan ... --profile``
on 4 gloo processes (2 pipelines x 2 replicas)."""
import os

import numpy as np
import pytest

from .cli_runs import ROOT, run_cli
from memadvisor.plan import Plan
from memadvisor.simulate import pipeline_sharding, prepare, simulate
from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.replay import CATEGORY_CODE
from memadvisor.simulate.simulator import transform
from memadvisor.trace import schema
from memadvisor.trace.analysis import analysed_step
from memadvisor.trace.io import read_trace

GPT = os.path.join(ROOT, "examples", "gpt_lm.py")
#: each replica's pipeline sees 8 samples, as the pp=2 runs of test_pipeline_parallel.py
GPT4_ARGS = ["--n-layer", "4", "--d-model", "64", "--batch-size", "16", "--device", "cpu"]
#: measured within 0.9% on every rank (docs/APPLY.md); held to 2%
TARGET = 0.02
_PARAMETER = CATEGORY_CODE[schema.PARAMETER]
_OTHER = CATEGORY_CODE[schema.OTHER]


@pytest.fixture(scope="module")
def gpt4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp_fsdp")
    path = folder / "gpt4.trace"
    run_cli("profile", GPT, "-o", path, "--steps", "3", "--", *GPT4_ARGS)
    return read_trace(str(path)), folder


def _stage_rows(base, shard: str, stage_blocks: list[int], is_last: bool):
    plan = Plan.parse(f"pp=2,shard={shard},world=4")
    timeline, *_ = transform(base, plan, hardware(None, base.meta.device))
    without, copies = pipeline_sharding.without_sharding_rows(timeline)
    rows = pipeline_sharding.stage_rows(without, shard, plan.shard_group_size, base.blocks,
                                        stage_blocks, base.block_parameter_fraction,
                                        {**copies, "held_until_next": False}, is_last)
    return timeline, without, rows


def test_a_stage_gathers_its_own_blocks_and_the_root(gpt4):
    """zero2 gathers each unit once (in forward, kept to its post-backward); zero3 once in
    forward and again in backward.  A stage's units are its blocks and the root: the whole
    model's parameters less the other stage's blocks."""
    trace, _ = gpt4
    base = prepare(trace)
    whole = float(base.timeline.size[base.timeline.category == _PARAMETER].sum())
    fraction = base.block_parameter_fraction
    outside = 1.0 - sum(fraction.values())
    for stage_blocks in ([0, 1], [2, 3]):
        expected = whole * (outside + sum(fraction[base.blocks[i]] for i in stage_blocks))
        for shard, gathers in (("zero2", 1), ("zero3", 2)):
            _, _, rows = _stage_rows(base, shard, stage_blocks, stage_blocks == [2, 3])
            gathered = rows["size"][rows["category"] == _PARAMETER].sum()
            assert gathered == pytest.approx(gathers * expected, rel=1e-3), (shard, stage_blocks)
    # the rows sharding.py placed for all four blocks are gone, nothing else
    timeline, without, _ = _stage_rows(base, "zero2", [0, 1], False)
    dropped = timeline.size - without.size
    assert dropped.sum() > 0
    assert set(np.unique(timeline.category[dropped > 0])) <= {_PARAMETER, _OTHER}
    assert timeline.size[timeline.category == CATEGORY_CODE[schema.ACTIVATION]].sum() == \
        without.size[without.category == CATEGORY_CODE[schema.ACTIVATION]].sum()


def test_a_stage_before_the_last_keeps_its_last_blocks_gather_buffer(gpt4):
    """The stage-stopping hook leaves the model's forward at the stage's last block, so the
    root's post-forward (which frees the last all-gather buffer) never runs there: the
    buffer (blocks.1's unsharded bytes) lives to the step's end; the last stage's forward
    completes and frees it."""
    trace, _ = gpt4
    base = prepare(trace)
    whole = float(base.timeline.size[base.timeline.category == _PARAMETER].sum())
    block_bytes = whole * base.block_parameter_fraction[base.blocks[1]]
    for shard in ("zero2", "zero3"):
        _, without, first = _stage_rows(base, shard, [0, 1], False)
        _, _, last = _stage_rows(base, shard, [2, 3], True)
        to_the_end = lambda rows: rows["size"][(rows["free_key"] >= without.n_events)
                                               & (rows["category"] == _OTHER)]
        assert to_the_end(first).tolist() == pytest.approx([block_bytes], rel=1e-3)
        assert not len(to_the_end(last))


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["zero2", "zero3"])
def test_pp_with_fsdp_predicted_per_rank_against_apply_profile(gpt4, shard):
    """Every rank of pp=2,shard=zeroN,world=4 against its own measured peak (before the
    per-stage rows: zero2 -10.4% / +4.3%, zero3 -14.6% / +2.6%)."""
    trace, folder = gpt4
    plan = f"pp=2,shard={shard},world=4"
    measured_path = folder / f"{shard}.trace"
    run_cli("apply", GPT, "--plan", plan, "-o", folder / f"{shard}.py", "-q",
            "--profile", measured_path, "--profile-steps", "3", "--", *GPT4_ARGS,
            "--steps", "5", timeout=600)
    stages = simulate(prepare(trace), Plan.parse(plan)).notes["pipeline_parallel"]["stages"]
    measured = []
    for rank in range(4):
        path = measured_path if rank == 0 else folder / f"{shard}.rank{rank}.trace"
        measured_trace = read_trace(str(path))
        measured.append(measured_trace.meta.steps[analysed_step(measured_trace)]["peak_bytes"])
    # apply drains the gloo groups within a stage (apply/gloo_release.py): the replicas of a
    # stage free FSDP's buffers at the same point, and the prompt figure is what they measure
    assert measured[0] == measured[2] and measured[1] == measured[3], (shard, measured)
    for rank in range(4):
        predicted = stages[rank % 2]["peak_bytes"]
        assert abs(predicted - measured[rank]) / measured[rank] <= TARGET, (
            shard, rank, predicted, measured[rank])
