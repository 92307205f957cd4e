"""`memadvisor summary TRACE [--json] [--gpu NAME | --device-memory SIZE]`"""
from __future__ import annotations

import json
import os

import click

from ..terminal import safe_text


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with stable keys.")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1),
              help="How many allocation sites to list.")
@click.option("--gpu", default=None,
              help="Check the run against this GPU's memory (e.g. a100-40gb): where it runs "
                   "out, what was live, and a plan that fits.")
@click.option("--device-memory", "device_memory", default=None,
              help="Check the run against a device of this many bytes (e.g. 24GiB).")
def command(trace_path, as_json, top, gpu, device_memory):
    """What fills memory at the peak of the last complete step, and which line made it.

    With --gpu or --device-memory (or for a snapshot whose allocator ran out of memory):
    an out-of-memory post-mortem -- the failing request, what was live by category and
    source line, how much reserved memory was cached but free, and a plan that fits.
    """
    from ..errors import UserError
    from ..trace.io import read_trace
    from ..trace.summary import shorten_paths, summarize, summary_text

    if gpu and device_memory:
        raise UserError("give --gpu or --device-memory, not both")
    trace = read_trace(trace_path)
    summary = summarize(trace, top=top)
    _modelled_reserved(trace, summary)
    oom = _post_mortem(trace, gpu, device_memory)
    summary["out_of_memory"] = None if oom is None else oom.to_dict()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        shorten_paths(summary, os.getcwd())
        click.echo(safe_text(summary_text(summary)))
        if oom is not None:
            from ..simulate.oom import post_mortem_text
            click.echo("\n" + safe_text(post_mortem_text(oom)))
        elif gpu or device_memory:
            click.echo("\nfits: the allocator model never needs more than the device holds")
    return 0


def _modelled_reserved(trace, summary) -> None:
    """A CUDA trace no allocator reported on (fake execution, the dispatch engine on a GPU
    without per-step stats): reserved memory per step from the allocator model run over the
    whole trace from a fresh process -- the first step, where optimizer state made between
    gradients usually sets ``max_memory_reserved``, beside the steady one."""
    if not str(trace.meta.device).startswith("cuda") or summary.get("reserved_bytes") is not None:
        summary["reserved_source"] = "recorded" if summary.get("reserved_bytes") is not None \
            else None
        return
    from ..simulate.recorded_state import model_whole_run

    run = model_whole_run(trace)
    for step in summary["steps"]:
        allocated, reserved = run.steps.get(step["index"], (None, None))
        step["modelled_allocated_bytes"], step["modelled_reserved_bytes"] = allocated, reserved
    analysed = summary["analysed_step"]
    summary["reserved_bytes"] = run.steps.get(analysed, (0, run.peak_reserved_bytes))[1] \
        if analysed is not None else run.peak_reserved_bytes
    summary["segments"] = run.segments
    summary["reserved_source"] = "modelled"


def _post_mortem(trace, gpu, device_memory):
    """The out-of-memory post-mortem where one is asked for or the trace recorded one."""
    recorded = (trace.meta.allocator or {}).get("oom_events")
    if not (gpu or device_memory or recorded):
        return None
    from ..simulate.hardware import hardware
    from ..simulate.oom import post_mortem
    from ..units import parse_bytes

    hw = hardware(gpu, trace.meta.device) if gpu else None
    if device_memory:
        capacity = parse_bytes(device_memory)
    elif hw is not None:
        capacity = hw.memory_bytes
    else:  # a recorded OOM with no device named: what the allocator held plus what was free
        _, requested, free = recorded[0]
        capacity = int((trace.meta.allocator or {}).get("peak_reserved_bytes", 0)) + int(free)
    return post_mortem(trace, capacity, hw=hw)
