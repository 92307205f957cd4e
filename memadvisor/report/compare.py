"""``memadvisor compare``'s core: what changed between two traces (or two steps of one).

Each side is one step (default: the analysed, last complete step) described two ways:
*at the peak* (bytes alive at that step's peak, by category and by module) and *in total*
(bytes allocated during the step).  The peak and what is alive there come from
``memadvisor.trace.analysis`` exactly as ``summarize`` computes them, so the analysed
step's numbers here equal ``memadvisor summary``'s.

The result's keys are a stable interface (``compare --json``):

- ``a``, ``b``: ``trace``, ``step``, ``events``, ``peak_bytes``, ``allocated_bytes``,
  ``duration_s`` (null where not timed), ``peak`` (``phase``, ``module``, ``op``)
- ``peak_change_bytes``, ``peak_change_ratio`` (null when A's peak is 0)
- ``by_category``, ``by_module``: rows of ``name``, ``a_peak_bytes``, ``b_peak_bytes``,
  ``peak_change_bytes``, ``a_allocated_bytes``, ``b_allocated_bytes``,
  ``allocated_change_bytes``; categories in schema order, modules by the size of the change
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UserError
from ..trace import analysis, schema
from ..trace.io import Trace

TOP_MODULES = 15
TOP_LEVEL = "(top level)"


def step_profile(trace: Trace, step: int | None = None) -> dict[str, Any]:
    """One step at its peak and in total; ``step=None`` is the analysed step."""
    events = trace.events
    if step is None:
        step = analysis.analysed_step(trace)
    else:
        _check_step(trace, step)
    live = analysis.live_bytes(events)
    window = analysis.step_slice(events, step)
    position, peak_bytes = analysis.peak_in(live, window)
    lives = analysis.lifetimes(events)
    alive = analysis.alive_at(lives, position) if position >= 0 else lives.iloc[:0]
    in_step = events.iloc[window]
    allocs = in_step[(in_step["action"] == schema.ALLOC).to_numpy()]
    durations = {s.get("index"): s.get("duration_s") for s in trace.meta.steps}
    peak_row = events.iloc[position] if position >= 0 else None
    return {
        "trace": trace.path,
        "step": step,
        "events": int(window.stop - window.start),
        "peak_bytes": peak_bytes,
        "allocated_bytes": int(analysis.counted_bytes(allocs).sum()),
        "duration_s": durations.get(step),
        "peak": None if peak_row is None else {
            "phase": str(peak_row["phase"]), "module": str(peak_row["module"]),
            "op": str(peak_row["op"])},
        "at_peak_by_category": analysis.by_category(alive),
        "at_peak_by_module": _sum_by(alive, "module"),
        "allocated_by_category": _sum_by(allocs, "category"),
        "allocated_by_module": _sum_by(allocs, "module"),
    }


def _check_step(trace: Trace, step: int) -> None:
    steps = np.unique(trace.events["step"].to_numpy())
    if step not in steps:
        have = f"{steps.min()}-{steps.max()}" if len(steps) else "none"
        raise UserError(f"{trace.path}: no step {step} in the trace (steps {have})")


def _sum_by(frame, key: str) -> dict[str, int]:
    sums = analysis.bytes_by(frame, key)["sum"]
    label = (lambda name: str(name) or TOP_LEVEL) if key == "module" else str
    return {label(name): int(size) for name, size in sums.items() if size}


def _rows(names, a: dict, b: dict) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        a_peak = a["at_peak"].get(name, 0)
        b_peak = b["at_peak"].get(name, 0)
        a_alloc = a["allocated"].get(name, 0)
        b_alloc = b["allocated"].get(name, 0)
        rows.append({"name": name, "a_peak_bytes": a_peak, "b_peak_bytes": b_peak,
                     "peak_change_bytes": b_peak - a_peak, "a_allocated_bytes": a_alloc,
                     "b_allocated_bytes": b_alloc, "allocated_change_bytes": b_alloc - a_alloc})
    return rows


def compare_profiles(a: dict[str, Any], b: dict[str, Any],
                     top_modules: int = TOP_MODULES) -> dict[str, Any]:
    def side(profile, kind):
        return {"at_peak": profile[f"at_peak_by_{kind}"],
                "allocated": profile[f"allocated_by_{kind}"]}

    seen = set(a["at_peak_by_category"]) | set(b["at_peak_by_category"]) | \
        set(a["allocated_by_category"]) | set(b["allocated_by_category"])
    order = {c: i for i, c in enumerate(schema.CATEGORIES)}
    categories = sorted(seen, key=lambda c: (order.get(c, len(order)), c))
    modules = set(a["at_peak_by_module"]) | set(b["at_peak_by_module"]) | \
        set(a["allocated_by_module"]) | set(b["allocated_by_module"])
    module_rows = _rows(sorted(modules), side(a, "module"), side(b, "module"))
    module_rows = [r for r in module_rows
                   if r["peak_change_bytes"] or r["allocated_change_bytes"]]
    module_rows.sort(key=lambda r: (-abs(r["peak_change_bytes"]),
                                    -abs(r["allocated_change_bytes"]), r["name"]))
    keys = ("trace", "step", "events", "peak_bytes", "allocated_bytes", "duration_s", "peak")
    change = b["peak_bytes"] - a["peak_bytes"]
    return {
        "a": {k: a[k] for k in keys},
        "b": {k: b[k] for k in keys},
        "peak_change_bytes": change,
        "peak_change_ratio": change / a["peak_bytes"] if a["peak_bytes"] else None,
        "by_category": _rows(categories, side(a, "category"), side(b, "category")),
        "by_module": module_rows[:top_modules],
    }


def compare_traces(a: Trace, b: Trace, *, step_a: int | None = None,
                   step_b: int | None = None, top_modules: int = TOP_MODULES) -> dict[str, Any]:
    return compare_profiles(step_profile(a, step_a), step_profile(b, step_b), top_modules)


def _signed(value: float) -> str:
    from ..units import format_bytes

    return ("+" if value > 0 else "") + format_bytes(value) if value else "0"


def compare_text(result: dict[str, Any]) -> str:
    """The human-readable comparison (plain text, pastes into a review)."""
    from ..units import format_bytes as fb

    a, b = result["a"], result["b"]
    ratio = result["peak_change_ratio"]
    pct = f", {100 * ratio:+.1f}%" if ratio is not None else ""
    def which(side):
        return "whole run (no complete step)" if side["step"] is None else f"step {side['step']}"

    lines = [f"A: {a['trace']} {which(a)}  ({a['events']:,} events)",
             f"B: {b['trace']} {which(b)}  ({b['events']:,} events)",
             f"peak: {fb(a['peak_bytes'])} -> {fb(b['peak_bytes'])} "
             f"({_signed(result['peak_change_bytes'])}{pct})",
             f"allocated in the step: {fb(a['allocated_bytes'])} -> {fb(b['allocated_bytes'])} "
             f"({_signed(b['allocated_bytes'] - a['allocated_bytes'])})", ""]

    def table(title, rows):
        lines.append(f"{title:<28} {'A at peak':>11} {'B at peak':>11} {'change':>11}   "
                     f"{'A total':>11} {'B total':>11} {'change':>11}")
        for r in rows:
            lines.append(f"  {r['name'][:26]:<26} {fb(r['a_peak_bytes']):>11} "
                         f"{fb(r['b_peak_bytes']):>11} {_signed(r['peak_change_bytes']):>11}   "
                         f"{fb(r['a_allocated_bytes']):>11} {fb(r['b_allocated_bytes']):>11} "
                         f"{_signed(r['allocated_change_bytes']):>11}")

    table("by category", result["by_category"])
    lines.append("")
    if result["by_module"]:
        table("modules that changed most", result["by_module"])
    else:
        lines.append("no module changed")
    return "\n".join(lines)
