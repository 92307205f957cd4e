"""tp=T: the plan knobs, which blocks are recognised, and runs on 2 and 4 CPU ranks (gloo)
compared with the unmodified single-process run."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from apply_runs import REPO, relative_error, run_distributed, run_original, same_math_error
from memadvisor.apply import tensor_parallel
from memadvisor.plan import Plan, PlanError

GPT, LLAMA = REPO / "examples" / "gpt_lm.py", REPO / "zoo" / "llama_decoder.py"
GPT_ARGS = ["--steps", "3", "--batch-size", "8", "--log-every", "100"]


# --- the plan ------------------------------------------------------------------------------
def test_tp_and_sp_parse_and_round_trip():
    plan = Plan.parse("tp=2,world=2,sp")
    assert (plan.tp, plan.sp, plan.data_parallel_size) == (2, True, 1)
    assert Plan.parse(plan.to_compact()) == plan
    assert plan.to_dict()["tp"] == 2 and plan.to_dict()["sp"] is True
    assert Plan.from_dict({"tp": 2, "world": 4, "shard": "zero3", "sp": False}).sp is False
    # the tensor-parallel group shares its batch: 8 samples over 4 ranks at tp=2 -> 4 each
    assert Plan.parse("tp=2,world=4,shard=zero3").micro_batch_size(8) == 4
    assert Plan.parse("tp=2,world=2").micro_batch_size(8) == 8


@pytest.mark.parametrize("text, words", [
    ("tp=3,world=4", "tp=3 must divide world=4"),
    ("tp=2,world=4", "add shard=zero2 or zero3"),
    ("sp,world=1", "needs tp=2 or more"),
    ("tp=2,world=2,shard=zero3", "no data-parallel rank"),
    ("tp=2,world=4,shard=ddp", "DTensor parameters"),
    ("tp=2,world=2,sp=maybe", "on or off"),
    ("tp=0", "at least 1"),
])
def test_impossible_tp_plans_are_refused_in_one_line(text, words):
    with pytest.raises(PlanError, match=words) as caught:
        Plan.parse(text)
    assert "\n" not in str(caught.value)


def test_bad_tp_plan_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "apply", str(GPT), "--plan",
                           "tp=3,world=2", "--dry-run"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert "tp=3 must divide world=2" in done.stderr and "Traceback" not in done.stderr


# --- which blocks are split -----------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim=16, n_heads=4, n_kv_heads=2, heads=True):
        super().__init__()
        if heads:
            self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        head = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * head, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head, bias=False)
        self.wo = nn.Linear(n_heads * head, dim, bias=False)


class FusedAttention(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.n_head = 4
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)


class SwiGLU(nn.Module):
    def __init__(self, dim=16, hidden=48):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attention, self.mlp = attention, SwiGLU()


def test_layout_splits_qkv_colwise_output_rowwise_and_finds_the_heads():
    model = nn.Sequential(Block(Attention()), Block(Attention()), nn.Linear(16, 10))
    layout = tensor_parallel.find_layout(model, 2)
    assert layout.heads == {"0.attention": {"n_heads": 4, "n_kv_heads": 2},
                            "1.attention": {"n_heads": 4, "n_kv_heads": 2}}
    styles = layout.linear_paths()
    assert styles["0.attention.wq"] == styles["0.attention.wv"] == "colwise"
    assert styles["0.attention.wo"] == "rowwise"
    assert styles["1.mlp.w1"] == styles["1.mlp.w3"] == "colwise"
    assert styles["1.mlp.w2"] == "rowwise"
    assert "2" not in styles  # the head stays replicated
    assert not layout.kept


def test_fused_qkv_attention_is_kept_with_the_reason_and_its_mlp_split():
    layout = tensor_parallel.find_layout(nn.Sequential(Block(FusedAttention())), 2)
    assert "fused qkv" in layout.kept["0.attention"]
    assert layout.mlp == {"0.mlp": {"up": ["w1", "w3"], "down": ["w2"]}}
    assert "kept replicated" in tensor_parallel.describe(layout)


class LanguageModel(nn.Module):
    """Embedding, two blocks, final norm, head: the shape tp splits along the vocabulary."""
    def __init__(self, vocab=32, tied=False, padding_idx=None, head_bias=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, 16, padding_idx=padding_idx)
        self.pos_embeddings = nn.Embedding(8, 16)
        self.layers = nn.ModuleList([Block(Attention()), Block(Attention())])
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, vocab, bias=head_bias)
        if tied:
            self.output.weight = self.tok_embeddings.weight


def test_embedding_and_head_are_split_along_the_vocabulary():
    layout = tensor_parallel.find_layout(LanguageModel(), 2)
    # the token embedding (the larger one), not the position embedding
    assert (layout.embedding, layout.head, layout.tied) == ("tok_embeddings", "output", False)
    assert layout.linear_paths()["output"] == "colwise"
    assert "tok_embeddings" in layout.split_paths() and "pos_embeddings" not in layout.split_paths()
    assert "tok_embeddings and output split along the vocabulary" in tensor_parallel.describe(
        layout)
    biased = tensor_parallel.find_layout(LanguageModel(head_bias=True), 2)
    assert biased.head == "output"


def test_tied_embedding_and_head_are_split_together():
    layout = tensor_parallel.find_layout(LanguageModel(tied=True), 2)
    assert (layout.embedding, layout.head, layout.tied) == ("tok_embeddings", "output", True)
    assert "tied weight, one shared shard" in tensor_parallel.describe(layout)


@pytest.mark.parametrize("model, tp, words", [
    (LanguageModel(padding_idx=0), 2, "padding_idx"),
    (LanguageModel(vocab=30), 4, "not divisible by tp"),
])
def test_an_embedding_that_cannot_be_split_stays_whole_with_the_reason(model, tp, words):
    if tp == 4:  # heads (4) and kv heads (2) must divide too: a model tp=4 can split
        for block in model.layers:
            block.attention.n_kv_heads = 4
            block.attention.wk = nn.Linear(16, 16, bias=False)
            block.attention.wv = nn.Linear(16, 16, bias=False)
    layout = tensor_parallel.find_layout(model, tp)
    assert layout.embedding is None and words in layout.vocabulary_kept["tok_embeddings"]
    assert f"tok_embeddings kept replicated ({layout.vocabulary_kept['tok_embeddings']})" \
        in tensor_parallel.describe(layout)


def test_an_embedding_without_a_head_linear_stays_whole_with_the_reason():
    # e.g. a GPT whose forward computes the logits as x @ self.tok_embeddings.weight.T:
    # a sharded weight there would meet a plain tensor
    model = LanguageModel()
    del model.output
    layout = tensor_parallel.find_layout(model, 2)
    assert layout.embedding is None and layout.head is None
    assert "no vocabulary-sized head Linear" in layout.vocabulary_kept["tok_embeddings"]


def test_a_tied_pair_stays_whole_together_when_one_cannot_be_split():
    layout = tensor_parallel.find_layout(LanguageModel(tied=True, padding_idx=0), 2)
    assert layout.embedding is None and layout.head is None and not layout.tied
    assert "tied to tok_embeddings" in layout.vocabulary_kept["output"]


@pytest.mark.parametrize("model, words", [
    (nn.Sequential(Block(Attention(heads=False))), "no head-count attribute"),
    (nn.Sequential(Block(Attention(n_heads=4, n_kv_heads=1))), "n_kv_heads=1, not divisible"),
    (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), "found no attention"),
])
def test_what_cannot_be_split_is_refused(model, words):
    with pytest.raises(PlanError, match=words):
        tensor_parallel.find_layout(model, 2)


def test_mixed_gradient_clipping_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3, 2))]
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for p, c in zip(params, copies):
        p.grad = torch.randn_like(p)
        c.grad = p.grad.clone()
    ours = tensor_parallel.clip_mixed_grad_norm_(params, 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(copies, 0.5)
    assert torch.allclose(ours, theirs)
    for p, c in zip(params, copies):
        assert torch.allclose(p.grad, c.grad)


# --- runs on several ranks ----------------------------------------------------------------
#: Tensor parallelism splits each row-parallel Linear's contraction (the attention output,
#: the MLP down projection) and the input gradient of each column-parallel one into T
#: partial sums that gloo's all-reduce adds: the same math summed in another order, T parts
#: (apply_runs.reorder_tolerance, which scales with the dtype's eps).  Under FSDP over
#: world/tp ranks the gradient of every parameter is also split over world/tp batch slices.
def _parts(plan: Plan) -> int:
    return plan.tp * plan.data_parallel_size


@pytest.mark.slow
def test_tp2_and_sp_on_two_ranks_train_as_the_unmodified_run(tmp_path):
    jobs = [(GPT, "tp=2,world=2", GPT_ARGS), (LLAMA, "tp=2,world=2", []),
            (GPT, "tp=2,world=2,sp", GPT_ARGS), (LLAMA, "tp=2,world=2,sp", [])]
    results = run_distributed(jobs, 2, tmp_path)
    for (script, plan, args), params in zip(jobs, results):
        original = run_original(script, args)
        error = same_math_error(params, original, _parts(Plan.parse(plan)))
        assert error <= 1, (script.name, plan, relative_error(params, original))


@pytest.mark.slow
def test_tp2_with_fsdp_on_four_ranks_is_two_dimensional(tmp_path):
    # gpt_lm: the tied embedding/head weight, split along the vocabulary over tp, then
    # sharded by FSDP over dp as one parameter of the root
    jobs = [(LLAMA, "tp=2,shard=zero3,world=4", []), (GPT, "tp=2,shard=zero3,world=4", GPT_ARGS)]
    results = run_distributed(jobs, 4, tmp_path)
    for (script, plan, args), params in zip(jobs, results):
        original = run_original(script, args)
        assert same_math_error(params, original, _parts(Plan.parse(plan))) <= 1, \
            (script.name, relative_error(params, original))
