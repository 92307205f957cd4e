"""`memadvisor report TRACE [--plan SPEC | --budget SIZE --gpus N] [--baseline OLD] -o FILE`"""
from __future__ import annotations

import click


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("-o", "--output", default="reports/memory.html", show_default=True,
              help="HTML file to write (folders are created).")
@click.option("--budget", default=None, metavar="SIZE",
              help="Memory per GPU, e.g. 24GiB: the headline says whether the peak fits, and "
                   "the plan section ranks the plans that would.")
@click.option("--gpus", "num_gpus", default=1, show_default=True, type=click.IntRange(min=1),
              help="GPUs the plans may use (with --budget).")
@click.option("--plan", "plan_spec", default=None, metavar="SPEC",
              help="Predict this one plan (key=value,... or a JSON file) instead of ranking.")
@click.option("--baseline", "baseline_path", default=None, metavar="OLD.trace",
              help="Add a comparison against an earlier trace.")
def command(trace_path, output, budget, num_gpus, plan_spec, baseline_path):
    """Write one self-contained HTML memory report of TRACE (opens offline)."""
    from ..output_files import check_output
    from ..report import write_report
    from ..units import format_bytes, parse_bytes

    output = check_output(output, "report")  # before the work, not after it
    budget_bytes = parse_bytes(budget) if budget is not None else None
    path = write_report(trace_path, output, budget_bytes=budget_bytes, num_gpus=num_gpus,
                        plan_spec=plan_spec, baseline_path=baseline_path)
    click.echo(f"memadvisor: wrote {path} ({format_bytes(path.stat().st_size)})", err=True)
    return 0
