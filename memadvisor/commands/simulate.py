"""`memadvisor simulate TRACE --plan SPEC [--gpu NAME] [--json]`"""
from __future__ import annotations

import json

import click


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--plan", "plan_spec", default="none", show_default=True,
              help="key=value,... (precision, checkpoint, accum, shard, world, hybrid, "
                   "offload, optimizer) or a plan JSON file.")
@click.option("--gpu", default=None, help="Target hardware profile, e.g. h100-80gb "
              "(default: the device that recorded the trace).")
@click.option("--expandable-segments", is_flag=True,
              help="Model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with stable keys.")
def command(trace_path, plan_spec, gpu, expandable_segments, as_json):
    """Predict one plan's per-rank peak memory and step-time cost, without running it."""
    from ..plan import Plan
    from ..trace.io import read_trace
    from ..simulate import hardware, prepare, simulate
    from ..simulate.output import simulate_dict, simulate_text

    plan = Plan.parse(plan_spec)
    trace = read_trace(trace_path)
    base = prepare(trace)
    hw = hardware(gpu, trace.meta.device)
    prediction = simulate(base, plan, hw, expandable_segments=expandable_segments)
    data = simulate_dict(base, prediction, hw)
    click.echo(json.dumps(data, indent=2) if as_json else simulate_text(data))
    return 0
