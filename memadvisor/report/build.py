"""Everything a report shows, computed from traces as plain data (no HTML here).

``build_report`` gathers the summary (peak, breakdown, sites, modules), the decimated
timeline, the budget verdict, the plan predictions, the advice beyond plans and the
baseline comparison; ``html``
turns that into a page.  Kept apart so the numbers can be tested without parsing HTML.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..trace.io import Trace
from ..trace.summary import shorten_paths, summarize
from ..units import format_bytes
from .advice import report_advice
from .compare import compare_traces
from .plans import PlanSection, out_of_memory_lines, predict_plans
from .timeline import MAX_BUCKETS, StepTimeline, extreme_positions, step_timeline

#: the predicted timeline is drawn half as wide as the measured one
PREDICTED_BUCKETS = MAX_BUCKETS // 2


@dataclass
class Headline:
    peak_bytes: int
    step: int | None
    budget_bytes: int | None = None
    fits: bool | None = None  #: None when no budget was given
    margin_bytes: int = 0  #: budget - peak (negative: over by that much)
    num_gpus: int = 1

    @property
    def text(self) -> str:
        where = f"step {self.step}" if self.step is not None else "the whole run"
        peak = f"Peak {format_bytes(self.peak_bytes)} in {where}"
        if self.budget_bytes is None:
            return f"{peak}; no budget given (pass --budget to judge the fit)"
        per_gpu = " per GPU" if self.num_gpus > 1 else ""
        if self.fits:
            return (f"{peak}: fits the {format_bytes(self.budget_bytes)}{per_gpu} budget with "
                    f"{format_bytes(self.margin_bytes)} to spare")
        return (f"{peak}: does not fit the {format_bytes(self.budget_bytes)}{per_gpu} budget, "
                f"over by {format_bytes(-self.margin_bytes)}")


@dataclass
class ReportData:
    trace: Trace
    summary: dict[str, Any]
    timeline: StepTimeline
    headline: Headline
    plans: PlanSection
    source_code: list[str] = field(default_factory=list)  #: code of each top site, or ''
    comparison: dict[str, Any] | None = None
    baseline_path: str = ""
    generated_unix_s: float = 0.0
    #: where the run runs out of the budget's (or the recorded device's) memory, as text
    out_of_memory: list[str] = field(default_factory=list)
    #: ``memadvisor.advice`` as dicts (in-place changes, allocator settings, data loading)
    advice: list[dict[str, Any]] = field(default_factory=list)
    advice_note: str = ""  #: why there is no advice, where it could not be read


def headline(summary: dict[str, Any], budget_bytes: int | None, num_gpus: int = 1) -> Headline:
    peak = summary["peak_bytes"]
    if budget_bytes is None:
        return Headline(peak, summary["analysed_step"], num_gpus=num_gpus)
    return Headline(peak, summary["analysed_step"], budget_bytes, peak <= budget_bytes,
                    budget_bytes - peak, num_gpus)


def decimate_pairs(pairs: list[tuple[float, int]], max_buckets: int = PREDICTED_BUCKETS
                   ) -> list[tuple[float, int]]:
    """A predicted timeline thinned like the measured one (min and max per bucket kept)."""
    if len(pairs) <= 2 * max_buckets + 2:
        return pairs
    values = np.asarray([p[1] for p in pairs], dtype=np.int64)
    return [pairs[i] for i in extreme_positions(values, max_buckets)]


def read_source_code(sites: list[dict[str, Any]], base: str) -> list[str]:
    """The code at each site ('' where unknown).  Only readable .py files: a trace naming
    other files must not pull their contents into a report that gets shared."""
    import linecache

    code = []
    for site in sites:
        name, number = site["source_file"], site["source_line"]
        path = name if os.path.isabs(name) else os.path.join(base, name)
        readable = name.endswith(".py") and number > 0 and os.path.isfile(path)
        code.append(linecache.getline(path, number).strip() if readable else "")
    return code


def build_report(trace: Trace, *, budget_bytes: int | None = None, num_gpus: int = 1,
                 plan_spec: str | None = None, baseline: Trace | None = None,
                 max_buckets: int = MAX_BUCKETS) -> ReportData:
    summary = summarize(trace)
    base = trace.meta.cwd or os.getcwd()
    source_code = read_source_code(summary["top_sites"], base)
    shorten_paths(summary, base)
    plans = predict_plans(trace, plan_spec=plan_spec, budget_bytes=budget_bytes,
                          num_gpus=num_gpus)
    if plans.recommended is not None and plans.recommended.timeline:
        plans.recommended.timeline = decimate_pairs(plans.recommended.timeline,
                                                    max(max_buckets // 2, 1))
    comparison = compare_traces(baseline, trace) if baseline is not None else None
    advice, advice_note = report_advice(trace)
    return ReportData(
        trace=trace, summary=summary,
        timeline=step_timeline(trace, max_buckets=max_buckets),
        headline=headline(summary, budget_bytes, num_gpus), plans=plans,
        source_code=source_code, comparison=comparison,
        baseline_path=baseline.path if baseline is not None else "",
        generated_unix_s=time.time(),
        out_of_memory=out_of_memory_lines(trace, budget_bytes),
        advice=advice, advice_note=advice_note)
