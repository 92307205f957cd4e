"""`memadvisor import-snapshot FILE.pickle [-o TRACE] [--device N]`"""
from __future__ import annotations

from pathlib import Path

import click

from ..units import format_bytes


@click.command()
@click.argument("snapshot_path", metavar="FILE.pickle")
@click.option("-o", "--output", default=None,
              help="Trace to write (default: FILE's name with .trace, beside it).")
@click.option("--device", default=None, type=click.IntRange(min=0),
              help="Which device's trace to import (default: the one with the most events).")
def command(snapshot_path, output, device):
    """Turn a CUDA memory snapshot (torch.cuda.memory._dump_snapshot) into a trace.

    The file is read without running anything in it (a restricted unpickler); every block
    becomes a lifetime with its requested and block bytes, stream, address, source line
    and an inferred category, and the allocator's segments and reserved memory are kept.
    """
    from ..errors import UserError
    from ..snapshot.importer import import_snapshot

    output = Path(output) if output else Path(snapshot_path).with_suffix(".trace")
    from ..output_files import check_output
    output = check_output(output, "trace" if "import" in __name__ else "snapshot")
    if output.exists() and output.resolve() == Path(snapshot_path).resolve():
        raise UserError(f"{output}: is the snapshot itself; choose another -o")
    result = import_snapshot(snapshot_path, output, device)
    checked = (f"all {result['blocks_checked']:,} blocks of the dump match the replay"
               if not result["block_mismatches"] else
               f"{result['block_mismatches']:,} of {result['blocks_checked']:,} blocks of the "
               "dump differ from the replay")
    click.echo(f"memadvisor: wrote {result['trace']} ({result['blocks']:,} blocks, peak "
               f"allocated {format_bytes(result['peak_allocated_bytes'])}, peak reserved "
               f"{format_bytes(result['peak_reserved_bytes'])}, {result['segments']:,} "
               f"segments; {checked})", err=True)
    return 0
