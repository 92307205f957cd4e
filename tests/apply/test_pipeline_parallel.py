"""pp=P: the plan knobs, how the block stack is cut, what is refused, and runs on 2 CPU
ranks (gloo) compared with the unmodified single-process run."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from apply_runs import REPO, relative_error, run_distributed, run_original, same_math_error
from memadvisor.apply import pipeline_data_parallel, pipeline_parallel
from memadvisor.plan import Plan, PlanError

GPT = REPO / "examples" / "gpt_lm.py"
GPT_ARGS = ["--steps", "3", "--batch-size", "8", "--log-every", "100"]


# --- the plan ------------------------------------------------------------------------------
def test_pp_knobs_parse_default_and_round_trip():
    plan = Plan.parse("pp=2,world=2")
    assert (plan.pp, plan.schedule, plan.pipeline_microbatches) == (2, "1f1b", 2)
    assert plan.data_parallel_size == 1
    assert plan.micro_batch_size(8) == 4  # one pipeline micro-batch: B / M
    gpipe = Plan.parse("pp=2,world=2,schedule=gpipe,microbatches=4")
    assert Plan.parse(gpipe.to_compact()) == gpipe
    assert gpipe.to_compact() == "world=2,pp=2,schedule=gpipe,microbatches=4"
    assert Plan.from_dict(gpipe.to_dict()) == gpipe
    assert gpipe.micro_batch_size(8) == 2


def test_interleaved_knobs_default_to_two_stages_per_rank():
    plan = Plan.parse("pp=2,schedule=interleaved")
    assert (plan.world, plan.pipeline_stages_per_rank, plan.pipeline_stages) == (2, 2, 4)
    assert plan.pipeline_microbatches == 2 and plan.micro_batch_size(8) == 4
    three = Plan.parse("pp=2,schedule=interleaved,stages_per_rank=3,microbatches=4")
    assert three.pipeline_stages == 6
    assert Plan.parse(three.to_compact()) == three
    assert three.to_compact() == "world=2,pp=2,schedule=interleaved,microbatches=4,stages_per_rank=3"
    # torch's ScheduleInterleaved1F1B runs max(1, M // P) rounds, which must divide M
    assert Plan.parse("pp=2,schedule=interleaved,microbatches=3").pipeline_microbatches == 3
    assert Plan.parse("pp=2,world=2").pipeline_stages_per_rank == 1


@pytest.mark.parametrize("text, words", [
    ("pp=2,world=2,stages_per_rank=2", "stages_per_rank=2 needs schedule=interleaved"),
    ("pp=2,schedule=interleaved,stages_per_rank=1", "stages_per_rank=1 is schedule=1f1b"),
    ("pp=2,schedule=interleaved,microbatches=5", "2 rounds of micro-batches, which must divide"),
    ("stages_per_rank=2", "add pp=2"),
    ("pp=2,world=2,schedule=zigzag", "schedule must be one of"),
    ("pp=2,world=2,microbatches=1", "needs at least 2 micro-batches"),
    ("pp=2,world=4", "world must equal pp"),
    ("pp=2,world=2,accum=2", "microbatches=4 instead of accum=2"),
    ("pp=2,tp=2,world=8", "world must equal pp x tp = 4"),
    ("pp=2,tp=2,shard=ddp,world=4", "world must be a multiple of 4 with at least 2 of them"),
    ("pp=2,tp=2,shard=zero1,world=8", "shard=zero1 is not supported"),
    ("pp=2,world=4,shard=zero3,schedule=interleaved", "interleaved is not supported yet"),
    ("pp=2,world=2,shard=zero2", "world must be a multiple of 2 with at least 2 of them"),
    ("pp=2,world=2,shard=ddp", "world must be a multiple of 2 with at least 2 of them"),
    ("pp=2,world=6,shard=ddp,hybrid=2", "it needs shard=zero1, zero2 or zero3"),
    ("pp=2,world=12,shard=zero3,hybrid=4", "must divide the 6 data-parallel replicas of each"),
    ("schedule=gpipe", "add pp=2"),
    ("microbatches=4", "add pp=2"),
    ("pp=0", "at least 1"),
])
def test_impossible_pp_plans_are_refused_in_one_line(text, words):
    with pytest.raises(PlanError, match=words) as caught:
        Plan.parse(text)
    assert "\n" not in str(caught.value)


def test_pp_with_ddp_runs_pipelines_side_by_side():
    """pp=2,shard=ddp,world=4: 2 pipelines of 2 stages; consecutive ranks are one pipeline,
    replica d takes the slice d of the batch (B / 2), which its pipeline cuts into M."""
    plan = Plan.parse("pp=2,shard=ddp,world=4")
    assert (plan.data_parallel_size, plan.pipeline_microbatches) == (2, 2)
    assert plan.micro_batch_size(16) == 4  # B / (replicas x M) per pipeline micro-batch
    assert [pipeline_data_parallel.pipeline_rank(plan, r) for r in range(4)] == [0, 1, 0, 1]
    assert [pipeline_data_parallel.data_parallel_rank(plan, r) for r in range(4)] == \
        [0, 0, 1, 1]
    split, replica = pipeline_data_parallel.batch_split(plan, 3)
    assert (split.data_parallel_size, split.micro_batch_size(16), replica) == (2, 8, 1)
    alone, _ = pipeline_data_parallel.batch_split(Plan.parse("pp=2"), 1)
    assert alone.data_parallel_size == 1  # a pipeline alone: every rank the whole batch


def test_a_batch_the_micro_batches_do_not_divide_is_refused():
    with pytest.raises(PlanError, match="multiple of 4"):
        Plan.parse("pp=2,world=2,microbatches=4").micro_batch_size(6)


def test_bad_pp_plan_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "apply", str(GPT), "--plan",
                           "pp=2,world=3", "--dry-run"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert "world must equal pp" in done.stderr and "Traceback" not in done.stderr


# --- how the stack is cut -------------------------------------------------------------------
def test_stage_ranges_are_contiguous_and_balanced():
    assert pipeline_parallel.stage_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert pipeline_parallel.stage_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert pipeline_parallel.stage_ranges(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(PlanError, match="at least 4 repeated blocks"):
        pipeline_parallel.stage_ranges(3, 4)


def test_an_interleaved_rank_holds_stages_r_and_r_plus_p():
    """pp=2 x 2 stages per rank over 4 blocks: rank 0 holds stages 0 and 2 (blocks 0, 2), as
    torch's loop-style placement puts stage s on rank s % P."""
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters())
    plan = Plan.parse("pp=2,schedule=interleaved")
    stage = pipeline_parallel.apply_pipeline(model, optimizer, plan, 0, "cpu")
    names = {n for n, _ in model.named_parameters()}
    assert {"blocks.0.fc.weight", "blocks.2.fc.weight"} <= names
    assert not any(n.startswith(("blocks.1.", "blocks.3.")) for n in names)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(names)
    assert stage.stage_indices == [0, 2] and stage.chunks == [range(0, 1), range(2, 3)]
    assert "rank 0 of 2: stages 0 (blocks 0), 2 (blocks 2) of 4" in \
        pipeline_parallel.describe(stage)


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Model(nn.Module):
    """embed -> blocks -> head; ``between`` changes the stream between blocks, ``loss`` says
    whether the forward returns its loss."""

    def __init__(self, between=False, loss=True):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 16)
        self.between, self.loss = between, loss

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
            if self.between:
                x = x * 0.5
        logits = self.head(x)
        if not self.loss:
            return logits
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _stage(model, rank=1):
    optimizer = torch.optim.AdamW(model.parameters())
    plan = Plan.parse("pp=2,world=2")
    return pipeline_parallel.apply_pipeline(model, optimizer, plan, rank, "cpu"), optimizer


def test_a_stage_keeps_its_blocks_and_the_layers_outside_the_stack():
    model = Model()
    stage, optimizer = _stage(model, rank=1)
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.startswith(("blocks.0.", "blocks.1.")) for n in names)
    assert {"blocks.2.fc.weight", "blocks.3.fc.weight", "embed.weight", "head.weight"} <= names
    held = sum(len(g["params"]) for g in optimizer.param_groups)
    assert held == len(names) == 2 * 2 + 1 + 2  # two blocks' weight+bias, embed, head w+b
    assert "stage 1 of 2 (blocks 2-3 of 4, 1f1b, 2 micro-batches)" in \
        pipeline_parallel.describe(stage)


@pytest.mark.parametrize("model, words", [
    (Model(between=True), "does more than embed -> blocks -> head"),
    (Model(loss=False), "output holds no loss"),
])
def test_a_forward_that_cannot_be_cut_is_refused_on_the_first_batch(model, words):
    stage, _ = _stage(model, rank=0)
    idx = torch.randint(16, (4, 5))
    with pytest.raises(PlanError, match=words):
        stage(idx, idx)


def test_argument_without_the_batch_dimension_is_refused():
    stage, _ = _stage(Model(), rank=0)
    with pytest.raises(PlanError, match="not a batch of 4 first"):
        stage(torch.randint(16, (4, 5)), torch.randint(16, (5,)))


def test_an_evaluation_call_without_gradients_is_refused():
    stage, _ = _stage(Model(), rank=0)
    idx = torch.randint(16, (4, 5))
    with torch.no_grad(), pytest.raises(PlanError, match="without gradients"):
        stage(idx, idx)


# --- runs on two ranks ----------------------------------------------------------------------
#: A pipeline sums each parameter's gradient over M micro-batches (scaled by 1/M), and the
#: layers outside the stack add two stages' gradients with gloo: the same math as the
#: unmodified step in another order, M parts (apply_runs.reorder_tolerance).
@pytest.mark.slow
def test_pp2_on_two_ranks_trains_as_the_unmodified_run(tmp_path):
    jobs = [(GPT, "pp=2,world=2", GPT_ARGS),
            (GPT, "pp=2,world=2,schedule=gpipe,microbatches=4", GPT_ARGS),
            (GPT, "pp=2,world=2,checkpoint=auto", GPT_ARGS),
            (GPT, "pp=2,world=2,precision=amp-bf16", GPT_ARGS)]
    results = run_distributed(jobs, 2, tmp_path)
    original = run_original(GPT, GPT_ARGS)
    for (_, plan, _), params in zip(jobs, results):
        if "amp-bf16" in plan:
            # bf16 matmuls: the tolerance of the single-process amp-bf16 runs (test_equivalence)
            assert relative_error(params, original) <= 1e-2, plan
            continue
        parts = Plan.parse(plan).pipeline_microbatches
        assert same_math_error(params, original, parts) <= 1, \
            (plan, relative_error(params, original))


#: interleaved needs P x V = 4 blocks: gpt_lm with 4 layers, and the zoo's Llama-style decoder
#: (2 layers, no flag) copied with 4
GPT4_ARGS = [*GPT_ARGS, "--n-layer", "4"]


@pytest.mark.slow
def test_interleaved_on_two_ranks_trains_as_the_unmodified_run(tmp_path):
    """Each rank holds 2 of 4 stages, the model's forward entered at each stage's blocks and
    the rank's other blocks passing the stream through; torch's ScheduleInterleaved1F1B runs
    them.  Same math in another order, M parts, as the 1F1B case."""
    llama4 = tmp_path / "llama4.py"
    llama4.write_text(LLAMA.read_text().replace("n_layers: int = 2", "n_layers: int = 4"))
    jobs = [(GPT, "pp=2,schedule=interleaved", GPT4_ARGS),
            (GPT, "pp=2,schedule=interleaved,microbatches=4,checkpoint=auto", GPT4_ARGS),
            (llama4, "pp=2,schedule=interleaved,microbatches=4", LLAMA_ARGS)]
    results = run_distributed(jobs, 2, tmp_path)
    originals = {GPT: run_original(GPT, GPT4_ARGS), llama4: run_original(llama4, LLAMA_ARGS)}
    for (script, plan, _), params in zip(jobs, results):
        parts = Plan.parse(plan).pipeline_microbatches
        assert same_math_error(params, originals[script], parts) <= 1, \
            (script.name, plan, relative_error(params, originals[script]))


@pytest.mark.slow
def test_pp_with_ddp_on_four_ranks_trains_as_the_unmodified_run(tmp_path):
    """2 pipelines x 2 stages (gloo, 4 processes): each replica's gradients (M parts of its
    half) averaged over the 2 replicas -- all-reduced (ddp) or reduce-scattered to shards of
    each stage's blocks and of the layers outside the stack (zero2, zero3), or all-reduced
    and each replica stepping its share of the stage's parameters (zero1): the same math in
    replicas x M parts.  gpt_lm clips the gradient norm: the shards' squares are summed over
    the replicas (before, zero2 missed that and was 160x over this tolerance)."""
    jobs = [(GPT, "pp=2,shard=ddp,world=4", GPT4_ARGS),
            (GPT, "pp=2,shard=ddp,world=4,schedule=interleaved", GPT4_ARGS),
            (GPT, "pp=2,shard=zero1,world=4", GPT4_ARGS),
            (GPT, "pp=2,shard=zero1,world=4,schedule=interleaved", GPT4_ARGS),
            (GPT, "pp=2,shard=zero2,world=4", GPT4_ARGS),
            (GPT, "pp=2,shard=zero3,world=4", GPT4_ARGS)]
    results = run_distributed(jobs, 4, tmp_path)
    original = run_original(GPT, GPT4_ARGS)
    for (_, plan, _), params in zip(jobs, results):
        parts = Plan.parse(plan).pipeline_microbatches * 2
        assert same_math_error(params, original, parts) <= 1, \
            (plan, relative_error(params, original))


@pytest.mark.slow
def test_pp_with_tp_on_four_ranks_trains_as_the_unmodified_run(tmp_path):
    """pp=2,tp=2 (gloo, 4 processes, a (dp, pp, tp) mesh): each stage's blocks split over its
    2 tensor-parallel ranks, the stages a pipeline; gpt_lm (tied embedding/head split over
    the vocabulary, gradient clipping: the squares of tp's shards summed over the tp group,
    a stage's over the pipeline) and the zoo's Llama decoder (GQA, RMSNorm, RoPE); with
    sp the stream between stages travels cut along the sequence.  The same math in M
    parts, as pp alone, the tp all-reduces adding their rounding."""
    jobs = [(GPT, "pp=2,tp=2,world=4", GPT4_ARGS),
            (GPT, "pp=2,tp=2,schedule=interleaved", GPT4_ARGS),
            (LLAMA, "pp=2,tp=2,world=4", LLAMA_ARGS),
            (GPT, "pp=2,tp=2,sp,schedule=interleaved", GPT4_ARGS),
            (LLAMA, "pp=2,tp=2,sp", LLAMA_ARGS)]
    results = run_distributed(jobs, 4, tmp_path)
    originals = {GPT: run_original(GPT, GPT4_ARGS), LLAMA: run_original(LLAMA, LLAMA_ARGS)}
    for (script, plan, _), params in zip(jobs, results):
        parts = Plan.parse(plan).pipeline_microbatches * 2
        assert same_math_error(params, originals[script], parts) <= 1, \
            (script.name, plan, relative_error(params, originals[script]))


@pytest.mark.slow
def test_three_dimensional_plans_on_eight_ranks_train_as_the_unmodified_run(tmp_path):
    """pp=2,tp=2 beside a second pipeline (world=8, a (dp, pp, tp) mesh): the replicas'
    tp-split gradients averaged over dp by the pipeline (ddp), or FSDP2 over dp on the
    tp-split blocks (zero3: 2-D DTensors per stage).  Same math in replicas x M parts."""
    jobs = [(GPT, "pp=2,tp=2,shard=ddp,world=8", GPT4_ARGS),
            (GPT, "pp=2,tp=2,shard=zero3,world=8", GPT4_ARGS)]
    results = run_distributed(jobs, 8, tmp_path)
    original = run_original(GPT, GPT4_ARGS)
    for (_, plan, _), params in zip(jobs, results):
        parts = Plan.parse(plan).pipeline_microbatches * 2 * 2
        assert same_math_error(params, original, parts) <= 1, \
            (plan, relative_error(params, original))


# --- a loss the script computes from the model's output ------------------------------------
LLAMA = REPO / "zoo" / "llama_decoder.py"
LLAMA_ARGS = ["--steps", "3", "--batch-size", "8"]
#: nanoGPT's own accumulation loop around ``with ctx:`` forward + loss (two pipeline calls
#: per optimizer step)
NANOGPT = REPO / "zoo" / "nanogpt_style.py"
NANOGPT_ARGS = ["--gradient_accumulation_steps=2"]

#: ``criterion(model(x), y)`` with a criterion module and a target the model never sees
CRITERION_SCRIPT = '''\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(4))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


torch.manual_seed(0)
model = Net()
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1)
for step in range(3):
    x = torch.randn(8, 6, generator=data)
    y = torch.randint(5, (8,), generator=data)
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.6f}")
'''


#: As the GPT case: the same math in another order over M micro-batches (the loss function
#: now runs per micro-batch on the last stage; cross-entropy's mean over equal micro-batches,
#: averaged over M, is the batch's mean), fp32, so reorder_tolerance(M) holds it.
@pytest.mark.slow
def test_pp2_with_the_scripts_own_loss_trains_as_the_unmodified_run(tmp_path):
    criterion_script = tmp_path / "criterion_loss.py"
    criterion_script.write_text(CRITERION_SCRIPT)
    # forward and loss in an autocast block (the pipeline enters it around each forward)
    autocast_script = tmp_path / "autocast_loss.py"
    autocast_script.write_text(CRITERION_SCRIPT.replace(
        "    loss = criterion(model(x), y)\n",
        "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "        logits = model(x)\n        loss = criterion(logits, y)\n"))
    jobs = [(LLAMA, "pp=2,world=2", LLAMA_ARGS),
            (LLAMA, "pp=2,world=2,schedule=gpipe,microbatches=4", LLAMA_ARGS),
            (criterion_script, "pp=2,world=2", []),
            (autocast_script, "pp=2,world=2", []),
            (NANOGPT, "pp=2,world=2", NANOGPT_ARGS)]
    results = run_distributed(jobs, 2, tmp_path)
    originals = {LLAMA: run_original(LLAMA, LLAMA_ARGS),
                 criterion_script: run_original(criterion_script, []),
                 autocast_script: run_original(autocast_script, []),
                 NANOGPT: run_original(NANOGPT, NANOGPT_ARGS)}
    for (script, plan, _), params in zip(jobs, results):
        if script is autocast_script:
            # bf16 matmuls: the tolerance of the single-process amp-bf16 runs
            # (test_equivalence), as the GPT case's
            assert relative_error(params, originals[script]) <= 1e-2, plan
            continue
        parts = Plan.parse(plan).pipeline_microbatches * (2 if script is NANOGPT else 1)
        assert same_math_error(params, originals[script], parts) <= 1, \
            (script.name, plan, relative_error(params, originals[script]))


def test_apply_refuses_a_loss_expression_it_cannot_pipeline_before_running(tmp_path):
    script = tmp_path / "accuracy.py"
    script.write_text(CRITERION_SCRIPT.replace(
        "    print(f\"step", "    accuracy = (logits.argmax(-1) == y).float().mean()\n"
        "    print(f\"step").replace("loss = criterion(model(x), y)",
                                    "logits = model(x)\n    loss = criterion(logits, y)"))
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "apply", str(script),
                           "--plan", "pp=2,world=2"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "line 33 reads `logits`, which the loss expression (line 28) computes" in \
        done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "accuracy_memadvisor.py").exists()
