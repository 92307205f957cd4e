"""One step's memory timeline, stacked by category and decimated for drawing.

A million events cannot be drawn, and plain subsampling would miss the peak, so the step
is cut into at most ``max_buckets`` runs of consecutive events and each bucket keeps the
events where the total live bytes are lowest and highest.  Every category is sampled at the
*same* events, so the stacked areas add up exactly to the total at every drawn point; the
exact global peak and each category's own highest point are always kept.

The series come from ``memadvisor.trace.analysis`` (``live_bytes``, ``category_series``,
``peak_in``), so the peak drawn is the peak ``summary`` and ``check`` report.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..trace import analysis, schema
from ..trace.io import Trace

#: 800 buckets keep at most ~1,600 points: more than a report's chart has pixel columns, and
#: small enough that a timeline of every category stays near 100 kB in the page
MAX_BUCKETS = 800
#: phases drawn as bands; 'other' (data loading, zero_grad) is left unshaded
BAND_PHASES = (schema.FORWARD, schema.BACKWARD, schema.OPTIMIZER)
MAX_BANDS = 60


@dataclass
class PhaseBand:
    phase: str
    start_ms: float
    end_ms: float


@dataclass
class StepTimeline:
    """What a timeline chart needs; plain arrays so the dashboard can use it as well."""

    step: int | None  #: the step drawn (None: the whole trace, no step completed)
    time_ms: np.ndarray  #: x of each drawn point: milliseconds since the step began
    positions: np.ndarray  #: the same points as event positions within the step (0-based)
    by_category: dict[str, np.ndarray]  #: live bytes per category at each drawn point
    total_bytes: np.ndarray  #: live bytes at each drawn point (the stack's sum)
    peak_bytes: int
    peak_ms: float
    peak: dict  #: the peak event: ``seq``, ``phase``, ``module``, ``op``
    phases: list[PhaseBand] = field(default_factory=list)
    events_in_step: int = 0

    @property
    def points(self) -> int:
        return len(self.time_ms)


def extreme_positions(values: np.ndarray, max_buckets: int = MAX_BUCKETS,
                      keep: tuple[int, ...] = ()) -> np.ndarray:
    """Sorted positions to draw: per bucket of consecutive values its min and max, the first
    and last value, and ``keep``.  At most ``2 * max_buckets + 2 + len(keep)`` positions."""
    n = len(values)
    if n <= 2 * max_buckets + 2:
        return np.arange(n)
    width = -(-n // max_buckets)  # ceil
    buckets = -(-n // width)
    # pad with the last value so the array reshapes; positions in the pad map back to n-1,
    # which holds the same value
    padded = np.concatenate([values, np.repeat(values[-1:], buckets * width - n)])
    rows = padded.reshape(buckets, width)
    starts = np.arange(buckets) * width
    highs = np.minimum(starts + rows.argmax(axis=1), n - 1)
    lows = np.minimum(starts + rows.argmin(axis=1), n - 1)
    extra = np.array([0, n - 1, *keep], dtype=np.int64)
    return np.unique(np.concatenate([highs, lows, extra]))


def _categories_present(events) -> list[str]:
    seen = {str(c) for c in events["category"].unique()}
    known = [c for c in schema.CATEGORIES if c in seen]
    return known + sorted(seen - set(schema.CATEGORIES))


def _step_start_ns(trace: Trace, step: int | None, first_event_ns: int) -> int:
    for info in trace.meta.steps:
        if step is not None and info.get("index") == step and info.get("start_ns") is not None:
            return min(int(info["start_ns"]), first_event_ns)
    return first_event_ns


def phase_bands(phases: np.ndarray, time_ms: np.ndarray) -> list[PhaseBand]:
    """Runs of one phase as bands; runs of one phase interleaved too finely to draw are
    merged into one band from its first to its last event."""
    if not len(phases):
        return []
    change = np.flatnonzero(phases[1:] != phases[:-1]) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(phases)]])
    bands = []
    for start, end in zip(starts, ends):
        phase = str(phases[start])
        if phase in BAND_PHASES:
            end_ms = time_ms[end] if end < len(time_ms) else time_ms[-1]
            bands.append(PhaseBand(phase, float(time_ms[start]), float(end_ms)))
    if len(bands) > MAX_BANDS:
        merged = {}
        for band in bands:
            first = merged.setdefault(band.phase, PhaseBand(band.phase, band.start_ms,
                                                            band.end_ms))
            first.start_ms = min(first.start_ms, band.start_ms)
            first.end_ms = max(first.end_ms, band.end_ms)
        bands = sorted(merged.values(), key=lambda b: b.start_ms)
    return bands


def step_timeline(trace: Trace, step: int | None = None, *, max_buckets: int = MAX_BUCKETS,
                  live: np.ndarray | None = None) -> StepTimeline:
    """The timeline of ``step`` (default: the analysed, last complete step)."""
    events = trace.events
    if step is None:
        step = analysis.analysed_step(trace)
    live = analysis.live_bytes(events) if live is None else live
    window = analysis.step_slice(events, step)
    peak_position, peak_bytes = analysis.peak_in(live, window)
    total = live[window]
    if not len(total):
        empty = np.zeros(0)
        return StepTimeline(step, empty, empty.astype(np.int64), {}, empty.astype(np.int64),
                            0, 0.0, {})

    # every category of the trace: parameters made before the step hold bytes in it
    # without a single event of their own there
    series = {c: analysis.category_series(events, c)[window]
              for c in _categories_present(events)}
    series = {c: values for c, values in series.items() if values.any()}

    keep = [peak_position - window.start] + [int(np.argmax(v)) for v in series.values()]
    positions = extreme_positions(total, max_buckets, tuple(keep))

    time_ns = events["time_ns"].to_numpy()[window]
    start_ns = _step_start_ns(trace, step, int(time_ns[0]))
    time_ms = (time_ns - start_ns) / 1e6
    peak_row = events.iloc[peak_position]
    return StepTimeline(
        step=step,
        time_ms=time_ms[positions],
        positions=positions,
        by_category={c: values[positions] for c, values in series.items()},
        total_bytes=total[positions],
        peak_bytes=peak_bytes,
        peak_ms=float(time_ms[peak_position - window.start]),
        peak={"seq": int(peak_row["seq"]), "phase": str(peak_row["phase"]),
              "module": str(peak_row["module"]), "op": str(peak_row["op"])},
        phases=phase_bands(events["phase"].to_numpy()[window], time_ms),
        events_in_step=len(total),
    )
