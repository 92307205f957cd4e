"""`memadvisor profile --fake [--gpu NAME] [--nproc N] [--rank R] SCRIPT -- ARGS`

The script runs in a child process (``python -m memadvisor.commands.profile_fake SPEC``)
because the fake CUDA shim must be loaded before torch is imported, and a process whose
torch saw no CUDA cannot be given one.  The child writes the trace and a small JSON
result; this side reads the trace back, replays the simulated device's rows through the
caching-allocator model (``simulate.recorded_state.model_whole_run``: per-step peak
allocated and reserved, as ``max_memory_allocated``/``max_memory_reserved`` would say
after a ``reset_peak_memory_stats`` at each step's start) and prints them.

Every failure is one line and a non-zero exit; the trace of a run that stopped early is
kept.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from ..errors import UserError
from ..units import format_bytes

#: exit status of a child that could not run at all (bad input, no shim)
EXIT_CANNOT_RUN = 2


@dataclass(kw_only=True, slots=True)
class StepPeaks:
    step: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int


def modelled_step_peaks(trace_path: Path, device: str, capacity_bytes: int = 0):
    """(per-step peaks on ``device``, the whole run's model) of a fake run's trace."""
    from ..simulate.allocator_config import parse_alloc_conf
    from ..simulate.recorded_state import model_whole_run
    from ..trace.io import Trace, read_trace
    trace = read_trace(trace_path)
    # only the simulated GPU's rows: CPU tensors (a model built on the CPU before
    # .cuda()) are host memory, which the CUDA allocator never holds
    events = trace.events[trace.events["device"] == device].reset_index(drop=True)
    config = parse_alloc_conf((trace.meta.allocator or {}).get("settings", ""))
    run = model_whole_run(Trace(events, trace.meta, trace.path), config, capacity_bytes)
    steps = [StepPeaks(step=step, peak_allocated_bytes=allocated,
                       peak_reserved_bytes=reserved)
             for step, (allocated, reserved) in sorted(run.steps.items())]
    return steps, run


def run_child(spec: dict, cwd: str | None = None, capture: bool = False) -> dict:
    """Run the child (in ``cwd``) and return its result; the script's output passes
    through, or with ``capture`` is kept and its last lines are named if no result came."""
    with tempfile.TemporaryDirectory(prefix="memadvisor-fake-") as folder:
        spec_path = Path(folder) / "spec.json"
        result_path = Path(folder) / "result.json"
        spec_path.write_text(json.dumps({**spec, "result": str(result_path)}))
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root,
                                                          env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.run([sys.executable, "-m", "memadvisor.commands.profile_fake",
                                   str(spec_path)], env=env, cwd=cwd, capture_output=capture,
                                  text=True, errors="replace")
        except KeyboardInterrupt:
            raise UserError("interrupted", exit_code=130) from None
        if not result_path.exists():
            how = (f"signal {-proc.returncode}" if proc.returncode < 0
                   else f"exit status {proc.returncode}")
            said = (proc.stderr or proc.stdout or "").strip().splitlines() if capture else []
            last = f": {said[-1].strip()}" if said else ""
            raise UserError(f"fake execution ended without a result ({how}){last}",
                            exit_code=proc.returncode if proc.returncode > 0 else 1)
        return json.loads(result_path.read_text())


def report(result: dict, spec: dict, quiet: bool) -> int:
    """Print the outcome, the modelled per-step peaks and the placeholder warnings."""
    if "cannot_run" in result:
        raise UserError(result["cannot_run"], exit_code=result.get("exit_code", 2))
    trace_path = Path(result["trace_path"])
    where = (f"{trace_path} ({result['events']:,} events, {result['steps_completed']} steps)")
    for read in result.get("placeholder_reads", []):
        click.echo(f"memadvisor: warning: {read['location']} read tensor values "
                   f"{read['reads']:,} time(s) ({read['op']}); fake execution answered "
                   f"{read['value']} (a branch or loop on them ran as that value chose)",
                   err=True)
    if spec["gpu"] is not None:
        _print_step_peaks(trace_path, result, spec)
    if result["status"] == "completed":
        click.echo(f"memadvisor: wrote {where}", err=True)
        return 0
    click.echo(f"memadvisor: {result['status']} after {result['steps_completed']} step(s): "
               f"{result['error']}", err=True)
    click.echo(f"memadvisor: kept partial trace {where}", err=True)
    return result["exit_code"] or 1


def _print_step_peaks(trace_path: Path, result: dict, spec: dict) -> None:
    from ..gpus import gpu_profile
    gpu = gpu_profile(spec["gpu"])
    device = f"cuda:{spec['rank'] % min(spec['nproc'], 8)}"
    steps, run = modelled_step_peaks(trace_path, device, gpu.total_memory_bytes)
    click.echo(f"memadvisor: {gpu.device_name} ({device}), caching-allocator model over "
               f"the whole run:", err=True)
    for peaks in steps:
        label = (f"step {peaks.step}" if peaks.step < result["steps_completed"]
                 else "after" if result["status"] == "completed"
                 else f"step {peaks.step} (unfinished)")
        click.echo(f"  {label:>19}: peak allocated {format_bytes(peaks.peak_allocated_bytes)}"
                   f", peak reserved {format_bytes(peaks.peak_reserved_bytes)}", err=True)
    if run.peak_reserved_bytes > gpu.total_memory_bytes:
        click.echo(f"memadvisor: warning: peak reserved {format_bytes(run.peak_reserved_bytes)}"
                   f" exceeds the {gpu.device_name}'s {format_bytes(gpu.total_memory_bytes)}: "
                   f"this run would fail with CUDA out of memory", err=True)


# --- the child ------------------------------------------------------------------------
def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result_path = Path(spec["result"])

    def answer(result: dict) -> int:
        result_path.write_text(json.dumps(result))
        return 0

    try:
        if spec["gpu"] is not None:
            from ..fake import preload
            preload(device_count=min(spec["nproc"], 8))  # before anything imports torch
        from ..profile.fake_run import profile_fake_script
        on_step = None if spec["quiet"] else _progress
        profiled = profile_fake_script(
            spec["script"], spec["args"], spec["output"], gpu=spec["gpu"],
            num_ranks=spec["nproc"], rank=spec["rank"], steps=spec["steps"] or None,
            timeout_s=spec["timeout_s"], step_boundary=spec["step_boundary"],
            on_step=on_step)
    except (UserError, Exception) as exc:  # noqa: BLE001 - one line, never a traceback
        text = " ".join(str(exc).split()) or type(exc).__name__
        prefix = "" if isinstance(exc, UserError) or type(exc).__name__ == \
            "FakeCudaUnavailable" else f"fake execution failed: {type(exc).__name__}: "
        return answer({"cannot_run": prefix + text,
                       "exit_code": getattr(exc, "exit_code", EXIT_CANNOT_RUN)})
    from ..trace.io import read_meta
    meta = read_meta(profiled.trace_path)
    return answer({
        "trace_path": str(profiled.trace_path), "status": profiled.status,
        "exit_code": profiled.exit_code, "error": profiled.error,
        "events": profiled.events, "steps_completed": profiled.steps_completed,
        "placeholder_reads": meta.extra.get("fake", {}).get("placeholder_reads", []),
    })


def _progress(info: dict) -> None:
    total = info["steps_requested"]
    of = f"/{total}" if total else ""
    print(f"memadvisor: step {info['steps_done']}{of} done (fake)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
