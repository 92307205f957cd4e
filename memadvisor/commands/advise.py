"""`memadvisor advise TRACE --budget 24GiB [--gpus 8] [--gpu h100-80gb] [--json] [--save-plan F]`"""
from __future__ import annotations

import json
import os

import click


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--budget", required=True, help="Memory per GPU, e.g. 24GiB or 80GB.")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(min=1),
              help="GPUs (ranks) available.")
@click.option("--gpu", default=None, help="Target hardware profile, e.g. h100-80gb "
              "(default: the device that recorded the trace).")
@click.option("--margin", default=0.05, show_default=True, type=float,
              help="Safety margin: plans must fit in budget x (1 - margin).")
@click.option("--allow", default="", help="Also propose plans that change training "
              "semantics: bf16, optimizer (comma-separated).")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--expandable-segments", is_flag=True,
              help="Model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
@click.option("--save-plan", default=None, help="Write the best plan as JSON for `apply`.")
@click.option("--overwrite", is_flag=True, help="Let --save-plan replace an existing file.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with stable keys.")
def command(trace_path, budget, gpus, gpu, margin, allow, top, expandable_segments, save_plan,
            overwrite, as_json):
    """Rank every plan that fits a memory budget by predicted step time."""
    from ..errors import UserError
    from ..trace.io import read_trace
    from ..units import parse_bytes
    from ..simulate import advise, hardware, prepare
    from ..simulate.output import advise_dict, advise_text

    budget_bytes = parse_bytes(budget)
    if save_plan and os.path.exists(save_plan) and not overwrite:
        raise UserError(f"{save_plan} exists; pass --overwrite to replace it")
    trace = read_trace(trace_path)
    base = prepare(trace)
    hw = hardware(gpu, trace.meta.device)
    allowed = {a.strip() for a in allow.split(",") if a.strip()}
    result = advise(base, hw, budget_bytes, gpus, margin=margin, allow=allowed, top=top,
                    expandable_segments=expandable_segments)
    data = advise_dict(base, result, hw)
    if save_plan:
        with open(save_plan, "w", encoding="utf-8") as f:
            json.dump(result.ranked[0].plan.to_dict(), f, indent=2)
            f.write("\n")
    click.echo(json.dumps(data, indent=2) if as_json else advise_text(data))
    return 0
