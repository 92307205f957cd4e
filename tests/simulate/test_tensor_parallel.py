"""tp=T predicted per rank (simulate/tensor_parallel.py) from an unmodified trace: the split
model state, the all-reduce volume, and the peak against ``apply --plan tp=2 --profile``."""
import importlib.util
import os

import numpy as np
import pytest

from .cli_runs import ROOT, run_cli
from memadvisor.plan import Plan, tensor_parallel_blocks, tensor_parallel_vocabulary
from memadvisor.simulate import prepare, simulate, tensor_parallel
from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.simulator import quick_simulate
from memadvisor.simulate.tensor_parallel_vocabulary import transient_rows
from memadvisor.trace.analysis import analysed_step
from memadvisor.trace.io import read_trace

LLAMA = os.path.join(ROOT, "zoo", "llama_decoder.py")
GPT = os.path.join(ROOT, "examples", "gpt_lm.py")
GPT_ARGS = ["--n-layer", "2", "--d-model", "64", "--batch-size", "8", "--device", "cpu"]
#: a classifier whose MLP Linears (fc1, fc2) are children of the model itself, beside its
#: convolutions: the split block is the whole model, only fc1's output onwards is split
MNIST = os.path.join(ROOT, "zoo", "mnist_under_if.py")
#: the issue's target for the analytic prediction against the measured per-rank peak
ANALYTIC_TARGET = 0.05


_cli = run_cli


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    out = {}
    for name, script, args in (("llama", LLAMA, []), ("gpt", GPT, GPT_ARGS),
                               ("mnist", MNIST, [])):
        path = folder / f"{name}.trace"
        _cli("profile", script, "-o", path, "--steps", "3", "--", *args)
        out[name] = read_trace(str(path))
    return out, folder


def _llama_model():
    spec = importlib.util.spec_from_file_location("llama_decoder_for_tp", LLAMA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.Transformer(module.ModelArgs(max_seq_len=32))


def test_split_model_state_and_all_reduce_volume_follow_the_model(traces):
    found, _ = traces
    base = prepare(found["llama"])
    llama, model = _llama_model()
    blocks = tensor_parallel_blocks(found["llama"].meta.modules)
    styles = blocks.linear_styles()
    assert len(styles) == 14  # per layer q, k, v, out + w1, w3, w2
    vocabulary = tensor_parallel_vocabulary(found["llama"].meta.modules, blocks)
    assert (vocabulary.embedding, vocabulary.head, vocabulary.tied) == (
        "tok_embeddings", "output", False)
    modules = dict(model.named_modules())
    split = list(styles) + ["tok_embeddings", "output"]
    split_bytes = sum(4 * p.numel() for path in split for p in modules[path].parameters())
    total_bytes = sum(4 * p.numel() for p in model.parameters())

    prediction = simulate(base, Plan.parse("tp=2,world=2"))
    # parameters and Adam's two moments: the split Linears', the embedding's and the
    # head's halves, the norms whole
    assert prediction.by_category["parameter"] == total_bytes - split_bytes // 2
    state = prediction.by_category["optimizer_state"]
    unmodified = simulate(base, Plan()).by_category["optimizer_state"]
    assert unmodified - state == split_bytes  # 2 moments x half of the split bytes

    # forward: each row-parallel output ([B, S, dim] fp32) all-reduced once per block, and
    # the embedding's lookup; backward: each column-parallel Linear's input gradient (q, k,
    # v, w1, w3 and the head), same size; the logits ([B, S, vocab]) all-gathered
    batch, seq, dim, vocab = 8, 32, model.params.dim, model.params.vocab_size
    activation = 4 * batch * seq * dim
    layers = model.params.n_layers
    notes = prediction.notes["tensor_parallel"]
    assert notes["vocabulary_split"] == ["tok_embeddings", "output"]
    assert notes["all_reduce_bytes_forward"] == (2 * layers + 1) * activation
    assert notes["all_reduce_bytes_backward"] == (5 * layers + 1) * activation
    assert notes["all_gather_bytes_forward"] == 4 * batch * seq * vocab
    assert notes["communication_bytes_per_micro_step"] == (  # ring, T=2
        (7 * layers + 2) * activation + 4 * batch * seq * vocab / 2)
    assert any(what.startswith("tp=2 all-reduces") and seconds > 0
               for what, seconds in prediction.cost.terms)


def test_tied_embedding_and_head_are_found_and_split_once(traces):
    found, _ = traces
    modules = found["gpt"].meta.modules
    vocabulary = tensor_parallel_vocabulary(modules, tensor_parallel_blocks(modules))
    assert (vocabulary.embedding, vocabulary.head, vocabulary.tied) == ("tok_emb", "lm_head",
                                                                        True)
    base = prepare(found["gpt"])
    tp = simulate(base, Plan.parse("tp=2,world=2")).by_category["parameter"]
    whole = simulate(base, Plan()).by_category["parameter"]
    # the tied weight (256 x 64 fp32) once, halved, with the MLPs' Linears
    mlp_bytes = 2 * 4 * (64 * 256 + 256 + 256 * 64)  # fc (weight, bias), proj weight
    assert whole - tp == (4 * 256 * 64 + mlp_bytes) // 2


def test_repeated_kv_heads_are_views_when_each_rank_holds_one_kv_head(traces):
    # llama_decoder: 2 K/V heads repeated twice by expand + reshape (a copy, aten::clone of
    # (8, 32, 2, 2, 16)); at tp=2 each rank holds one and the reshape is a view, so the
    # rotary K and the value projection are what attention saves instead
    found, _ = traces
    timeline = prepare(found["llama"]).timeline
    modules = found["llama"].meta.modules
    blocks = tensor_parallel_blocks(modules)
    views, free_key = tensor_parallel._repeat_views(timeline, blocks, modules, 2,
                                                    timeline.free_key.copy())
    assert views.sum() == 4  # K and V of 2 layers
    for row in np.flatnonzero(views):
        assert timeline.shape[row] == "8,32,2,2,16"
        for source in timeline.reads.of(row):
            assert free_key[source] == timeline.free_key[row] > timeline.free_key[source]


def test_the_heads_gather_adds_its_buffers_freed_at_once_or_at_the_next_collective(traces):
    found, _ = traces
    timeline = prepare(found["gpt"]).timeline  # batch 8, seq 32, d_model 64, vocab 256
    modules = found["gpt"].meta.modules
    vocabulary = tensor_parallel_vocabulary(modules, tensor_parallel_blocks(modules))
    logits, hidden = 4 * 8 * 32 * 256, 4 * 8 * 32 * 64
    prompt, volume = transient_rows(timeline, vocabulary, 2)
    assert volume == {"all_reduce_forward": hidden, "all_gather_forward": logits}
    # the local lookup; the local logits (V/T) and the all-gather's output (V), around the
    # logits' own allocation; in backward this rank's V/T columns of their gradient
    assert sorted(prompt["size"]) == sorted([hidden, logits / 2, logits, logits / 2])
    gathered = np.flatnonzero(np.isin(prompt["size"], [logits]))[0]
    assert prompt["free_key"][gathered] - prompt["alloc_key"][gathered] == 1.0
    later = prompt["alloc_key"][gathered] + 40.5
    held, _ = transient_rows(timeline, vocabulary, 2, lambda key: later)
    assert held["free_key"][gathered] == later
    assert tensor_parallel.held_until(np.array([10.0, 20.0]), 12.0) == 20.75
    assert tensor_parallel.held_until(np.array([10.0, 20.0]), 20.0) is None


def test_fused_qkv_attention_is_predicted_replicated_as_apply_keeps_it(traces):
    found, _ = traces
    prediction = simulate(prepare(found["gpt"]), Plan.parse("tp=2,world=2"))
    notes = prediction.notes["tensor_parallel"]
    assert notes["attention_blocks"] == 0 and notes["mlp_blocks"] == 2
    assert set(notes["kept_replicated"]) == {"blocks.0.attn", "blocks.1.attn"}


def test_plans_without_tp_are_untouched_and_tp_is_replayed_not_bounded(traces):
    found, _ = traces
    base = prepare(found["llama"])
    plain = simulate(base, Plan.parse("accum=2"))
    assert "tensor_parallel" not in plain.notes
    assert quick_simulate(base, Plan.parse("tp=2,world=2"), hardware(None, base.meta.device),
                          {}, {}) is None
    # sequence parallel divides the norms' and residuals' activations, but PyTorch's
    # ColwiseParallel(input_layouts=Shard(1)) gathers the input per Linear and each keeps
    # its whole copy for backward (q, k, v, w1, w3: five per layer): on this small
    # Llama sp costs more than it saves, as the measured runs show (3.52 MB vs 3.30 MB)
    tp = simulate(base, Plan.parse("tp=2,world=2")).peak_bytes
    assert simulate(base, Plan.parse("tp=2,world=2,sp")).peak_bytes > tp


@pytest.mark.slow
@pytest.mark.parametrize("name, script, args, plan", [
    ("llama", LLAMA, [], "tp=2,world=2"), ("gpt", GPT, GPT_ARGS, "tp=2,world=2"),
    ("llama", LLAMA, [], "tp=2,world=2,sp"), ("gpt", GPT, GPT_ARGS, "tp=2,world=2,sp"),
    ("llama", LLAMA, [], "tp=2,shard=zero3,world=4"),
    ("mnist", MNIST, [], "tp=2,world=2")])
def test_predicted_peak_per_rank_against_apply_profile(traces, name, script, args, plan):
    """gloo's worker thread frees what an all-gather used when it is next scheduled: at
    once, or (main thread busy) as late as the rank's next collective -- a race (measured
    2026-11-26: gpt_lm tp=2 rank 0 held the head's gathered logits into the backward, rank
    1 freed them at once; gpt_lm --vocab-size 8192 sp freed them two ops late on both).
    ``peak_bytes`` is the late bound, the note the prompt figure; every rank measures
    within the two (each case here has measured one of them to the byte)."""
    found, folder = traces
    tag = f"{name}_{plan.replace('=', '').replace(',', '_')}"
    measured_path = folder / f"{tag}.trace"
    _cli("apply", script, "--plan", plan, "-o", folder / f"{tag}.py", "-q",
         "--profile", measured_path, "--profile-steps", "3", "--", *args,
         *([] if name == "mnist" else ["--steps", "5"]))  # mnist runs its 3 batches
    prediction = simulate(prepare(found[name]), Plan.parse(plan))
    late = prediction.peak_bytes
    prompt = prediction.notes.get("peak_bytes_if_collectives_free_at_once", late)
    assert prompt <= late
    ranks = Plan.parse(plan).world
    for path in [measured_path] + [folder / f"{tag}.rank{r}.trace" for r in range(1, ranks)]:
        trace = read_trace(str(path))
        measured = trace.meta.steps[analysed_step(trace)]["peak_bytes"]
        assert prompt * (1 - ANALYTIC_TARGET) <= measured <= late * (1 + ANALYTIC_TARGET), \
            (name, plan, path.name, late, prompt, measured)
