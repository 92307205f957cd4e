"""Reports for reviewers and pipelines: the HTML report, the CI gate, trace comparison.

Pure readers of traces (no torch import): ``build`` computes what a report shows,
``html`` renders it with the figures of ``memadvisor.ui.figures``, ``gate`` judges a trace
against a budget and a baseline, ``compare`` says what changed between two traces,
``plans`` is the one adapter to the simulator.
"""
from __future__ import annotations

from pathlib import Path

from ..trace.io import read_trace


def write_report(trace_path: str, output: str | Path, *, budget_bytes: int | None = None,
                 num_gpus: int = 1, plan_spec: str | None = None,
                 baseline_path: str | None = None) -> Path:
    """Read the trace(s), build the report and write it to ``output``."""
    from .build import build_report
    from .html import render_html, write_html

    trace = read_trace(trace_path)
    baseline = read_trace(baseline_path) if baseline_path else None
    data = build_report(trace, budget_bytes=budget_bytes, num_gpus=num_gpus,
                        plan_spec=plan_spec, baseline=baseline)
    return write_html(output, render_html(data))


__all__ = ["write_report"]
