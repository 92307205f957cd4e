"""``torch.compile`` as advice: ``compile_saving`` (which runs the recorded script again
with inductor's partitioner on fake tensors, a few seconds to tens of seconds) turned into
an ``Advice``.  Opt-in (``advise --compile``): the other providers only read the trace.
Imports torch only when run.
"""
from __future__ import annotations

import os

from ..errors import UserError
from ..units import format_bytes
from . import INFO, MISSING, SUGGESTED, Advice

KIND = "compile"


def compile_advice(trace_path: str | os.PathLike, script: str = "") -> list[Advice]:
    """One Advice: compiling saves bytes at the peak (suggested), does not (info), or could
    not be predicted (missing, with the reason)."""
    from ..trace.io import TraceError
    from .compile_saving import compile_saving
    try:
        found = compile_saving(trace_path)
    except (UserError, TraceError) as exc:
        return [Advice(kind=KIND, title="torch.compile: not predicted", status=MISSING,
                       reason=" ".join(str(exc).split()), location=script)]
    peak = found.peak
    saved_at_peak = max(0, peak.eager_peak_bytes - peak.predicted_peak_bytes)
    breaks = sum(found.graph_breaks.values())
    how = (f"inductor's partitioner on the recorded script's {len(found.graphs)} graph(s) "
           f"({found.method} tensors, {found.seconds:.1f} s): backward would hold "
           f"{format_bytes(found.compiled_saved_bytes)} instead of "
           f"{format_bytes(found.eager_saved_bytes)}; step peak "
           f"{format_bytes(peak.eager_peak_bytes)} -> {format_bytes(peak.predicted_peak_bytes)}"
           + (f"; {breaks} graph break(s): " + "; ".join(found.graph_breaks) if breaks else ""))
    details = {"eager_saved_bytes": found.eager_saved_bytes,
               "compiled_saved_bytes": found.compiled_saved_bytes,
               "eager_peak_bytes": peak.eager_peak_bytes,
               "predicted_peak_bytes": peak.predicted_peak_bytes,
               "graphs": len(found.graphs), "graph_breaks": dict(found.graph_breaks),
               "method": found.method}
    if saved_at_peak > 0 and found.compiled_saved_bytes < found.eager_saved_bytes:
        return [Advice(kind=KIND, title="compile the model: model = torch.compile(model)",
                       bytes_saved=int(saved_at_peak), location=script, reason=how,
                       details=details)]
    return [Advice(kind=KIND, title="torch.compile would not lower the peak here",
                   status=INFO, location=script, reason=how, details=details)]
