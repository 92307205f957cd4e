"""Prediction vs measurement on CPU: each hand-modified TinyLM loop is profiled and its peak
compared with what the simulator predicts from the *baseline* trace alone.

This is the fast CI subset of the accuracy matrix (benchmarks/accuracy_matrix.py): every
case within 3%, the median within 1% (docs/ACCURACY.md).
"""
import statistics

import pytest
import torch

from memadvisor.plan import Plan
from memadvisor.simulate import simulate

CASES = {
    "checkpoint=blocks": (dict(checkpointed=True), "checkpoint=Block"),
    "accum=2": (dict(accum=2), "accum=2"),
    "accum=4": (dict(accum=4), "accum=4"),
    "checkpoint+accum=2": (dict(checkpointed=True, accum=2), "checkpoint=Block,accum=2"),
    "optimizer=sgd": (dict(optimizer="sgd"), "optimizer=sgd"),
    "optimizer=sgd-momentum": (dict(optimizer="sgd-momentum"), "optimizer=sgd-momentum"),
    "bf16": (dict(dtype=torch.bfloat16), "precision=bf16"),
    "bf16+sgd-momentum+accum=2": (dict(dtype=torch.bfloat16, optimizer="sgd-momentum", accum=2),
                                  "precision=bf16,optimizer=sgd-momentum,accum=2"),
}


@pytest.fixture(scope="module")
def results(loops, base):
    out = {}
    for name, (variant, spec) in CASES.items():
        measured = loops.measured_peak(loops.run(**variant))
        predicted = simulate(base, Plan.parse(spec)).peak_bytes
        out[name] = (predicted, measured)
    measured = loops.measured_peak(loops.run_autocast())
    out["amp-bf16"] = (simulate(base, Plan.parse("precision=amp-bf16")).peak_bytes, measured)
    return out


def _error(pair):
    predicted, measured = pair
    return abs(predicted - measured) / measured


def test_baseline_replay_is_exact(base, baseline_trace, loops):
    assert base.peak.bytes == loops.measured_peak(baseline_trace)
    assert sum(base.peak.by_category.values()) == base.peak.bytes


@pytest.mark.parametrize("name", list(CASES) + ["amp-bf16"])
def test_each_case_within_3_percent(results, name):
    assert _error(results[name]) <= 0.03, results[name]


def test_median_within_1_percent(results):
    assert statistics.median(_error(p) for p in results.values()) <= 0.01


def test_structural_techniques_are_exact(results):
    # lifetimes and optimizer state are replayed exactly; only autocast is a heuristic
    for name in ("checkpoint=blocks", "optimizer=sgd", "optimizer=sgd-momentum", "bf16"):
        assert results[name][0] == results[name][1], name


@pytest.mark.parametrize("spec", ["accum=2", "accum=4", "checkpoint=Block,accum=8",
                                  "precision=amp-bf16,accum=2,optimizer=sgd-momentum"])
def test_fast_accumulation_equals_laid_out_micro_steps(base, spec):
    from memadvisor.simulate.accumulation import accumulated_peak, apply_accumulation
    from memadvisor.simulate.hardware import hardware
    from memadvisor.simulate.simulator import transform
    plan = Plan.parse(spec)
    timeline, *_ = transform(base, plan, hardware(None))
    assert accumulated_peak(timeline, plan.accum).bytes == \
        apply_accumulation(timeline, plan.accum).peak().bytes
