"""`memadvisor compare A.trace [B.trace] [--step-a N] [--step-b N] [--json]`"""
from __future__ import annotations

import json

import click

from ..terminal import safe_text


@click.command()
@click.argument("a_path", metavar="A.trace")
@click.argument("b_path", metavar="[B.trace]", required=False)
@click.option("--step-a", type=click.IntRange(min=0), default=None,
              help="Step of A to compare (default: its last complete step).")
@click.option("--step-b", type=click.IntRange(min=0), default=None,
              help="Step of B to compare (default: its last complete step).")
@click.option("--top", default=15, show_default=True, type=click.IntRange(min=1),
              help="How many modules to list.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with stable keys.")
def command(a_path, b_path, step_a, step_b, top, as_json):
    """What changed from A to B, per category and per module, at the peak and in total.

    B defaults to A, so `compare run.trace --step-a 0 --step-b 2` compares two steps.
    """
    from ..report.compare import compare_traces, compare_text
    from ..trace.io import read_trace

    a = read_trace(a_path)
    b = read_trace(b_path) if b_path and b_path != a_path else a
    result = compare_traces(a, b, step_a=step_a, step_b=step_b, top_modules=top)
    click.echo(json.dumps(result, indent=2) if as_json else safe_text(compare_text(result)))
    return 0
