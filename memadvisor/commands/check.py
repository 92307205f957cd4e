"""`memadvisor check TRACE --budget SIZE [--baseline OLD --max-increase 5%] [--junit FILE]`"""
from __future__ import annotations

import time

import click

from ..terminal import safe_text


def _write_junit(path, results, trace_path, started, error=None):
    from pathlib import Path

    from ..report.gate import junit_xml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(junit_xml(results, trace_path=trace_path,
                              elapsed_s=time.perf_counter() - started, error=error),
                    encoding="utf-8")


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--budget", default=None, metavar="SIZE",
              help="Most memory the step may use, e.g. 16GiB (the analysed step's peak).")
@click.option("--baseline", "baseline_path", default=None, metavar="OLD.trace",
              help="Fail when the peak grew over this earlier trace's by more than allowed.")
@click.option("--max-increase", default="5%", show_default=True, metavar="PCT|SIZE",
              help="Growth over the baseline allowed: a percentage (5%) or a size (100MiB).")
@click.option("--junit", "junit_path", default=None, metavar="FILE",
              help="Also write a JUnit XML file, one testcase per check.")
def command(trace_path, budget, baseline_path, max_increase, junit_path):
    """CI gate: exit 0 when TRACE fits the budget and has not regressed, 1 when not,
    2 on bad input.  Prints one line per check."""
    from ..errors import UserError
    from ..report.gate import Increase, require_complete_step, run_checks
    from ..trace.io import TraceError, read_trace
    from ..trace.summary import summarize
    from ..units import parse_bytes

    started = time.perf_counter()
    try:
        if budget is None and baseline_path is None:
            raise UserError("nothing to check: give --budget and/or --baseline", exit_code=2)
        budget_bytes = parse_bytes(budget) if budget is not None else None
        increase = Increase.parse(max_increase)
        summary = summarize(read_trace(trace_path))
        baseline = summarize(read_trace(baseline_path)) if baseline_path else None
        for checked in (summary, baseline):
            if checked is not None:
                require_complete_step(checked)
    except (UserError, TraceError) as exc:
        if junit_path:
            _write_junit(junit_path, [], trace_path, started, error=str(exc))
        raise
    results = run_checks(summary, budget_bytes=budget_bytes, baseline=baseline,
                         max_increase=increase)
    for result in results:
        verdict = "ok  " if result.passed else "FAIL"
        click.echo(safe_text(f"memadvisor check: {verdict} {result.name}: {result.message}"),
                   err=not result.passed)
    if junit_path:
        _write_junit(junit_path, results, trace_path, started)
    return 0 if all(r.passed for r in results) else 1
