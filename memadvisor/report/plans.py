"""The one place reports reach the simulator: plan predictions for the plan section.

The simulator is optional to a report: when ``memadvisor.simulate`` lacks its entry points
the report says so in its plan section and still judges the measured peak against the
budget.  The interface expected (docs/REPORTS.md, "Plan predictions"):

- ``memadvisor.simulate.advise(trace, budget_bytes=int | None, num_gpus=int) -> list[dict]``
  ranked best first;
- ``memadvisor.simulate.simulate(trace, plan_spec: str) -> dict``;

each dict with ``plan`` (str), ``peak_bytes``, ``reserved_bytes``, ``step_time_factor``,
``changes`` (str), ``fits`` (bool) and optionally ``timeline``: ``[(x, live_bytes), ...]``
where x is a time or an event number.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from ..trace.io import Trace

UNAVAILABLE = "plan predictions unavailable: simulator not installed in this version"
REQUIRED_KEYS = ("plan", "peak_bytes", "reserved_bytes", "step_time_factor", "changes", "fits")


@dataclass
class PlanPrediction:
    plan: str
    peak_bytes: int
    reserved_bytes: int
    step_time_factor: float
    changes: str
    fits: bool
    timeline: list[tuple[float, int]] | None = None  #: (time or event number, live bytes)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> "PlanPrediction":
        if not isinstance(data, dict):
            raise TypeError(f"{source} returned {type(data).__name__}, expected a dict")
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise TypeError(f"{source} returned a plan without {', '.join(missing)}")
        timeline = data.get("timeline")
        return cls(plan=str(data["plan"]), peak_bytes=int(data["peak_bytes"]),
                   reserved_bytes=int(data["reserved_bytes"]),
                   step_time_factor=float(data["step_time_factor"]),
                   changes=str(data["changes"]), fits=bool(data["fits"]),
                   timeline=None if timeline is None else
                   [(float(x), int(y)) for x, y in timeline])


@dataclass
class PlanSection:
    """What the report's plan section shows."""

    available: bool  #: False: the simulator is missing (``message`` says so)
    message: str = ""
    predictions: list[PlanPrediction] = field(default_factory=list)
    recommended: PlanPrediction | None = None
    requested: str = ""  #: 'plan' (--plan), 'budget' (--budget) or '' (neither)


def _entry_point(name: str):
    try:
        module = importlib.import_module("memadvisor.simulate")
    except ImportError:
        return None
    return getattr(module, name, None)


def validate_plan_spec(plan_spec: str) -> None:
    """Refuse a malformed ``--plan`` even when no simulator will read it (UserError)."""
    from ..plan import Plan

    Plan.parse(plan_spec)


def predict_plans(trace: Trace, *, plan_spec: str | None = None,
                  budget_bytes: int | None = None, num_gpus: int = 1) -> PlanSection:
    """Predictions for ``--plan`` (that one plan) or ``--budget`` (ranked plans)."""
    if plan_spec is not None:
        validate_plan_spec(plan_spec)
        simulate = _entry_point("simulate")
        if simulate is None:
            return PlanSection(available=False, message=UNAVAILABLE, requested="plan")
        prediction = PlanPrediction.from_dict(simulate(trace, plan_spec),
                                              "memadvisor.simulate.simulate")
        return PlanSection(available=True, predictions=[prediction], recommended=prediction,
                           requested="plan")
    if budget_bytes is None:
        return PlanSection(available=_entry_point("advise") is not None,
                           message="give --budget (and --gpus) or --plan for plan predictions")
    advise = _entry_point("advise")
    if advise is None:
        return PlanSection(available=False, message=UNAVAILABLE, requested="budget")
    predictions = [PlanPrediction.from_dict(p, "memadvisor.simulate.advise")
                   for p in advise(trace, budget_bytes=budget_bytes, num_gpus=num_gpus)]
    recommended = next((p for p in predictions if p.fits), None)
    message = "" if recommended else "no plan the simulator knows fits this budget"
    return PlanSection(available=True, message=message, predictions=predictions,
                       recommended=recommended, requested="budget")
