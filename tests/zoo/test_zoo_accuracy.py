"""The fast CI subset of the zoo's accuracy matrix (``benchmarks/verify_matrix.py``,
docs/ACCURACY.md): predictions from each script's own profile against the plan run for
real by ``apply --profile`` on this CPU, at the targets of the matrix -- analytic: each
case within 5%, the median within 1%; executed (``--verify-by fake``: the rewrite on fake
CPU tensors, each op's kernel blocks measured on this machine): each case within 2%, the
median within 0.5%.

One case per class of code the simulator got wrong on scripts it was not written for:
attention's sequence-first inside of a batch-first model (kwargs_model), a step with
several backward passes (dcgan), a closure that makes the gradients several times per step
(lbfgs_sine, 2 ranks), a framework that clears gradients between forward and backward
(lightning_classifier), and two plain ones (llama_decoder, nanogpt_style); and for the
executed figure, checkpointing of a convolutional GAN (the generator state checkpoint keeps,
oneDNN's convolution scratch) and of an encoder-decoder transformer (a decoder layer's
input gradient arrives long before its cross-attention's memory gradient: the profiler's
backward hooks must not keep the first until the last).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from zoo_scripts import load_benchmark, zoo_scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {s.name: s for s in zoo_scripts()}
CASES = [("kwargs_model", "accum=2"), ("dcgan", "optimizer=sgd"),
         ("lbfgs_sine", "shard=ddp,world=2"), ("lightning_classifier", "precision=amp-bf16"),
         ("llama_decoder", "precision=amp-bf16"), ("nanogpt_style", "accum=2"),
         ("dcgan", "checkpoint=auto"), ("seq2seq_transformer", "checkpoint=auto")]


def _matrix():
    return load_benchmark("verify_matrix")


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    matrix, folder = _matrix(), tmp_path_factory.mktemp("zoo-accuracy")
    out = {}
    for name, plan in CASES:
        script = SCRIPTS[name]
        if script.missing_package():
            continue
        trace = folder / f"{name}.trace"
        if not trace.exists():
            proc = matrix._cli("profile", str(script.path), "-o", str(trace), "--steps", "3",
                               "-q", cwd=ROOT)
            assert proc.returncode == 0, proc.stderr[-2000:]
        analytic, why = matrix._simulate(trace, plan)
        assert analytic is not None and not why, why
        real, why = matrix._simulate(trace, plan, "--verify", "--verify-by", "real")
        assert not why, f"{name} {plan}: {why}"
        measured = real["verification"]["executed_peak_bytes"]
        fake, why = matrix._simulate(trace, plan, "--verify", "--verify-by", "fake")
        assert not why, f"{name} {plan}: {why}"
        executed = fake["verification"]["executed_peak_bytes"]
        out[(name, plan)] = ((analytic["peak_bytes"] - measured) / measured,
                             (executed - measured) / measured)
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_each_case_within_5_percent_analytic_and_2_executed(errors, case):
    if case not in errors:
        pytest.skip(f"{SCRIPTS[case[0]].missing_package()} not installed")
    analytic, executed = errors[case]
    assert abs(analytic) <= 0.05, f"{case}: analytic {analytic:+.2%}"
    assert abs(executed) <= 0.02, f"{case}: executed {executed:+.2%}"


def test_median_within_1_percent_analytic_and_half_a_percent_executed(errors):
    assert statistics.median(abs(a) for a, _ in errors.values()) <= 0.01, errors
    assert statistics.median(abs(e) for _, e in errors.values()) <= 0.005, errors
