"""`memadvisor simulate TRACE --plan SPEC [--gpu NAME] [--json]`"""
from __future__ import annotations

import json

import click

from ..terminal import safe_text

#: how a verification executes a deep model (simulate --verify, advise)
verify_depth_option = click.option(
    "--verify-depth", "verify_depth", type=click.Choice(["auto", "full"]), default="auto",
    show_default=True,
    help="How a plan for a model with a stack of 12 or more alike layers is executed on a "
         "GPU: 'auto' cuts the stack to 2, 3 and 4 layers and makes the full depth's "
         "requests from those runs (checked against the 4-layer run; docs/VERIFY.md), "
         "'full' runs it at the script's own depth (slow on deep models).")


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--plan", "plan_spec", default="none", show_default=True,
              help="key=value,... (precision, checkpoint, accum, shard, world, hybrid, "
                   "offload, optimizer) or a plan JSON file.")
@click.option("--gpu", default=None, help="Target hardware profile, e.g. h100-80gb "
              "(default: the device that recorded the trace).")
@click.option("--expandable-segments", is_flag=True,
              help="Model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
@click.option("--verify", is_flag=True,
              help="Also execute the plan -- the script rewritten by `apply`, on fake tensors "
                   "on the simulated GPU (each rank on a fake process group), or for real on "
                   "this CPU for the cpu target -- and show the executed peak beside the "
                   "analytic one; the executed figure wins.")
@click.option("--rank", "ranks", type=click.IntRange(min=0), multiple=True,
              help="With --verify on a GPU: the ranks to execute (repeatable) [default: 0 "
                   "and the last].")
@click.option("--verify-by", "verify_by", type=click.Choice(["fake", "real"]), default=None,
              help="With --verify: 'fake' tensors (the default on a GPU; on the cpu target each "
                   "op's kernel blocks are measured on this machine) or a 'real' run (the "
                   "cpu target's default).")
@verify_depth_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object with stable keys.")
def command(trace_path, plan_spec, gpu, expandable_segments, verify, ranks, verify_by,
            verify_depth, as_json):
    """Predict one plan's per-rank peak memory and step-time cost, without running it."""
    from ..errors import UserError
    from ..plan import Plan, environment_problems
    from ..trace.io import read_trace
    from ..simulate import simulate
    from ..verify import baseline_as_applied
    from ..simulate.output import simulate_dict, simulate_text

    check_gpu_option(gpu)
    plan = Plan.parse(plan_spec)
    trace = read_trace(trace_path)
    base = baseline_as_applied(trace)  # the loop as apply rewrites it
    hw = target_hardware(gpu, trace.meta.device, expandable_segments)
    # the plans advise rejects and apply refuses are refused here too, in the same words
    problems = environment_problems(plan, target_environment(hw))
    if problems:
        raise UserError(f"cannot simulate {plan} on {hw.name}: {problems[0]}")
    if (ranks or verify_by) and not verify:
        raise UserError("--rank and --verify-by say how --verify executes: add --verify")
    if verify_by == "real" and hw.device_type != "cpu":
        raise UserError(f"--verify-by real runs the plan on this machine's CPU; {hw.name} "
                        "can only be verified by fake execution")
    script = None
    if verify:
        from ..verify import ranks_to_run, recorded_script
        script = recorded_script(trace.meta, trace_path)  # before the search: fail early
        ranks_to_run(plan.world, ranks or None)
    prediction = simulate(base, plan, hw, expandable_segments=expandable_segments)
    data = simulate_dict(base, prediction, hw)
    if verify:
        from ..verify import compare, verify_plan
        from ..verify.compare import verification_lines
        click.echo(f"memadvisor: executing {plan} to verify the prediction ...", err=True)
        verification = verify_plan(script, trace.meta, plan, hw, ranks=ranks or None,
                                   method=verify_by, depth=verify_depth)
        data["verification"] = compare(prediction, verification)
    text = json.dumps(data, indent=2) if as_json else safe_text(simulate_text(data))
    if verify and not as_json:
        text += "\n\n" + safe_text("\n".join(verification_lines(data["verification"])))
    click.echo(text)
    if verify and not data["verification"]["executed"]:
        return 1  # asked to verify and could not: never a silent success
    return 0


# --- shared with `advise` -------------------------------------------------------------------
def check_gpu_option(gpu: str | None) -> None:
    """An empty ``--gpu`` is a mistake (a shell variable left unset), not the default."""
    from ..errors import UserError
    from ..simulate.hardware import PROFILES

    if gpu is not None and not gpu.strip():
        raise UserError(f"--gpu needs a name; known: {', '.join(PROFILES)}")


def target_hardware(gpu: str | None, trace_device: str, expandable_segments: bool):
    """The target profile; warns when ``--expandable-segments`` cannot apply to it."""
    from ..simulate import hardware

    hw = hardware(gpu, trace_device)
    if expandable_segments and hw.device_type != "cuda":
        click.echo(f"memadvisor: warning: --expandable-segments only applies to CUDA targets; "
                   f"ignored for {hw.name} (pick a GPU with --gpu)", err=True)
    return hw


def target_environment(hw):
    """What ``environment_problems`` checks, as ``advise`` fills it in from the profile."""
    from ..plan import Environment

    return Environment(device_type=hw.device_type, bf16_supported=hw.bf16,
                       fp16_supported=hw.fp16, bitsandbytes_available=True)
