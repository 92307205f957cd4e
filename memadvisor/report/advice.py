"""The report's advice section: ``memadvisor.advice`` on the trace's own device (the
report has no target option: a CUDA trace is judged on its GPU, a CPU trace on the CPU).

Kept apart from ``plans`` (the simulator's plan predictions) so that a trace the advice
cannot read -- no complete step, no simulator installed -- still gets its report, with
the reason in the section.
"""
from __future__ import annotations

from typing import Any

from ..errors import UserError
from ..trace.io import Trace


def report_advice(trace: Trace) -> tuple[list[dict[str, Any]], str]:
    """(the advice as dicts, '' or why there is none)."""
    try:
        from ..advice import advice_dicts, collect
        from ..simulate import hardware
        from ..verify import baseline_as_applied  # the loop as apply rewrites it
    except ImportError:  # a memadvisor without the simulator: the report goes on
        return [], "advice unavailable: simulator not installed in this version"
    try:
        base = baseline_as_applied(trace)
        hw = hardware(None, trace.meta.device)
    except UserError as exc:
        return [], f"advice unavailable: {exc}"
    return advice_dicts(collect(trace, base, hw)), ""
