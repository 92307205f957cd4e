"""`memadvisor profile SCRIPT [options] -- ARGS`"""
from __future__ import annotations

import sys

import click

from ..units import format_bytes


def _progress(info: dict) -> None:
    total = info["steps_requested"]
    done = info["steps_done"]
    of = f"/{total}" if total else ""
    click.echo(f"memadvisor: step {done}{of} done; live {format_bytes(info['live_bytes'])}, "
               f"peak so far {format_bytes(info['peak_bytes'])}", err=True)


@click.command(context_settings={"ignore_unknown_options": False})
@click.argument("script", type=click.Path(dir_okay=True, path_type=str))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("-o", "--output", default=None,
              help="Trace file to write (default: SCRIPT's name with .trace). "
                   "Under torchrun, rank R>0 writes NAME.rankR.trace.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=0),
              help="Stop the script after this many training steps (0: let it finish).")
@click.option("--timeout", "timeout_s", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Give up when a step takes longer than this many seconds.")
@click.option("--step-boundary", type=click.Choice(["auto", "optimizer", "backward"]),
              default="auto", show_default=True,
              help="What ends a step: a torch.optim step, or each backward (manual updates).")
@click.option("--engine", type=click.Choice(["auto", "native", "dispatch"]), default=None,
              help="How ops are followed: 'native' (C++ hooks, CPU memory, least overhead), "
                   "'dispatch' (a Python dispatch mode: CPU and CUDA).  Default 'auto': "
                   "native without a GPU ($MEMADVISOR_ENGINE overrides).")
@click.option("--no-probes", "no_probes", is_flag=True,
              help="Skip measuring the script's convolutions and Linear layers in bf16 after "
                   "the run (faster on large CPU models; bf16 plans then fall back to "
                   "formulas for those kernels' scratch).")
@click.option("--fake", is_flag=True,
              help="Run every tensor fake (shapes and dtypes, no memory, no compute) on a "
                   "simulated GPU: profile a model this machine cannot hold, a GPU script "
                   "on a CPU-only machine (docs/FAKE.md).")
@click.option("--gpu", default=None,
              help="With --fake: the GPU the script sees (a100-40gb, h100-80gb, ...); "
                   "without it, fake tensors on the CPU.")
@click.option("--nproc", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --fake: ranks in the job (init_process_group gets a fake group).")
@click.option("--rank", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --fake: which rank of --nproc to run.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines.")
def command(script, script_args, output, steps, timeout_s, step_boundary, engine, no_probes,
            fake, gpu, nproc, rank, quiet):
    """Run SCRIPT (as `python SCRIPT ARGS` would) for a few steps and record a memory trace.

    Put the script's own arguments after `--`:

        memadvisor profile train.py -o run.trace --steps 3 -- --batch-size 32
    """
    from pathlib import Path

    from ..errors import UserError

    # answer a mistyped path at once, before paying for importing torch
    if not Path(script).exists():
        raise UserError(f"{script}: no such script")
    output = output or f"{Path(script).stem}.trace"
    if fake:
        return _profile_fake(script, list(script_args), output, steps, timeout_s,
                             step_boundary, engine, gpu, nproc, rank, quiet)
    if gpu is not None or nproc != 1 or rank != 0:
        raise UserError("--gpu, --nproc and --rank simulate a device: use them with --fake")
    from ..profile import profile_script

    result = profile_script(script, list(script_args), output, steps=steps or None,
                            timeout_s=timeout_s, step_boundary=step_boundary,
                            on_step=None if quiet else _progress, engine=engine,
                            probes=not no_probes, exit_when_stop_swallowed=True)
    sys.stdout.flush()
    where = f"{result.trace_path} ({result.events:,} events, {result.steps_completed} steps, " \
            f"peak {format_bytes(result.peak_bytes)})"
    if result.engine_note:
        click.echo(f"memadvisor: note: recorded with the slower dispatch engine: "
                   f"{result.engine_note}", err=True)
    if result.write_error:  # the script's own outcome first: it is what the user must fix
        if result.status != "completed":
            click.echo(f"memadvisor: the script's run: {result.status}: {result.error}",
                       err=True)
            if result.traceback:
                click.echo(result.traceback.rstrip(), err=True)
        click.echo(f"memadvisor: error: {result.write_error}", err=True)
        return result.exit_code
    if result.status == "completed":
        click.echo(f"memadvisor: wrote {where}", err=True)
        return 0
    if result.status == "error":
        rule = "-" * 72
        click.echo(f"{rule}\nmemadvisor: the script failed after {result.steps_completed} "
                   f"step(s): {result.error}\n{rule}\n{result.traceback.rstrip()}\n{rule}",
                   err=True)
    else:
        click.echo(f"memadvisor: {result.status}: {result.error}", err=True)
    click.echo(f"memadvisor: kept partial trace {where}", err=True)
    return result.exit_code


def _profile_fake(script, script_args, output, steps, timeout_s, step_boundary, engine, gpu,
                  nproc, rank, quiet) -> int:
    from pathlib import Path

    from ..errors import UserError
    from . import profile_fake
    if engine == "native":
        raise UserError("--fake records with the dispatch engine: the native engine follows "
                        "the CPU allocator, which fake tensors never use")
    if rank >= nproc:
        raise UserError(f"--rank {rank} is not a rank of --nproc {nproc}")
    if gpu is not None:
        from ..gpus import gpu_profile
        gpu = gpu_profile(gpu).name  # an unknown name fails here, before the child starts
    if not Path(script).is_file():
        raise UserError(f"{script}: is not a file, expected a Python script")
    spec = {"script": str(script), "args": script_args, "output": str(output), "gpu": gpu,
            "nproc": nproc, "rank": rank, "steps": steps, "timeout_s": timeout_s,
            "step_boundary": step_boundary, "quiet": quiet}
    result = profile_fake.run_child(spec)
    sys.stdout.flush()
    return profile_fake.report(result, spec, quiet)
