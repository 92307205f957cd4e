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
import threading
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


def _child_environment() -> dict:
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def run_child(spec: dict, cwd: str | None = None, capture: bool = False,
              server: "ChildServer | None" = None) -> dict:
    """Run the child (in ``cwd``) and return its result; the script's output passes
    through, or with ``capture`` is kept and its last lines are named if no result came.
    ``server``: fork the child from it (a simulated GPU and ``capture`` only) instead of
    starting a fresh Python."""
    with tempfile.TemporaryDirectory(prefix="memadvisor-fake-") as folder:
        spec_path = Path(folder) / "spec.json"
        result_path = Path(folder) / "result.json"
        spec_path.write_text(json.dumps({**spec, "result": str(result_path)}))
        try:
            forked = None
            if server is not None and capture and spec["gpu"] is not None:
                forked = server.run(spec_path, cwd, Path(folder))
            if forked is not None:
                returncode, said = forked
            else:  # a fresh child (also where the server could not start or ended)
                proc = subprocess.run([sys.executable, "-m", "memadvisor.commands.profile_fake",
                                       str(spec_path)], env=_child_environment(), cwd=cwd,
                                      capture_output=capture, text=True, errors="replace")
                returncode, said = proc.returncode, (proc.stderr or proc.stdout or "")
        except KeyboardInterrupt:
            raise UserError("interrupted", exit_code=130) from None
        if not result_path.exists():
            how = (f"signal {-returncode}" if returncode < 0 else f"exit status {returncode}")
            said = said.strip().splitlines() if capture else []
            last = f": {said[-1].strip()}" if said else ""
            raise UserError(f"fake execution ended without a result ({how}){last}",
                            exit_code=returncode if returncode > 0 else 1)
        return json.loads(result_path.read_text())


class ChildServer:
    """A process that loads the fake CUDA shim and imports torch (and the dynamo package
    FakeTensorMode imports) once and forks a child per fake execution: a fresh child's
    imports cost seconds, more than a small script's whole run.  Each forked child is what
    ``python -m memadvisor.commands.profile_fake SPEC`` would be: torch imported after the
    shim, no CUDA state yet, its own working folder, output captured.  Several runs may be
    asked for at once, from several threads; ``close()`` (or leaving the ``with`` block)
    ends it.  Simulated GPUs only: a fake CPU run must not see the shim's devices."""

    def __init__(self, cwd: str | None = None):
        self._cwd = cwd
        self._process = None
        self._lock = threading.Lock()
        self._pending: dict[int, list] = {}  # request id -> [event, exit status]
        self._next_id = 0
        self._reader = None

    def __enter__(self):
        with self._lock:  # it imports while the scripts are rewritten
            if self._process is None:
                self._start()
        return self

    def __exit__(self, *exc):
        self.close()

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "memadvisor.commands.profile_fake", "--serve"],
            env=_child_environment(), cwd=self._cwd, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._process.stdout:
            answer = json.loads(line)
            with self._lock:
                waiting = self._pending.pop(answer["id"], None)
            if waiting is not None:
                waiting[1] = answer["returncode"]
                waiting[0].set()
        with self._lock:  # the server ended: nothing more will be answered
            pending, self._pending = self._pending, {}
        for waiting in pending.values():
            waiting[0].set()

    def run(self, spec_path: Path, cwd: str | None, folder: Path) -> tuple[int, str] | None:
        """Fork a child for ``spec_path`` in ``cwd``; (its exit status, what it said), or
        None where the server is not running (it could not start: a fresh child says why)."""
        output, errors = folder / "stdout.txt", folder / "stderr.txt"
        waiting = [threading.Event(), None]
        with self._lock:
            if self._process is None:
                self._start()
            if self._process.poll() is not None:
                return None
            request_id = self._next_id
            self._next_id += 1
            self._pending[request_id] = waiting
            try:
                self._process.stdin.write(json.dumps({
                    "id": request_id, "spec": str(spec_path),
                    "cwd": str(Path(cwd or os.getcwd()).resolve()),
                    "stdout": str(output), "stderr": str(errors)}) + "\n")
                self._process.stdin.flush()
            except OSError:
                self._pending.pop(request_id, None)
                return None
        waiting[0].wait()
        if waiting[1] is None:
            return None
        said = [path.read_text(errors="replace") for path in (errors, output) if path.exists()]
        return waiting[1], next((text for text in said if text.strip()), "")

    def close(self) -> None:
        if self._process is None:
            return
        try:
            self._process.stdin.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None


def _serve() -> int:
    """The server's side (``--serve``): one JSON request a line on stdin, one answer a line
    on stdout when its child ends."""
    import selectors
    import signal
    import time
    # Ctrl-C reaches the children (same process group); the server waits for them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..fake import preload
    preload()  # the device count is each child's (fake_execution sets it)
    import torch
    import torch._dynamo  # noqa: F401 -- what FakeTensorMode imports on creation
    import torch._functorch.config  # noqa: F401
    # not the profiler: it imports pyarrow, whose allocator starts a thread, and a fork
    # copies no thread
    if torch.cuda._initialized or torch.cuda._cached_device_count is not None:
        raise RuntimeError("torch's CUDA state was created before a fork")
    answers = os.dup(1)
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 1)  # nothing the server imports may write into the answers
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    children: dict[int, int] = {}  # pid -> request id
    pending = b""
    open_input = True
    while open_input or children:
        if open_input and selector.select(timeout=0.05):
            data = os.read(0, 65536)
            open_input = bool(data)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _serve_child(request, answers, quiet)  # never returns
                children[pid] = request["id"]
        elif not open_input:
            time.sleep(0.05)  # children left: wait for them
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            request_id = children.pop(pid, None)
            if request_id is not None:
                os.write(answers, (json.dumps({"id": request_id, "returncode":
                                               os.waitstatus_to_exitcode(status)})
                                   + "\n").encode())
    return 0


def _serve_child(request: dict, answers: int, quiet: int) -> None:
    """A forked child: what ``python -m memadvisor.commands.profile_fake SPEC`` started in
    the request's folder would do, its output into the request's files."""
    import signal
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.close(answers)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            output = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(output, fd)
            os.close(output)
        os.dup2(quiet, 0)
        os.close(quiet)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` started there has it
        code = _child_main(request["spec"])
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


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
            value_sizes=spec.get("value_sizes"), value_reads=spec.get("value_reads"),
            keep_layers=spec.get("keep_layers"), light_layers=spec.get("light_layers"),
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
        "layer_stacks": meta.extra.get("fake", {}).get("layer_stacks"),
    })


def _progress(info: dict) -> None:
    total = info["steps_requested"]
    of = f"/{total}" if total else ""
    print(f"memadvisor: step {info['steps_done']}{of} done (fake)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(_serve() if sys.argv[1] == "--serve" else _child_main(sys.argv[1]))
