"""The dashboard's plan panel as plain data: the simulator's ranking for a budget and a
number of GPUs, and any one plan's prediction with the terms it is made of.

The same calls ``memadvisor advise`` and ``memadvisor simulate`` make (``prepare``,
``hardware``, ``advise``, ``simulate``, ``output.prediction_dict``), so a row of the table
is the number those commands print.  ``prepare`` runs once per trace, a ranking once per
(budget, GPUs); both are cached because the page asks again on every edit.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from ..plan import Plan
from ..report.build import decimate_pairs
from ..report.plans import SHOWN_OVER_BUDGET, timeline_pairs
from ..trace.io import Trace
from ..units import format_bytes


@dataclass
class PlanRanking:
    """What the plan table shows for one (budget, GPUs): fitting plans best first, then
    the nearest misses.  ``message`` says why there are none, or what to know."""

    budget_bytes: int | None
    num_gpus: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""


class PlanAdvisor:
    """The simulator bound to one trace and one target GPU."""

    def __init__(self, trace: Trace, gpu: str | None = None):
        from ..simulate import hardware

        self.trace = trace
        # an unknown --gpu is a UserError now, before the server starts
        self.hardware = hardware(gpu, trace.meta.device)
        self._base = None
        self._base_error: str | None = None
        self._rankings: dict[tuple[int, int], PlanRanking] = {}
        self._lock = threading.Lock()

    def baseline(self):
        """The simulator's ``prepare`` of the trace (UserError when it refuses it)."""
        from ..verify import baseline_as_applied

        with self._lock:
            if self._base is None and self._base_error is None:
                try:
                    self._base = baseline_as_applied(self.trace)
                except UserError as exc:
                    self._base_error = str(exc)
        if self._base_error is not None:
            raise UserError(self._base_error)
        return self._base

    def rank(self, budget_bytes: int | None, num_gpus: int = 1) -> PlanRanking:
        if not budget_bytes:
            return PlanRanking(None, num_gpus, message="enter a budget per GPU to rank plans")
        key = (int(budget_bytes), int(num_gpus))
        with self._lock:
            cached = self._rankings.get(key)
        if cached is not None:
            return cached
        ranking = self._rank(*key)
        with self._lock:
            self._rankings[key] = ranking
        return ranking

    def _rank(self, budget_bytes: int, num_gpus: int) -> PlanRanking:
        from ..simulate import advise

        try:
            base = self.baseline()
            result = advise(base, self.hardware, budget_bytes, num_gpus)
        except UserError as exc:  # no complete step, or no plan fits: say so in the panel
            return PlanRanking(budget_bytes, num_gpus, message=f"no plans: {exc}")
        rows = ([plan_row(p, True) for p in result.ranked]
                + [plan_row(p, False) for p in result.too_big[:SHOWN_OVER_BUDGET]])
        misses = ", then the nearest misses" if result.too_big else ""
        message = (f"{result.evaluated} plans evaluated for {num_gpus} GPU(s) of "
                   f"{format_bytes(budget_bytes)} (usable {format_bytes(result.usable_bytes)}"
                   f" with the 5% margin): {len(result.ranked)} that fit, fastest first"
                   f"{misses}")
        return PlanRanking(budget_bytes, num_gpus, rows, message)

    def detail(self, plan_spec: str) -> dict[str, Any]:
        """One plan's prediction (``simulate --json``'s keys) plus ``timeline``: its
        predicted live bytes as (event position in the step, bytes), thinned for drawing."""
        from ..simulate import simulate
        from ..simulate.output import simulate_dict

        base = self.baseline()
        # the spec comes from the page: a spec, never a path the server would open
        prediction = simulate(base, Plan.parse_spec(plan_spec), self.hardware)
        data = simulate_dict(base, prediction, self.hardware)
        pairs = timeline_pairs(prediction.timeline)
        data["timeline"] = decimate_pairs(pairs) if pairs else []
        return data


def plan_row(prediction, fits: bool) -> dict[str, Any]:
    """A table row: raw numbers for sorting and tests, text for reading."""
    from ..simulate import explain

    plan = prediction.plan
    reserved = prediction.reserved_bytes
    reserved = prediction.peak_bytes if reserved is None else int(reserved)
    return {"plan": plan.to_compact() or "none", "peak_bytes": int(prediction.peak_bytes),
            "reserved_bytes": reserved,
            "step_time_factor": round(float(prediction.step_time_factor), 4),
            "fits": "yes" if fits else "no",
            "peak": format_bytes(prediction.peak_bytes), "reserved": format_bytes(reserved),
            "step_time": f"x{prediction.step_time_factor:.3f}",
            "changes": "; ".join(explain.changes(plan))}
