"""A stand-in for the simulator behind the report's adapter (``report.plans``)."""
from __future__ import annotations


def fake_plans(peak_bytes: int, budget_bytes: int | None) -> list[dict]:
    """What the simulator's advise() is expected to return: ranked plans, best first."""
    budget = budget_bytes or peak_bytes
    return [
        {"plan": "precision=amp-bf16", "peak_bytes": int(peak_bytes * 0.7),
         "reserved_bytes": int(peak_bytes * 0.8), "step_time_factor": 0.9,
         "changes": "autocast to bfloat16", "fits": peak_bytes * 0.7 <= budget,
         "timeline": [(float(i), int(peak_bytes * 0.7 * i / 2999)) for i in range(3000)]},
        {"plan": "<b>checkpoint=auto</b>", "peak_bytes": int(peak_bytes * 0.5),
         "reserved_bytes": int(peak_bytes * 0.6), "step_time_factor": 1.3,
         "changes": "recompute <script>alert(3)</script> blocks", "fits": True},
    ]


def install_fake_simulator(monkeypatch) -> list:
    """Puts a stand-in behind the report's simulator adapter; returns its call log."""
    from memadvisor.report import plans
    from memadvisor.trace.summary import summarize

    calls = []

    def advise(trace, budget_bytes, num_gpus):
        calls.append(("advise", budget_bytes, num_gpus))
        return fake_plans(summarize(trace)["peak_bytes"], budget_bytes)

    def simulate(trace, plan_spec, budget_bytes):
        calls.append(("simulate", plan_spec))
        return dict(fake_plans(summarize(trace)["peak_bytes"], budget_bytes)[0], plan=plan_spec)

    monkeypatch.setattr(plans, "_simulator",
                        lambda: plans.Simulator(advise=advise, simulate=simulate))
    return calls
