"""The one place reports reach the simulator: plan predictions for the plan section.

Reports need little from the simulator, and need it in one shape (docs/REPORTS.md, "Plan
predictions"):

- ``advise(trace, budget_bytes, num_gpus) -> list[dict]``: plans ranked best first;
- ``simulate(trace, plan_spec, budget_bytes) -> dict``: one plan;

each dict with ``plan`` (str), ``peak_bytes``, ``reserved_bytes``, ``step_time_factor``,
``changes`` (str), ``fits`` (bool, or None without a budget) and optionally ``timeline``:
``[(x, live_bytes), ...]`` where x is a time or an event position.

``_simulator()`` binds those two to ``memadvisor.simulate`` (``prepare``, ``hardware``,
``advise``, ``simulate``); it is the only code that knows the simulator's own API.  Without
the simulator, or when it refuses a trace (a ``UserError``, e.g. no complete step), the
report says so in its plan section and still judges the measured peak against the budget.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import UserError
from ..trace.io import Trace

UNAVAILABLE = "plan predictions unavailable: simulator not installed in this version"
REQUIRED_KEYS = ("plan", "peak_bytes", "reserved_bytes", "step_time_factor", "changes", "fits")
#: plans shown that do not fit, after those that do (the nearest misses say what is close)
SHOWN_OVER_BUDGET = 3


@dataclass
class PlanPrediction:
    plan: str
    peak_bytes: int
    reserved_bytes: int
    step_time_factor: float
    changes: str
    fits: bool | None  #: None: no budget to judge against
    timeline: list[tuple[float, int]] | None = None  #: (time or event position, live bytes)
    #: why ``memadvisor apply`` cannot rewrite the profiled script for this plan, if it cannot
    apply_refused: str | None = None

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
                   changes=str(data["changes"]),
                   fits=None if data["fits"] is None else bool(data["fits"]),
                   timeline=None if timeline is None else
                   [(float(x), int(y)) for x, y in timeline],
                   apply_refused=data.get("apply_refused"))


@dataclass
class PlanSection:
    """What the report's plan section shows."""

    available: bool  #: False: no predictions (``message`` says why)
    message: str = ""
    predictions: list[PlanPrediction] = field(default_factory=list)
    recommended: PlanPrediction | None = None
    requested: str = ""  #: 'plan' (--plan), 'budget' (--budget) or '' (neither)


@dataclass
class Simulator:
    """The two calls a report makes, in the shape documented above."""

    advise: Callable[[Trace, int, int], list[dict[str, Any]]]
    simulate: Callable[[Trace, str, int | None], dict[str, Any]]


def _simulator() -> Simulator | None:
    """``memadvisor.simulate`` seen through the report's interface (None when absent)."""
    try:
        sim = importlib.import_module("memadvisor.simulate")
        explain = importlib.import_module("memadvisor.simulate.explain")
    except ImportError:
        return None
    if not all(hasattr(sim, name) for name in ("prepare", "hardware", "advise", "simulate")):
        return None
    from ..plan import Plan
    from ..verify import baseline_as_applied  # the loop as apply rewrites it

    def as_dict(prediction, fits: bool | None, with_timeline: bool) -> dict[str, Any]:
        plan = prediction.plan
        reserved = prediction.reserved_bytes
        return {"plan": plan.to_compact() or "none", "peak_bytes": prediction.peak_bytes,
                "reserved_bytes": prediction.peak_bytes if reserved is None else reserved,
                "step_time_factor": prediction.step_time_factor,
                "changes": "; ".join(explain.changes(plan)) or "nothing (the script as is)",
                "fits": fits,
                "timeline": timeline_pairs(prediction.timeline) if with_timeline else None}

    def advise(trace: Trace, budget_bytes: int, num_gpus: int) -> list[dict[str, Any]]:
        base = baseline_as_applied(trace)
        result = sim.advise(base, sim.hardware(None, trace.meta.device), budget_bytes, num_gpus)
        refused = _apply_refusals(trace, [p.plan for p in result.ranked])
        first = next((i for i, p in enumerate(result.ranked)
                      if p.plan.to_compact() not in refused), None)
        # only the recommended plan's timeline is drawn: the first apply can realise
        shown = [{**as_dict(p, True, i == first),
                  "apply_refused": refused.get(p.plan.to_compact())}
                 for i, p in enumerate(result.ranked)]
        return shown + [as_dict(p, False, False) for p in result.too_big[:SHOWN_OVER_BUDGET]]

    def simulate(trace: Trace, plan_spec: str, budget_bytes: int | None) -> dict[str, Any]:
        base = baseline_as_applied(trace)
        prediction = sim.simulate(base, Plan.parse(plan_spec),
                                  sim.hardware(None, trace.meta.device))
        data = as_dict(prediction, None, True)
        if budget_bytes is not None:
            data["fits"] = data["reserved_bytes"] <= budget_bytes
        return data

    return Simulator(advise=advise, simulate=simulate)


def _apply_refusals(trace: Trace, plans) -> dict[str, str]:
    """Plan -> why ``apply`` cannot rewrite the profiled script for it (nothing runs);
    empty where the script is not there to check."""
    from ..verify import apply_refusals, recorded_script
    try:
        script = recorded_script(trace.meta, trace.path or "trace")
    except UserError:
        return {}
    recorded_on = "cuda" if str(trace.meta.device).startswith("cuda") else "cpu"
    return apply_refusals(script, plans, recorded_on)  # the report ranks for that device


def timeline_pairs(timeline) -> list[tuple[float, int]] | None:
    """The simulator's per-step timeline as (event position, live bytes) pairs, thinned
    for drawing like the measured one (each bucket's min and max kept).  The dashboard
    draws any plan it is asked about with this too."""
    import numpy as np

    from .timeline import MAX_BUCKETS, extreme_positions

    if timeline is None or not hasattr(timeline, "live_curve"):
        return None
    live, order = timeline.live_curve()
    keys = np.concatenate([timeline.free_key, timeline.alloc_key])[order]
    # storages alive before the step carry key -1: draw them at the step's first event
    keys = np.clip(keys, 0, max(int(getattr(timeline, "n_events", 1)) - 1, 0))
    keep = extreme_positions(live, MAX_BUCKETS, (int(np.argmax(live)),) if len(live) else ())
    return list(zip(keys[keep].astype(float).tolist(),
                    np.rint(live[keep]).astype(np.int64).tolist()))


def validate_plan_spec(plan_spec: str) -> None:
    """Refuse a malformed ``--plan`` even when no simulator will read it (UserError)."""
    from ..plan import Plan

    Plan.parse(plan_spec)


def predict_plans(trace: Trace, *, plan_spec: str | None = None,
                  budget_bytes: int | None = None, num_gpus: int = 1) -> PlanSection:
    """Predictions for ``--plan`` (that one plan) or ``--budget`` (ranked plans)."""
    requested = "plan" if plan_spec is not None else ("budget" if budget_bytes else "")
    if plan_spec is not None:
        validate_plan_spec(plan_spec)
    if not requested:
        return PlanSection(available=False, message="pass --budget (and --gpus) or --plan "
                                                    "for plan predictions")
    simulator = _simulator()
    if simulator is None:
        return PlanSection(available=False, message=UNAVAILABLE, requested=requested)
    try:
        if plan_spec is not None:
            raw = [simulator.simulate(trace, plan_spec, budget_bytes)]
        else:
            raw = simulator.advise(trace, budget_bytes, num_gpus)
    except UserError as exc:  # e.g. no complete step, or no plan fits: say why, keep the report
        return PlanSection(available=False, message=f"the simulator gave no plans: {exc}",
                           requested=requested)
    source = f"simulator {'simulate' if plan_spec is not None else 'advise'}"
    predictions = [PlanPrediction.from_dict(p, source) for p in raw]
    if plan_spec is not None:
        recommended = predictions[0]
    else:
        recommended = next((p for p in predictions if p.fits and not p.apply_refused), None)
    message = "" if recommended else "no plan the simulator knows fits this budget"
    return PlanSection(available=True, message=message, predictions=predictions,
                       recommended=recommended, requested=requested)


def out_of_memory_lines(trace: Trace, budget_bytes: int | None) -> list[str]:
    """The simulator's out-of-memory post-mortem as lines of text: for a trace whose
    allocator recorded running out, or a run that does not fit ``budget_bytes`` (taken as
    the device's memory).  Empty when neither, or without the simulator."""
    recorded = (trace.meta.allocator or {}).get("oom_events")
    if not recorded and not budget_bytes:
        return []
    try:
        oom = importlib.import_module("memadvisor.simulate.oom")
    except ImportError:
        return []
    if recorded and not budget_bytes:
        _, _, free = recorded[0]
        budget_bytes = int((trace.meta.allocator or {}).get("peak_reserved_bytes", 0)) + int(free)
    try:
        found = oom.post_mortem(trace, int(budget_bytes))
    except UserError as exc:
        return [f"no post-mortem: {exc}"]
    return oom.post_mortem_text(found).splitlines() if found is not None else []
