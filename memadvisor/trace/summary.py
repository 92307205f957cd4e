"""``memadvisor summary``'s core: what fills memory at the peak, as plain data.

The keys of ``summarize()``'s result are a documented, stable interface (``--json``):

- ``peak_bytes``: peak live bytes in the analysed (last complete) step
- ``analysed_step``: that step's index (null when no step completed: then the whole trace)
- ``peak``: where the peak is: ``seq``, ``time_ns``, ``phase``, ``module``, ``op``
- ``by_category``: bytes per category alive at the peak
- ``steps``: per step ``index``, ``peak_bytes``, ``duration_s`` (null where not timed)
- ``parameter_bytes``, ``buffer_bytes``, ``gradient_bytes`` (most alive at once in the
  analysed step), ``optimizer_state_bytes`` (alive at the end of it)
- ``top_sites``: up to 10 allocation sites alive at the peak, largest first, each with
  ``source_file``, ``source_line``, ``source_function``, ``op``, ``module``, ``category``,
  ``bytes``, ``count``
- ``reserved_bytes``, ``segments``: the CUDA caching allocator's peak reserved bytes and
  its segment count where one reported them (None otherwise)
- ``top_activation_modules``: modules by activation bytes alive when activations peak
- ``status``, ``error``, ``steps_completed``, ``device``, ``script``, ``events``
"""
from __future__ import annotations

from typing import Any

from . import analysis, schema
from .io import Trace

TOP_SITES = 10
TOP_MODULES = 10


def summarize(trace: Trace, top: int = TOP_SITES, *, live=None, lives=None) -> dict[str, Any]:
    """``live`` / ``lives``: ``analysis.live_bytes`` / ``analysis.lifetimes`` of the trace's
    events where the caller has them already (the dashboard keeps both)."""
    events = trace.events
    meta = trace.meta
    live = analysis.live_bytes(events) if live is None else live
    step = analysis.analysed_step(trace)
    lives = analysis.lifetimes(events) if lives is None else lives
    at_peak = peak_sites(events, live, lives, step, top)
    position, peak_bytes = at_peak["position"], at_peak["peak_bytes"]
    durations = {s["index"]: s.get("duration_s") for s in meta.steps}
    steps = [{"index": s["index"], "peak_bytes": s["peak_bytes"],
              "duration_s": durations.get(s["index"])}
             for s in analysis.step_peaks(events, live)]
    peak_row = events.iloc[position] if position >= 0 else None
    return {
        "trace": trace.path,
        "script": meta.script,
        "status": meta.status,
        "error": meta.error,
        "device": meta.device,
        "events": len(events),
        "steps_completed": meta.steps_completed,
        "analysed_step": step,
        "peak_bytes": peak_bytes,
        "peak": None if peak_row is None else {
            "seq": int(peak_row["seq"]), "time_ns": int(peak_row["time_ns"]),
            "phase": str(peak_row["phase"]), "module": str(peak_row["module"]),
            "op": str(peak_row["op"]),
        },
        "by_category": at_peak["by_category"],
        "steps": steps,
        "parameter_bytes": int(meta.parameter_bytes),
        "buffer_bytes": int(meta.buffer_bytes),
        "gradient_bytes": at_peak["gradient_bytes"],
        "optimizer_state_bytes": at_peak["optimizer_state_bytes"],
        "top_sites": at_peak["top_sites"],
        "top_activation_modules": at_peak["top_activation_modules"],
        **allocator_figures(meta, step),
    }


def allocator_figures(meta, step: int | None) -> dict[str, Any]:
    """What a CUDA caching allocator itself reported (None where no allocator did): peak
    reserved bytes and segments, from an imported snapshot or a run's per-step stats."""
    allocator = meta.allocator or {}
    reserved = allocator.get("peak_reserved_bytes")
    if reserved is None:
        by_step = {s.get("index"): s.get("cuda_max_reserved_bytes") for s in meta.steps}
        reserved = by_step.get(step)
    return {"reserved_bytes": None if reserved is None else int(reserved),
            "segments": allocator.get("segments")}


def peak_sites(events, live, lives, step: int | None, top: int = TOP_SITES) -> dict[str, Any]:
    """One step's peak (``step`` None: the whole run): its event position and bytes, the
    bytes alive there per category, the largest allocation sites alive there, the modules holding the most activations when
    activations peak, and the step's gradient and optimizer-state bytes."""
    window = analysis.step_slice(events, step)
    position, peak_bytes = analysis.peak_in(live, window)
    alive = analysis.alive_at(lives, position) if position >= 0 else lives.iloc[:0]
    return {"position": position, "peak_bytes": peak_bytes,
            "by_category": analysis.by_category(alive),
            "gradient_bytes": _most_alive(events, schema.GRADIENT, window),
            "optimizer_state_bytes": _alive_at_end(events, schema.OPTIMIZER_STATE, window),
            "top_sites": _top_sites(alive, top),
            "top_activation_modules": _activation_modules(events, lives, window)}


def _most_alive(events, category: str, window: slice) -> int:
    series = analysis.category_series(events, category)[window]
    return int(series.max()) if len(series) else 0


def _alive_at_end(events, category: str, window: slice) -> int:
    series = analysis.category_series(events, category)[window]
    return int(series[-1]) if len(series) else 0


def _top_sites(alive, top: int) -> list[dict[str, Any]]:
    if alive.empty:
        return []
    keys = ["source_file", "source_line", "source_function", "op", "module", "category"]
    groups = (analysis.bytes_by(alive, keys, ("sum", "count"))
              .reset_index().sort_values("sum", ascending=False, kind="stable").head(top))
    return [{"source_file": str(r.source_file), "source_line": int(r.source_line),
             "source_function": str(r.source_function), "op": str(r.op),
             "module": str(r.module), "category": str(r.category),
             "bytes": int(r.sum), "count": int(r.count)} for r in groups.itertuples()]


def _activation_modules(events, lives, window: slice) -> list[dict[str, Any]]:
    series = analysis.category_series(events, schema.ACTIVATION)
    position, peak = analysis.peak_in(series, window)
    if position < 0 or peak <= 0:
        return []
    alive = analysis.alive_at(lives, position)
    alive = alive[alive["category"] == schema.ACTIVATION]
    sums = analysis.bytes_by(alive, "module")["sum"].sort_values(
        ascending=False, kind="stable").head(TOP_MODULES)
    return [{"module": str(m) or "(top level)", "bytes": int(b)} for m, b in sums.items()
            if b > 0]


def summary_text(summary: dict[str, Any]) -> str:
    """The human-readable summary (no colours, so it pastes into issues)."""
    from ..units import format_bytes as fb

    lines = []
    status = "" if summary["status"] == "completed" else \
        f"  [run {summary['status']}: {summary['error']}]"
    lines.append(f"trace: {summary['trace']}  ({summary['events']:,} events, "
                 f"{summary['steps_completed']} steps, device {summary['device']}){status}")
    step = summary["analysed_step"]
    where = summary["peak"] or {}
    step_text = f"step {step} (the last complete step)" if step is not None else \
        "the whole run (no step completed)"
    lines.append(f"peak: {fb(summary['peak_bytes'])} in {step_text}, during "
                 f"{where.get('phase', '?')} in {where.get('module') or '(top level)'} "
                 f"at {where.get('op') or '?'}")
    if summary.get("reserved_bytes") is not None:
        segments = f" in {summary['segments']:,} segments" if summary.get("segments") else ""
        how = " (the allocator model, from a fresh process)" \
            if summary.get("reserved_source") == "modelled" else ""
        lines.append(f"reserved by the CUDA caching allocator: {fb(summary['reserved_bytes'])}"
                     f"{segments} (peak){how}")
        modelled = [s for s in summary["steps"] if s.get("modelled_reserved_bytes")]
        if modelled:
            lines.append("reserved per step: " + ", ".join(
                f"{s['index']}: {fb(s['modelled_reserved_bytes'])}" for s in modelled))
    lines.append("")
    lines.append("at the peak, by category:")
    total = max(summary["peak_bytes"], 1)
    for category, size in sorted(summary["by_category"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {category:<16} {fb(size):>12}  {100 * size / total:5.1f}%")
    lines.append("")
    lines.append(f"model state: parameters {fb(summary['parameter_bytes'])}, gradients "
                 f"{fb(summary['gradient_bytes'])}, optimizer state "
                 f"{fb(summary['optimizer_state_bytes'])}")
    lines.append("peak per step: " + _few(
        [f"{s['index']}: {fb(s['peak_bytes'])}" for s in summary["steps"]]))
    if summary["top_sites"]:
        lines.append("")
        lines.append("largest allocation sites alive at the peak:")
        for site in summary["top_sites"]:
            where = f"{site['source_file']}:{site['source_line']}" if site["source_file"] \
                else "(no user frame)"
            lines.append(f"  {fb(site['bytes']):>12}  {site['count']:>4}x  {site['category']:<15} "
                         f"{site['op']:<28} {site['module'] or '-':<24} {where}")
    if summary["top_activation_modules"]:
        lines.append("")
        lines.append("modules holding the most activations:")
        for entry in summary["top_activation_modules"]:
            lines.append(f"  {fb(entry['bytes']):>12}  {entry['module']}")
    return "\n".join(lines)


def _few(items: list[str], each_end: int = 8) -> str:
    """A long per-step list as its first and last entries (--json has them all)."""
    if len(items) <= 2 * each_end + 1:
        return ", ".join(items)
    return (", ".join(items[:each_end]) + f", ... ({len(items) - 2 * each_end} more), "
            + ", ".join(items[-each_end:]) + f"  [{len(items):,} steps; --json has all]")


def shorten_paths(summary: dict[str, Any], base: str) -> None:
    """Make source paths relative to ``base`` for display (JSON keeps them absolute)."""
    import os
    for site in summary["top_sites"]:
        if site["source_file"].startswith(base + os.sep):
            site["source_file"] = os.path.relpath(site["source_file"], base)


__all__ = ["summarize", "summary_text", "shorten_paths", "peak_sites"]
