"""A deep model's plan executed as three shallow runs (docs/VERIFY.md, "Deep models").

Fake execution costs a few hundred microseconds per op whatever the tensors' sizes, so a
plan for a 760-layer model costs 190 times one for 4 layers.  Where the recorded model has
a stack of at least :data:`CUT_FROM_LAYERS` alike layers, each rank runs the plan with
every such stack cut to 2, 3 and 4 layers (``fake/depth.py``); ``layer_synthesis`` makes
the full-depth stream of requests from the first two, after making the 4-layer one and
finding it equal to the run at 4 layers, request for request and in its modelled peaks.
Anything else -- no stack was cut where the script makes it, stacks of different depths,
a cut run that fails, a synthesis that does not reproduce the 4-layer run -- runs the plan
at full depth, as without this, and says why.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..trace.io import Trace, read_trace
from . import layer_synthesis

#: the least layers a recorded stack must have for its plans to run shallow (below it the
#: three short runs cost about what one full run does)
CUT_FROM_LAYERS = 12
#: layers each stack keeps in the three runs: fit on the first two, check on the third
KEEPS = (2, 3, 4)


def _stacks(meta) -> dict[tuple[str, str], int]:
    """(container, layer class) -> layers, of the recorded model's children named 0, 1, ..."""
    stacks: dict[tuple[str, str], int] = {}
    for module in meta.modules or []:
        parent, _, leaf = module["path"].rpartition(".")
        if leaf.isdigit():
            stacks[(parent, module["type"])] = stacks.get((parent, module["type"]), 0) + 1
    return stacks


def deepest_stack(meta) -> int:
    """Layers in the recorded model's deepest stack of alike children."""
    return max(_stacks(meta).values(), default=0)


def light_layer_classes(meta) -> list[str]:
    """Layer classes the recorded model has exactly one stack of (at least the cut's least
    depth): building their instances past the kept ones can be skipped (``fake/depth.py``:
    constructing 760 fake layers to keep 2 took 9.5 s of a 10.8 s run)."""
    from ..fake.depth import MIN_LAYERS
    counts: dict[str, list[int]] = {}
    for (_, kind), layers in _stacks(meta).items():
        counts.setdefault(kind, []).append(layers)
    return sorted(kind for kind, depths in counts.items()
                  if len(depths) == 1 and depths[0] >= MIN_LAYERS)


def runs_shallow(meta, depth: str, on_gpu: bool) -> bool:
    """Whether a plan for the recorded script runs as shallow runs: ``depth`` 'auto' and a
    stack of at least CUT_FROM_LAYERS, on a simulated GPU (the allocator model replays
    the made stream; a CPU verification reads the run's own peak)."""
    return depth == "auto" and on_gpu and deepest_stack(meta) >= CUT_FROM_LAYERS


def run_shallow(run_at: Callable[[int | None], dict], peaks_of: Callable,
                device_of: Callable) -> dict:
    """One rank's result, as ``run_child`` gives it, from shallow runs where they hold.

    ``run_at(keep)``: the rank's fake run with stacks cut to ``keep`` layers (None: not
    cut); ``peaks_of(trace)``: its RankPeaks from a Trace; ``device_of(trace)``: the
    rank's device in a run's trace.  A result made from shallow runs
    carries ``peaks`` and ``shallow`` (what ran, in words); one run in full carries
    ``shallow_refused`` (why not shallow) unless nothing was cut at all."""
    results = {}
    for keep in KEEPS:
        result = run_at(keep)
        if not _completed(result):
            return _in_full(run_at, f"the script failed with its layers cut to {keep}")
        stacks = (result.get("layer_stacks") or {}).get("stacks") or []
        if not stacks:
            return result  # nothing to cut where the script made it: this was the full run
        results[keep] = result
    depths = sorted({stack["layers"] for stack in stacks})
    if len(depths) > 1:
        return _in_full(run_at, "its stacks of layers have different depths (" +
                        ", ".join(str(d) for d in depths) + ")")
    layers = depths[0]
    traces = {keep: read_trace(Path(results[keep]["trace_path"])) for keep in KEEPS}
    rows = {}
    for keep, trace in traces.items():
        device = device_of(trace)
        paths = layer_synthesis.stack_paths(trace.meta.modules,
                                            {s["layer"] for s in stacks}, keep)
        rows[keep] = layer_synthesis.device_rows(trace.events, device, paths, keep)
    first, second, check = KEEPS
    try:
        model = layer_synthesis.fit(rows[first], rows[second], second)
        made = model.at(check)
        difference = layer_synthesis.first_difference(made, rows[check])
        if not difference:
            made_peaks = peaks_of(_as_trace(made, traces[check]))
            ran_peaks = peaks_of(_as_trace(rows[check], traces[check]))
            if (made_peaks.peak_allocated_bytes, made_peaks.peak_reserved_bytes) != \
                    (ran_peaks.peak_allocated_bytes, ran_peaks.peak_reserved_bytes):
                difference = (f"its modelled peaks {made_peaks.peak_allocated_bytes:,} / "
                              f"{made_peaks.peak_reserved_bytes:,} B, the run's "
                              f"{ran_peaks.peak_allocated_bytes:,} / "
                              f"{ran_peaks.peak_reserved_bytes:,} B")
        if difference:
            return _in_full(run_at, f"the {check}-layer stream made from {first} and "
                            f"{second} layers differs from the {check}-layer run: "
                            f"{difference}")
        full = model.at(layers)
    except layer_synthesis.SynthesisError as exc:
        return _in_full(run_at, str(exc))
    result = dict(results[check])
    result["peaks"] = peaks_of(_as_trace(full, traces[check]))
    result["shallow"] = (f"its {layers}-layer stack ran at {first}, {second} and {check} "
                         f"layers, the {layers}-layer run's {len(full):,} requests made from "
                         f"them (the {check}-layer one made so matched its run)")
    return result


def _completed(result) -> bool:
    return isinstance(result, dict) and "cannot_run" not in result and \
        result.get("status") == "completed" and result.get("steps_completed", 0) >= 1


def _in_full(run_at, why: str) -> dict:
    result = run_at(None)
    if isinstance(result, dict):
        result = {**result, "shallow_refused": why}
    return result


def _as_trace(rows, ran):
    """A Trace of the made (or normalised) rows with the run's metadata."""
    events = rows.drop(columns=["layer", "any_layer"])
    return Trace(events.reset_index(drop=True), ran.meta, None)
