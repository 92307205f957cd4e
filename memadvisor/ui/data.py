"""What the dashboard shows, as plain data: no dash, no plotly here.

``DashboardData`` reads the trace once and keeps what every callback needs (live bytes,
storage lifetimes, the summary, the comparison); the step timelines and the storages alive
at a moment are computed on demand from it with the same functions ``summary`` and the
HTML report use (``memadvisor.trace.analysis``, ``report.timeline.step_timeline``), so a
peak means the same thing on the page as on the command line.

Nothing here sends per-event data anywhere: a timeline is decimated (``step_timeline``),
and a moment's table keeps its ``max_rows`` largest storages plus their totals.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..report.build import read_source_code
from ..report.compare import compare_traces
from ..report.timeline import StepTimeline, step_timeline
from ..trace import analysis, schema
from ..trace.io import Trace, read_trace
from ..trace.summary import peak_sites, shorten_paths, summarize

#: rows of the "alive at this moment" table sent to the page (largest first)
MAX_MOMENT_ROWS = 200
#: the step selector's value for "the whole run" (a trace without a complete step)
WHOLE_RUN = -1


@dataclass
class Moment:
    """The storages alive just after one event, largest first."""

    position: int  #: the event's position in the trace (0-based)
    seq: int
    step: int | None
    time_ms: float  #: since the step began, as on the timeline's x axis
    phase: str
    module: str
    op: str
    live_bytes: int  #: the timeline's total at this event
    storage_count: int  #: storages alive (all of them, not only the rows)
    by_category: dict[str, int]
    rows: list[dict[str, Any]]  #: at most ``MAX_MOMENT_ROWS``, largest first

    @property
    def rows_bytes(self) -> int:
        return sum(r["bytes"] for r in self.rows)


@dataclass
class DashboardData:
    """One trace (and optionally a baseline), read once, queried by the callbacks."""

    trace: Trace
    summary: dict[str, Any]
    live: np.ndarray  #: live bytes after each event (``analysis.live_bytes``)
    lives: pd.DataFrame  #: one row per storage (``analysis.lifetimes``)
    baseline: Trace | None = None
    comparison: dict[str, Any] | None = None
    _columns: dict = field(default_factory=dict, repr=False)
    _windows: dict = field(default_factory=dict, repr=False)
    _timelines: dict = field(default_factory=dict, repr=False)
    _sites: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def analysed_step(self) -> int | None:
        return self.summary["analysed_step"]

    def timeline(self, step: int | None = None) -> StepTimeline:
        """The decimated timeline of ``step`` (None: the analysed step), cached."""
        step = self.analysed_step if step is None else step
        with self._lock:
            if step not in self._timelines:
                self._timelines[step] = step_timeline(self.trace, step, live=self.live)
            return self._timelines[step]

    def lifetime_columns(self) -> dict[str, np.ndarray]:
        """``lives``' columns a moment needs, as arrays (made once: a click filters these,
        not the whole frame)."""
        with self._lock:
            if not self._columns:
                lives = self.lives
                categories = pd.Categorical(lives["category"].astype(str),
                                            categories=list(schema.CATEGORIES))
                self._columns.update(
                    alloc_pos=lives["alloc_pos"].to_numpy(np.int64),
                    free_pos=lives["free_pos"].to_numpy(np.int64),
                    size=lives["size_bytes"].to_numpy(np.int64),
                    counted=analysis.counted_bytes(lives),
                    # a category the schema does not know: a bin of its own, not shown
                    category=np.where(categories.codes < 0, len(schema.CATEGORIES),
                                      categories.codes).astype(np.int64))
            return self._columns

    def step_window(self, step: int | None) -> slice:
        """``analysis.step_slice`` (a binary search of a million steps: kept per step)."""
        with self._lock:
            if step not in self._windows:
                self._windows[step] = analysis.step_slice(self.trace.events, step)
            return self._windows[step]

    def sites(self, step: int | None) -> dict[str, Any]:
        """``summary.peak_sites`` of ``step`` (None: the whole run), each top site with
        its code line (``code``) and its path relative to the script's folder; cached."""
        with self._lock:
            if step not in self._sites:
                sites = peak_sites(self.trace.events, self.live, self.lives, step)
                base = self.trace.meta.cwd or os.getcwd()
                for site, code in zip(sites["top_sites"],
                                      read_source_code(sites["top_sites"], base)):
                    site["code"] = code
                shorten_paths(sites, base)
                self._sites[step] = sites
            return self._sites[step]


def load(trace_path: str, baseline_path: str | None = None) -> DashboardData:
    """Read the trace (and baseline); a missing or damaged file is a one-line TraceError."""
    return from_traces(*read(trace_path, baseline_path))


def read(trace_path: str, baseline_path: str | None = None) -> tuple[Trace, Trace | None]:
    trace = read_trace(trace_path)
    return trace, read_trace(baseline_path) if baseline_path else None


def from_traces(trace: Trace, baseline: Trace | None = None) -> DashboardData:
    live, lives = analysis.live_bytes(trace.events), analysis.lifetimes(trace.events)
    summary = summarize(trace, live=live, lives=lives)
    shorten_paths(summary, trace.meta.cwd or os.getcwd())
    comparison = compare_traces(baseline, trace) if baseline is not None else None
    data = DashboardData(trace=trace, summary=summary, live=live, lives=lives,
                         baseline=baseline, comparison=comparison)
    data.lifetime_columns()  # now, not at the first click
    return data


def step_options(data: DashboardData) -> list[dict[str, Any]]:
    """The step selector's choices: every step in the trace, the analysed one marked."""
    steps = np.unique(data.trace.events["step"].to_numpy()) if len(data.trace.events) else []
    analysed = data.analysed_step
    if analysed is None:
        return [{"label": "whole run (no complete step)", "value": WHOLE_RUN}]
    done = data.trace.meta.steps_completed
    options = []
    for step in (int(s) for s in steps):
        note = " (analysed: last complete)" if step == analysed else (
            " (partial)" if step >= done else "")
        options.append({"label": f"step {step}{note}", "value": step})
    return options


def step_value(value: Any) -> int | None:
    """The selector's value as a step index (None: the whole run)."""
    if value is None or value == WHOLE_RUN:
        return None
    return int(value)


def clicked_position(data: DashboardData, step: int | None,
                     click_data: dict | None) -> int | None:
    """The event position a click on the timeline of ``step`` points at (None: no click).

    Every category's chart trace is drawn at the same events, so a point's index is an
    index into the timeline's ``positions`` whichever category was clicked; a click whose
    index does not fit (a figure of another step) falls back to the nearest time."""
    points = (click_data or {}).get("points") or []
    if not points:
        return None
    timeline = data.timeline(step)
    if not timeline.points:
        return None
    point = points[0]
    index = point.get("pointIndex", point.get("pointNumber"))
    x = point.get("x")
    if index is None or not 0 <= int(index) < timeline.points or (
            x is not None and abs(float(timeline.time_ms[int(index)]) - float(x)) > 1e-3 *
            max(1.0, abs(float(x)))):
        if x is None:
            return None
        index = int(np.argmin(np.abs(timeline.time_ms - float(x))))
    return data.step_window(step).start + int(timeline.positions[int(index)])


def peak_position(data: DashboardData, step: int | None) -> int:
    position, _ = analysis.peak_in(data.live, data.step_window(step))
    return position


def moment(data: DashboardData, position: int, step: int | None,
           max_rows: int = MAX_MOMENT_ROWS) -> Moment:
    """What is alive just after the event at ``position``, and which line made it.

    The storages alive (``analysis.alive_at``'s rule), their bytes per category
    (``analysis.by_category``'s) and the largest first (ties in trace order), found on
    arrays: only the rows shown are read from the frame."""
    events = data.trace.events
    columns = data.lifetime_columns()
    alive = np.flatnonzero((columns["alloc_pos"] <= position)
                           & (columns["free_pos"] > position))
    sums = np.bincount(columns["category"][alive], weights=columns["counted"][alive],
                       minlength=len(schema.CATEGORIES) + 1)
    by_category = {c: int(sums[i]) for i, c in enumerate(schema.CATEGORIES) if int(sums[i])}
    sizes = columns["size"][alive]
    if len(alive) > max_rows:  # only the storages as large as the max_rows-th can be shown
        kept = sizes >= np.partition(sizes, len(sizes) - max_rows)[len(sizes) - max_rows]
        alive_kept, sizes = alive[kept], sizes[kept]
    else:
        alive_kept = alive
    largest = alive_kept[np.lexsort((alive_kept, -sizes))[:max_rows]]
    row = events.iloc[position]
    window = data.step_window(step)
    timeline = data.timeline(step)
    start_ms = float(timeline.time_ms[0]) if timeline.points else 0.0
    first_ns = int(events["time_ns"].iat[window.start]) if window.stop > window.start else 0
    time_ms = start_ms + (int(row["time_ns"]) - first_ns) / 1e6
    base = data.trace.meta.cwd or ""
    shown = data.lives.iloc[largest]  # a list per column: no row objects, no categories
    rows = [_storage_row(r, base) for r in zip(*(shown[name].tolist() for name in ROW_FIELDS))]
    return Moment(position=position, seq=int(row["seq"]), step=step, time_ms=time_ms,
                  phase=str(row["phase"]), module=str(row["module"]), op=str(row["op"]),
                  live_bytes=int(data.live[position]), storage_count=len(alive),
                  by_category=by_category, rows=rows)


#: the columns of ``lives`` a moment's row is made of, in ``_storage_row``'s order
ROW_FIELDS = ("size_bytes", "category", "op", "module", "dtype", "shape", "source_file",
              "source_line", "source_function", "phase", "storage_id")


def _storage_row(r: tuple, base: str) -> dict[str, Any]:
    (size_bytes, category, op, module, dtype, shape, source_file, source_line,
     source_function, phase, storage_id) = r
    source = str(source_file)
    if base and source.startswith(base + os.sep):
        source = os.path.relpath(source, base)
    where = f"{source}:{int(source_line)}" if source else "(no user frame)"
    return {"bytes": int(size_bytes), "category": str(category), "op": str(op),
            "module": str(module) or "(top level)", "dtype": str(dtype),
            "shape": f"[{shape}]", "source": where,
            "function": str(source_function), "phase": str(phase),
            "storage_id": int(storage_id)}
