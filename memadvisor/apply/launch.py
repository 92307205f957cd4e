"""Run a rewritten script: in this process, or on N ranks through ``torch.distributed.run``.

One process runs in-process, the script as ``__main__`` (like ``python train.py``).  N
processes go through torchrun's own parser and launcher (``torch.distributed.run``),
called in-process the way torchtune's ``tune run`` does; every rank runs
``memadvisor.apply.rank_main``, which runs the script (or profiles it) and reports a
failure through torch elastic's error file so the launcher can name the failing rank.
Multi-node flags (``--nnodes``, ``--node-rank``, ``--rdzv-*``, ``--master-*``) pass
through to torchrun unchanged; without them a single-node job uses ``--standalone`` (a
free port) instead of torchrun's fixed default port.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

#: torchrun flags that mean the job spans nodes or has its own rendezvous
_RENDEZVOUS_FLAGS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv-endpoint",
                     "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend", "--master-addr",
                     "--master_addr", "--master-port", "--master_port", "--standalone")


@dataclass
class LaunchRequest:
    script: Path  #: the rewritten script
    args: list[str] = field(default_factory=list)  #: the script's own arguments
    nproc: int = 1  #: processes on this node
    launcher_args: list[str] = field(default_factory=list)  #: passed to torchrun as they are
    profile: Path | None = None  #: rank 0's trace; rank R writes <stem>.rankR<suffix>
    profile_steps: int = 3
    save_parameters: Path | None = None  #: full parameters after the run (rank 0 writes)
    steps: int | None = None  #: stop after this many optimizer steps (None: the script's end)
    #: end a process that makes no optimizer step for this long (None: never; watchdog.py)
    timeout_s: float | None = None

    @property
    def in_process(self) -> bool:
        return self.nproc == 1 and not self.launcher_args


def run(request: LaunchRequest) -> int:
    """Run it; returns the exit status (0) or raises UserError naming what failed."""
    from .frameworks.probe import refuse_before_launch
    refuse_before_launch(request.script)  # a framework script's plan this machine cannot run
    if request.in_process:
        return run_in_process(request.script, request.args, request.profile,
                              request.profile_steps, request.save_parameters, request.steps,
                              request.timeout_s)
    return run_torchrun(request)


# --- one process ----------------------------------------------------------------------------
def run_in_process(script: Path, args: list[str], profile: Path | None = None,
                   profile_steps: int = 3, save_parameters: Path | None = None,
                   steps: int | None = None, timeout_s: float | None = None) -> int:
    import contextlib

    from . import runtime
    from .frameworks import probe as frameworks
    from .steps import stop_after
    from .watchdog import ProgressWatchdog, end_the_rank
    completed = False
    watchdog = ProgressWatchdog(timeout_s, end_the_rank) if timeout_s else \
        contextlib.nullcontext()
    try:
        with watchdog:
            if profile is not None:
                _profile(script, args, profile, steps or profile_steps)
            else:
                with stop_after(steps):
                    run_script(script, args)
        completed = True
    finally:
        runtime.finish(save_parameters=str(save_parameters) if save_parameters and completed
                       else None)
        # a framework script's plan: stop if it was never checked, save what it trained
        frameworks.finish(str(save_parameters) if save_parameters else None, completed)
    return 0


def _profile(script: Path, args: list[str], output: Path, steps: int) -> None:
    from ..profile import profile_script
    result = profile_script(script, args, output, steps=steps)
    if result.status != "completed":
        plan_error = "PlanError: "  # the plan cannot run this batch: one line, as unprofiled
        if plan_error in result.error:
            raise UserError(result.error.split(plan_error, 1)[1])
        if result.traceback:
            sys.stderr.write(result.traceback)
        raise UserError(f"{script.name} {result.status} while profiled: {result.error} "
                        f"(the trace so far is in {result.trace_path})",
                        exit_code=result.exit_code or 1)


def run_script(script: Path, args: list[str]) -> None:
    """``python script args`` in this process: argv, sys.path[0] and ``__main__`` as Python
    sets them.  The script's own exception is printed (its frames only) and becomes a
    UserError; a PlanError from ``prepare`` stays one line."""
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [str(script), *args]
    folder = str(Path(script).resolve().parent)
    if sys.path:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise UserError(f"{Path(script).name} exited with sys.exit({exc.code!r})",
                            exit_code=exc.code if isinstance(exc.code, int) else 1) from None
    except UserError:
        raise
    except Exception as exc:
        sys.stderr.write(_script_traceback(exc))
        lines = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
        last = lines[-1] if lines else type(exc).__name__
        raise UserError(f"{Path(script).name} failed: {last}", exit_code=1) from None
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0


def _script_traceback(exc: BaseException) -> str:
    """The traceback without memadvisor's and runpy's frames: what the user wrote."""
    package = str(Path(__file__).resolve().parents[1])
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(package) and "runpy" not in f.filename]
    return ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
            + "".join(traceback.format_exception_only(type(exc), exc)))


# --- N processes ----------------------------------------------------------------------------
def torchrun_argv(request: LaunchRequest) -> list[str]:
    """The torchrun command line (after ``torchrun``) for this request."""
    argv = ["--nproc-per-node", str(request.nproc)]
    passed = request.launcher_args
    if not any(a.split("=")[0] in _RENDEZVOUS_FLAGS for a in passed):
        argv.append("--standalone")
    argv += [*passed, "--module", "memadvisor.apply.rank_main"]
    if request.profile is not None:
        argv += ["--profile", str(request.profile), "--profile-steps", str(request.profile_steps)]
    if request.save_parameters is not None:
        argv += ["--save-parameters", str(request.save_parameters)]
    if request.steps:
        argv += ["--steps", str(request.steps)]
    if request.timeout_s:
        argv += ["--timeout", f"{request.timeout_s:g}"]
    return argv + ["--", str(request.script), *request.args]


def parse_torchrun_args(argv: list[str]):
    """torchrun's own parser; its complaints become a UserError instead of an exit."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "memadvisor apply (torchrun options)"

    def error(message):
        raise UserError(f"torchrun option: {message}")

    parser.error = error
    return parser.parse_args(argv)


def nodes_of(launcher_args: list[str]) -> int | None:
    """Number of nodes the torchrun flags ask for (None for an elastic MIN:MAX range)."""
    args = parse_torchrun_args([*launcher_args, "x.py"])
    low, _, high = str(args.nnodes).partition(":")
    if high and high != low:
        return None
    try:
        return int(low)
    except ValueError:
        raise UserError(f"torchrun option --nnodes {args.nnodes!r} is not a number") from None


def run_torchrun(request: LaunchRequest) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    args = parse_torchrun_args(torchrun_argv(request))
    # the ranks import memadvisor from wherever this process did
    package_root = str(Path(__file__).resolve().parents[2])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, saved) if p)
    try:
        torchrun(args)
    except ChildFailedError as exc:
        raise UserError(describe_failure(exc), exit_code=_exit_code(exc)) from None
    except SignalException as exc:  # Ctrl-C or SIGTERM: torchrun has stopped the ranks
        import signal
        name = signal.Signals(exc.sigval).name
        raise UserError(f"interrupted by {name}; the ranks were stopped",
                        exit_code=128 + int(exc.sigval)) from None
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return 0


def _message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message or "").strip()
    for prefix in ("UserError: ", "PlanError: ", "RewriteError: "):
        message = message.removeprefix(prefix)
    return message


def describe_failure(exc) -> str:
    """One line naming the rank that failed first (with its own message when it left one)."""
    failures = exc.failures
    # torch elastic fills a missing error file with the placeholder '<NONE>'
    explained = {rank: f for rank, f in failures.items()
                 if f.error_file_data.get("message") not in (None, "", "<NONE>")}
    pool = explained or failures
    rank, failure = min(pool.items(), key=lambda item: (item[1].timestamp, item[0]))
    message = _message(failure)
    if not explained:
        message = (f"exit code {failure.exitcode}" if failure.exitcode >= 0
                   else f"killed by signal {-failure.exitcode}")
    others = len(failures) - 1
    tail = f" ({others} other rank{'s' if others != 1 else ''} also stopped)" if others else ""
    return f"rank {rank} failed: {message}{tail}"


def _exit_code(exc) -> int:
    codes = [f.exitcode for f in exc.failures.values() if f.exitcode > 0]
    return codes[0] if codes else 1
