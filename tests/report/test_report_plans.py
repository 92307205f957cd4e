"""The adapter between reports and the simulator."""
from __future__ import annotations

import pytest

from memadvisor.errors import UserError
from memadvisor.report import plans
from memadvisor.report.plans import UNAVAILABLE, predict_plans
from memadvisor.report.synthetic import make_trace
from memadvisor.trace.io import read_trace
from memadvisor.trace.summary import summarize

MIB = 1024**2


def test_missing_simulator_is_reported_not_raised(traces, no_simulator):
    trace = read_trace(traces["base"])
    for kwargs in ({"budget_bytes": 10**9}, {"plan_spec": "precision=amp-bf16"}):
        section = predict_plans(trace, **kwargs)
        assert not section.available and section.message == UNAVAILABLE
        assert section.predictions == [] and section.recommended is None


def test_nothing_requested_calls_no_simulator(traces, fake_simulator):
    section = predict_plans(read_trace(traces["base"]))
    assert fake_simulator == [] and not section.available
    assert "--budget" in section.message


def test_bad_plan_spec_is_a_user_error_even_without_simulator(traces, no_simulator):
    with pytest.raises(UserError) as info:
        predict_plans(read_trace(traces["base"]), plan_spec="precision")
    assert info.value.exit_code == 2


def fake(monkeypatch, advise=None, simulate=None):
    monkeypatch.setattr(plans, "_simulator",
                        lambda: plans.Simulator(advise=advise, simulate=simulate))


def test_recommended_is_the_first_plan_that_fits(traces, monkeypatch):
    ranked = [dict(plan=f"p{i}", peak_bytes=100 - i, reserved_bytes=110, step_time_factor=1.0,
                   changes="", fits=i >= 1) for i in range(3)]
    fake(monkeypatch, advise=lambda trace, budget_bytes, num_gpus: ranked)
    section = predict_plans(read_trace(traces["base"]), budget_bytes=99)
    assert [p.plan for p in section.predictions] == ["p0", "p1", "p2"]
    assert section.recommended.plan == "p1"


def test_a_simulator_breaking_the_contract_is_a_bug_not_a_notice(traces, monkeypatch):
    fake(monkeypatch, advise=lambda trace, budget_bytes, num_gpus: [{"plan": "x"}])
    with pytest.raises(TypeError, match="without peak_bytes"):
        predict_plans(read_trace(traces["base"]), budget_bytes=1)


def test_a_trace_the_simulator_refuses_becomes_a_notice(traces, monkeypatch):
    def refuse(trace, budget_bytes, num_gpus):
        raise UserError("the profiled run completed no training step")

    fake(monkeypatch, advise=refuse)
    section = predict_plans(read_trace(traces["base"]), budget_bytes=1)
    assert not section.available
    assert section.message == ("the simulator gave no plans: the profiled run completed no "
                               "training step")


real_simulator = pytest.mark.skipif(plans._simulator() is None,
                                    reason="memadvisor.simulate not in this checkout")


@real_simulator
def test_real_simulator_through_the_adapter(tmp_path):
    trace = read_trace(make_trace(tmp_path / "t.trace", 4_000))
    peak = summarize(trace)["peak_bytes"]
    from memadvisor.simulate.hardware import cublas_workspace_bytes, hardware
    # the target GPU's two cuBLAS workspaces (forward and backward threads) come on top of
    # anything a plan can cut
    budget = int(peak * 0.8) + 2 * cublas_workspace_bytes(hardware(None, trace.meta.device))
    section = predict_plans(trace, budget_bytes=budget, num_gpus=1)
    assert section.available and section.predictions
    fitting = [p for p in section.predictions if p.fits]
    assert fitting and section.recommended is fitting[0]
    assert all(p.reserved_bytes <= budget for p in fitting)
    assert all(p.peak_bytes > 0 and p.step_time_factor > 0 and p.changes
               for p in section.predictions)
    assert section.recommended.timeline  # (event position, bytes) pairs
    assert max(b for _, b in section.recommended.timeline) == section.recommended.peak_bytes

    one = predict_plans(trace, plan_spec="none", budget_bytes=2 * peak)
    assert [p.plan for p in one.predictions] == ["none"]
    # the unchanged script predicts itself, plus what a tensor-level trace cannot see on a
    # GPU: cuBLAS's workspaces, one for the forward's thread and one for backward's
    assert one.predictions[0].peak_bytes == peak + 2 * cublas_workspace_bytes(
        hardware(None, trace.meta.device))
    assert one.predictions[0].fits is True

    hopeless = predict_plans(trace, budget_bytes=MIB)
    assert not hopeless.available and hopeless.message.startswith("the simulator gave no plans")


@real_simulator
def test_a_plan_apply_cannot_realise_is_marked_and_never_recommended(tmp_path, monkeypatch):
    trace = read_trace(make_trace(tmp_path / "t.trace", 4_000))
    peak = summarize(trace)["peak_bytes"]
    from memadvisor.simulate.hardware import cublas_workspace_bytes, hardware
    budget = int(peak * 0.8) + 2 * cublas_workspace_bytes(hardware(None, trace.meta.device))
    plain = predict_plans(trace, budget_bytes=budget)
    first = plain.recommended.plan
    seen = []

    def refuse_the_first(_trace, plan_list):
        seen.extend(p.to_compact() for p in plan_list)
        return {first: "step: no `optimizer.step()` call found for the optimizer"}

    monkeypatch.setattr(plans, "_apply_refusals", refuse_the_first)
    section = predict_plans(trace, budget_bytes=budget)
    assert first in seen  # every ranked plan was checked against the script
    marked = [p for p in section.predictions if p.apply_refused]
    assert [p.plan for p in marked] == [first]
    assert section.recommended is not None and section.recommended.plan != first
    assert section.recommended.fits and section.recommended.timeline


def test_without_the_script_no_plan_is_marked(tmp_path):
    trace = read_trace(make_trace(tmp_path / "t.trace", 1_000))
    assert plans._apply_refusals(trace, []) == {}  # a synthetic trace names no script
