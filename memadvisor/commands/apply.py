"""``memadvisor apply``: rewrite a script to use a plan, show the diff, run it.

    memadvisor apply train.py --plan "precision=amp-bf16,shard=zero3,world=8" --nproc 8 -- ARGS

Options memadvisor does not know before ``--`` go to torchrun (``--nnodes 2
--rdzv-endpoint host:29500 ...``); everything after ``--`` goes to the script.
"""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import UserError


class _SplitAtDoubleDash(click.Command):
    """Keep what follows ``--`` for the script: click would mix it with torchrun options."""

    def parse_args(self, ctx, args):
        if "--" in args:
            split = args.index("--")
            args, ctx.meta["script_args"] = args[:split], list(args[split + 1:])
        else:
            ctx.meta["script_args"] = []
        return super().parse_args(ctx, args)


#: a rank with no optimizer step for this long is stuck (gloo's default collective timeout)
DEFAULT_RANK_TIMEOUT_S = 1800.0


@click.command(cls=_SplitAtDoubleDash, context_settings={"ignore_unknown_options": True},
               short_help="Rewrite a script to use a plan and run it.")
@click.argument("script", type=click.Path(path_type=Path))
@click.option("--plan", "plan_text", required=True, metavar="PLAN",
              help="key=value,... (precision, checkpoint, accum, shard, world, hybrid, "
                   "offload, optimizer) or a JSON file.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Where to write the rewritten script [default: SCRIPT_memadvisor.py beside it].")
@click.option("--in-place", is_flag=True, help="Rewrite SCRIPT itself, keeping SCRIPT.orig.")
@click.option("--dry-run", is_flag=True, help="Print the diff only; write and run nothing.")
@click.option("--no-run", is_flag=True, help="Write the rewritten script but do not run it.")
@click.option("--nproc", type=int, help="Processes on this node [default: the plan's world].")
@click.option("--profile", "profile_path", type=click.Path(path_type=Path), metavar="OUT",
              help="Profile the run: rank 0 writes OUT, rank R writes OUT's stem + .rankR.")
@click.option("--profile-steps", type=int, default=3, show_default=True,
              help="Steps to profile with --profile.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Stop after this many optimizer steps (each optimizer's; with --profile "
                   "also the steps profiled) [default: the script's own end].")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=None,
              help="End the run when a process makes no optimizer step for this many "
                   "seconds, naming where it is stuck (0: never) [default: 1800 on several "
                   "processes, as gloo's collective timeout; never in one process].")
@click.option("--save-parameters", type=click.Path(path_type=Path), metavar="FILE",
              help="After the run, save the full parameters (torch.save) to compare runs.")
@click.option("--allow-batch-coupling", is_flag=True,
              help="Run an accum or data-parallel plan although the loss couples the batch's "
                   "samples (in-batch negatives): each micro-batch and rank then computes it "
                   "over its own samples only, a different loss [default: refused].")
@click.option("-q", "--quiet", is_flag=True, help="Do not print the diff.")
@click.argument("launcher_args", nargs=-1, type=click.UNPROCESSED,
                metavar="[TORCHRUN OPTIONS]... [-- SCRIPT ARGS...]")
@click.pass_context
def command(ctx, script, plan_text, output, in_place, dry_run, no_run, nproc, profile_path,
            profile_steps, steps, timeout_s, save_parameters, allow_batch_coupling, quiet,
            launcher_args):
    """Rewrite SCRIPT to use PLAN (a diff is printed), write it beside SCRIPT, and run it:
    in this process, or with torchrun on --nproc processes.  Arguments after -- go to the
    script; other unknown options before -- go to torchrun."""
    from ..apply import files, launch
    from ..apply.rewrite import rewrite_source
    from ..plan import Plan

    if script.name.startswith("-"):
        raise UserError(f"SCRIPT must come first, got the option {script}")
    source = _read_script(script)
    plan = Plan.parse(plan_text)
    launcher_args = list(launcher_args)
    nproc = _processes(plan, nproc, launcher_args)
    if not dry_run and not no_run:
        _check_machine(plan)

    rewrite = rewrite_source(source, plan, str(script))
    destination = None if dry_run else files.choose_destination(script, output, in_place)
    if not quiet:
        new_name = str(destination.path) if destination else str(files.default_output(script))
        _print_diff(rewrite.diff(str(script), new_name), script)
    if dry_run:
        return 0
    files.write(destination, script, rewrite.code)
    kept = f" (original kept as {destination.backup})" if destination.backup else ""
    click.echo(f"memadvisor: wrote {destination.path}{kept}", err=True)
    if no_run:
        return 0
    if allow_batch_coupling:  # read by the rewritten script's ranks (apply/batch_watch.py)
        import os
        from ..apply.batch_watch import ALLOW_ENV
        os.environ[ALLOW_ENV] = "1"
    where = "in this process" if nproc == 1 and not launcher_args else f"on {nproc} processes"
    click.echo(f"memadvisor: running {destination.path.name} with plan {plan} {where}", err=True)
    return launch.run(launch.LaunchRequest(
        script=destination.path, args=ctx.meta.get("script_args", []), nproc=nproc,
        launcher_args=launcher_args, profile=profile_path, profile_steps=profile_steps,
        save_parameters=save_parameters, steps=steps,
        timeout_s=_timeout(timeout_s, nproc, launcher_args)))


def _timeout(timeout_s: float | None, nproc: int, launcher_args: list[str]) -> float | None:
    if timeout_s is None:
        return None if nproc == 1 and not launcher_args else DEFAULT_RANK_TIMEOUT_S
    return timeout_s or None


def _read_script(script: Path) -> str:
    if not script.exists():
        raise UserError(f"{script}: no such script")
    if script.is_dir():
        raise UserError(f"{script}: is a directory, expected a Python script")
    try:
        return script.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{script}: not UTF-8 text") from None
    except OSError as exc:
        raise UserError(f"{script}: cannot read ({exc.strerror})") from None


def _processes(plan, nproc: int | None, launcher_args: list[str]) -> int:
    """Processes on this node; nodes x processes must equal the plan's world."""
    from ..apply.launch import nodes_of

    nodes = nodes_of(launcher_args) if launcher_args else 1
    if nproc is None:
        if nodes and plan.world % nodes:
            raise UserError(f"world={plan.world} does not split over {nodes} nodes")
        return plan.world // nodes if nodes else plan.world
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    if nodes is not None and nodes * nproc != plan.world:
        nodes_text = f"{nodes} nodes x " if nodes > 1 else ""
        raise UserError(f"the plan is for world={plan.world} ranks but {nodes_text}--nproc "
                        f"{nproc} starts {nodes * nproc}: make them equal")
    return nproc


def _check_machine(plan) -> None:
    """What can be refused before anything runs: a GPU-only plan on a machine without one."""
    if not plan.needs_gpu:
        return
    import torch

    from ..plan import Environment, environment_problems
    if not torch.cuda.is_available():
        problems = environment_problems(plan, Environment(device_type="cpu"))
        if problems:
            raise UserError(problems[0].replace("the model is on cpu", "this machine has no "
                                                "CUDA GPU"))


def _print_diff(diff: str, script: Path) -> None:
    if not diff:
        click.echo(f"memadvisor: {script} already uses this plan (no changes)", err=True)
        return
    for line in diff.splitlines():
        color = None
        if line.startswith("+") and not line.startswith("+++"):
            color = "green"
        elif line.startswith("-") and not line.startswith("---"):
            color = "red"
        elif line.startswith("@@"):
            color = "cyan"
        click.echo(click.style(line, fg=color) if color else line)
