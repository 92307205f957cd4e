"""pp=P predicted per stage (simulate/pipeline_parallel.py) from an unmodified trace: the
stage's model state, in-flight micro-batches under each schedule, the bubble in the step
time, and the per-rank peaks against ``apply --plan pp=2 --profile``."""
import os

import pytest

from .cli_runs import ROOT, check_stages_against_apply_profile, run_cli
from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.simulate import pipeline_parallel
from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.simulator import quick_simulate
from memadvisor.trace.analysis import analysed_step
from memadvisor.trace.io import read_trace

GPT = os.path.join(ROOT, "examples", "gpt_lm.py")
GPT_ARGS = ["--n-layer", "2", "--d-model", "64", "--batch-size", "8", "--device", "cpu"]
LLAMA = os.path.join(ROOT, "zoo", "llama_decoder.py")
LLAMA_ARGS = ["--batch-size", "8", "--steps", "5"]
GPT4_ARGS = [*GPT_ARGS, "--n-layer", "4"]
#: the issue's target for the analytic prediction against the measured per-rank peak
ANALYTIC_TARGET = 0.05


_cli = run_cli


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp")
    path = folder / "gpt.trace"
    _cli("profile", GPT, "-o", path, "--steps", "3", "--", *GPT_ARGS)
    return read_trace(str(path)), folder


@pytest.fixture(scope="module")
def gpt4(tmp_path_factory):
    """gpt_lm with 4 layers: pp=2 x 2 stages per rank (schedule=interleaved)."""
    folder = tmp_path_factory.mktemp("pp_interleaved")
    path = folder / "gpt4.trace"
    _cli("profile", GPT, "-o", path, "--steps", "3", "--", *GPT4_ARGS)
    return read_trace(str(path)), folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The zoo's Llama-style decoder, whose script computes the loss from the logits."""
    folder = tmp_path_factory.mktemp("pp_llama")
    path = folder / "llama.trace"
    _cli("profile", LLAMA, "-o", path, "--steps", "3", "--", *LLAMA_ARGS)
    return read_trace(str(path)), folder


def _measured_against_predicted(script, args, base_trace, folder, plan):
    """(stage, predicted, measured) per stage: ``apply --plan PLAN --profile`` against the
    prediction from the unmodified trace."""
    tag = plan.replace("=", "").replace(",", "_")
    measured_path = folder / f"{tag}.trace"
    _cli("apply", script, "--plan", plan, "-o", folder / f"{tag}.py", "-q",
         "--profile", measured_path, "--profile-steps", "3", "--", *args)
    stages = simulate(prepare(base_trace), Plan.parse(plan)).notes["pipeline_parallel"]["stages"]
    paths = [measured_path] + [folder / f"{tag}.rank{r}.trace" for r in range(1, len(stages))]
    found = []
    for stage, path in zip(stages, paths):
        measured_trace = read_trace(str(path))
        measured = measured_trace.meta.steps[analysed_step(measured_trace)]["peak_bytes"]
        found.append((stage["stage"], stage["peak_bytes"], measured))
    return found


def test_the_script_held_output_and_the_p2p_buffers_per_stage(llama):
    """llama_decoder's script holds ``logits`` past the forward (and the previous step's until
    the next forward); under pp it gets the step's loss only, the logits dying in the last
    stage's loss function.  PipelineStage keeps one receive buffer per micro-batch."""
    trace, _ = llama
    base = prepare(trace)
    notes = simulate(base, Plan.parse("pp=2,world=2,microbatches=4")).notes["pipeline_parallel"]
    # one micro-batch's logits, 2 x 32 tokens x 128 vocabulary in fp32, and its 0-dim loss
    # (the script is handed a mean made after the schedule instead)
    assert notes["script_held_output_bytes"] == 2 * 32 * 128 * 4 + 4
    stream = notes["stream_bytes"]
    assert stream == 2 * 32 * 64 * 4
    assert [s["p2p_buffer_bytes"] for s in notes["stages"]] == [4 * stream, 5 * stream]


def test_a_tied_embedding_heads_gradient_is_on_both_end_stages(gpt, llama):
    """gpt_lm ties lm_head to tok_emb: under pp the last stage's head makes that gradient
    too (the trace has one, after the embedding's backward); llama_decoder ties nothing."""
    plan = Plan.parse("pp=2,world=2")
    tied = simulate(prepare(gpt[0]), plan).notes["pipeline_parallel"]["tied_gradient_bytes"]
    assert tied == 256 * 64 * 4  # vocabulary x d_model, fp32
    untied = simulate(prepare(llama[0]), plan).notes["pipeline_parallel"]
    assert untied["tied_gradient_bytes"] == 0


def test_simulate_reports_every_stage(llama):
    """``simulate --plan pp=...``: the peak is the worst stage's; JSON and text carry each."""
    from memadvisor.simulate.output import simulate_dict, simulate_text
    trace, _ = llama
    base = prepare(trace)
    hw = hardware(None, base.meta.device)
    data = simulate_dict(base, simulate(base, Plan.parse("pp=2,world=2"), hw), hw)
    stages = data["pipeline_stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert data["peak_bytes"] == max(s["peak_bytes"] for s in stages)
    text = simulate_text(data)
    assert "stage 1 (blocks 1, 1 in flight): " in text
    assert f"({stages[1]['peak_bytes']:,} B)" in text
    plain = simulate_dict(base, simulate(base, Plan.parse("shard=zero2,world=2"), hw), hw)
    assert plain["pipeline_stages"] is None


def test_schedule_rules():
    one_f_one_b = Plan.parse("pp=4,world=4,microbatches=8")
    assert [pipeline_parallel.in_flight_micro_batches(one_f_one_b, s) for s in range(4)] == \
        [4, 3, 2, 1]  # stage 0 holds the most
    gpipe = Plan.parse("pp=4,world=4,schedule=gpipe,microbatches=8")
    assert [pipeline_parallel.in_flight_micro_batches(gpipe, s) for s in range(4)] == [8] * 4
    assert pipeline_parallel.bubble_fraction(one_f_one_b) == pytest.approx(3 / 11)
    assert pipeline_parallel.bubble_fraction(Plan()) == 0.0
    assert pipeline_parallel.stage_ranges(5, 2) == [range(0, 3), range(3, 5)]


def test_each_stage_holds_its_blocks_state_and_the_layers_outside_the_stack(gpt):
    trace, _ = gpt
    base = prepare(trace)
    unmodified = simulate(base, Plan())
    prediction = simulate(base, Plan.parse("pp=2,world=2"))
    stages = prediction.notes["pipeline_parallel"]["stages"]
    share = 1.0 - sum(base.block_parameter_fraction.values()) \
        + base.block_parameter_fraction["blocks.0"]
    parameters = unmodified.by_category["parameter"]
    # gpt_lm at these sizes: 474,112 B of parameters, each block 42% of them
    assert parameters == 474_112
    assert stages[0]["by_category"]["parameter"] == pytest.approx(parameters * share, abs=1)
    assert [s["blocks"] for s in stages] == [[0, 0], [1, 1]]
    assert [s["in_flight_micro_batches"] for s in stages] == [2, 1]
    assert prediction.peak_bytes == max(s["peak_bytes"] for s in stages)
    assert prediction.micro_batch_size == 4  # B / M
    # stream between stages: micro-batch 4 x 32 tokens x 64 fp32
    assert prediction.notes["pipeline_parallel"]["stream_bytes"] == 4 * 32 * 64 * 4
    assert any("bubble" in what and seconds > 0 for what, seconds in prediction.cost.terms)


def test_gpipe_holds_more_micro_batches_than_1f1b_on_the_first_stage(gpt):
    trace, _ = gpt
    base = prepare(trace)
    gpipe = simulate(base, Plan.parse("pp=2,world=2,schedule=gpipe,microbatches=4"))
    one_f = simulate(base, Plan.parse("pp=2,world=2,microbatches=4"))
    g0, f0 = (p.notes["pipeline_parallel"]["stages"][0] for p in (gpipe, one_f))
    assert (g0["in_flight_micro_batches"], f0["in_flight_micro_batches"]) == (4, 2)
    assert g0["peak_bytes"] > f0["peak_bytes"]


def test_pp_is_replayed_not_bounded(gpt):
    trace, _ = gpt
    base = prepare(trace)
    assert quick_simulate(base, Plan.parse("pp=2,world=2"), hardware(None, base.meta.device),
                          {}, {}) is None


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["pp=2,world=2", "pp=2,world=2,schedule=gpipe,microbatches=4"])
def test_predicted_peak_per_stage_against_apply_profile(gpt, plan):
    trace, folder = gpt
    for stage, predicted, measured in _measured_against_predicted(
            GPT, [*GPT_ARGS, "--steps", "5"], trace, folder, plan):
        assert abs(predicted - measured) / measured <= ANALYTIC_TARGET, \
            (plan, stage, predicted, measured)


#: the loss computed by the script (the pipeline's loss function on the last stage)
@pytest.mark.slow
@pytest.mark.parametrize("plan", ["pp=2,world=2", "pp=2,world=2,microbatches=4",
                                  "pp=2,world=2,schedule=gpipe,microbatches=4"])
def test_llama_predicted_peak_per_stage_against_apply_profile(llama, plan):
    trace, folder = llama
    for stage, predicted, measured in _measured_against_predicted(
            LLAMA, LLAMA_ARGS, trace, folder, plan):
        assert abs(predicted - measured) / measured <= ANALYTIC_TARGET, \
            (plan, stage, predicted, measured)


def test_interleaved_rank_holds_its_stages_and_their_micro_batches_in_flight(gpt4):
    """pp=2 x 2 stages per rank over 4 blocks: rank 0 holds stages 0 and 2; at its peak
    (the second backward of stage 0, M=4) torch's order has 3 micro-batches in flight on
    stage 0 and 2 on stage 2 (``apply --profile`` shows the same: blocks.0's activations 3x,
    blocks.2's 2x); the bubble (P-1)/(VM+P-1)."""
    trace, _ = gpt4
    base = prepare(trace)
    prediction = simulate(base, Plan.parse("pp=2,schedule=interleaved,microbatches=4"))
    notes = prediction.notes["pipeline_parallel"]
    rank0, rank1 = notes["stages"]
    assert (rank0["stages"], rank0["stage_blocks"]) == ([0, 2], [[0, 0], [2, 2]])
    assert (rank1["stages"], rank1["stage_blocks"]) == ([1, 3], [[1, 1], [3, 3]])
    assert rank0["in_flight_at_peak"] == [3, 2]
    assert notes["bubble_fraction"] == pytest.approx(1 / 9)
    # both ranks hold half the blocks and every layer outside the stack
    share = 1.0 - sum(base.block_parameter_fraction.values()) \
        + base.block_parameter_fraction["blocks.0"] + base.block_parameter_fraction["blocks.2"]
    assert rank0["parameter_share"] == pytest.approx(share)
    assert prediction.peak_bytes == max(rank0["peak_bytes"], rank1["peak_bytes"])
    one_f = simulate(base, Plan.parse("pp=2,microbatches=4"))
    assert one_f.notes["pipeline_parallel"]["bubble_fraction"] == pytest.approx(1 / 5)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["pp=2,schedule=interleaved",
                                  "pp=2,schedule=interleaved,microbatches=4"])
def test_interleaved_predicted_peak_per_rank_against_apply_profile(gpt4, plan):
    trace, folder = gpt4
    for rank, predicted, measured in _measured_against_predicted(
            GPT, [*GPT4_ARGS, "--steps", "5"], trace, folder, plan):
        assert abs(predicted - measured) / measured <= ANALYTIC_TARGET, \
            (plan, rank, predicted, measured)


@pytest.mark.slow
@pytest.mark.parametrize("script, plan", [
    ("gpt4", "pp=2,tp=2,world=4"), ("gpt4", "pp=2,tp=2,schedule=interleaved"),
    ("gpt4", "pp=2,tp=2,shard=zero3,world=8"), ("llama", "pp=2,tp=2,world=4"),
    ("gpt4", "pp=2,shard=zero1,world=4"), ("llama", "pp=2,tp=2,sp"),
    ("gpt4", "pp=2,tp=2,sp,schedule=interleaved")])
def test_pp_composed_predicted_per_rank_against_apply_profile(script, plan, request):
    """pp x tp (a (dp, pp, tp) mesh), pp x zero1: each rank's measured peak against its
    stage's prediction, tensor parallelism's split applied to the timeline before the
    stages are cut; the tp ranks of one stage (and its FSDP replicas) measure the same
    (apply drains the gloo groups within a stage; zero1's replicas own different shares).
    Measured 2026-11-26: gpt_lm 4 layers +0.41/+0.44%, interleaved +0.39/+0.38%, zero3
    world=8 -0.06/+1.25%, llama -1.07/-0.01%, zero1 -0.05..+0.04% (before dropping DDP's
    bucket, which a pipeline does not make: +39.5% on stage 0); with sp (the stream between
    stages cut along the sequence) llama -2.62/-0.01%, gpt_lm interleaved -0.81/+0.41%."""
    trace, folder = request.getfixturevalue(script)
    path, args = (GPT, [*GPT4_ARGS, "--steps", "5"]) if script == "gpt4" else (LLAMA, LLAMA_ARGS)
    stages = simulate(prepare(trace), Plan.parse(plan)).notes["pipeline_parallel"]["stages"]
    check_stages_against_apply_profile(path, args, plan, stages, folder, ANALYTIC_TARGET)


def test_pp_with_ddp_predicts_each_replica_as_a_pipeline_on_its_slice(gpt):
    """pp=2,shard=ddp,world=4: each rank is the stage of a pipeline fed B / 2 samples; apply
    averages the gradients in place after the schedule, with no DDP gradient bucket (the
    row simulate/sharding.py adds for ddp is not counted)."""
    trace, _ = gpt
    base = prepare(trace)
    both = simulate(base, Plan.parse("pp=2,shard=ddp,world=4"))
    alone = simulate(base, Plan.parse("pp=2"), micro_batch=2)
    assert both.micro_batch_size == 2  # 8 samples / (2 replicas x 2 micro-batches)
    assert [s["peak_bytes"] for s in both.notes["pipeline_parallel"]["stages"]] == \
        [s["peak_bytes"] for s in alone.notes["pipeline_parallel"]["stages"]]


def test_interleaved_p2p_buffers_and_the_gradient_of_a_stage_output(gpt4):
    """Under interleaved every input gradient a stage sent back is among the sends held to
    the step's end: the receive side is M buffers per stage after the first (1f1b/gpipe add
    the input gradient sent back last); a stage before the last runs its backward from the
    gradient of its output (one stream), which no stage's rows hold."""
    trace, _ = gpt4
    base = prepare(trace)
    notes = simulate(base, Plan.parse("pp=2,schedule=interleaved")).notes["pipeline_parallel"]
    stream = notes["stream_bytes"]
    rank0, rank1 = notes["stages"]
    # rank 0: stage 2 receives M; stages 0 and 2 receive M output gradients each
    assert rank0["p2p_buffer_bytes"] == 3 * 2 * stream
    # rank 1: stages 1 and 3 receive M each; stage 1 receives M output gradients
    assert rank1["p2p_buffer_bytes"] == 3 * 2 * stream
    one_f = simulate(base, Plan.parse("pp=2")).notes["pipeline_parallel"]["stages"]
    assert one_f[0]["p2p_buffer_bytes"] == 2 * stream
    assert one_f[1]["p2p_buffer_bytes"] == (2 + 1) * stream


def test_data_parallel_traffic_under_pp_and_tp_is_a_ranks_share_over_its_replicas(gpt4):
    """Under pp / tp a rank all-reduces (or gathers) its own part of the model over its D
    replicas, not the whole model over the world: before, the ddp term of pp=2,shard=ddp,
    world=4 counted every gradient of the model, ring over 4."""
    from memadvisor.simulate.sharding import communication_bytes
    from memadvisor.simulate.simulator import _model_share
    trace, _ = gpt4
    base = prepare(trace)
    plan = Plan.parse("pp=2,shard=ddp,world=4")
    prediction = simulate(base, plan)
    share = _model_share(plan, prediction.notes)
    stages = prediction.notes["pipeline_parallel"]["stages"]
    assert share == max(s["parameter_share"] for s in stages) < 0.7
    gradients = 1000.0
    assert communication_bytes(plan, gradients, gradients) == 2 * gradients * (1 / 2)
    assert communication_bytes(Plan.parse("shard=ddp,world=4"), gradients, gradients) == \
        2 * gradients * (3 / 4)
    # FSDP's hooks run per pipeline micro-batch
    zero3 = Plan.parse("pp=2,shard=zero3,world=4,microbatches=4")
    assert communication_bytes(zero3, gradients, gradients) == \
        4 * communication_bytes(Plan.parse("shard=zero3,world=2"), gradients, gradients)
    tp = Plan.parse("tp=2,shard=zero3,world=4")
    tp_share = _model_share(tp, simulate(base, tp).notes)
    assert 0.5 <= tp_share < 0.75  # blocks and vocabulary split, norms and positions whole


def test_every_stage_holds_the_cuda_workspaces(gpt4):
    """cuBLAS's workspaces are the process's, made before the step and kept (rows outside any
    module, alive through the step): every stage's process has them.  Before, they were
    taken for rows made before the blocks (the embedding's) and given to stage 0 only:
    stage 1 of gpt_lm 4 layers on an H100 was predicted 2.7 MiB, executed 68.3 MiB."""
    trace, _ = gpt4
    stages = simulate(prepare(trace), Plan.parse("pp=2"), hardware("h100-80gb")).notes[
        "pipeline_parallel"]["stages"]
    assert all(stage["peak_bytes"] > 64 * 2**20 for stage in stages), stages


def test_simulate_text_names_each_interleaved_stage_of_a_rank(gpt4):
    """Under interleaved a rank holds stages r, r + P, ...: the text names each with its
    blocks (before: one span 'blocks 0-2', as if rank 0 held block 1 too)."""
    from memadvisor.simulate.output import simulate_dict, simulate_text
    trace, _ = gpt4
    base = prepare(trace)
    hw = hardware(None, base.meta.device)
    text = simulate_text(simulate_dict(
        base, simulate(base, Plan.parse("pp=2,schedule=interleaved"), hw), hw))
    assert "rank 0 (stages 0: blocks 0, 2: blocks 2; " in text
    assert "rank 1 (stages 1: blocks 1, 3: blocks 3; " in text
