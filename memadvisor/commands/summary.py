"""`memadvisor summary TRACE [--json]`"""
from __future__ import annotations

import json
import os

import click


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with stable keys.")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1),
              help="How many allocation sites to list.")
def command(trace_path, as_json, top):
    """What fills memory at the peak of the last complete step, and which line made it."""
    from ..trace.io import read_trace
    from ..trace.summary import shorten_paths, summarize, summary_text

    trace = read_trace(trace_path)
    summary = summarize(trace, top=top)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        shorten_paths(summary, os.getcwd())
        click.echo(summary_text(summary))
    return 0
