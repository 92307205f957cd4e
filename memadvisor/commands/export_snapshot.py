"""`memadvisor export-snapshot TRACE [-o FILE.pickle]`"""
from __future__ import annotations

from pathlib import Path

import click

from ..units import format_bytes


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("-o", "--output", default=None,
              help="Snapshot to write (default: TRACE's name with .pickle, beside it).")
def command(trace_path, output):
    """Write a trace as a CUDA memory snapshot that pytorch.org/memory_viz opens.

    An imported snapshot keeps its recorded addresses and segments; any other trace (CPU,
    predicted) is laid out by memadvisor's model of the CUDA caching allocator.
    """
    from ..errors import UserError
    from ..snapshot.exporter import export_snapshot
    from ..trace.io import read_trace

    output = Path(output) if output else Path(trace_path).with_suffix(".pickle")
    from ..output_files import check_output
    output = check_output(output, "trace" if "import" in __name__ else "snapshot")
    if output.exists() and output.resolve() == Path(trace_path).resolve():
        raise UserError(f"{output}: is the trace itself; choose another -o")
    trace = read_trace(trace_path)
    result = export_snapshot(trace, output)
    click.echo(f"memadvisor: wrote {result['snapshot']} ({result['events']:,} events, "
               f"{result['segments']:,} segments, reserved "
               f"{format_bytes(result['reserved_bytes'])})", err=True)
    return 0
